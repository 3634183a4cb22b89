"""KV sessions: rollback, and scoring a segment (token tree) after the history in one pass."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tiny import last_logits
from transformers import AutoModelForCausalLM

from tandem import batching
from tandem.kv import KVSession, tree_segment


@pytest.fixture(scope="module")
def model(tiny_target: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_segment_scores_each_branch_as_if_alone(tiny_target: Path, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    session = KVSession("s", vocab_size=40)
    batching.forward(session, model, [3, 4, 5, 6], logits_to_keep=1)
    # Tree after history [3..6] + new [7, 8]: root children 9 and 10; 11 under 9; 12 under 11.
    tree = tree_segment((9, 10, 11, 12), (-1, -1, 0, 2))
    logits, hidden = batching.forward_segment(session, model, [7, 8], tree, with_hidden=True)
    history = [3, 4, 5, 6, 7, 8]
    branches = [history, history + [9], history + [10], history + [9, 11], history + [9, 11, 12]]
    for row, ids in enumerate(branches):
        torch.testing.assert_close(logits[row], last_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert hidden is not None and hidden.shape[0] == 5
    # The segment leaves no trace: the cache holds the history, and continues it exactly.
    assert session.length == len(history)
    next_logits = batching.forward(session, model, [13], logits_to_keep=1)[0]
    torch.testing.assert_close(next_logits, last_logits(model, history + [13]), atol=1e-4, rtol=1e-4)


def test_a_segment_after_a_long_history_projects_only_the_rows_it_returns(model) -> None:  # type: ignore[no-untyped-def]
    """A target proposer's prefill appends the whole prompt: the vocabulary projection must
    cover the 1 + t rows returned, not every prompt token ([n + t, vocab] floats that no KV
    budget counts; 5 GB for an 8k prompt with Qwen2.5's vocabulary)."""
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: rows.append(args[0].shape[1]))
    try:
        session = KVSession("s", vocab_size=40)
        logits, _ = batching.forward_segment(session, model, list(range(3, 35)), tree_segment((5, 6), (-1, 0)))
    finally:
        hook.remove()
    assert logits.shape[0] == 3
    assert rows == [3]


def test_the_head_projects_a_contiguous_block_of_rows(model) -> None:  # type: ignore[no-untyped-def]
    """A pass over n tokens keeping fewer rows (a prefill, a catch-up, a segment after history)
    hands the vocabulary projection a copy of those rows, not a strided view of the hidden
    states (is_contiguous() passes such a view when one row is kept): on a CPU, torch ran the
    projection of Qwen2.5-1.5B in bf16 on such a view as a batched matmul that first copies
    the whole [vocab, hidden] weight, 1 s a pass, 3x the prefill itself."""
    seen: list[bool] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: seen.append(args[0].stride() == torch.empty(args[0].shape).stride()))
    try:
        session = KVSession("s", vocab_size=40)
        batching.forward(session, model, list(range(3, 20)), logits_to_keep=1)
        batching.forward(session, model, list(range(3, 9)), logits_to_keep=2)
        batching.forward_segment(session, model, [9, 10, 11], tree_segment((5, 6), (-1, 0)))
    finally:
        hook.remove()
    assert seen == [True, True, True]


def test_rollback_beyond_the_cache_is_refused(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.errors import CacheMismatch

    session = KVSession("s", vocab_size=40)
    batching.forward(session, model, [3, 4], logits_to_keep=1)
    with pytest.raises(CacheMismatch, match="beyond the session's cache length 2"):
        session.rollback(3)


@dataclass
class Marks:
    """A soft state that holds a mark at some positions (as the draft's q at each position)."""

    at: set[int]
    told: list[int] = field(default_factory=list)

    def rollback(self, position: int) -> bool:
        self.told.append(position)
        self.at = {p for p in self.at if p <= position}
        return bool(self.at)


@dataclass
class Whole:
    """A soft state that no cut leaves standing (as Medusa's next tree)."""

    def rollback(self, position: int) -> bool:
        return False


def test_soft_states_roll_back_with_the_cache(model) -> None:  # type: ignore[no-untyped-def]
    session = KVSession("s", vocab_size=40)
    batching.forward(session, model, [3, 4, 5, 6, 7], logits_to_keep=1)
    marks = Marks({1, 3, 5})
    session.states.put(marks)
    session.states.put(Whole())
    session.rollback(5)  # no cut: nobody is told
    assert marks.told == [] and session.states.get(Whole) is not None
    session.rollback(3)
    assert marks.told == [3] and marks.at == {1, 3} and session.states.get(Whole) is None
    assert session.states.get(Marks) is marks
    session.rollback(0)  # a new cache: what holds no mark goes
    assert session.length == 0 and marks.told == [3, 0] and session.states.get(Marks) is None
    batching.forward(session, model, [3, 4], logits_to_keep=1)
    session.states.put(Marks({1}))
    session.evict()
    assert len(session.states) == 0


# --- The KV budget: least-recently-used eviction --------------------------------------------

def _table_with(model, budget: int, *lengths: int):  # type: ignore[no-untyped-def]
    from tandem.kv import SessionTable

    table = SessionTable(max_sessions=8, kv_budget_tokens=budget)
    sessions = []
    for i, n in enumerate(lengths):
        _, session = table.open(f"s{i}", vocab_size=40)
        table.reserve(session, n)
        batching.forward(session, model, list(range(3, 3 + n)), logits_to_keep=1)
        table.settle(session)
        sessions.append(session)
    return table, sessions


def test_budget_evicts_idle_sessions_least_recently_used_first(model) -> None:  # type: ignore[no-untyped-def]
    table, (a, b, c) = _table_with(model, 30, 10, 10, 10)
    table.reserve(a, 10)  # a is now the most recently used
    _, d = table.open("d", vocab_size=40)
    table.reserve(d, 12)  # 42 > 30: evict b (least recent), then 32 > 30: evict c
    assert (a.evicted, b.evicted, c.evicted) == (False, True, True)
    assert b.length == 0 and table.cached_tokens == 10


def test_tails_drafted_ahead_go_before_any_session(model) -> None:  # type: ignore[no-untyped-def]
    table, (a, b) = _table_with(model, 40, 10, 12)
    b.tail_from = 8  # b's last 4 tokens were drafted ahead: nobody has asked for them yet
    b.tail_extra, b.guesses = 9, "copies of b's cache, one per guess"
    b.reserved = b.length + b.tail_extra
    assert table.tail_tokens == 4 + 9
    _, c = table.open("c", vocab_size=40)
    table.reserve(c, 20)  # 51 > 40: b's tail goes (13 tokens), not a (least recently used)
    assert not a.evicted and not b.evicted
    assert b.length == 8 and b.tail_from is None and table.tail_tokens == 0
    assert b.guesses is None and b.reserved == 8


def test_drafting_ahead_claims_only_free_room(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.errors import BudgetHeld

    table, (a, b) = _table_with(model, 24, 10, 10)
    with pytest.raises(BudgetHeld, match="no free room"):
        table.reserve(b, 16, evict=False)  # 26 > 24: it would take a's room
    assert not a.evicted
    table.reserve(b, 14, evict=False)  # 24 fits
    assert b.reserved == 14


def test_a_tail_being_drafted_is_not_cut_under_it(model) -> None:  # type: ignore[no-untyped-def]
    table, (a, b) = _table_with(model, 30, 10, 12)
    b.tail_from, b.ahead = 8, True  # its drafting task is writing the tail now
    _, c = table.open("c", vocab_size=40)
    table.reserve(c, 10)
    assert b.length == 12 and a.evicted  # the tail stays; the least recently used session goes


def test_passes_record_the_tokens_the_cache_holds(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.batching import Pass, single

    session = KVSession("t", vocab_size=40)
    single(model, Pass(session, 0, (3, 4, 5, 6)))
    single(model, Pass(session, 2, (7, 8)))  # cut back to 2, then append
    assert session.held_tokens == [3, 4, 7, 8]
    session.rollback(3)
    assert session.held_tokens == [3, 4, 7]


def test_a_session_whose_pass_is_running_is_never_evicted(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.batching import Pass, StepScheduler
    from tandem.errors import BudgetHeld, SessionEvicted

    table, (a, b) = _table_with(model, 15, 10, 5)
    _, c = table.open("c", vocab_size=40)
    a.pending = 1  # a pass of a is queued or running (the scheduler counts it)
    with pytest.raises(BudgetHeld, match="held by other sessions' steps under way"):
        table.reserve(c, 10)  # evicting b (idle) would not make room while a's pass runs
    assert not a.evicted and not b.evicted  # so nothing is evicted for a refused step
    a.pass_over()
    table.reserve(c, 10)  # a's pass is over: now a can go (least recently used), b need not
    assert a.evicted and not b.evicted
    with pytest.raises(SessionEvicted):  # and a pass of a submitted after its eviction is refused
        asyncio.run(StepScheduler(4, 64, sessions=table)(Pass(a, 10, (1,))))
    assert a.pending == 0


def test_a_step_waiting_for_room_wakes_when_a_pass_ends(model) -> None:  # type: ignore[no-untyped-def]
    """No polling: the waiter is woken by the end of the pass that held the room."""
    table, (a, b) = _table_with(model, 15, 10, 5)
    _, c = table.open("c", vocab_size=40)
    a.pending = b.pending = 1

    async def run() -> None:
        with pytest.raises(BudgetHeld):
            table.reserve(c, 10)
        waiting = asyncio.ensure_future(table.room_freed(60.0))
        still = asyncio.ensure_future(a.still())
        await asyncio.sleep(0)
        assert not waiting.done() and not still.done()
        a.pass_over()
        table.changed()
        await asyncio.wait_for(asyncio.gather(waiting, still), 5.0)
        table.reserve(c, 10)
        assert a.evicted and not b.evicted

    from tandem.errors import BudgetHeld

    asyncio.run(run())


def test_an_evicted_session_claims_no_room(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.errors import SessionEvicted

    table, (a, b, c) = _table_with(model, 30, 10, 10, 10)
    a.evict()
    with pytest.raises(SessionEvicted):
        table.reserve(a, 25)  # its step is refused before it can push b or c out
    assert not b.evicted and not c.evicted


def test_a_step_larger_than_the_budget_is_refused(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.errors import ResourceExhausted

    table, (a,) = _table_with(model, 20, 5)
    with pytest.raises(ResourceExhausted, match=r"needs 21 cached tokens but .* budget is 20"):
        table.reserve(a, 21)


def test_an_evicted_session_is_over(model) -> None:  # type: ignore[no-untyped-def]
    from tandem.errors import SessionEvicted

    _, (a,) = _table_with(model, 0, 6)
    a.evict()
    for position in (6, 0):  # even a step from scratch: the caller rebuilds on a new session
        with pytest.raises(SessionEvicted, match="open a new session and resend the history"):
            a.rollback(position)


def test_a_queued_first_step_gives_its_reservation_back(model) -> None:  # type: ignore[no-untyped-def]
    table, (a,) = _table_with(model, 30, 10)
    _, fresh = table.open("fresh", vocab_size=40)
    table.reserve(fresh, 15)  # its prefill is queued: nothing cached yet, 15 claimed
    _, c = table.open("c", vocab_size=40)
    table.reserve(c, 20)  # 45 > 30: the least recently used (a), then the queued one, go
    assert a.evicted and fresh.evicted and not c.evicted


def test_a_session_in_the_middle_of_its_step_is_not_evicted_the_step_waits(model) -> None:  # type: ignore[no-untyped-def]
    """Found with batching: drafts evicted between the passes of their own step, again and
    again, until the orchestrator gave the draft up. Sessions between steps go; room held by
    steps under way is waited for (BudgetHeld), never taken."""
    from tandem.errors import BudgetHeld

    table, (a, b, c) = _table_with(model, 30, 10, 10, 10)
    a.in_step = b.in_step = True  # between passes of their steps
    _, d = table.open("d", vocab_size=40)
    table.reserve(d, 10)  # c is between steps: it goes, though a is older
    d.in_step = True
    assert (a.evicted, b.evicted, c.evicted) == (False, False, True)
    _, e = table.open("e", vocab_size=40)
    with pytest.raises(BudgetHeld):
        table.reserve(e, 10)  # only steps under way hold the room
    assert not a.evicted and not b.evicted
    a.in_step = False
    table.reserve(e, 10)  # a's step ended: now it can go
    assert a.evicted and not b.evicted
