"""Tiny random Hugging Face models with a real (character-level) tokenizer, saved to disk.

They load through the same `from_pretrained(path)` code as real models, so the tests
exercise the real loading path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOS = "<eos>"
PROMPTS = ["def fib(n):", "hello world", "x = (a, b)\n", "a"]
DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n"


def make_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")


def make_model(path: Path, *, seed: int, chars: str = DEFAULT_CHARS, eos_token_id: int = 0,
               layers: int = 2, hidden: int = 32, init_std: float = 0.3,
               vocab_size: int | None = None) -> Path:
    """Save a tiny random Llama model and its tokenizer at `path`."""
    tokenizer = make_tokenizer(chars)
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=init_std, tie_word_embeddings=False,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_draft_like(target: Path, path: Path, *, noise: float, seed: int) -> Path:
    """A draft that is the target plus Gaussian weight noise: partial agreement with the target.

    noise=0 gives a draft identical to the target (every drafted token accepted).
    """
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).exists():
            (path / name).write_bytes((target / name).read_bytes())
    return path


def greedy_reference(path: Path | str, prompt_ids: list[int], max_new_tokens: int,
                     eos_token_id: int | None = None) -> list[int]:
    """The target's own greedy generate(): the ground truth for exactness tests."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # generate() falls back to the model's own EOS for an unset one: clear it to ignore EOS.
    model.generation_config.eos_token_id = eos_token_id
    model.config.eos_token_id = eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return [int(t) for t in out[0, len(prompt_ids):]]


def random_prompts(vocab_size: int, count: int, length: int, seed: int) -> list[list[int]]:
    """Prompts of ordinary tokens (ids 2.. : no EOS, no unk), all of one length so they batch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (count, length), generator=generator).tolist()  # type: ignore[no-any-return]


def make_medusa_heads(target: Path, path: Path, *, seed: int = 0, num_heads: int = 3,
                      temperature: float = 0.0, num_prompts: int = 320, max_new_tokens: int = 64,
                      epochs: int = 3) -> Path:
    """Medusa heads for a tiny target, trained on its own text (EOS ignored): seconds on a CPU."""
    from target_service.medusa import save_heads
    from target_service.medusa_train import TrainConfig, train_medusa

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    prompts = random_prompts(model.config.vocab_size, num_prompts, 8, seed)
    config = TrainConfig(num_heads=num_heads, max_new_tokens=max_new_tokens, temperature=temperature,
                         epochs=epochs, learning_rate=1e-2, generate_batch_size=64, held_out=0.0,
                         seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a busy CPU
    try:
        heads, _ = train_medusa(model, prompts, config, str(target))
    finally:
        torch.set_num_threads(threads)
    return save_heads(heads, path)
