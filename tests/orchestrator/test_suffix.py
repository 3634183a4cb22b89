"""Suffix decoding: the index, the proposal and the choice it offers the loop, on their own."""

from __future__ import annotations

import random

from orchestrator.policy import CostModel, Ema, Speculation
from orchestrator.suffix import (
    MAX_PATTERN,
    MIN_TOKEN_PROB,
    NO_PROPOSAL,
    SuffixIndex,
    SuffixProposer,
    continuation,
)


def test_the_longest_match_of_the_history_end_wins() -> None:
    index = SuffixIndex()
    index.add([1, 2, 3, 4, 5, 9, 9, 3, 4, 6, 7])
    matched, found = index.matches([8, 2, 3, 4])
    assert matched == 3  # "2 3 4" once (then 5); "3 4" alone also precedes 6
    assert [held[i] for held, i in found] == [5]
    assert index.matches([7, 7, 3, 4])[0] == 2
    assert index.matches([3, 5]) == (0, [])  # no such pair
    assert index.matches([4]) == (0, [])  # too short to key


def test_a_match_is_at_most_max_pattern_and_the_history_own_end_does_not_count() -> None:
    tokens = list(range(100, 100 + 2 * MAX_PATTERN))
    index = SuffixIndex()
    seq = index.add(tokens)
    assert index.matches(tokens) == (0, [])  # its only occurrence is its own end: nothing follows
    index.extend(seq, tokens)  # the whole run again: the first occurrence is followed by the run
    matched, found = index.matches(tokens)
    assert matched == MAX_PATTERN and [held[i] for held, i in found] == [100]


def test_the_continuation_follows_the_majority_and_stops_at_the_probability_floor() -> None:
    index = SuffixIndex()
    for tail in ([5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, 9]):
        index.add([1, 2, *tail])
    matched, found = index.matches([0, 1, 2])
    assert matched == 2 and len(found) == 4
    tokens, probabilities = continuation(found, 10)
    # 5 (4 of 4), then 6 (3 of 4: 0.75), then 7 (2 of 3: 0.5); then nothing follows.
    assert tokens == [5, 6, 7]
    assert probabilities == [1.0, 0.75, 0.5]
    assert continuation(found, 2)[0] == [5, 6]
    spread = SuffixIndex()
    for t in range(20):  # twenty different continuations: each a twentieth, below the floor
        spread.add([1, 2, 100 + t])
    assert 1 / 20 < MIN_TOKEN_PROB and continuation(spread.matches([1, 2])[1], 10) == ([], [])


def test_the_shared_index_is_bounded_and_keeps_matching_what_it_holds() -> None:
    rng = random.Random(0)
    index = SuffixIndex(max_tokens=1000)
    sequences = [[rng.randrange(50_000) for _ in range(97)] for _ in range(60)]
    for tokens in sequences:
        index.add(tokens)
        assert index.tokens <= 1000
    assert len(index) == 1000 // 97  # the latest ones
    assert index.matches(sequences[0][:10]) == (0, [])  # evicted
    matched, found = index.matches(sequences[-1][:10])
    assert matched == 10 and [held[i] for held, i in found] == [sequences[-1][10]]
    # Stale entries were purged along the way: what is filed is what is held, about.
    assert sum(len(v) for v in index._where.values()) <= 2 * index.tokens


def test_a_request_proposes_from_its_own_repetition_and_from_other_requests_outputs() -> None:
    shared = SuffixIndex(max_tokens=10_000)
    edit = list(range(200, 260))  # a file a request quotes, then starts to repeat
    mine = SuffixProposer(shared)
    proposal = mine.free([1, 2, *edit, 7, *edit[:20]], 16)
    assert list(proposal.block.token_ids) == edit[20:36] and proposal.expected == 16.0
    assert proposal.block.draft_probs == (1.0,) * 16  # one-hot drafts
    assert SuffixProposer(shared).free([1, 2, 3], 16) is NO_PROPOSAL  # nothing like it yet
    # Another request's output, filed after it ended, serves a new request with the same start.
    shared.add([5, 6, *edit])
    other = SuffixProposer(shared)
    assert list(other.free([9, 5, 6, *edit[:3]], 4).block.token_ids) == edit[3:7]
    assert other.free([9, 5, 6], 0) is NO_PROPOSAL


def _policy(verify: dict[int, float], draft_ms: float | None) -> Speculation:
    costs = CostModel()
    costs.seed_verify(sorted(verify.items()))
    if draft_ms is not None:
        costs.draft_ms_per_token = Ema(value=draft_ms)
    return Speculation("adaptive", 4, costs)


def test_a_free_proposal_is_cut_to_the_length_that_yields_most_tokens_per_millisecond() -> None:
    cpu = {t: 40.0 + 12.0 * t for t in range(1, 18)}  # a target on a CPU: v(1) 52 ms, v(9) 148 ms
    policy = _policy(cpu, draft_ms=5.0)
    sure, doubtful = [1.0] * 8, [1.0, 0.5, 0.25, 0.2, 0.15, 0.12, 0.11, 0.1]
    # Against the target alone (k = 0: 1 token in 52 ms). A sure 8-token path yields 9 tokens
    # in 148 ms (its first 4: 5 in 100 ms), so all 8 go; a doubtful one, its first 2 tokens
    # (2.5 in 76 ms; 1: 2 in 64 ms; 3: 2.75 in 88 ms).
    assert policy.free_length(sure, 0, 1, 64) == 8
    assert policy.free_length(doubtful, 0, 1, 64) == 2
    assert policy.free_length([0.2], 0, 1, 64) == 0  # 1.2 tokens in 64 ms: plain is better
    # Against the draft model at k = 4 (E(4) at the prior 0.7: 2.77 tokens in 120 ms).
    assert policy.free_length([1.0] * 4, 4, 1, 64) == 4
    assert policy.free_length([0.3, 0.1], 4, 1, 64) == 0
    # Proposals that kept half what they expected: the estimates count for half.
    assert policy.free_length([0.4], 0, 1, 64) == 1  # 1.4 tokens in 64 ms
    for _ in range(40):
        policy.observe_free(4.0, 2)
    assert policy.free_ratio() < 0.6 and policy.costs.free_ratio.value < 0.6
    assert policy.free_length([0.4], 0, 1, 64) == 0  # 1.2 tokens in 64 ms
    # The deployment's ratio forgets with every decode step: a later request tries again.
    for _ in range(300):
        policy.costs.free_ratio.forget()
    assert Speculation("adaptive", 4, policy.costs).free_length([0.4], 0, 1, 64) == 1
    # Nothing measured yet: all of it, and learn.
    assert _policy({}, None).free_length([0.1] * 3, 0, 1, 64) == 3
