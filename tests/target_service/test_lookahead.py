"""Lookahead decoding's proposer: segment layout, one-pass scoring, n-gram harvesting, state reset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import last_logits, verify_directly
from transformers import AutoModelForCausalLM

from tandem import batching, sampling
from tandem.kv import KVSession, tree_segment
from tandem.lm import Capabilities
from tandem.model_service import ModelServiceConfig, Step
from target_service.lookahead import (
    LookaheadConfig,
    LookaheadProposer,
    LookaheadState,
    NgramPool,
    concat,
    ngram_trie,
    window_segment,
)
from target_service.proposers import build_proposers

TREES = Capabilities("transformers", token_trees=True, hidden_states=True)
NO_TREES = Capabilities("llama.cpp", token_trees=False, hidden_states=False)

VOCAB = 40
GREEDY = sampling.SamplingParams()


@pytest.fixture(scope="module")
def model(tiny_target: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def as_sets(visible: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in visible]


# --- Segment layout ---

def test_window_segment_w3_n3() -> None:
    # Level 0: a1 a2 (column 0 is the last history token); level 1: b0 b1 b2.
    a1, a2, b0, b1, b2 = 11, 12, 20, 21, 22
    segment = window_segment([[a1, a2], [b0, b1, b2]])
    assert segment.token_ids == (a1, a2, b0, b1, b2)
    # Token (level l, column i) sits at last + l + i: offset l + i - 1.
    assert segment.offsets == (0, 1, 0, 1, 2)
    # (l, i) sees level 0's columns 1..i and its own column on levels 1..l.
    assert as_sets(segment.visible) == [{0}, {0, 1}, {2}, {0, 3}, {0, 1, 4}]


def test_window_segment_w2_n4() -> None:
    # Level 0: a1; level 1: b0 b1; level 2: c0 c1.
    segment = window_segment([[11], [20, 21], [30, 31]])
    assert segment.token_ids == (11, 20, 21, 30, 31)
    assert segment.offsets == (0, 0, 1, 1, 2)
    assert as_sets(segment.visible) == [{0}, {1}, {0, 2}, {1, 3}, {0, 2, 4}]


def test_ngram_trie_merges_shared_prefixes() -> None:
    tokens, parents = ngram_trie([(5, 6), (5, 7), (8, 6)])
    assert tokens == (5, 6, 7, 8, 6)
    assert parents == (-1, 0, 0, -1, 3)


def test_candidates_put_the_tree_after_the_window_unseen_by_it() -> None:
    proposer = LookaheadProposer(LookaheadConfig(window=2, ngram=3, candidates=2))
    session = KVSession("s", vocab_size=VOCAB)
    pool = NgramPool(2)
    pool.add(9, (5, 6))
    pool.add(9, (5, 7))
    session.states.put(LookaheadState([[11], [20, 21]], pool))
    candidates = proposer.get_candidates(session, [3, 9])
    segment = candidates.segment
    # Window a1 | b0 b1, then the trie of 9's continuations, most recent first: 5 -> (7, 6).
    assert segment.token_ids == (11, 20, 21, 5, 7, 6)
    assert candidates.tree_nodes == (3, 4, 5)
    assert candidates.tree_parents == (-1, 0, 0)
    assert candidates.tree_token_ids == (5, 7, 6)
    assert segment.offsets == (0, 0, 1, 0, 1, 1)
    assert as_sets(segment.visible) == [{0}, {1}, {0, 2}, {3}, {3, 4}, {3, 5}]


# --- One pass: the lookahead branch is read as columns, and leaves the tree's rows alone ---

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_window_rows_continue_their_columns(tiny_target: Path, attn: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    session = KVSession("s", vocab_size=VOCAB)
    history = [3, 4, 5, 6, 7]
    batching.forward(session, model, history[:3], logits_to_keep=1)
    levels = [[11, 12], [20, 21, 22], [30, 31, 32]]  # W=3, N=4
    logits, _ = batching.forward_segment(session, model, history[3:], window_segment(levels))
    columns = {(0, 1): [11], (0, 2): [11, 12], (1, 0): [20], (1, 1): [11, 21], (1, 2): [11, 12, 22],
               (2, 0): [20, 30], (2, 1): [11, 21, 31], (2, 2): [11, 12, 22, 32]}
    # Segment order is level by level, column by column: sorted (level, column).
    for row, key in enumerate(sorted(columns), start=1):
        torch.testing.assert_close(logits[row], last_logits(model, history + columns[key]),
                                   atol=1e-4, rtol=1e-4)


def test_window_does_not_change_the_verification_rows(model) -> None:  # type: ignore[no-untyped-def]
    tree = tree_segment((9, 10, 11, 12), (-1, -1, 0, 2))
    window = window_segment([[13, 14], [15, 16, 17], [18, 19, 20]])
    rows = {}
    for name, segment in (("tree", tree), ("both", concat(window, tree))):
        session = KVSession(name, vocab_size=VOCAB)
        batching.forward(session, model, [3, 4, 5, 6], logits_to_keep=1)
        logits, _ = batching.forward_segment(session, model, [7, 8], segment)
        rows[name] = torch.cat([logits[:1], logits[-4:]])
        assert session.length == 6
    torch.testing.assert_close(rows["both"], rows["tree"], atol=1e-5, rtol=1e-5)


# --- Harvesting and the window's advance ---

def test_ngram_pool_keeps_the_most_recent_per_key() -> None:
    pool = NgramPool(2)
    for rest in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.add(7, rest)
    assert pool.get(7) == [(5, 6), (1, 2)]
    assert pool.get(8) == []
    empty = NgramPool(0)
    empty.add(7, (1, 2))
    assert empty.get(7) == []


def one_hot_rows(tokens: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), VOCAB).float()


def test_update_harvests_columns_and_advances_one_level() -> None:
    proposer = LookaheadProposer(LookaheadConfig(window=3, ngram=4, candidates=4))
    session = KVSession("s", vocab_size=VOCAB)
    levels = [[11, 12], [20, 21, 22], [30, 31, 32]]
    session.states.put(LookaheadState([lv[:] for lv in levels], NgramPool(4), steps=2))
    candidates = proposer.get_candidates(session, [9])
    # Rows: 0 (history), 1..2 level 0, 3..5 level 1, 6..8 level 2 (the newest): argmaxes 1, 2, 3.
    logits = one_hot_rows([0, 0, 0, 0, 0, 0, 1, 2, 3])
    proposer.update_candidate_strategy(session, candidates, logits, None, sampling.TreeVerdict((), 4))
    state = session.states.get(LookaheadState)
    # Column i read upwards plus its argmax; column 0 starts at the last history token.
    assert state.pool.by_first == {9: [(20, 30, 1)], 11: [(21, 31, 2)], 12: [(22, 32, 3)]}
    # The oldest level goes; level 1 loses column 0 (the next last history token takes it).
    assert state.levels == [[21, 22], [30, 31, 32], [1, 2, 3]]
    assert state.steps == 3


def test_a_fresh_window_is_not_harvested() -> None:
    proposer = LookaheadProposer(LookaheadConfig(window=2, ngram=4, candidates=4))
    session = KVSession("s", vocab_size=VOCAB)
    for step in range(3):
        candidates = proposer.get_candidates(session, [5, 6, 7] if step == 0 else [8])
        rows = len(candidates.segment.token_ids) + 1
        proposer.update_candidate_strategy(session, candidates, one_hot_rows([step + 1] * rows),
                                           None, sampling.TreeVerdict((), 8))
        state = session.states.get(LookaheadState)
        # Levels 1..N-2 all come out of passes after N-2 = 2 of them.
        assert bool(state.pool.by_first) == (step >= 2)


# --- Soft state: seeded from the history, forgotten with the cache ---

def test_state_is_seeded_from_history_and_reset_on_rebuild(model) -> None:  # type: ignore[no-untyped-def]
    proposer = LookaheadProposer(LookaheadConfig(window=4, ngram=3, candidates=3))
    session = KVSession("s", vocab_size=VOCAB)
    history = [3, 4, 5, 6, 7, 8]
    verify_directly(model, session, Step(0, history), proposer, GREEDY, seed=1)
    state = session.states.get(LookaheadState)
    assert state.steps == 1
    # A rebuilt cache (cache_position 0) drops the state; the new window is seeded again,
    # from the history alone (the same history gives the same window).
    session.rollback(0)
    assert session.states.get(LookaheadState) is None
    fresh = [KVSession(name, VOCAB) for name in "ab"]
    windows = [proposer.state(s, history).levels for s in fresh]
    assert windows[0] == windows[1]
    assert all(t in history for level in windows[0] for t in level)
    assert proposer.state(KVSession("c", VOCAB), history[:-1]).levels != windows[0]


def decode(model, proposer: LookaheadProposer, prompt: list[int], length: int,  # type: ignore[no-untyped-def]
           params: sampling.SamplingParams = GREEDY) -> tuple[list[int], int, int]:
    """The orchestrator's loop against the scorer, in process: (tokens, drafted, accepted)."""
    session = KVSession("s", vocab_size=VOCAB)
    history, synced, drafted, accepted = list(prompt), 0, 0, 0
    while len(history) - len(prompt) < length:
        verified = verify_directly(model, session, Step(synced, history[synced:]), proposer,
                                   params, seed=len(history))
        synced = verified.cache_length
        history += verified.committed_token_ids
        drafted += verified.proposed_count
        accepted += len(verified.committed_token_ids) - 1
    return history[len(prompt):][:length], drafted, accepted


PROMPT = [5, 6, 7, 8, 5, 6]


@pytest.fixture(scope="module")
def expected(tiny_target: Path) -> list[int]:
    from tiny import greedy_reference

    return greedy_reference(tiny_target, PROMPT, 40)


@pytest.mark.parametrize("w, n, g", [(5, 3, 5), (3, 4, 2), (1, 3, 1)])
def test_greedy_decoding_in_process_equals_generate(model, expected: list[int], w: int, n: int,  # type: ignore[no-untyped-def]
                                                    g: int) -> None:
    tokens, drafted, accepted = decode(model, LookaheadProposer(LookaheadConfig(w, n, g)), PROMPT, 40)
    assert tokens == expected
    assert 0 <= accepted <= drafted


def test_config_flag() -> None:
    assert LookaheadConfig.parse("off") is None and LookaheadConfig.parse("") is None
    assert LookaheadConfig.parse("7, 4, 3") == LookaheadConfig(7, 4, 3)
    for bad in ("5,3", "a,b,c", "5,2,5", "0,3,5"):
        with pytest.raises(ValueError, match="--lookahead"):
            LookaheadConfig.parse(bad)
    from tandem.v1 import common_pb2

    assert common_pb2.PROPOSER_LOOKAHEAD in build_proposers(ModelServiceConfig(), None, TREES)  # type: ignore[arg-type]
    assert not build_proposers(ModelServiceConfig(lookahead="off"), None, TREES)  # type: ignore[arg-type]


def test_proposers_are_offered_by_what_the_backend_can_run() -> None:
    from tandem.errors import InvalidRequest

    # A backend that scores no trees (the llama.cpp target): no Lookahead, Medusa refused.
    assert not build_proposers(ModelServiceConfig(), None, NO_TREES)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="scores no token trees"):
        build_proposers(ModelServiceConfig(medusa_heads="heads"), None, NO_TREES)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="returns no hidden states"):
        build_proposers(ModelServiceConfig(medusa_heads="heads"), None,  # type: ignore[arg-type]
                        Capabilities("other", token_trees=True, hidden_states=False))
