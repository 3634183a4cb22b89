"""Faults under sampling, and the counters the reliability table names.

docs/ARCHITECTURE.md: a lost session's step is resent "same seed, so the same answer for a
drafted block", and a seeded request is reproducible on any replica given the same block
lengths (a request that sets num_speculative_tokens). So a seeded, sampled request that
loses a draft and a target mid-request, with another of each left, yields exactly the tokens
of the undisturbed run: stronger than keeping the law, and what is checked here. (A target
proposer's rebuilt step starts with no state, so only its law is kept: a fresh session's law,
which tests/orchestrator/test_distribution.py covers.)

`tandem_session_rebuilds_total` and `tandem_draft_fallbacks_total` must move when a replica
is lost, and only then.
"""

from __future__ import annotations

import queue
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from replicas import FAULT_LENGTH, stream_with_fault
from scrape import sample
from tiny import PROMPTS, make_tokenizer

from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

SAMPLED: dict[str, Any] = {"temperature": 1.0, "seed": 7, "num_speculative_tokens": 4,
                           "ignore_eos": True}
METRICS = ["--metrics-port", "0"]

pytestmark = pytest.mark.slow  # its own stacks, replicas killed mid-request (CI runs it)


@pytest.fixture
def two_of_each(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target), num_drafts=2, num_targets=2,
                        orchestrator_args=METRICS)
    yield stack
    stack.stop()


def counters(stack: Stack) -> dict[str, float]:
    return {"draft rebuilds": sample(stack.orchestrator, "tandem_session_rebuilds_total", service="draft"),
            "target rebuilds": sample(stack.orchestrator, "tandem_session_rebuilds_total", service="target"),
            "fallbacks": sample(stack.orchestrator, "tandem_draft_fallbacks_total")}


class Stream:
    """One session on a replica: send a step, read its answer."""

    def __init__(self, method: Any) -> None:
        self.steps: queue.Queue[Any] = queue.Queue()
        self.replies = method(iter(self.steps.get, None), timeout=60)

    def step(self, request: Any) -> Any:
        self.steps.put(request)
        return next(self.replies)

    def close(self) -> None:
        self.steps.put(None)
        list(self.replies)


def test_a_resent_step_gets_the_same_answer_on_another_replica(two_of_each: Stack) -> None:
    """The second step of a sampled session, and the same step resent from cache position 0
    to a fresh session on the other replica (what a rebuild sends), give the same block and
    the same scores."""
    stack = two_of_each
    prompt = make_tokenizer().encode(PROMPTS[0])
    params = common_pb2.SamplingParams(temperature=1.0)
    drafts = [grpc.insecure_channel(p.address) for p in stack.drafts]
    targets = [grpc.insecure_channel(p.address) for p in stack.targets]
    try:
        draft = Stream(draft_pb2_grpc.DraftServiceStub(drafts[0]).ProposeBlocks)
        target = Stream(target_pb2_grpc.TargetServiceStub(targets[0]).ScoreBlocks)

        def propose(stream: Stream, position: int, history: list[int], seed: int) -> Any:
            return stream.step(draft_pb2.ProposeBlocksRequest(
                cache_position=position, new_token_ids=history[position:], num_speculative_tokens=4,
                max_support_size=8, sampling=params, seed=seed))

        def score(stream: Stream, position: int, history: list[int], block: Any, seed: int) -> Any:
            return stream.step(target_pb2.ScoreBlocksRequest(
                cache_position=position, new_token_ids=history[position:], sampling=params, seed=seed,
                draft_proposal=target_pb2.DraftProposal(token_ids=block.token_ids,
                                                        distributions=block.distributions)))

        first = propose(draft, 0, prompt, 11)
        score(target, 0, prompt, first, 21)
        # Two drafted tokens kept and one more committed; both caches roll back to the kept prefix.
        history = [*prompt, *first.token_ids[:2], 3]
        kept = len(prompt) + 2
        block = propose(draft, kept, history, 12)
        scores = score(target, kept, history, block, 22)
        draft.close()
        target.close()

        resent_block = propose(Stream(draft_pb2_grpc.DraftServiceStub(drafts[1]).ProposeBlocks),
                               0, history, 12)
        resent_scores = score(Stream(target_pb2_grpc.TargetServiceStub(targets[1]).ScoreBlocks),
                              0, history, block, 22)
    finally:
        for channel in (*drafts, *targets):
            channel.close()
    assert list(resent_block.token_ids) == list(block.token_ids)
    for resent, original in zip(resent_block.distributions, block.distributions, strict=True):
        assert list(resent.token_ids) == list(original.token_ids)
        assert list(resent.probs) == pytest.approx(list(original.probs), abs=1e-5)
    resent_scored, scored = resent_scores.block_scores, scores.block_scores
    assert list(resent_scored.recovered_token_ids) == list(scored.recovered_token_ids)
    assert resent_scored.bonus_token_id == scored.bonus_token_id
    assert list(resent_scored.target_probs) == pytest.approx(list(scored.target_probs), abs=1e-5)


def test_a_seeded_sampled_request_keeps_its_tokens_when_a_draft_and_a_target_die(
        two_of_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack = two_of_each
    before = counters(stack)
    with stack.client() as client:
        undisturbed = client.generate(PROMPTS[0], max_new_tokens=FAULT_LENGTH, **SAMPLED)
    assert counters(stack) == before  # nothing lost, nothing counted
    assert list(undisturbed.token_ids) != reference(PROMPTS[0], FAULT_LENGTH)  # sampled, not greedy

    def kill_the_first_of_each() -> None:
        # Both sessions went to the first replica of each pool (least loaded, in order).
        stack.drafts[0].proc.send_signal(signal.SIGKILL)
        stack.targets[0].proc.send_signal(signal.SIGKILL)

    tokens, summary = stream_with_fault(stack, kill_the_first_of_each, **SAMPLED)
    assert tokens == list(undisturbed.token_ids)
    # The same blocks were drafted and kept: every step was replayed, none redrawn.
    assert (summary.usage.drafted_tokens, summary.usage.accepted_tokens) == \
        (undisturbed.usage.drafted_tokens, undisturbed.usage.accepted_tokens)
    after = counters(stack)
    assert after["draft rebuilds"] > before["draft rebuilds"]
    assert after["target rebuilds"] > before["target rebuilds"]
    assert after["fallbacks"] == before["fallbacks"]  # another draft took over


@pytest.mark.parametrize("k", [4, 0])  # 0: the target's decode runs are evicted part way
def test_seeded_sampled_requests_keep_their_tokens_through_repeated_evictions(
        tiny_draft: Path, tiny_target: Path, k: int) -> None:
    """Four concurrent sessions of ~55 tokens on replicas whose KV budget holds two: the
    drafts' and the target's caches are evicted again and again, and every evicted step is
    resent from position 0. Each request still yields the tokens it yields alone."""
    budget = ["--kv-budget-tokens", "120"]
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=budget, target_args=budget,
                        orchestrator_args=METRICS)
    try:
        def run(job: tuple[str, int]) -> list[int]:
            with stack.client() as client:
                return list(client.generate(job[0], max_new_tokens=40, **{
                    **SAMPLED, "seed": job[1], "num_speculative_tokens": k}).token_ids)

        jobs = [(prompt, 100 + i) for i, prompt in enumerate(PROMPTS)]
        alone = [run(job) for job in jobs]
        before = counters(stack)
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            together = list(pool.map(run, jobs))
        after = counters(stack)
    finally:
        stack.stop()
    assert together == alone
    assert (after["draft rebuilds"] > before["draft rebuilds"]) == bool(k)
    assert after["target rebuilds"] > before["target rebuilds"]
    assert after["fallbacks"] == before["fallbacks"]


def test_losing_the_last_draft_is_one_fallback(tiny_draft: Path, tiny_target: Path) -> None:
    stack = start_stack(str(tiny_draft), str(tiny_target), orchestrator_args=METRICS)
    try:
        before = counters(stack)
        tokens, summary = stream_with_fault(stack, lambda: stack.drafts[0].proc.send_signal(signal.SIGKILL),
                                            **SAMPLED)
        assert len(tokens) == summary.usage.completion_tokens == FAULT_LENGTH
        after = counters(stack)
        assert after["fallbacks"] == before["fallbacks"] + 1
        assert after["draft rebuilds"] > before["draft rebuilds"]  # it was tried again first
        assert after["target rebuilds"] == before["target rebuilds"]
        assert any("going on with the target alone" in line for line in stack.orchestrator.lines)
    finally:
        stack.stop()
