"""Faults with real processes: replicas killed, restarted or drained mid-request, and deadlines.

The orchestrator's history is the source of truth and the services' caches are soft
state, so every fault below ends with the same tokens as an undisturbed run (greedy), or
with a clear status after the tokens already committed, never a gap or a repeat.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from replicas import FAULT_LENGTH, stream_with_fault, wait_for
from tiny import PROMPTS

from tandem.launch import Stack, restart, start_stack

pytestmark = pytest.mark.slow  # a stack of real processes per test: minutes (CI runs it)



@pytest.fixture
def two_of_each(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target), num_drafts=2, num_targets=2)
    yield stack
    stack.stop()


@pytest.fixture
def one_of_each(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target),
                        orchestrator_args=["--replica-retry-s", "60"])
    yield stack
    stack.stop()


def test_draft_killed_mid_request_moves_to_the_other_draft(two_of_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    victim = two_of_each.drafts[0]
    tokens, summary = stream_with_fault(two_of_each, lambda: victim.proc.send_signal(signal.SIGKILL),
                                        num_speculative_tokens=4)
    assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
    assert summary.usage.completion_tokens == FAULT_LENGTH  # type: ignore[attr-defined]
    # The first session went to the first replica (least loaded, in order), so it was rebuilt.
    assert any("lost on draft replica" in line for line in two_of_each.orchestrator.lines)
    assert summary.usage.drafted_tokens > 0  # type: ignore[attr-defined]


def test_target_killed_mid_request_is_rebuilt_on_the_other_target(two_of_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    # The first session goes to the first replica (least loaded, in order): kill it. The
    # output must still be the undisturbed run's, token for token, with no gap or repeat.
    tokens, summary = stream_with_fault(
        two_of_each, lambda: two_of_each.targets[0].proc.send_signal(signal.SIGKILL),
        num_speculative_tokens=4)
    assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
    assert summary.usage.completion_tokens == FAULT_LENGTH  # type: ignore[attr-defined]
    assert any("lost on target replica" in line for line in two_of_each.orchestrator.lines)
    # The orchestrator keeps serving on the survivor.
    with two_of_each.client() as client:
        again = client.generate(PROMPTS[1], max_new_tokens=20, ignore_eos=True)
    assert len(again.token_ids) == 20


def test_last_draft_killed_falls_back_to_the_target_then_returns(one_of_each: Stack, reference,  # type: ignore[no-untyped-def]
                                                                 tiny_draft: Path) -> None:
    draft = one_of_each.drafts[0]
    tokens, _summary = stream_with_fault(one_of_each, lambda: draft.proc.send_signal(signal.SIGKILL),
                                        num_speculative_tokens=4)
    assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
    assert any("going on with the target alone" in line for line in one_of_each.orchestrator.lines)
    # The draft comes back on the same address: new requests use it again.
    one_of_each.drafts[0] = restart(draft)
    with one_of_each.client() as client:
        def drafting() -> bool:
            reply = client.generate(PROMPTS[1], max_new_tokens=20, num_speculative_tokens=4, ignore_eos=True)
            assert list(reply.token_ids) == reference(PROMPTS[1], 20)
            return reply.usage.drafted_tokens > 0
        wait_for(drafting, "requests draft again on the restarted draft replica")


def test_target_restart_mid_request_is_rebuilt_transparently(one_of_each: Stack, reference,  # type: ignore[no-untyped-def]
                                                             tiny_target: Path) -> None:
    target = one_of_each.targets[0]

    def kill_and_restart() -> None:
        target.proc.send_signal(signal.SIGKILL)
        target.proc.wait()
        one_of_each.targets[0] = restart(target)

    tokens, summary = stream_with_fault(one_of_each, kill_and_restart, num_speculative_tokens=4)
    assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
    assert summary.usage.completion_tokens == FAULT_LENGTH  # type: ignore[attr-defined]
    assert any("rebuilding it from the history" in line for line in one_of_each.orchestrator.lines)


def test_no_target_left_ends_with_unavailable_after_the_committed_tokens(
        tiny_draft: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(str(tiny_draft), str(tiny_target), orchestrator_args=["--replica-retry-s", "1"])
    try:
        tokens, error = stream_with_fault(stack, lambda: stack.targets[0].proc.send_signal(signal.SIGKILL),
                                          num_speculative_tokens=4)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert "no replica could take the session over" in error.details()
        assert 0 < len(tokens) < FAULT_LENGTH
        assert tokens == reference(PROMPTS[0], FAULT_LENGTH)[:len(tokens)]  # a prefix: no gap, no repeat
    finally:
        stack.stop()


def test_deadline_ends_with_deadline_exceeded_after_the_tokens_produced(one_of_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """The target is frozen (SIGSTOP) when the first tokens arrive, so the deadline passes
    mid-stream by construction, however fast the machine. A deadline that passes before the
    first tokens (a busy machine) proves nothing: then it is tried again with twice the time."""
    target = one_of_each.targets[0].proc
    for timeout in (2.0, 4.0, 8.0, 16.0, 32.0, 64.0):
        tokens: list[int] = []
        try:
            with one_of_each.client() as client, pytest.raises(grpc.RpcError) as raised:
                for message in client.generate_stream(PROMPTS[0], max_new_tokens=490, ignore_eos=True,
                                                      num_speculative_tokens=0, timeout=timeout):
                    if not tokens:
                        target.send_signal(signal.SIGSTOP)
                    tokens.extend(message.delta.token_ids)
        finally:
            target.send_signal(signal.SIGCONT)
        if tokens:
            break
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(tokens) < 490
    assert tokens == reference(PROMPTS[0], len(tokens))


def test_sigterm_drains_in_flight_streams_then_exits_zero(one_of_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.v1 import target_pb2, target_pb2_grpc

    target = one_of_each.targets[0]
    seen: dict[str, object] = {}

    def drain() -> None:
        target.proc.send_signal(signal.SIGTERM)
        # Once draining, the replica is NOT_SERVING and refuses new sessions: the bootstrap
        # answers UNAVAILABLE, and soon its listener is closed (which also reads UNAVAILABLE).
        with grpc.insecure_channel(target.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def not_serving() -> bool:
                try:
                    return bool(health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                                == health_pb2.HealthCheckResponse.NOT_SERVING)
                except grpc.RpcError as exc:
                    return exc.code() == grpc.StatusCode.UNAVAILABLE

            wait_for(not_serving, "the draining target is NOT_SERVING or gone")
            step = target_pb2.ScoreBlocksRequest(session_id="late", new_token_ids=[3], draft_proposal=target_pb2.DraftProposal())
            try:
                next(target_pb2_grpc.TargetServiceStub(channel).ScoreBlocks(iter([step]), timeout=10))
                seen["new_session"] = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                seen["new_session"] = exc.code()

    tokens, summary = stream_with_fault(one_of_each, drain, num_speculative_tokens=4)
    assert seen["new_session"] == grpc.StatusCode.UNAVAILABLE
    # The stream that was in flight finishes, undisturbed; then the process exits 0.
    assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
    assert summary.usage.completion_tokens == FAULT_LENGTH  # type: ignore[attr-defined]
    assert target.proc.wait(timeout=60) == 0


def test_kv_budget_evicts_idle_sessions_and_rebuilds_them_without_changing_output(
        tiny_draft: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # Four concurrent sessions of ~50 tokens each against a 120-token budget on the target.
    stack = start_stack(str(tiny_draft), str(tiny_target), target_args=["--kv-budget-tokens", "120"])
    try:
        with stack.client() as client, ThreadPoolExecutor(max_workers=4) as pool:
            replies = list(pool.map(lambda p: client.generate(p, max_new_tokens=40, num_speculative_tokens=4,
                                                              ignore_eos=True), PROMPTS))
        for prompt, reply in zip(PROMPTS, replies, strict=True):
            assert list(reply.token_ids) == reference(prompt, 40)
        assert any("NOT_FOUND" in line and "evicted" in line for line in stack.orchestrator.lines)
        # One step that needs more than the whole budget is refused, naming the limit.
        with stack.client() as client, pytest.raises(grpc.RpcError) as raised:
            client.generate([5] * 130, max_new_tokens=4, ignore_eos=True)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--kv-budget-tokens" in raised.value.details()
        with stack.client() as client:  # and the replicas still serve
            assert list(client.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True).token_ids) == \
                reference(PROMPTS[1], 10)
    finally:
        stack.stop()
