"""The speculation loop's own bookkeeping, with stand-ins for the remote sessions (the
services' behaviour is covered end to end elsewhere; here a failure is placed exactly)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.policy import CostModel
from orchestrator.speculation import Generation, Usage, speculate
from tandem import sampling
from tandem.errors import Unavailable
from tandem.v1 import common_pb2


class SlowDraft:
    """A draft whose prefill is still running (e.g. backing off before a retry)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def get_candidates(self, history: list[int], k: int, params: Any, seed: int) -> Any:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def update_candidate_strategy(self, *args: Any) -> None:
        pass


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
                     proposer=common_pb2.PROPOSER_DRAFT_MODEL, eos_token_ids=frozenset())

    async def scenario() -> None:
        draft = SlowDraft()
        steps = speculate(gen, draft, FailingTarget(draft), Usage(), CostModel())  # type: ignore[arg-type]
        with pytest.raises(Unavailable):
            await steps.__anext__()
        await asyncio.sleep(0)  # let a cancellation land
        assert draft.cancelled, "the draft's prefill outlived the step that needed it"
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    asyncio.run(scenario())
