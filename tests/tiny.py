"""The tiny random models live in bench/tiny.py, shared with `tandem bench-load`."""

from bench.tiny import (
    DEFAULT_CHARS,
    EOS,
    PROMPTS,
    greedy_reference,
    make_draft_like,
    make_model,
    make_tokenizer,
)

__all__ = ["DEFAULT_CHARS", "EOS", "PROMPTS", "greedy_reference", "make_draft_like", "make_model",
           "make_tokenizer"]
