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
    cache_length: int  # what the step may assume the cache holds: its history and k - 1 drafts
    reused: int  # of the k, how many were drafted ahead (no pass while this step waited)


# How many of the model's most likely tokens each position remembers: guesses of what the
# target will commit there are drawn from them.
RANKED = 4


@dataclass(frozen=True)
class Position:
    """What the draft computed at one position: q, and the model's own ranking there."""

    q: sampling.SparseDistribution
    ranked: tuple[int, ...]  # the RANKED most likely tokens by logit, most likely first


@dataclass(frozen=True)
class Branch:
    """A block drafted ahead for a history the next step may name."""

    history: tuple[int, ...]
    seed: int
    token_ids: tuple[int, ...]
    distributions: tuple[sampling.SparseDistribution, ...]


@dataclass
class DraftState:
    """What a session's cache lets the next step reuse, under one request's parameters.

    positions[p] is what the draft computed at position p from the cache's first p tokens:
    valid while p <= the cache's length (a cut drops what follows; every append below prunes
    the positions past its cut first). `branches` are blocks drafted ahead for histories the
    cache no longer holds (it moved on to the next guess); they serve the next step only.
    """

    key: tuple[sampling.SamplingParams, int]  # (params, max_support_size) of the dists
    positions: dict[int, Position] = field(default_factory=dict)
    branches: list[Branch] = field(default_factory=list)


class Drafter:
    """One session's drafting: each q comes from the session's cache when it already holds
    it (drafted ahead), else from a pass."""

    def __init__(self, forward: Forward, session: KVSession, params: sampling.SamplingParams,
                 max_support_size: int, seed: int) -> None:
        self.forward, self.session, self.seed = forward, session, seed
        self.params, self.max_support_size = params, max_support_size

    def state(self) -> DraftState:
        key = (self.params, self.max_support_size)
        state = self.session.proposer_state.get("draft")
        if state is None or state.key != key:
            state = self.session.proposer_state["draft"] = DraftState(key)
        return state

    def known(self, history: list[int]) -> Position | None:
        """What the draft computed at position len(history), if the cache holds it for this history."""
        p, held = len(history), self.session.held_tokens
        position = self.state().positions.get(p)
        if position is None or p > len(held) or held[:p] != history:
            return None
        return position

    async def at(self, history: list[int]) -> tuple[Position, bool]:
        """q (and the ranking) at position len(history), and whether the cache held it (no pass)."""
        position = self.known(history)
        if position is not None:
            return position, True
        held = self.session.held_tokens
        common = next((i for i, (a, b) in enumerate(zip(held, history)) if a != b),
                      min(len(held), len(history)))
        keep = min(common, len(history) - 1)  # at least the last token is fed: its logits are q
        state = self.state()
        state.positions = {p: d for p, d in state.positions.items() if p <= keep}
        logits = (await self.forward(Pass(self.session, keep, tuple(history[keep:])))).logits
        support, probs = sampling.truncate(sampling.probabilities(logits, self.params)[0],
                                           self.max_support_size)
        ranked = torch.topk(logits[0], min(RANKED, logits.shape[-1])).indices
        position = Position(sampling.SparseDistribution(tuple(support.tolist()), tuple(probs.tolist())),
                            tuple(ranked.tolist()))
        self.state().positions[len(history)] = position  # after the pass: a reset at 0 clears the state
        return position, False

    async def draft(self, history: list[int], k: int) -> tuple[list[int], list[sampling.SparseDistribution], int]:
        """k tokens after `history`, their q, and how many needed no pass.

        The last drafted token is not fed: its q is all the target needs.
        """
        tokens: list[int] = []
        dists: list[sampling.SparseDistribution] = []
        reused = 0
        for _ in range(k):
            position, held = await self.at(history + tokens)
            reused += held
            tokens.append(draw(position.q, self.seed, len(history) + len(tokens)))
            dists.append(position.q)
        return tokens, dists, reused

    def drafted_ahead(self, history: list[int], k: int) -> Branch | None:
        """A block of k drafted ahead for `history`, off the cache, if one was."""
        key = tuple(history)
        return next((b for b in self.state().branches if b.history == key and b.seed == self.seed
                     and len(b.token_ids) >= k), None)


async def propose_block(
    forward: Forward,
    session: KVSession,
    history: list[int],
    num_speculative_tokens: int,
    params: sampling.SamplingParams,
    max_support_size: int,
    seed: int,
) -> ProposedBlock:
    """Draft k tokens after `history` (the step's tokens after the prefix it assumes).

    Each token is drawn from the draft's distribution under the request's parameters,
    truncated to its `max_support_size` most likely tokens and renormalised; that
    truncated distribution is what is reported, so q is exact (FIELD_NOTES: sparse q).
    Each token's pass goes through `forward`, so the j-th tokens of all drafting sessions
    share a pass; a token whose q the cache already holds (drafted ahead) needs none, and a
    block drafted ahead for this very history needs no pass at all.
    """
    drafter = Drafter(forward, session, params, max_support_size, seed)
    k = num_speculative_tokens
    if k == 0:  # a prefill: fill the cache, and keep q for what follows
        await drafter.at(history)
        return ProposedBlock((), (), len(history), 0)
    branch = drafter.drafted_ahead(history, k)
    drafter.state().branches = []  # they were for this step only
    if branch is not None:
        return ProposedBlock(branch.token_ids[:k], branch.distributions[:k], len(history) + k - 1, k)
    tokens, dists, reused = await drafter.draft(history, k)
    # The cache may hold more (a continuation drafted ahead): the caller's view ends here.
    return ProposedBlock(tuple(tokens), tuple(dists), len(history) + k - 1, reused)


@dataclass
class Guesses:
    """What a session's drafting ahead has guessed: the history whose block it drafts now,
    and those whose blocks are done (the step that names one is a hit)."""

    current: list[int] = field(default_factory=list)
    done: list[list[int]] = field(default_factory=list)
    drafted: int = 0  # tokens drafted ahead

    def hit(self, history: list[int]) -> bool:
        return history == self.current or history in self.done


async def draft_ahead(forward: Forward, session: KVSession, history: list[int],
                      block: tuple[int, ...], depth: int, params: sampling.SamplingParams,
                      max_support_size: int, seed: int, stop: asyncio.Event,
                      guesses: Guesses) -> None:
    """While the target verifies `block` (drafted after `history`), draft the step after it.

    The outcomes guessed, most likely first: the whole block accepted with the draft's most
    likely bonus token; then the first drafted token rejected and the target's token being
    the draft's most likely other token; then the second; and so on. For each, `depth`
    tokens are drafted after the guessed history, each with its q: the branch the cache
    holds last is reused from the cache, the others are kept as blocks. Stops between
    passes once `stop` is set or the budget took the tail back.
    """
    drafter = Drafter(forward, session, params, max_support_size, seed)
    drafter.state().branches = []
    k = len(block)
    # Where each drafted token was drawn, while the cache still holds it (not after a block
    # that came from a branch: its positions were never in this cache).
    drawn = {i: drafter.known(history + list(block[:i])) for i in range(k)}
    for accepted in (k, *range(k)):  # full acceptance, then a rejection at 1, 2, ...
        if stop.is_set() or session.tail_from is None:
            break
        prefix = history + list(block[:accepted])
        if accepted == k:
            position, _ = await drafter.at(prefix)  # the bonus position: x_k is fed
            guess = position.ranked[0]
        elif (known := drawn[accepted]) is not None:
            guess = next(t for t in known.ranked if t != block[accepted])
        else:
            continue
        guesses.current = [*prefix, guess]
        tokens: list[int] = []
        dists: list[sampling.SparseDistribution] = []
        while len(tokens) < depth and not stop.is_set() and session.tail_from is not None:
            position, _ = await drafter.at(guesses.current + tokens)
            tokens.append(draw(position.q, seed, len(guesses.current) + len(tokens)))
            dists.append(position.q)
            guesses.drafted += 1
        if len(tokens) == depth:
            drafter.state().branches.append(
                Branch(tuple(guesses.current), seed, tuple(tokens), tuple(dists)))
            guesses.done.append(guesses.current)
