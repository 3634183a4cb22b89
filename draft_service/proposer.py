"""Drafting a block of tokens with exactly the information exact rejection sampling needs,
and drafting the next block ahead while the target verifies this one.

The token drafted at absolute position p is drawn with randomness keyed by (seed, p), the
request's seed, never by step or timing. So a block is a function of the history alone:
drafted now, or ahead of time on a guess of the history that came true, it is the same
block. That is what lets a session's cache hold a speculative continuation (the block, the
draft's most likely bonus token, and the block after it, each position with its q) which
the next step reuses as far as its history matches. Why reusing these numbers keeps the
target's law: docs/ARCHITECTURE.md ("Drafting ahead").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from tandem import sampling
from tandem.batching import Forward, Pass
from tandem.kv import KVSession
from tandem.model_service import Step

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A seed for the draw at `position` of a request seeded `seed` (splitmix64 of both)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def draw(dist: sampling.SparseDistribution, seed: int, position: int) -> int:
    """The draft's token at `position`: a draw from q with the position's own randomness."""
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    probs = torch.tensor(dist.probs, dtype=torch.float32)
    return dist.token_ids[int(sampling.sample(probs[None], generator)[0])]


@dataclass(frozen=True)
class ProposedBlock:
    token_ids: tuple[int, ...]  # [k]
    distributions: tuple[sampling.SparseDistribution, ...]  # [k], the q each token was drawn from
    cache_length: int
    reused: int  # of the k, how many were drafted ahead (no pass while this step waited)


@dataclass
class DraftState:
    """q at each position the session's cache reaches, under one request's parameters.

    dists[p] is the q of the token at position p, from the cache's first p tokens: valid
    while p <= the cache's length (a cut drops what follows; every append below prunes
    the positions past its cut first).
    """

    key: tuple[sampling.SamplingParams, int]  # (params, max_support_size) of the dists
    dists: dict[int, sampling.SparseDistribution] = field(default_factory=dict)


class Drafter:
    """One session's drafting: each q comes from the session's cache when it already holds
    it (drafted ahead), else from a pass."""

    def __init__(self, forward: Forward, session: KVSession, params: sampling.SamplingParams,
                 max_support_size: int, seed: int) -> None:
        self.forward, self.session, self.seed = forward, session, seed
        self.params, self.max_support_size = params, max_support_size

    def _state(self) -> DraftState:
        key = (self.params, self.max_support_size)
        state = self.session.proposer_state.get("draft")
        if state is None or state.key != key:
            state = self.session.proposer_state["draft"] = DraftState(key)
        return state

    def known(self, history: list[int]) -> sampling.SparseDistribution | None:
        """q at position len(history), if the cache already holds it for this history."""
        p, held = len(history), self.session.held_tokens
        dist = self._state().dists.get(p)
        if dist is None or p > len(held) or held[:p] != history:
            return None
        return dist

    async def dist_at(self, history: list[int]) -> tuple[sampling.SparseDistribution, bool]:
        """q at position len(history), and whether the cache already held it (no pass)."""
        dist = self.known(history)
        if dist is not None:
            return dist, True
        held = self.session.held_tokens
        common = next((i for i, (a, b) in enumerate(zip(held, history)) if a != b),
                      min(len(held), len(history)))
        keep = min(common, len(history) - 1)  # at least the last token is fed: its logits are q
        state = self._state()
        state.dists = {p: d for p, d in state.dists.items() if p <= keep}
        logits = (await self.forward(Pass(self.session, keep, tuple(history[keep:])))).logits
        support, probs = sampling.truncate(sampling.probabilities(logits, self.params)[0],
                                           self.max_support_size)
        dist = sampling.SparseDistribution(tuple(support.tolist()), tuple(probs.tolist()))
        self._state().dists[len(history)] = dist  # after the pass: a reset at 0 clears the state
        return dist, False

    async def draft(self, history: list[int], k: int) -> tuple[list[int], list[sampling.SparseDistribution], int]:
        """k tokens after `history`, their q, and how many needed no pass.

        The last drafted token is not fed: its q is all the target needs.
        """
        tokens: list[int] = []
        dists: list[sampling.SparseDistribution] = []
        reused = 0
        for _ in range(k):
            dist, held = await self.dist_at(history + tokens)
            reused += held
            tokens.append(draw(dist, self.seed, len(history) + len(tokens)))
            dists.append(dist)
        return tokens, dists, reused


async def propose_block(
    forward: Forward,
    session: KVSession,
    step: Step,
    num_speculative_tokens: int,
    params: sampling.SamplingParams,
    max_support_size: int,
    seed: int,
) -> ProposedBlock:
    """Roll back to the step's cache position, append its tokens, draft k tokens.

    Each token is drawn from the draft's distribution under the request's parameters,
    truncated to its `max_support_size` most likely tokens and renormalised; that
    truncated distribution is what is reported, so q is exact (FIELD_NOTES: sparse q).
    Each token's pass goes through `forward`, so the j-th tokens of all drafting sessions
    share a pass; a token whose q the cache already holds (drafted ahead) needs none.
    """
    history = session.held_tokens[:step.cache_position] + step.new_token_ids
    drafter = Drafter(forward, session, params, max_support_size, seed)
    if num_speculative_tokens == 0:  # a prefill: fill the cache, and keep q for what follows
        await drafter.dist_at(history)
        return ProposedBlock((), (), session.length, 0)
    tokens, dists, reused = await drafter.draft(history, num_speculative_tokens)
    # The cache may hold more (a continuation drafted ahead): the caller's view ends here.
    length = min(session.length, len(history) + num_speculative_tokens - 1)
    return ProposedBlock(tuple(tokens), tuple(dists), length, reused)


async def draft_ahead(forward: Forward, session: KVSession, guess: list[int], depth: int,
                      params: sampling.SamplingParams, max_support_size: int, seed: int,
                      stop: asyncio.Event) -> int:
    """While the target verifies the block that ends `guess`, draft the step after it.

    The branch guessed is full acceptance with the draft's most likely bonus token: `guess`
    grows by that token, then by `depth` drafted tokens, each with its q in the cache for
    the next step to reuse if its history matches. Stops between passes once `stop` is set
    or the budget took the tail back. Returns the tokens drafted ahead.
    """
    drafter = Drafter(forward, session, params, max_support_size, seed)
    dist, _ = await drafter.dist_at(guess)
    guess.append(dist.token_ids[0])  # truncate() keeps the most likely first
    drafted = 0
    while drafted < depth and not stop.is_set() and session.tail_from is not None:
        dist, _ = await drafter.dist_at(guess)
        guess.append(draw(dist, seed, len(guess)))
        drafted += 1
    return drafted
