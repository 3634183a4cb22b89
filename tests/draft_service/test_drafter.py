"""The draft's continuation cache in process: whatever histories a session's steps name, in
any order (rollbacks, branches that diverge mid-way, guesses drafted ahead), the q it gives
for a history is the q a fresh cache computes for it, and only matching work is reused."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.proposer import Drafter, Guesses, draft_ahead, draw, propose_block
from tandem import sampling
from tandem.batching import direct
from tandem.kv import KVSession

PARAMS = sampling.SamplingParams(temperature=1.0)
SUPPORT, SEED = 6, 7


@pytest.fixture(scope="module")
def model(tiny_draft: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_draft, dtype=torch.float32).eval()


def fresh_q(model, history: list[int]) -> sampling.SparseDistribution:  # type: ignore[no-untyped-def]
    position, held = asyncio.run(Drafter(direct(model), KVSession("fresh", 40), PARAMS, SUPPORT, SEED).at(history))
    assert not held
    return position.q


def fresh_block(model, history: list[int], k: int):  # type: ignore[no-untyped-def]
    return asyncio.run(propose_block(direct(model), KVSession("fresh", 40), history, k, PARAMS, SUPPORT, SEED))


def test_the_q_for_a_history_is_a_fresh_caches_whatever_came_before(model) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    session = KVSession("s", 40)
    drafter = Drafter(direct(model), session, PARAMS, SUPPORT, SEED)
    history = [rng.randrange(3, 30) for _ in range(6)]
    reused = 0
    for _ in range(40):
        # Keep a random prefix, then a random tail: rollbacks, divergence mid-cache, growth.
        history = history[:rng.randrange(1, len(history) + 1)] + \
            [rng.randrange(3, 30) for _ in range(rng.randrange(0, 4))]
        position, held = asyncio.run(drafter.at(history))
        want = fresh_q(model, history)
        assert position.q.token_ids == want.token_ids
        assert position.q.probs == pytest.approx(want.probs, abs=1e-5)
        reused += held
        assert session.held_tokens[:len(history)] == history  # and maybe more: what followed it
    assert reused > 0  # some histories were already there


def drafted_ahead(model, history: list[int], k: int):  # type: ignore[no-untyped-def]
    """A session that answered a step for `history`, then drafted ahead (to the end)."""
    session = KVSession("s", 40)
    forward = direct(model)
    block = asyncio.run(propose_block(forward, session, history, k, PARAMS, SUPPORT, SEED))
    session.tail_from = block.cache_length  # as the service marks it: nobody asked for what follows
    guesses = Guesses()
    asyncio.run(draft_ahead(forward, session, history, block.token_ids, k, PARAMS, SUPPORT, SEED,
                            asyncio.Event(), guesses))
    return session, block, guesses


@pytest.mark.parametrize("accepted", [4, 0, 2], ids=["all-accepted", "first-rejected", "third-rejected"])
def test_each_guess_drafted_ahead_is_the_block_a_fresh_draft_gives(model, accepted: int) -> None:  # type: ignore[no-untyped-def]
    history, k = [5, 9, 11, 7], 4
    session, block, guesses = drafted_ahead(model, history, k)
    # Every outcome guessed, and drafted to the end (in the session's cache and k copies).
    assert len(guesses.guesses) == k + 1 and guesses.drafted == (k + 1) * k
    x = list(block.token_ids)
    ranked = fresh_q(model, history + x[:accepted])
    if accepted == k:  # the draft's most likely bonus token
        guess = ranked.token_ids[0]
    else:  # the draft's most likely token other than the rejected one
        guess = next(t for t in ranked.token_ids if t != x[accepted])
    nxt = history + x[:accepted] + [guess]
    assert guesses.hit(nxt)
    got = asyncio.run(propose_block(direct(model), session, nxt, k, PARAMS, SUPPORT, SEED))
    want = fresh_block(model, nxt, k)
    assert got.reused == k and got.token_ids == want.token_ids
    assert got.cache_length == want.cache_length == len(nxt) + k - 1
    for a, b in zip(got.distributions, want.distributions, strict=True):
        assert a.token_ids == b.token_ids and a.probs == pytest.approx(b.probs, abs=1e-5)
    # The cache catches up with the block it answered from, on the next step's first pass.
    after = nxt + list(got.token_ids) + [3]
    again = asyncio.run(propose_block(direct(model), session, after, 2, PARAMS, SUPPORT, SEED))
    assert again.token_ids == fresh_block(model, after, 2).token_ids


def test_a_history_nobody_guessed_is_drafted_afresh(model) -> None:  # type: ignore[no-untyped-def]
    history, k = [5, 9, 11, 7], 3
    session, _, guesses = drafted_ahead(model, history, k)
    other = history + [next(t for t in range(3, 30) if not guesses.hit(history + [t]))]
    got = asyncio.run(propose_block(direct(model), session, other, k, PARAMS, SUPPORT, SEED))
    assert got.reused == 0 and got.token_ids == fresh_block(model, other, k).token_ids


def test_the_seed_is_part_of_a_draws_key(model) -> None:  # type: ignore[no-untyped-def]
    block = fresh_block(model, [5, 9, 11, 7], 4)
    positions = range(4, 8)
    assert [draw(d, SEED, p) for d, p in zip(block.distributions, positions)] == list(block.token_ids)
    assert any(draw(d, SEED + 1, p) != t for d, p, t in zip(block.distributions, positions, block.token_ids))


@pytest.mark.parametrize("params", [sampling.SamplingParams(temperature=0.6),
                                    sampling.SamplingParams(temperature=1.8, top_k=8)],
                         ids=["t0.6", "t1.8-topk8"])
def test_the_reported_q_is_the_drafts_warped_law_and_what_it_draws_from(model, params) -> None:  # type: ignore[no-untyped-def]
    """At a temperature other than 1, the q a block reports is the draft's own distribution
    under the request's parameters (transformers' warpers over its logits, truncated to the
    support), and the drafted tokens follow it: a draft that reports q at T while drawing at
    T = 1 fails one or the other, in a second, without a service."""
    from laws import p_value, warped_by_transformers
    from tiny import last_logits

    history, support = [3, 9, 4, 11], 1024
    session = KVSession("s", 40)
    draws = []
    q = None
    for seed in range(3000):  # the q at this position is computed once, then held by the cache
        block = asyncio.run(propose_block(direct(model), session, history, 1, params, support, seed))
        q = block.distributions[0] if q is None else q
        assert block.distributions[0] == q
        draws.append(block.token_ids[0])
    want = warped_by_transformers(last_logits(model, history)[None], params)[0].double()
    reported = torch.zeros_like(want)
    reported[list(q.token_ids)] = torch.tensor(q.probs, dtype=torch.float64)
    assert torch.allclose(reported, want, atol=1e-5)
    counts = torch.bincount(torch.tensor(draws), minlength=want.shape[0])
    assert p_value(counts, reported) > 1e-3
