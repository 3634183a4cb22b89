"""The prefix cache: the KV of finished sessions, kept for the next session that starts the same way
(and the KV of live sessions, copied for one that starts as they did).

A conversation's next turn, an agent's next call and every request under one system prompt
repeat the tokens of a request before them. When a session's stream ends, its cache (the KV of
the tokens it holds: a pure function of those tokens, whichever passes computed it) becomes an
entry here. A new session whose first step's history starts with an entry's tokens starts from a
copy of that entry cut to the common prefix, and its first pass computes only the rest. A live
session between passes that holds a longer common prefix is copied instead (requests under one
system prompt that overlap in time, an agent's calls in parallel).

Entries are found by their first block of `BLOCK_TOKENS` tokens, then compared token by token
(the longest common prefix wins, the most recently used on a tie), so a hit is exact, never a
hash's guess. An entry that is a prefix of a newer one is dropped when the newer one arrives
(the newer serves every request the older would). The store is bounded in tokens and in
entries, least recently used first; the session table evicts entries before any session's KV
(`SessionTable.reserve`).

How a copy is made is the engine's (`fork` below): a transformers cache shares the entry's
tensors (a session's cache only ever cuts a view or appends a new tensor, never writes in
place), so a hit costs no copy; a llama.cpp cache copies the sequence's cells by reference
(`llama_memory_seq_cp` on a unified cache).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Tokens in the block that files an entry; a shorter history is never looked up, and a shorter
# common prefix is not reused (its pass costs little more than the lookup).
BLOCK_TOKENS = 16


@dataclass(eq=False)
class Entry:
    """One kept cache and the tokens whose KV it holds."""

    token_ids: tuple[int, ...]
    cache: Any
    last_used: int = 0


@dataclass(frozen=True)
class PrefixStats:
    """What the prefix cache did, since the service started."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (slices compared in C, halving the span)."""
    a, b = tuple(a), tuple(b)  # a tuple's slice never equals a list's
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class PrefixCache:
    """Kept caches of finished sessions, at most `max_tokens` tokens in `max_entries` entries.

    `fork(cache, length)`: a new cache holding the first `length` tokens of `cache`, which is left
    as it is; `keep(cache)`: what the store holds of a session's cache when it ends (the cache
    itself, or a copy where the engine may write over the session's tensors later).
    """

    max_tokens: int
    max_entries: int
    fork: Callable[[Any, int], Any]
    keep: Callable[[Any], Any] = lambda cache: cache
    on_evict: Callable[[int], None] = lambda tokens: None  # an entry of that many tokens was evicted
    on_change: Callable[[], None] = lambda: None  # after an entry came or went
    free: Callable[[Any], None] = lambda cache: None  # a dropped entry's cache, freed now
    _by_block: dict[tuple[int, ...], list[Entry]] = field(default_factory=dict)
    _clock: Any = field(default_factory=itertools.count)
    _tokens: int = 0  # over every entry: read by the session table at every step's reservation
    stats: PrefixStats = PrefixStats()

    @property
    def tokens(self) -> int:
        return self._tokens

    def entries(self) -> list[Entry]:
        return [e for bucket in self._by_block.values() for e in bucket]

    def lookup(self, token_ids: Sequence[int], most: int,
               live: Iterable[tuple[Sequence[int], Any]] = ()) -> tuple[Any, int] | None:
        """A new cache holding the longest cached prefix of `token_ids`, up to `most` tokens, and
        its length; None when none of at least BLOCK_TOKENS tokens is cached.

        `live`: live sessions' (tokens, cache) pairs, whose first block is the history's; one
        that holds a longer prefix than any entry is copied instead (as `keep` then `fork`)."""
        if most < BLOCK_TOKENS:
            return None
        self.stats = _add(self.stats, lookups=1)
        token_ids = tuple(token_ids)
        best, best_length = None, 0
        for entry in self._by_block.get(token_ids[:BLOCK_TOKENS], ()):
            length = min(common_prefix(entry.token_ids, token_ids), most)
            if length > best_length or (length == best_length and best is not None
                                        and entry.last_used > best.last_used):
                best, best_length = entry, length
        live_cache, live_length = None, max(best_length, BLOCK_TOKENS - 1)
        for tokens, cache in live:
            length = min(common_prefix(tokens, token_ids), most)
            if length > live_length:
                live_cache, live_length = cache, length
        if live_cache is not None:
            source, best_length = self.keep(live_cache), live_length
        elif best is not None:
            source = best.cache
            best.last_used = next(self._clock)
        else:
            return None
        self.stats = _add(self.stats, hits=1, reused_tokens=best_length)
        return self.fork(source, best_length), best_length

    def insert(self, token_ids: Sequence[int], cache: Any) -> None:
        """Keep `cache`, which holds the KV of `token_ids`; entries it extends are dropped."""
        tokens = tuple(token_ids)
        if len(tokens) < BLOCK_TOKENS or len(tokens) > self.max_tokens:
            return
        bucket = self._by_block.setdefault(tokens[:BLOCK_TOKENS], [])
        for entry in list(bucket):
            if entry.token_ids[:len(tokens)] == tokens:  # it holds this much already
                entry.last_used = next(self._clock)
                return
            if tokens[:len(entry.token_ids)] == entry.token_ids:  # this one serves all it would
                bucket.remove(entry)
                self._tokens -= len(entry.token_ids)
                self.free(entry.cache)
        bucket.append(Entry(tokens, self.keep(cache), next(self._clock)))
        self._tokens += len(tokens)
        while self.tokens > self.max_tokens or len(self.entries()) > self.max_entries:
            self.evict_one()
        self.on_change()

    def evict_one(self, frees: Callable[[Entry], bool] = lambda entry: True) -> int:
        """Drop the least recently used entry of those whose dropping `frees` storage (on
        llama.cpp an entry whose cells live sessions copied frees none); its tokens (0: none
        was dropped)."""
        entries = [e for e in self.entries() if frees(e)]
        if not entries:
            return 0
        victim = min(entries, key=lambda e: e.last_used)
        bucket = self._by_block[victim.token_ids[:BLOCK_TOKENS]]
        bucket.remove(victim)
        if not bucket:
            del self._by_block[victim.token_ids[:BLOCK_TOKENS]]
        self._tokens -= len(victim.token_ids)
        self.free(victim.cache)
        self.stats = _add(self.stats, evictions=1)
        self.on_evict(len(victim.token_ids))
        self.on_change()
        return len(victim.token_ids)


def _add(stats: PrefixStats, **counts: int) -> PrefixStats:
    return PrefixStats(**{name: getattr(stats, name) + counts.get(name, 0)
                          for name in ("lookups", "hits", "reused_tokens", "evictions")})
