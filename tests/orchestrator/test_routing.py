"""Routing that follows the prefix caches: the rule on its own, and interleaved conversations
over two drafts and two targets."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.routing import LOAD_BOUND, PrefixRoutes, block_keys, choose, rendezvous
from tandem.launch import start_stack
from tandem.prefix import BLOCK_TOKENS


def test_a_key_names_a_whole_prefix() -> None:
    history = list(range(3 * BLOCK_TOKENS + 5))
    keys = block_keys(history)
    assert len(keys) == 3 and block_keys(history[:2 * BLOCK_TOKENS]) == keys[:2]
    changed = [99, *history[1:]]  # one token of the first block: every key changes
    assert not set(block_keys(changed)) & set(keys)
    assert block_keys(history[:BLOCK_TOKENS - 1]) == []


def test_a_replica_leaving_or_joining_moves_only_the_prefixes_it_held_or_wins() -> None:
    keys = [block_keys(random.Random(i).choices(range(100), k=BLOCK_TOKENS))[0] for i in range(300)]
    three = ["a:1", "b:1", "c:1"]
    before = {k: rendezvous(k, three)[0] for k in keys}
    after_leave = {k: rendezvous(k, ["a:1", "b:1"])[0] for k in keys}
    assert all(after_leave[k] == before[k] for k in keys if before[k] != "c:1")
    after_join = {k: rendezvous(k, [*three, "d:1"])[0] for k in keys}
    assert all(after_join[k] in (before[k], "d:1") for k in keys)
    assert 40 < sum(after_join[k] == "d:1" for k in keys) < 110  # about a quarter moved


def test_a_session_goes_where_its_prefix_went_unless_that_replica_is_past_the_bound() -> None:
    routes = PrefixRoutes()
    turn = block_keys(list(range(4 * BLOCK_TOKENS)))
    first_block_winner = rendezvous(turn[0], ["a", "b"])[0]
    other = "b" if first_block_winner == "a" else "a"
    # Another conversation went to the other replica through the first three blocks (a shared
    # system prompt) and on past them.
    routes.record([*turn[:3], *block_keys(list(range(5 * BLOCK_TOKENS, 7 * BLOCK_TOKENS)))], other)
    assert routes.continued(turn, ["a", "b"]) is None
    assert choose({"a": 0, "b": 0}, turn, routes) == other
    # That replica is past the bound: ceil(1.25 * 4 / 2) = 3 open sessions.
    assert LOAD_BOUND == 1.25
    assert choose({other: 3, first_block_winner: 0}, turn, routes) == first_block_winner
    # No block: the least loaded.
    assert choose({"a": 2, "b": 1}, [], routes) == "b"
    routes.forget(other)
    assert choose({"a": 0, "b": 0}, turn, routes) == first_block_winner


def test_a_conversation_stays_where_its_earlier_turn_went_past_the_bound() -> None:
    """A later turn holds the earlier turn's whole history: it goes where that turn went, even
    when the other conversations there kept their replica busy while those elsewhere ended
    (four open there, none on the other); a new conversation sharing only its system prompt
    is still held to the bound, and one that went past an end makes it a shared prefix."""
    routes = PrefixRoutes()
    system = list(range(3 * BLOCK_TOKENS))
    earlier = block_keys([*system, *range(100, 100 + BLOCK_TOKENS)])
    later = block_keys([*system, *range(100, 100 + 3 * BLOCK_TOKENS)])
    stranger = block_keys([*system, *range(900, 900 + 2 * BLOCK_TOKENS)])
    held = "b" if rendezvous(earlier[0], ["a", "b"])[0] == "a" else "a"
    free = "a" if held == "b" else "b"
    routes.record(earlier, held)
    assert routes.continued(later, ["a", "b"]) == held
    assert choose({held: 4, free: 0}, later, routes) == held
    assert choose({held: 4, free: 0}, stranger, routes) == free
    # n > 1: the choices hold exactly the prefilled prompt, and go where it went.
    assert choose({held: 4, free: 0}, earlier, routes) == held
    routes.record(stranger, free)  # it went past the system prompt's blocks only: no end there
    assert routes.continued(later, ["a", "b"]) == held
    routes.record(later, held)  # the next turn went past the earlier turn's end
    assert routes.continued(earlier, ["a", "b"]) is None and routes.continued(later, [held]) == held


def test_routes_are_bounded() -> None:
    routes = PrefixRoutes(capacity=4)
    keys = block_keys(list(range(6 * BLOCK_TOKENS)))
    routes.record(keys, "a")
    assert routes.holder(keys[:2], ["a"]) is None and routes.holder(keys, ["a"]) == "a"


@pytest.mark.slow
def test_interleaved_conversations_find_their_earlier_turns(tiny_draft: Path, tiny_target: Path) -> None:
    """Eight conversations at once over two drafts and two targets, three turns each: a later
    turn reuses at least 80% of the turn before on the target (and the draft), almost always."""
    stack = start_stack(str(tiny_draft), str(tiny_target), num_drafts=2, num_targets=2)
    rng = random.Random(5)
    systems = [rng.choices(range(2, 35), k=40) for _ in range(2)]  # two shared system prompts
    reuse: list[tuple[int, int, int]] = []  # (target cached, draft cached, the turn before's prompt)

    def conversation(c: int) -> None:
        history = [*systems[c % 2], *rng.choices(range(2, 35), k=10)]
        before = 0  # the turn before's prompt
        with stack.client() as client:
            for turn in range(3):
                reply = client.generate(history, max_new_tokens=12, num_speculative_tokens=2,
                                        ignore_eos=True)
                if turn:
                    reuse.append((reply.usage.target_cached_tokens, reply.usage.draft_cached_tokens, before))
                before = len(history)
                history = [*history, *reply.token_ids, *rng.choices(range(2, 35), k=8)]

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(conversation, range(8)))
    finally:
        stack.stop()
    assert len(reuse) == 16
    assert sum(target >= 0.8 * before for target, _, before in reuse) >= 0.9 * len(reuse), reuse
    assert sum(draft >= 0.8 * before for _, draft, before in reuse) >= 0.9 * len(reuse), reuse
