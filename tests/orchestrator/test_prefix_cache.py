"""Prefix caching end to end: a later turn of a conversation starts from the KV its earlier turn
left on both tiers, says so in its usage, and decodes what a cold request decodes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from scrape import sample
from tiny import greedy_reference

from tandem.launch import Process, Stack

LENGTH = 16


def ended(*processes: Process) -> None:
    """Until the replicas have closed every session (a closed session's cache is kept then,
    or a moment later where a pass of it was still running)."""
    deadline = time.monotonic() + 30
    while any(sample(p, "tandem_sessions_active") for p in processes):
        assert time.monotonic() < deadline, "sessions stayed open"
        time.sleep(0.05)
    time.sleep(0.3)


def turn(start: int, n: int) -> list[int]:
    return [2 + (start + 5 * i) % 33 for i in range(n)]


@pytest.mark.parametrize("k", [0, 3])
def test_a_later_turn_starts_from_the_earlier_one_on_both_tiers(tiny_stack: Stack, tiny_target: Path,
                                                                 k: int) -> None:
    first = turn(k, 30)
    with tiny_stack.client() as client:
        reply = client.generate(first, max_new_tokens=LENGTH, num_speculative_tokens=k, ignore_eos=True)
        assert reply.usage.target_cached_tokens == 0  # a prompt never seen
        ended(*tiny_stack.drafts, *tiny_stack.targets)
        second = [*first, *reply.token_ids, 7, 8, 9]
        again = client.generate(second, max_new_tokens=LENGTH, num_speculative_tokens=k, ignore_eos=True)
        # Another request that leaves the kept history after 20 tokens: 20 are reused, no more.
        branch = [*first[:20], *turn(k + 7, 12)]
        other = client.generate(branch, max_new_tokens=LENGTH, num_speculative_tokens=k, ignore_eos=True)
    assert other.usage.target_cached_tokens == 20
    assert list(other.token_ids) == greedy_reference(tiny_target, branch, LENGTH)
    # The target kept its whole history but its last token (never fed) and what it drafted
    # past it; the next turn reuses at least the first turn's prompt and output but the last.
    assert len(first) + LENGTH - 1 <= again.usage.target_cached_tokens < len(second)
    if k:
        assert len(first) <= again.usage.draft_cached_tokens < len(second)
    assert list(again.token_ids) == greedy_reference(tiny_target, second, LENGTH)
