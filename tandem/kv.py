"""Per-session KV caches on a model service, and the session table that bounds them.

The orchestrator's token history is the source of truth; a cache here is soft state
that holds the KV of a prefix of that history (plus, transiently, drafted tokens).
Every step names `cache_position`, the prefix length it assumes: the cache is cut
back to it (rollback), then the step's new tokens are appended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from tandem.errors import CacheMismatch, InvalidRequest, ResourceExhausted
from tandem.models import CausalLM


@dataclass
class KVSession:
    """One session's KV cache on one model."""

    session_id: str
    vocab_size: int
    cache: DynamicCache = field(default_factory=DynamicCache)

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def rollback(self, cache_position: int) -> None:
        """Drop cached tokens past `cache_position`."""
        if cache_position > self.length:
            raise CacheMismatch(
                f"cache_position {cache_position} is beyond the session's cache length "
                f"{self.length}; resend the history from a position <= {self.length}"
            )
        if cache_position == 0:
            self.cache = DynamicCache()
        elif cache_position < self.length:
            # transformers 5.x: crop() takes the (negative) number of tokens to remove.
            self.cache.crop(cache_position - self.length)

    def check_tokens(self, field_name: str, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"{field_name} contains ids outside [0, {self.vocab_size}): {bad[:5]}"
            )

    @torch.inference_mode()
    def forward(self, model: CausalLM, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        """Append token_ids to the cache; return the last `logits_to_keep` logits [n, vocab] (CPU, fp32)."""
        device = model.get_input_embeddings().weight.device
        ids = torch.tensor([token_ids], dtype=torch.long, device=device)
        # transformers >= 5.24 names the argument `cache` (past_key_values is deprecated); the
        # DynamicCache is updated in place.
        out = model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        logits: torch.Tensor = out.logits[0, -logits_to_keep:].float().cpu()
        return logits


class SessionTable:
    """Live sessions of one service, bounded by `max_sessions`."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[int, KVSession] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, vocab_size: int) -> tuple[int, KVSession]:
        if len(self._sessions) >= self.max_sessions:
            raise ResourceExhausted(
                f"max_sessions ({self.max_sessions}) sessions are open on this replica; "
                "retry later or raise --max-sessions"
            )
        self._next += 1
        session = KVSession(session_id=session_id, vocab_size=vocab_size)
        self._sessions[self._next] = session
        return self._next, session

    def close(self, handle: int) -> None:
        self._sessions.pop(handle, None)
