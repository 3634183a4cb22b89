"""The tiny random models live in bench/tiny.py, shared with `tandem bench-load`; Medusa heads for them here."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.tiny import (
    DEFAULT_CHARS,
    EOS,
    PROMPTS,
    greedy_reference,
    make_draft_like,
    make_model,
    make_tokenizer,
)

__all__ = [
    "DEFAULT_CHARS",
    "EOS",
    "PROMPTS",
    "greedy_reference",
    "last_logits",
    "make_draft_like",
    "make_medusa_heads",
    "make_model",
    "make_tokenizer",
    "random_prompts",
]


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


def last_logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's logits after `ids`, from one plain full pass (the reference for cached passes)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]
