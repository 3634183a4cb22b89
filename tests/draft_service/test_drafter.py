"""The draft's continuation cache in process: whatever histories a session's steps name, in
any order (rollbacks, branches that diverge mid-way, a guess drafted ahead), the q it gives
for a history is the q a fresh cache computes for it, and only matching work is reused."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.proposer import Drafter, draft_ahead, draw
from tandem import sampling
from tandem.batching import direct
from tandem.kv import KVSession

PARAMS = sampling.SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def model(tiny_draft: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(tiny_draft, dtype=torch.float32).eval()


def fresh_q(model, history: list[int]) -> sampling.SparseDistribution:  # type: ignore[no-untyped-def]
    session = KVSession("fresh", 40)
    dist, held = asyncio.run(Drafter(direct(model), session, PARAMS, 6, 1).dist_at(history))
    assert not held
    return dist


def test_the_q_for_a_history_is_a_fresh_caches_whatever_came_before(model) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    session = KVSession("s", 40)
    drafter = Drafter(direct(model), session, PARAMS, 6, 1)
    history = [rng.randrange(3, 30) for _ in range(6)]
    reused = 0
    for _ in range(40):
        # Keep a random prefix, then a random tail: rollbacks, divergence mid-cache, growth.
        history = history[:rng.randrange(1, len(history) + 1)] + \
            [rng.randrange(3, 30) for _ in range(rng.randrange(0, 4))]
        dist, held = asyncio.run(drafter.dist_at(history))
        want = fresh_q(model, history)
        assert dist.token_ids == want.token_ids
        assert dist.probs == pytest.approx(want.probs, abs=1e-5)
        reused += held
        assert session.held_tokens[:len(history)] == history  # and maybe more: what followed it
    assert reused > 0  # some histories were already there


def test_a_guess_drafted_ahead_is_the_next_steps_block(model) -> None:  # type: ignore[no-untyped-def]
    session = KVSession("s", 40)
    forward = direct(model)
    history = [5, 9, 11, 7]
    block, _, _ = asyncio.run(Drafter(forward, session, PARAMS, 6, 7).draft(history, 3))
    guess = history + block
    session.tail_from = session.length  # as the service marks it: nobody asked for what follows
    drafted = asyncio.run(draft_ahead(forward, session, guess, 3, PARAMS, 6, 7, asyncio.Event()))
    assert drafted == 3 and len(guess) == len(history) + 3 + 1 + 3
    bonus = guess[len(history) + 3]  # the draft's most likely token after the block
    assert bonus == fresh_q(model, history + block).token_ids[0]
    nxt = history + block + [bonus]
    tokens, dists, reused = asyncio.run(Drafter(forward, session, PARAMS, 6, 7).draft(nxt, 3))
    assert reused == 3 and tokens == guess[len(nxt):]
    alone, alone_dists, none = asyncio.run(Drafter(forward, KVSession("f", 40), PARAMS, 6, 7).draft(nxt, 3))
    assert none == 0 and tokens == alone
    for a, b in zip(dists, alone_dists, strict=True):
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
    # Another seed draws other tokens at the same positions: the seed is part of the key.
    assert any(draw(d, 8, p) != t for p, (d, t) in enumerate(zip(dists, tokens, strict=True)))
