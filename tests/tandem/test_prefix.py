"""The prefix cache: what it finds, what it keeps and drops, and that a session started from a
kept prefix computes what a cold one does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import last_logits
from transformers import AutoModelForCausalLM

from tandem import batching
from tandem.errors import BudgetHeld
from tandem.kv import SessionTable, fork_cache
from tandem.prefix import BLOCK_TOKENS, PrefixCache, common_prefix


@pytest.fixture(scope="module")
def model(tiny_target: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


class Held:
    """A stand-in cache: the tokens it holds (forks are cut copies)."""

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens


def held_cache(**kwargs: Any) -> PrefixCache:
    return PrefixCache(fork=lambda cache, n: Held(cache.tokens[:n]), **{"max_tokens": 1000, "max_entries": 8,
                                                                         **kwargs})


def tokens(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


@pytest.mark.parametrize("a, b, common", [((), (1,), 0), ((1, 2), [1, 2, 3], 2), ((1, 2, 3), (1, 2, 3), 3), ((1, 2, 3), (1, 2), 2),
                                          ((1, 2, 3, 4), (1, 2, 5, 4), 2), ((9,), (1,), 0),
                                          (tuple(range(100)), (*range(99), 7), 99)])
def test_common_prefix(a: tuple[int, ...], b: tuple[int, ...], common: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == common


def test_the_longest_kept_prefix_is_found_up_to_the_limit() -> None:
    store = held_cache()
    base = tokens(0, 40)
    store.insert(base[:20], Held(base[:20]))
    store.insert((*base[:30], 99, 98), Held((*base[:30], 99, 98)))
    found = store.lookup(base, most=39)
    assert found is not None and found[1] == 30 and found[0].tokens == base[:30]
    found = store.lookup(base, most=25)  # all but the tokens the step must compute
    assert found is not None and found[1] == 25
    assert store.lookup(tokens(1, 40), most=39) is None  # another first block
    assert store.lookup(base[:BLOCK_TOKENS], most=BLOCK_TOKENS - 1) is None  # too short to look up
    assert store.stats.lookups == 3 and store.stats.hits == 2 and store.stats.reused_tokens == 55


def test_an_entry_a_newer_one_extends_is_dropped_and_a_prefix_of_one_is_not_kept() -> None:
    store = held_cache()
    base = tokens(0, 50)
    store.insert(base[:20], Held(base[:20]))
    store.insert(base[:40], Held(base[:40]))  # the next turn: it serves all the first would
    assert [e.token_ids for e in store.entries()] == [base[:40]]
    store.insert(base[:30], Held(base[:30]))  # held already
    assert [e.token_ids for e in store.entries()] == [base[:40]]
    assert store.tokens == 40


def test_bounds_evict_the_least_recently_used() -> None:
    evicted: list[int] = []
    store = held_cache(max_tokens=100, max_entries=3, on_evict=evicted.append)
    a, b, c, d = (tokens(s * 100, 30) for s in range(4))
    for t in (a, b, c):
        store.insert(t, Held(t))
    assert store.lookup(a, most=29) is not None  # a is used: b is now the oldest
    store.insert(d, Held(d))  # 4 entries and 120 tokens: b goes
    assert {e.token_ids for e in store.entries()} == {a, c, d} and evicted == [30]
    store.insert(tokens(500, 101), Held(()))  # longer than the whole store: not kept
    assert store.tokens == 90


@torch.inference_mode()
def test_a_session_from_a_kept_prefix_computes_what_a_cold_one_does(model: Any) -> None:
    """The table keeps a closed session's cache; a new session whose history extends it starts
    from it, computes only the rest, and gets the logits of the whole history; the kept
    entry's tensors are not changed by what the new session appends (they are shared)."""
    table = SessionTable(8, prefix=PrefixCache(1000, 8, fork_cache))
    handle, first = table.open("a", 40)
    history = [(7 * i) % 33 + 2 for i in range(24)]
    batching.single(model, batching.Pass(first, 0, tuple(history[:20])))
    table.close(handle)
    [entry] = table.prefix.entries()  # type: ignore[union-attr]
    kept = [layer.keys.clone() for layer in entry.cache.layers]

    _, second = table.open("b", 40)
    reused = table.start_from_prefix(second, history)
    assert reused == 20 and second.length == 20 and second.held_tokens == history[:20]
    out = batching.single(model, batching.Pass(second, 20, tuple(history[20:]), logits_to_keep=1))
    assert out.logits is not None
    torch.testing.assert_close(out.logits[0], last_logits(model, history), atol=1e-5, rtol=1e-5)
    # A history that leaves the kept one at 18: the copy is cut there.
    other = [*history[:18], 5, 6, 7]
    _, third = table.open("c", 40)
    assert table.start_from_prefix(third, other) == 18 and third.length == 18
    out = batching.single(model, batching.Pass(third, 18, tuple(other[18:]), logits_to_keep=1))
    assert out.logits is not None
    torch.testing.assert_close(out.logits[0], last_logits(model, other), atol=1e-5, rtol=1e-5)
    for layer, before in zip(entry.cache.layers, kept, strict=True):
        assert torch.equal(layer.keys, before)


def test_a_session_starts_from_what_a_live_session_holds(model: Any) -> None:
    """A live session between passes that holds a longer prefix than any kept entry is copied;
    both then compute what cold sessions do. One with a pass pending is not."""
    table = SessionTable(8, prefix=PrefixCache(1000, 8, fork_cache))
    history = [(5 * i) % 31 + 2 for i in range(30)]
    handle, kept = table.open("kept", 40)
    batching.single(model, batching.Pass(kept, 0, tuple(history[:17])))
    table.close(handle)
    _, live = table.open("live", 40)
    batching.single(model, batching.Pass(live, 0, tuple(history[:24])))

    live.pending = 1  # a pass of it queued: its cache may be changing
    _, early = table.open("early", 40)
    assert table.start_from_prefix(early, history) == 17  # the entry's
    live.pending = 0
    _, second = table.open("second", 40)
    assert table.start_from_prefix(second, history) == 24 and second.held_tokens == history[:24]
    out = batching.single(model, batching.Pass(second, 24, tuple(history[24:]), logits_to_keep=1))
    assert out.logits is not None
    torch.testing.assert_close(out.logits[0], last_logits(model, history), atol=1e-5, rtol=1e-5)
    # The live session goes on elsewhere, as if nothing had been copied.
    other = [*history[:24], 9, 8, 7]
    out = batching.single(model, batching.Pass(live, 24, tuple(other[24:]), logits_to_keep=1))
    assert out.logits is not None
    torch.testing.assert_close(out.logits[0], last_logits(model, other), atol=1e-5, rtol=1e-5)
    assert table.prefix is not None and table.prefix.stats.hits == 2


def test_kept_prefixes_give_way_before_idle_sessions() -> None:
    table = SessionTable(8, kv_budget_tokens=100, prefix=PrefixCache(100, 8, lambda cache, n: cache))
    _, idle = table.open("idle", 40)
    idle.cache.get_seq_length = lambda *_: 30  # type: ignore[method-assign]
    table.prefix.insert(tokens(0, 40), object())  # type: ignore[union-attr]
    table.prefix.insert(tokens(100, 20), object())  # type: ignore[union-attr]
    _, busy = table.open("busy", 40)
    table.reserve(busy, 40)  # 30 + 60 kept + 40: the older kept prefix goes, no session
    assert not idle.evicted and [e.token_ids for e in table.prefix.entries()] == [tokens(100, 20)]  # type: ignore[union-attr]
    # Drafting ahead takes free room only, kept prefixes counting as free: never a session's.
    table.reserve(busy, 70, evict=False)
    assert not idle.evicted and not table.prefix.entries()  # type: ignore[union-attr]
    with pytest.raises(BudgetHeld):
        table.reserve(busy, 71, evict=False)


def test_a_session_closed_with_a_pass_pending_is_kept_once_it_is_still() -> None:
    async def run() -> list[tuple[int, ...]]:
        table = SessionTable(8, prefix=PrefixCache(1000, 8, fork_cache))
        handle, session = table.open("s", 40)
        session.token_ids = list(tokens(0, 20))
        session.cache.get_seq_length = lambda *_: 20  # type: ignore[method-assign]
        session.pending = 1  # a pass of drafting ahead, still running
        table.close(handle)
        assert not table.prefix.entries()  # type: ignore[union-attr]
        session.pass_over()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return [e.token_ids for e in table.prefix.entries()]  # type: ignore[union-attr]

    assert asyncio.run(run()) == [tokens(0, 20)]
