"""The types that several of Tandem's layers share: a loaded causal LM, and the cache a
batched pass hands it. A leaf: it imports nothing of Tandem's, so the modules above it
(kv, batching, parallel, models) never import each other to name them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

#: A loaded Hugging Face causal LM (transformers ships no precise types for them).
CausalLM = Any


@dataclass(frozen=True)
class Capabilities:
    """What a loaded backend does besides plain passes (a block of tokens appended to a
    session's cache, rows of logits back): stated by the backend when it loads, so that the
    services offer what needs more (a target proposer's token tree, Medusa's hidden states)
    by reading them, not by trying the model."""

    backend: str  # "transformers" or "llama.cpp"
    # Scores a segment after the new tokens under a hand-built mask, then forgets it (Lookahead's
    # and Medusa's token trees).
    token_trees: bool
    # Returns the last hidden states at the kept rows (Medusa's heads read them).
    hidden_states: bool
    # How far a pass with a hand-built full causal mask matches the model's own: inside the
    # positions it serves exactly and inside its sliding window (`models.exact_positions`).
    exact_positions: float = float("inf")

    def refusal(self, needs_hidden: bool) -> str | None:
        """Why a target proposer cannot run on this backend (None: it can)."""
        if not self.token_trees:
            return f"the {self.backend} target scores no token trees"
        if needs_hidden and not self.hidden_states:
            return f"the {self.backend} target returns no hidden states"
        return None


@dataclass(frozen=True, eq=False)
class Rows:
    """One session's part of a batched pass, as numbers: what any rank needs to attend for it.

    The pass appends `new` history tokens after the `cached` ones its cache holds, then scores
    a segment (a proposer's tree, forgotten after the pass): segment token i sits `offsets[i]`
    positions past the last new token, plus one, and sees the history and the segment tokens
    its row of `visible` names.
    """

    cached: int
    new: int
    offsets: tuple[int, ...] = ()
    visible: torch.Tensor | None = None  # [t, t] bool, on the host; None without a segment

    @property
    def queries(self) -> int:
        return self.new + len(self.offsets)

    @property
    def keys(self) -> int:
        """The keys its rows attend over: the cache, then the pass's own tokens."""
        return self.cached + self.queries

    def positions(self) -> list[int]:
        end = self.cached + self.new
        return [*range(self.cached, end), *(end + o for o in self.offsets)]

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Which keys each row sees, [1, 1, queries, keys] bool, built on `device` from the
        numbers above; None where sdpa needs no mask (one row that sees every key, or a causal
        prefill), which is when transformers' own mask would be None too, so a pass of one
        session makes the same attention calls as the model's own forward.

        A history row sees the cache and the history up to itself; a segment row sees all the
        history and its `visible` row; with `window`, only keys less than `window` positions back.
        """
        c, n, t = self.cached, self.new, len(self.offsets)
        if not t and (self.queries == 1 or c == 0) and (window is None or self.keys < window):
            return None
        keys = torch.arange(self.keys, device=device)
        last_seen = torch.cat([torch.arange(c, c + n, device=device),
                               torch.full((t,), c + n - 1, device=device)])
        allowed = keys[None, :] <= last_seen[:, None]  # [queries, keys]: no segment key yet
        if t:
            assert self.visible is not None
            allowed[n:, c + n:] = self.visible.to(device)
        if window is not None:
            end = c + n
            key_positions = torch.cat([keys[:end], end + torch.tensor(self.offsets, dtype=torch.long, device=device)])
            query_positions = key_positions[c:]
            allowed &= (query_positions[:, None] - key_positions[None, :]) < window
        return allowed[None, None]


@dataclass(frozen=True, eq=False)
class Layout:
    """A batched pass's shape: each session's `Rows`, in the order they sit in the row, and the
    model's sliding window. Small and made of numbers: a tensor-parallel rank 0 sends it to
    the other ranks, which rebuild the same masks on their own devices."""

    rows: tuple[Rows, ...]
    window: int | None = None


@dataclass(eq=False)
class BatchCache:
    """The cache a batched pass sees: each session's own cache, side by side.

    Per layer, `update` appends each session's new keys and values to that session's cache and
    keeps what the cache then holds in `held`; the attention (tandem.batching) runs session by
    session over `held`, with each session's `masks`. Nothing is concatenated or copied
    across sessions, and no mask spans two sessions.
    """

    caches: list[DynamicCache]  # in `layout.rows` order
    layout: Layout
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # this layer's
    _masks: dict[torch.device, list[torch.Tensor | None]] = field(default_factory=dict)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, kv_heads, T, head_dim], the sessions' rows in order
        held, start = [], 0
        for cache, rows in zip(self.caches, self.layout.rows, strict=True):
            end = start + rows.queries
            held.append(cache.update(key_states[:, :, start:end], value_states[:, :, start:end], layer_idx))
            start = end
        self.held = held
        return key_states, value_states  # unused: the attention reads `held`

    def masks(self, device: torch.device) -> list[torch.Tensor | None]:
        """Each session's mask (`Rows.mask`) on `device`, built once a pass for each device
        the layers run on (one; several where a device map spreads the layers)."""
        if device not in self._masks:
            self._masks[device] = [rows.mask(self.layout.window, device) for rows in self.layout.rows]
        return self._masks[device]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # a batched pass always names its positions

    def call_kwargs(self, device: torch.device | str) -> dict[str, Any]:
        """What a batched forward call passes besides ids, positions and outputs: this cache,
        to the model and (as `tandem_batch`) to the attention; and an empty 4D mask, which
        transformers takes as already built, so that it builds no mask of its own."""
        return {"cache": self, "tandem_batch": self, "use_cache": True,
                "attention_mask": torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)}


#: The arguments `BatchCache.call_kwargs` adds to a call (a tensor-parallel rank 0 sends the
#: layout in their place).
BATCH_KWARGS = ("cache", "tandem_batch", "use_cache", "attention_mask")
