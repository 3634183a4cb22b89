"""Tiny random Hugging Face models with a real (character-level) tokenizer, saved to disk:
the models of the tests and of `tandem bench-load`.

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

from tandem import matmul

EOS = "<eos>"
PROMPTS = ["def fib(n):", "hello world", "x = (a, b)\n", "a"]
DEFAULT_CHARS = "abcdefghijklmnopqrstuvwxyz .,:()=\n"


def make_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, unk_token="<unk>")  # type: ignore[no-untyped-call]


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
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)  # type: ignore[no-untyped-call]
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
                     eos_token_id: int | None = None, matmul_path: str = matmul.DEFAULT
                     ) -> list[int]:
    """The target's own greedy generate() on a matmul path: the ground truth for exactness tests."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    matmul.apply(model, matmul_path, matmul.TIMED_ROWS)
    # generate() falls back to the model's own EOS for an unset one: clear it to ignore EOS.
    model.generation_config.eos_token_id = eos_token_id
    model.config.eos_token_id = eos_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,  # type: ignore[no-untyped-call]
                              eos_token_id=eos_token_id, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return [int(t) for t in out[0, len(prompt_ids):]]


def make_pair(directory: Path) -> tuple[Path, Path]:
    """(draft, target): the tests' tiny pair, a target and a noisy copy of it as the draft."""
    target = make_model(directory / "target", seed=1)
    return make_draft_like(target, directory / "draft", noise=0.05, seed=2), target
