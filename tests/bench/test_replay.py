"""Offline replay of prompt lookup against a known greedy output."""

from __future__ import annotations

from bench.replay import replay


def test_a_repeated_phrase_is_drafted_and_kept() -> None:
    prompt = [1, 2, 3, 4, 5, 9]
    output = [1, 2, 3, 4, 5, 7]  # "1 2" recurs: lookup proposes 3 4 5 9, the target keeps 3 4 5
    r = replay(prompt, output, k=4)
    # pass 1: no n-gram ends at 9 -> token 1; pass 2: [9, 1] never seen -> 2;
    # pass 3: "1 2" seen -> drafts 3 4 5 9, keeps 3 4 5, the target says 7.
    assert (r.tokens, r.passes, r.proposals, r.accepted) == (6, 3, 1, 3)


def test_nothing_to_look_up_is_one_token_per_pass() -> None:
    r = replay([10, 11, 12], [13, 14, 15, 16], k=4)
    assert (r.passes, r.proposals, r.accepted) == (4, 0, 0)
