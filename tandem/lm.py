"""The types that several of Tandem's layers share: a loaded causal LM, and the cache a
batched pass hands it. A leaf: it imports nothing of Tandem's, so the modules above it
(kv, batching, parallel, models) never import each other to name them."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

#: A loaded Hugging Face causal LM (transformers ships no precise types for them).
CausalLM = Any


class BatchCache:
    """The cache a batched pass sees: the sessions' caches side by side.

    `parts` pairs each session's cache with how many of the pass's tokens are its own, in
    the order they sit in the flattened row.
    """

    def __init__(self, parts: list[tuple[DynamicCache, int]]) -> None:
        self.parts = parts

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, kv_heads, T, head_dim] -> [1, kv_heads, S, head_dim]
        keys, values, start = [], [], 0
        for cache, n in self.parts:
            k, v = cache.update(key_states[:, :, start:start + n], value_states[:, :, start:start + n],
                                layer_idx)
            keys.append(k)
            values.append(v)
            start += n
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # a batched pass always names its positions
