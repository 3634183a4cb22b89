"""Suffix decoding: proposals from what followed the history's end before, no model.

Agents and code tools repeat themselves: a file comes back with one line changed, a tool call
has the shape of the last one, an answer quotes its question. Suffix decoding (Oliaro et al.,
"SuffixDecoding", 2024) finds the longest end of the history (up to MAX_PATTERN tokens) that
occurred before, in the request's own tokens and in recent outputs of every request, and
proposes the continuation most of those occurrences share: at each position the token most
of the matching occurrences go on with, its estimated probability the share of them that do,
multiplied along the path. A proposal ends where that probability falls below MIN_TOKEN_PROB
or where it reaches MAX_SPEC_FACTOR tokens per matched token, so a long match proposes far and
a short one little (the paper's defaults, as ArcticInference ships them). Of the request's
own index and the shared one, the proposal with the higher expected count (the sum of its
path probabilities) is taken.

Occurrences are filed by token pair (`SuffixIndex`); a lookup reads the RECENT latest
occurrences of the history's last pair and extends each match backwards. The shared index
holds at most `max_tokens` tokens, oldest sequences out first; it is a cache of traffic,
rebuilt by traffic after a restart.

A proposal is a function of the tokens seen, so each token is a one-hot draft: the target
keeps it with probability p(x), else resamples from p without x, the exact rule for
deterministic drafts. It costs no model call, so the loop takes it whenever its expected
tokens per millisecond beat the draft model's (orchestrator/speculation.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.domain import EMPTY_BLOCK, DraftBlock, ReadsHistory, one_hot_block
from tandem import sampling

MAX_PATTERN = 32  # the longest end of the history matched
MIN_TOKEN_PROB = 0.1  # a proposal ends where its path's estimated probability falls below this
MAX_SPEC_FACTOR = 1.0  # at most this many proposed tokens per matched token
RECENT = 128  # occurrences of a token pair read per lookup, latest first
SHARED_TOKENS = 1 << 18  # the shared index's default size (--suffix-cache-tokens)


class SuffixIndex:
    """Token sequences whose every token pair is filed by the pair, for matching a history's
    end against them; at most `max_tokens` tokens (0: no bound), oldest sequences out first."""

    def __init__(self, max_tokens: int = 0) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._seqs: dict[int, list[int]] = {}
        self._order: deque[int] = deque()
        # (a, b) -> [(sequence, index of b)], oldest first; entries of evicted sequences are
        # skipped, and purged when they outnumber the live ones.
        self._where: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._stale = 0
        self._next = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: Sequence[int]) -> int:
        """File a new sequence; its id, for `extend`."""
        seq, self._next = self._next, self._next + 1
        self._seqs[seq] = []
        self._order.append(seq)
        self.extend(seq, tokens)
        return seq

    def extend(self, seq: int, tokens: Sequence[int]) -> None:
        held = self._seqs.get(seq)
        if held is None:
            return  # evicted
        for token in tokens:
            held.append(token)
            if len(held) > 1:
                self._where.setdefault((held[-2], token), []).append((seq, len(held) - 1))
        self.tokens += len(tokens)
        while self.max_tokens and self.tokens > self.max_tokens and len(self._order) > 1:
            self._evict()

    def _evict(self) -> None:
        gone = self._seqs.pop(self._order.popleft())
        self.tokens -= len(gone)
        self._stale += len(gone)
        if self._stale > self.tokens:
            where: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for seq in self._order:
                held = self._seqs[seq]
                for i in range(1, len(held)):
                    where.setdefault((held[i - 1], held[i]), []).append((seq, i))
            self._where, self._stale = where, 0

    def matches(self, history: Sequence[int]) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest match of the history's end (at most MAX_PATTERN tokens, at least 2),
        and each occurrence of it as (its sequence, the index of the token after it); an
        occurrence with nothing after it (the history's own end) does not count."""
        if len(history) < 2:
            return 0, []
        best, found = 0, []
        for seq, i in reversed(self._where.get((history[-2], history[-1]), [])[-RECENT:]):
            held = self._seqs.get(seq)
            if held is None or i + 1 >= len(held):
                continue
            most = min(MAX_PATTERN, i + 1, len(history))
            m = 2
            while m < most and held[i - m] == history[-1 - m]:
                m += 1
            if m > best:
                best, found = m, [(held, i + 1)]
            elif m == best:
                found.append((held, i + 1))
        return best, found


def continuation(found: list[tuple[list[int], int]], most: int) -> tuple[list[int], list[float]]:
    """The path most of the occurrences `found` go on with, at most `most` tokens, ending
    where its estimated probability falls below MIN_TOKEN_PROB; and that probability at each
    of its tokens (their sum: its expected accepted count)."""
    tokens: list[int] = []
    probabilities: list[float] = []
    probability = 1.0
    while len(tokens) < most:
        live = [(held, j) for held, j in found if j < len(held)]
        if not live:
            break
        token, count = Counter(held[j] for held, j in live).most_common(1)[0]
        probability *= count / len(live)
        if probability < MIN_TOKEN_PROB:
            break
        tokens.append(token)
        probabilities.append(probability)
        found = [(held, j + 1) for held, j in live if held[j] == token]
    return tokens, probabilities


@dataclass(frozen=True)
class Proposal:
    """A suffix proposal: its tokens, and the estimated probability that the target keeps
    each with all before it (their sum: how many it is expected to keep)."""

    block: DraftBlock
    probabilities: tuple[float, ...] = ()

    @property
    def expected(self) -> float:
        return sum(self.probabilities)

    def cut(self, length: int) -> Proposal:
        """Its first `length` tokens."""
        if length >= len(self.probabilities):
            return self
        b = self.block
        return Proposal(DraftBlock(b.token_ids[:length], b.distributions[:length],
                                   b.draft_probs[:length], b.cache_length, b.compute_ms),
                        self.probabilities[:length])


NO_PROPOSAL = Proposal(EMPTY_BLOCK)


@dataclass
class SuffixProposer(ReadsHistory):
    """Suffix decoding for one request: its own tokens, indexed as they come, and the
    deployment's shared index of recent outputs (the engine's)."""

    shared: SuffixIndex
    name: str = "suffix"
    wire_bytes: int = 0
    drafts: bool = False  # no blocks of the policy's k: its proposals are all free
    free_proposals: bool = True
    own: SuffixIndex = field(default_factory=SuffixIndex)
    _seq: int = -1
    _seen: int = 0

    async def get_candidates(self, history: list[int], num_speculative_tokens: int,
                             params: sampling.SamplingParams, seed: int, ahead: int = 0) -> DraftBlock:
        return EMPTY_BLOCK

    def free(self, history: list[int], most: int) -> Proposal:
        """The better of the two indexes' proposals for what follows `history` (at most `most`
        tokens), as one-hot drafts."""
        if most <= 0:
            return NO_PROPOSAL
        started = time.perf_counter()
        if self._seq < 0:
            self._seq = self.own.add(history)
        else:
            self.own.extend(self._seq, history[self._seen:])
        self._seen = len(history)
        best: tuple[list[int], list[float]] = ([], [])
        for index in (self.own, self.shared):
            matched, found = index.matches(history)
            if found:
                tokens, probabilities = continuation(found, min(most, math.floor(MAX_SPEC_FACTOR * matched)))
                if sum(probabilities) > sum(best[1]):
                    best = (tokens, probabilities)
        tokens, probabilities = best
        if not tokens:
            return NO_PROPOSAL
        return Proposal(one_hot_block(tokens, (time.perf_counter() - started) * 1000.0), tuple(probabilities))
