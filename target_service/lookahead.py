"""Lookahead decoding as a target proposer (Fu et al., ICML 2024, arXiv 2402.02057).

Each step scores one segment after the step's history tokens, in the target's own pass:

* a *lookahead branch*: a 2D window of W columns over the last N-1 Jacobi levels. Level 0,
  column 0 is the last history token; token (l, i) sits at position last + l + i and sees
  level 0's columns 0..i and the tokens above it in its column (levels 1..l). Reading a
  column upwards is therefore a causal sequence, and the argmax after (N-2, i) continues it:
  level 0..N-2 of column i plus that argmax is an n-gram, harvested into a pool keyed by
  its first token. Then the window advances one level: the oldest level is dropped and the
  argmaxes become the newest (the reference's ALWAYS_FWD_ONE: the window moves one position
  per step whatever the step committed, so it drifts behind after a long accepted path
  and the Jacobi iteration catches up; its n-grams do not depend on where they were found).
* a *verification branch*: the pool's n-grams that start with the last history token,
  whose remaining N-1 tokens are merged into a trie under the root and verified with
  `sampling.verify_tree`.

The two branches share the pass but never see each other, so the lookahead branch cannot
change the verification rows. Every candidate is a function of past passes (argmaxes of
earlier steps' logits, a window seeded from the history), never of this step's random
draws, so verification keeps the target's exact law under sampling too.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass, field

import torch

from tandem import sampling
from tandem.kv import KVSession, Segment, tree_segment
from target_service.candidates import Candidates


@dataclass(frozen=True)
class LookaheadConfig:
    window: int  # W: columns of the lookahead window
    ngram: int  # N: n-gram size; the window keeps N-1 levels
    candidates: int  # G: most n-grams verified per step (and kept per pool key)

    @classmethod
    def parse(cls, spec: str) -> LookaheadConfig | None:
        """From a flag value "W,N,G"; None for "" or "off"."""
        if spec.strip().lower() in ("", "off"):
            return None
        try:
            window, ngram, candidates = (int(part) for part in spec.split(","))
        except ValueError:
            raise ValueError(f"--lookahead must be W,N,G (three integers) or off, got {spec!r}") from None
        if window < 1 or ngram < 3 or candidates < 0:
            raise ValueError(f"--lookahead {spec!r}: need W >= 1, N >= 3 and G >= 0")
        return cls(window, ngram, candidates)


@dataclass
class NgramPool:
    """N-grams keyed by their first token, at most `size` per key, least recently seen first."""

    size: int
    by_first: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        if self.size == 0:
            return
        entries = self.by_first.setdefault(first, [])
        if rest in entries:
            entries.remove(rest)
        elif len(entries) >= self.size:
            del entries[0]
        entries.append(rest)

    def get(self, first: int) -> list[tuple[int, ...]]:
        """The continuations of `first`, most recently seen first."""
        return self.by_first.get(first, [])[::-1]


@dataclass
class LookaheadState:
    """One session's window and pool (soft state: lost with the cache, rebuilt as it goes)."""

    levels: list[list[int]]  # [N-1]: level 0 holds columns 1..W-1, the others columns 0..W-1
    pool: NgramPool
    steps: int = 0  # passes since the window was seeded
    last_token: int = -1  # the last history token of the step in flight (level 0, column 0)

    def rollback(self, position: int) -> bool:
        # The window and the pool are guesses that hold after any history; a new cache (a new
        # or rebuilt session) seeds a new window from its history.
        return position > 0


def seed_window(history: list[int], config: LookaheadConfig) -> list[list[int]]:
    """Levels drawn from the history's own tokens (the reference's copy_from), seeded by it."""
    digest = hashlib.blake2b(",".join(map(str, history)).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    w = config.window
    return [[rng.choice(history) for _ in range(w - 1 if level == 0 else w)]
            for level in range(config.ngram - 1)]


@functools.cache
def window_layout(window: int, ngram: int) -> tuple[tuple[int, ...], torch.Tensor]:
    """Offsets [t] and visibility [t, t] of a W x (N-1) window, level by level, column by column."""
    index: dict[tuple[int, int], int] = {}  # (level, column) -> segment index
    for level in range(ngram - 1):
        for column in range(1 if level == 0 else 0, window):
            index[level, column] = len(index)
    visible = torch.zeros(len(index), len(index), dtype=torch.bool)
    for (level, column), i in index.items():
        for c in range(1, column + 1):
            visible[i, index[0, c]] = True
        for above in range(1, level + 1):
            visible[i, index[above, column]] = True
    return tuple(level + column - 1 for level, column in index), visible


def window_segment(levels: list[list[int]]) -> Segment:
    """The lookahead branch as a segment (level 0's column 0 is the last history token)."""
    w = len(levels[1])
    assert len(levels[0]) == w - 1 and all(len(level) == w for level in levels[1:])
    offsets, visible = window_layout(w, len(levels) + 1)
    return Segment(tuple(t for level in levels for t in level), offsets, visible)


def ngram_trie(continuations: list[tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Merge continuations of the root into a token tree: (token_ids, parents), parents first."""
    token_ids: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for continuation in continuations:
        node = -1
        for token in continuation:
            if (node, token) not in children:
                children[node, token] = len(token_ids)
                token_ids.append(token)
                parents.append(node)
            node = children[node, token]
    return tuple(token_ids), tuple(parents)


def concat(first: Segment, second: Segment) -> Segment:
    """Both segments in one, neither seeing the other."""
    a, b = len(first.token_ids), len(second.token_ids)
    visible = torch.zeros(a + b, a + b, dtype=torch.bool)
    visible[:a, :a] = first.visible
    visible[a:, a:] = second.visible
    return Segment(first.token_ids + second.token_ids, first.offsets + second.offsets, visible)


class LookaheadProposer:
    """Proposes n-grams from a pool that a Jacobi window, scored in the same pass, keeps filling."""

    with_hidden = False

    def __init__(self, config: LookaheadConfig) -> None:
        self.config = config
        w = config.window
        # The newest level's segment indices: after level 0 (W-1 tokens) and N-3 full levels.
        first_top = (w - 1) + (config.ngram - 3) * w
        self._top_rows = [1 + first_top + i for i in range(w)]  # logits rows after them
        self._window_tokens = first_top + w
        # The window, then a trie of at most G continuations of N-1 tokens.
        self.max_segment_tokens = self._window_tokens + config.candidates * (config.ngram - 1)

    def state(self, session: KVSession, new_token_ids: list[int]) -> LookaheadState:
        state = session.states.get(LookaheadState)
        if state is None:
            # No state: the session is new or its cache was rebuilt (or started from a kept
            # prefix), so what it holds and new_token_ids are the history.
            state = LookaheadState(seed_window([*session.held_tokens, *new_token_ids], self.config),
                                   NgramPool(self.config.candidates))
            session.states.put(state)
        return state

    def get_candidates(self, session: KVSession, new_token_ids: list[int]) -> Candidates:
        state = self.state(session, new_token_ids)
        state.last_token = new_token_ids[-1]
        tree_ids, parents = ngram_trie(state.pool.get(state.last_token))
        segment = concat(window_segment(state.levels), tree_segment(tree_ids, parents))
        nodes = tuple(range(self._window_tokens, self._window_tokens + len(tree_ids)))
        return Candidates(segment, nodes, parents)

    def update_candidate_strategy(self, session: KVSession, candidates: Candidates,
                                  logits: torch.Tensor, hidden: torch.Tensor | None,
                                  verdict: sampling.TreeVerdict) -> None:
        """Harvest the window's n-grams and advance it one Jacobi level. logits [1 + t, vocab]."""
        state = session.states.get(LookaheadState)
        assert state is not None, "get_candidates made it"
        levels = state.levels
        newest = logits[self._top_rows].argmax(-1).tolist()  # [W]
        # Level 0 of a freshly seeded window is history noise: harvest once every level the
        # n-grams read (1..N-2) came out of a pass.
        if state.steps >= self.config.ngram - 2:
            for column in range(self.config.window):
                first = state.last_token if column == 0 else levels[0][column - 1]
                rest = tuple(level[column] for level in levels[1:]) + (newest[column],)
                state.pool.add(first, rest)
        state.levels = [levels[1][1:], *(level[:] for level in levels[2:]), newest]
        state.steps += 1
