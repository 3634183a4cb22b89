"""Proposers the orchestrator runs a step with: a draft model on the draft service, prompt
lookup, suffix decoding (orchestrator/suffix.py), or auto (suffix where it pays, else the draft).

The seam follows transformers' candidate generators: `get_candidates` proposes a block of
up to k tokens with the distribution each was drawn from (q), `update_candidate_strategy`
hears how many were accepted. Lookahead and Medusa are not here: they need the target's
own forward pass, so the target service runs them (target_service/proposers.py) and the
orchestrator only asks for them (TargetSession.proposer).

Prompt lookup runs here, not on a draft replica: it needs only the token history, which
the orchestrator owns, so it costs no round trip and no replica. It is not combined with the
draft model: replayed on the target's own output it proposes on under 10% of passes and keeps
fewer tokens per proposal than the draft does (bench/replay.py, docs/BENCHMARKS.md).
Suffix decoding, which also reads recent outputs of every request and proposes as far as its
match justifies, is: `auto` offers its proposal before each step (`free`), and the loop takes
it where it pays more than the draft's block.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from orchestrator.domain import EMPTY_BLOCK, DraftBlock, ReadsHistory, one_hot_block
from orchestrator.remote import DraftSession
from orchestrator.suffix import NO_PROPOSAL, Proposal, SuffixProposer
from tandem import metrics, sampling
from tandem.errors import ReplicaRefused, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)


class Proposer(Protocol):
    name: str  # its orchestrator.domain.REGISTRY entry
    # Whether it drafts blocks of the policy's k (`get_candidates`: a model, prompt lookup),
    # and whether it offers free proposals of its own length before each step (`free`).
    drafts: bool
    free_proposals: bool

    @property
    def wire_bytes(self) -> int:
        """Bytes the proposer exchanged with other services."""

    async def get_candidates(self, history: list[int], num_speculative_tokens: int,
                             params: sampling.SamplingParams, seed: int, ahead: int = 0) -> DraftBlock:
        """Up to k tokens to follow `history`; k=0 may prepare (the draft model prefills).

        `seed` is the request's: the same on every step. `ahead`: how many tokens the next
        step will likely draft, which a proposer that overlaps may draft meanwhile.
        """

    def free(self, history: list[int], most: int) -> Proposal:
        """A proposal that costs no model call (at most `most` tokens; NO_PROPOSAL: none)."""

    def update_candidate_strategy(self, block: DraftBlock, accepted: int, history_length: int) -> None:
        """`accepted` of `block` (a `get_candidates` block) were kept after `history_length`
        history tokens."""

    def lag(self, history_length: int) -> int:
        """History tokens the proposer must take in with its next block (a draft model's cache
        catching up); 1 in step, more after steps it sat out."""

    async def close(self) -> None:
        """Release what the proposer holds (a remote session)."""


@dataclass
class DraftModelProposer:
    """A draft model on a draft replica: each block is sampled under the request's parameters."""

    session: DraftSession
    max_support_size: int
    overlap: bool = True  # draft the next block ahead while the target verifies (--overlap)
    name: str = "draft-model"
    lost: bool = False  # every draft replica failed: the request goes on with the target alone
    drafts: bool = True
    free_proposals: bool = False

    def free(self, history: list[int], most: int) -> Proposal:
        return NO_PROPOSAL

    @property
    def wire_bytes(self) -> int:
        return self.session.wire_bytes

    async def get_candidates(self, history: list[int], num_speculative_tokens: int,
                             params: sampling.SamplingParams, seed: int, ahead: int = 0) -> DraftBlock:
        if self.lost:
            return EMPTY_BLOCK
        try:
            return await self.session.propose(history, num_speculative_tokens, params,
                                              self.max_support_size, seed,
                                              ahead if self.overlap else 0)
        except (Unavailable, ResourceExhausted) as exc:
            # The draft only ever changes speed: without one, the target decodes alone, exactly.
            why = ("the draft refused this request" if isinstance(exc, ReplicaRefused)
                   else "no draft replica left")
            log.warning("session %s: %s (%s); going on with the target alone",
                        self.session.session_id, why, exc)
            metrics.DRAFT_FALLBACKS.inc()
            self.lost = True
            await self.session.close()
            return EMPTY_BLOCK

    def update_candidate_strategy(self, block: DraftBlock, accepted: int, history_length: int) -> None:
        # Of what the draft's cache now holds, only the prefix that became history stays valid.
        if block is not EMPTY_BLOCK:
            self.session.advance(block.cache_length, history_length + accepted)

    def lag(self, history_length: int) -> int:
        return history_length - self.session.synced

    async def close(self) -> None:
        await self.session.close()


def lookup(history: list[int], max_tokens: int, min_ngram: int, max_ngram: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the history's last n-gram.

    Longer n-grams are tried first (a longer match predicts better); [] when none matches.
    """
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start + n - 1] == tail[-1] and history[start:start + n] == tail:
                return history[start + n:start + n + max_tokens]
    return []


@dataclass
class PromptLookupProposer(ReadsHistory):
    """Prompt lookup (n-gram): proposes from the history itself, no model.

    The proposal is a function of the history, so each token is a one-hot draft: the
    target keeps it with probability p(x) and otherwise resamples from p without x, the
    exact rule for deterministic drafts (vLLM's n-gram proposer does the same).
    """

    min_ngram: int
    max_ngram: int
    name: str = "prompt-lookup"
    wire_bytes: int = 0
    drafts: bool = True
    free_proposals: bool = False

    def free(self, history: list[int], most: int) -> Proposal:
        return NO_PROPOSAL

    async def get_candidates(self, history: list[int], num_speculative_tokens: int,
                             params: sampling.SamplingParams, seed: int, ahead: int = 0) -> DraftBlock:
        if num_speculative_tokens == 0:
            return EMPTY_BLOCK
        started = time.perf_counter()
        tokens = lookup(history, num_speculative_tokens, self.min_ngram, self.max_ngram)
        if not tokens:
            return EMPTY_BLOCK
        return one_hot_block(tokens, (time.perf_counter() - started) * 1000.0)


@dataclass
class AutoProposer:
    """Per step, the cheaper good proposal: a suffix proposal (free) where it is expected to
    yield more tokens per millisecond than the draft model's block, else the draft model's
    (the loop decides, orchestrator/speculation.py)."""

    draft: DraftModelProposer
    suffix: SuffixProposer
    name: str = "auto"
    drafts: bool = True
    free_proposals: bool = True

    @property
    def wire_bytes(self) -> int:
        return self.draft.wire_bytes

    async def get_candidates(self, history: list[int], num_speculative_tokens: int,
                             params: sampling.SamplingParams, seed: int, ahead: int = 0) -> DraftBlock:
        return await self.draft.get_candidates(history, num_speculative_tokens, params, seed, ahead)

    def free(self, history: list[int], most: int) -> Proposal:
        return self.suffix.free(history, most)

    def update_candidate_strategy(self, block: DraftBlock, accepted: int, history_length: int) -> None:
        self.draft.update_candidate_strategy(block, accepted, history_length)

    def lag(self, history_length: int) -> int:
        return self.draft.lag(history_length)

    async def close(self) -> None:
        await self.draft.close()
