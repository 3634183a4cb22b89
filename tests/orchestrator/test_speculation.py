"""The speculation loop's own bookkeeping, with stand-ins for the remote sessions (the
services' behaviour is covered end to end elsewhere; here a failure is placed exactly)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.domain import Generation, Step, Usage
from orchestrator.policy import CostModel
from orchestrator.speculation import speculate
from tandem import sampling
from tandem.errors import Unavailable


class SlowDraft:
    """A draft whose prefill is still running (e.g. backing off before a retry)."""

    drafts, free_proposals = True, False

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def get_candidates(self, history: list[int], k: int, params: Any, seed: int,
                             ahead: int = 0) -> Any:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def update_candidate_strategy(self, *args: Any) -> None:
        pass

    def lag(self, history_length: int) -> int:
        return history_length


class FailingTarget:
    synced = 0

    def __init__(self, draft: SlowDraft) -> None:
        self.draft = draft

    async def score(self, *args: Any) -> Any:
        await self.draft.started.wait()
        raise Unavailable("the target replica went away")


def test_a_failed_prefill_leaves_no_draft_step_running() -> None:
    gen = Generation(prompt_token_ids=(1, 2, 3), max_new_tokens=4, sampling=sampling.SamplingParams(),
                     seed=0, num_speculative_tokens=2, policy="fixed",
                     proposer="draft-model", eos_token_ids=frozenset())

    async def scenario() -> None:
        draft = SlowDraft()
        steps = speculate(gen, draft, FailingTarget(draft), CostModel())  # type: ignore[arg-type]
        with pytest.raises(Unavailable):
            await steps.__anext__()
        await asyncio.sleep(0)  # let a cancellation land
        assert draft.cancelled, "the draft's prefill outlived the step that needed it"
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(scenario())


class TreeTarget:
    """A target that proposes and verifies its own tree (Lookahead, Medusa): each pass scores
    a 19-token segment the orchestrator never sees, and commits two tokens."""

    synced = 0
    proposer = "lookahead"

    async def score(self, history: list[int], *args: Any) -> Any:
        from orchestrator.domain import TreeCommit

        self.synced = len(history)
        return TreeCommit(committed_token_ids=(5, 6), proposed_count=19,
                          cache_length=len(history), compute_ms=50.0)

    def advance(self, cache_length: int, committed: int) -> None:
        pass


def test_a_target_proposers_passes_do_not_pass_for_narrow_verify_costs() -> None:
    """The verify-cost table is shared by every proposer and keyed by the tokens a pass scored.
    A tree pass scores a segment of unknown width: filed under its 1-2 history tokens, it made
    narrow passes look expensive to the draft-model policy."""
    gen = Generation(prompt_token_ids=(1, 2, 3), max_new_tokens=8, sampling=sampling.SamplingParams(),
                     seed=0, num_speculative_tokens=4, policy="adaptive",
                     proposer="lookahead", eos_token_ids=frozenset())
    costs = CostModel()

    async def scenario() -> list[int]:
        return [t async for step in speculate(gen, None, TreeTarget(), costs)  # type: ignore[arg-type]
                for t in step.token_ids]

    assert asyncio.run(scenario()) == [5, 6] * 4
    assert costs.verify_ms == {}


def test_usage_is_folded_from_steps_after_a_stop_string_cut() -> None:
    """One place grows usage: from each step's record and how many of its tokens were kept."""
    prefill = Step([7], False, prefill=True, draft_ms=5.0, target_ms=9.0, wall_ms=20.0)
    block = Step([1, 2, 3, 4], False, accepted=3, drafted=4, rejected=1, draft_ms=2.0,
                 target_ms=3.0, wall_ms=6.0)
    usage = Usage(proposer="draft-model", prompt_tokens=3).fold(prefill, 1).fold(block, 2)
    assert (usage.completion_tokens, usage.accepted_tokens, usage.drafted_tokens) == (3, 2, 4)
    assert (usage.rejected_tokens, usage.target_forward_passes) == (1, 2)
    assert (usage.prefill_ms, usage.draft_ms, usage.target_ms) == (20.0, 2.0, 3.0)
