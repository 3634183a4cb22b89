"""Prompt lookup: what it proposes from the history."""

from __future__ import annotations

import asyncio

from orchestrator.proposers import PromptLookupProposer, lookup
from tandem.sampling import SamplingParams


def test_lookup_proposes_what_followed_the_latest_match() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(history, 2, min_ngram=1, max_ngram=3) == [7, 8]


def test_lookup_prefers_longer_ngrams() -> None:
    # The 1-gram [3] last occurred before 5; the 2-gram [2, 3] last occurred before 7.
    history = [2, 3, 7, 0, 3, 5, 2, 3]
    assert lookup(history, 1, min_ngram=1, max_ngram=2) == [7]
    assert lookup(history, 1, min_ngram=1, max_ngram=1) == [5]


def test_lookup_without_a_match_proposes_nothing() -> None:
    assert lookup([1, 2, 3, 4], 3, min_ngram=1, max_ngram=3) == []
    assert lookup([5], 3, min_ngram=1, max_ngram=3) == []


def test_lookup_stops_at_the_end_of_the_history() -> None:
    assert lookup([4, 5, 4], 5, min_ngram=1, max_ngram=2) == [5, 4]


def test_prompt_lookup_block_is_one_hot() -> None:
    proposer = PromptLookupProposer(min_ngram=1, max_ngram=3)
    block = asyncio.run(proposer.get_candidates([1, 2, 3, 1, 2], 4, SamplingParams(), seed=0))
    assert block.token_ids == (3, 1, 2)
    assert block.draft_probs == (1.0, 1.0, 1.0)
    assert [list(d.token_ids) for d in block.distributions] == [[3], [1], [2]]
    assert asyncio.run(proposer.get_candidates([1, 2, 3, 1, 2], 0, SamplingParams(), 0)).token_ids == ()
