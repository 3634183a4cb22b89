"""A replica at `--max-sessions` answers RESOURCE_EXHAUSTED, and what the orchestrator makes of it.

A full target sends the session to another target; when every target is full, the caller gets
RESOURCE_EXHAUSTED naming the limit; a full draft leaves the request to the target alone
(counted in `tandem_draft_fallbacks_total`). Sessions are held open with raw streams, so a
replica is full exactly while a test says so.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from scrape import sample
from tiny import PROMPTS, make_tokenizer

from tandem.launch import Process, Stack, start_stack
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow  # its own stacks of real processes (CI runs it)

LENGTH = 30
FULL = "max_sessions (1) sessions are open on this replica"


@pytest.fixture(scope="module")
def one_session_each(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    """One draft and two targets that each take one session; the orchestrator serves metrics."""
    limit = ["--max-sessions", "1"]
    stack = start_stack(str(tiny_draft), str(tiny_target), num_targets=2, draft_args=limit,
                        target_args=limit, orchestrator_args=["--metrics-port", "0"])
    yield stack
    stack.stop()


def _stream(process: Process, role: str) -> tuple[Any, Any]:
    """(method, first step) of a draft or target stream."""
    prompt = make_tokenizer().encode(PROMPTS[0])
    if role == "draft":
        return (draft_pb2_grpc.DraftServiceStub, "ProposeBlocks",
                draft_pb2.ProposeBlocksRequest(new_token_ids=prompt, num_speculative_tokens=1,
                                               max_support_size=4))
    return target_pb2_grpc.TargetServiceStub, "ScoreBlocks", target_pb2.ScoreBlocksRequest(
        new_token_ids=prompt, draft_proposal=target_pb2.DraftProposal())


def one_step(process: Process, role: str) -> Any:
    stub_class, method, step = _stream(process, role)
    with grpc.insecure_channel(process.address) as channel:
        return list(getattr(stub_class(channel), method)(iter([step]), timeout=30))


@contextlib.contextmanager
def holding(process: Process, role: str, timeout: float = 60.0) -> Iterator[None]:
    """Hold one session open on `process` (retrying while an earlier stream's session closes)."""
    stub_class, method, step = _stream(process, role)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(process.address) as channel:
        while True:
            steps: queue.Queue[Any] = queue.Queue()
            steps.put(step)
            replies = getattr(stub_class(channel), method)(iter(steps.get, None), timeout=timeout)
            try:
                next(replies)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, exc
                time.sleep(0.05)
        try:
            yield
        finally:
            steps.put(None)
            list(replies)


def eventually(fn: Any, timeout: float = 60.0) -> Any:
    """fn()'s result once it stops raising RESOURCE_EXHAUSTED (a closed stream's session is
    freed just after the stream ends)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_replica_at_max_sessions_refuses_another(one_session_each: Stack, role: str) -> None:
    process = one_session_each.drafts[0] if role == "draft" else one_session_each.targets[0]
    with holding(process, role), pytest.raises(grpc.RpcError) as err:
        one_step(process, role)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert FULL in err.value.details()
    # The held session closed: the replica takes a session again.
    assert eventually(lambda: one_step(process, role))[0].cache_length >= len(PROMPTS[0])


def test_a_full_target_sends_the_session_to_another(one_session_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack = one_session_each
    full = stack.targets[0]  # the first choice among equally loaded replicas
    rebuilds = sample(stack.orchestrator, "tandem_session_rebuilds_total", service="target")
    with holding(full, "target"), stack.client() as client:
        reply = client.generate(PROMPTS[1], max_new_tokens=LENGTH, num_speculative_tokens=4,
                                ignore_eos=True)
    assert list(reply.token_ids) == reference(PROMPTS[1], LENGTH)
    assert reply.usage.drafted_tokens > 0
    assert any(f"lost on target replica {full.address} (RESOURCE_EXHAUSTED" in line
               for line in stack.orchestrator.lines)
    assert sample(stack.orchestrator, "tandem_session_rebuilds_total", service="target") > rebuilds


def test_every_target_full_gives_resource_exhausted(one_session_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack = one_session_each
    with holding(stack.targets[0], "target"), holding(stack.targets[1], "target"), \
            stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[2], max_new_tokens=LENGTH, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert FULL in err.value.details()
    with stack.client() as client:  # room again: the next request is served
        reply = eventually(lambda: client.generate(PROMPTS[2], max_new_tokens=LENGTH, ignore_eos=True))
    assert list(reply.token_ids) == reference(PROMPTS[2], LENGTH)


def test_a_full_draft_leaves_the_request_to_the_target_alone(one_session_each: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack = one_session_each
    fallbacks = sample(stack.orchestrator, "tandem_draft_fallbacks_total")
    with holding(stack.drafts[0], "draft"), stack.client() as client:
        reply = client.generate(PROMPTS[3], max_new_tokens=LENGTH, num_speculative_tokens=4,
                                ignore_eos=True)
    assert list(reply.token_ids) == reference(PROMPTS[3], LENGTH)
    assert reply.usage.drafted_tokens == 0
    assert any("going on with the target alone" in line for line in stack.orchestrator.lines)
    assert sample(stack.orchestrator, "tandem_draft_fallbacks_total") == fallbacks + 1
    # The draft has room again: requests draft again.
    with stack.client() as client:
        reply = eventually(lambda: client.generate(PROMPTS[3], max_new_tokens=LENGTH,
                                                   num_speculative_tokens=4, ignore_eos=True))
    assert list(reply.token_ids) == reference(PROMPTS[3], LENGTH)
