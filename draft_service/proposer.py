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
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem import sampling
from tandem.batching import Forward, Pass, PassOutput
from tandem.grammar import GrammarState
from tandem.kv import KVSession, fork_cache


def draw(dist: sampling.SparseDistribution, seed: int, position: int) -> int:
    """The draft's token at `position`: a draw from q with the position's own randomness."""
    generator = torch.Generator().manual_seed(sampling.position_seed(seed, position))
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


@dataclass
class DraftState:
    """What a session's cache lets the next step reuse, under one request's parameters.

    positions[p] is what the draft computed at position p from the cache's first p tokens:
    valid while p <= the cache's length (a cut drops what follows: `rollback`).
    """

    key: tuple[sampling.SamplingParams, int, Any]  # (params, max_support_size, grammar) of the dists
    positions: dict[int, Position] = field(default_factory=dict)

    def rollback(self, position: int) -> bool:
        self.positions = {p: d for p, d in self.positions.items() if p <= position}
        return bool(self.positions)


def within(q: sampling.SparseDistribution, allowed: torch.Tensor) -> sampling.SparseDistribution | None:
    """q restricted to the tokens a grammar allows and renormalised (None: it gives none of
    them mass)."""
    kept = [(t, p) for t, p in zip(q.token_ids, q.probs, strict=True) if p > 0 and bool(allowed[t])]
    if not kept:
        return None
    if len(kept) == len(q.token_ids):
        return q
    total = sum(p for _, p in kept)
    return sampling.SparseDistribution(tuple(t for t, _ in kept), tuple(p / total for _, p in kept))


class Drafter:
    """One session's drafting: each q comes from the session's cache when it already holds
    it (drafted ahead), else from a pass. Under a grammar each token is drawn from q masked
    to what the grammar allows after the tokens before it."""

    def __init__(self, forward: Forward, session: KVSession, params: sampling.SamplingParams,
                 max_support_size: int, seed: int, grammar: GrammarState | None = None) -> None:
        self.forward, self.session, self.seed = forward, session, seed
        self.params, self.max_support_size = params, max_support_size
        self.grammar = grammar

    def state(self) -> DraftState:
        key = (self.params, self.max_support_size, self.grammar.spec if self.grammar is not None else None)
        state = self.session.states.get(DraftState)
        if state is None or state.key != key:
            state = DraftState(key)
            self.session.states.put(state)
        return state

    def known(self, history: list[int]) -> Position | None:
        """What the draft computed at position len(history), if the cache holds it for this history."""
        p, held = len(history), self.session.held_tokens
        position = self.state().positions.get(p)
        if position is None or p > len(held) or held[:p] != history:
            return None
        return position

    async def at(self, history: list[int], allowed: torch.Tensor | None = None) -> tuple[Position, bool]:
        """q (and the ranking) at position len(history), and whether the cache held it (no pass).
        `allowed`: the grammar's mask there, applied to the logits before q is taken."""
        position = self.known(history)
        if position is not None:
            return position, True
        held = self.session.held_tokens
        common = next((i for i, (a, b) in enumerate(zip(held, history)) if a != b),
                      min(len(held), len(history)))
        keep = min(common, len(history) - 1)  # at least the last token is fed: its logits are q
        params, support = self.params, self.max_support_size

        def read(out: PassOutput) -> Position:
            assert out.logits is not None
            logits = out.logits
            row = logits[0] if allowed is None else logits[0].float().masked_fill(~allowed.to(logits.device), -math.inf)
            return Position(sampling.draft_distribution(row, params, support),
                            tuple(sampling.top_tokens(logits[0], RANKED)))

        computed: Position = (await self.forward(Pass(self.session, keep, tuple(history[keep:]),
                                                      reduce=read))).value
        self.state().positions[len(history)] = computed  # after the pass (its rollback drops what it cut)
        return computed, False

    async def draft(self, history: list[int], k: int) -> tuple[list[int], list[sampling.SparseDistribution], int]:
        """k tokens after `history`, their q, and how many needed no pass.

        The last drafted token is not fed: its q is all the target needs.
        """
        tokens: list[int] = []
        dists: list[sampling.SparseDistribution] = []
        reused = 0
        for _ in range(k):
            allowed = None
            if self.grammar is not None:
                allowed = self.grammar.allowed()
                if not allowed.any():
                    break
                if int(allowed.sum()) == 1:
                    # The grammar forces the token: q is one-hot whatever the model says, so no
                    # pass (the next one feeds it with the tokens before it).
                    tokens.append(int(allowed.nonzero()[0, 0]))
                    dists.append(sampling.SparseDistribution((tokens[-1],), (1.0,)))
                    self.grammar.take(tokens[-1])
                    continue
            position, held = await self.at(history + tokens, allowed)
            reused += held
            # A q drafted ahead was taken without the mask: it is masked here (and where it
            # gives the allowed tokens no mass, the block ends).
            q = position.q if allowed is None else within(position.q, allowed)
            if q is None:
                break
            tokens.append(draw(q, self.seed, len(history) + len(tokens)))
            dists.append(q)
            if self.grammar is not None:
                self.grammar.take(tokens[-1])
        return tokens, dists, reused


def fork(session: KVSession, length: int) -> KVSession:
    """A copy of the session's cache cut to `length`, with what the draft computed there: a
    guess drafts in it without disturbing the session's own."""
    branch = KVSession(f"{session.session_id}/guess", session.vocab_size,
                       new_cache=session.new_cache, cache=fork_cache(session.cache, length))
    branch.token_ids = session.token_ids[:length]
    state = session.states.get(DraftState)
    if state is not None:
        branch.states.put(DraftState(state.key, {p: d for p, d in state.positions.items() if p <= length}))
    return branch


def adopt(session: KVSession, history: list[int]) -> None:
    """If drafting ahead guessed `history` in a copy of the cache, take that copy's cache; and
    drop every other guess (they were for this step only)."""
    guesses, session.guesses, session.tail_extra = session.guesses, None, 0
    if guesses is None:
        return
    for guess in guesses.guesses:
        if guess.history == history and guess.session is not session:
            session.cache, session.token_ids = guess.session.cache, guess.session.token_ids
            session.states.pop(DraftState)
            if (state := guess.session.states.get(DraftState)) is not None:
                session.states.put(state)


async def propose_block(
    forward: Forward,
    session: KVSession,
    history: list[int],
    num_speculative_tokens: int,
    params: sampling.SamplingParams,
    max_support_size: int,
    seed: int,
    grammar: GrammarState | None = None,
) -> ProposedBlock:
    """Draft k tokens after `history` (the step's tokens after the prefix it assumes); under
    a grammar (following `history`), fewer where the draft gives its allowed tokens no mass.

    Each token is drawn from the draft's distribution under the request's parameters,
    truncated to its `max_support_size` most likely tokens and renormalised; that
    truncated distribution is what is reported, so q is exact: the token was drawn from it.
    Each token's pass goes through `forward`, so the j-th tokens of all drafting sessions
    share a pass; a token whose q the cache already holds (drafted ahead) needs none, and a
    block drafted ahead for this very history needs no pass at all.
    """
    drafter = Drafter(forward, session, params, max_support_size, seed, grammar)
    k = num_speculative_tokens
    if k == 0:  # a prefill: fill the cache, and keep q for what follows
        adopt(session, history)
        await drafter.at(history)
        return ProposedBlock((), (), len(history), 0)
    adopt(session, history)
    tokens, dists, reused = await drafter.draft(history, k)
    # The cache may hold more (a continuation drafted ahead): the caller's view ends here.
    return ProposedBlock(tuple(tokens), tuple(dists), len(history) + max(len(tokens) - 1, 0), reused)


@dataclass
class Guess:
    """One outcome drafting ahead guessed: the history it leads to, the cache it drafts in
    (the session's own, or a copy cut where the guess leaves the block), and its tokens."""

    history: list[int]
    session: KVSession
    tokens: list[int] = field(default_factory=list)


@dataclass
class Guesses:
    """What a session's drafting ahead guessed (a step whose history is one is a hit)."""

    guesses: list[Guess] = field(default_factory=list)
    drafted: int = 0  # tokens drafted ahead

    def hit(self, history: list[int]) -> bool:
        return any(g.history == history for g in self.guesses)

    async def still(self) -> None:
        """Until no pass of a guess is queued or running."""
        for guess in self.guesses:
            await guess.session.still()


async def draft_ahead(forward: Forward, session: KVSession, history: list[int],
                      block: tuple[int, ...], depth: int, params: sampling.SamplingParams,
                      max_support_size: int, seed: int, stop: asyncio.Event,
                      guesses: Guesses, copies: bool = True) -> None:
    """While the target verifies `block` (drafted after `history`), draft the step after it.

    The outcomes guessed: the whole block accepted with the draft's most likely bonus token
    (drafted in the session's own cache, which holds the block already); and, with `copies`,
    a rejection at 1, 2, ... k with the draft's most likely other token there, each in a copy
    of the cache cut where it leaves the block. All of them grow together, a token per round,
    so that their passes share the scheduler's forward passes. For each, `depth` tokens are
    drafted after the guessed history, each with its q in its cache; the next step adopts the
    cache of the guess it names. Stops between rounds once `stop` is set or the budget took
    the tail back.
    """
    drafter = Drafter(forward, session, params, max_support_size, seed)
    k = len(block)
    if copies:
        # Where each drafted token was drawn (not kept after a block that came from a copy).
        for i in range(k):
            drawn = drafter.known(history + list(block[:i]))
            if drawn is not None:
                prefix = history + list(block[:i])
                guess = next(t for t in drawn.ranked if t != block[i])
                guesses.guesses.append(Guess([*prefix, guess], fork(session, len(prefix))))
    session.guesses = guesses
    session.tail_extra = sum(len(g.history) + depth for g in guesses.guesses)

    async def grow(guess: Guess) -> None:
        grower = Drafter(forward, guess.session, params, max_support_size, seed)
        position, _ = await grower.at(guess.history + guess.tokens)
        guess.tokens.append(draw(position.q, seed, len(guess.history) + len(guess.tokens)))
        guesses.drafted += 1

    async def full() -> None:
        position, _ = await drafter.at(history + list(block))  # the bonus position: x_k is fed
        guesses.guesses.insert(0, Guess([*history, *block, position.ranked[0]], session))

    for round_ in range(depth + 1):
        growing = [g for g in guesses.guesses if len(g.tokens) < depth]
        if stop.is_set() or session.tail_from is None or (round_ and not growing):
            break
        await asyncio.gather(*(full(),) if round_ == 0 else (), *(grow(g) for g in growing))
