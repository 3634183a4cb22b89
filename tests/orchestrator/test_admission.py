"""Admission control: --max-concurrent-requests run, --max-queued-requests wait, the rest are
refused with RESOURCE_EXHAUSTED naming the limits. No wall-clock asserts: the end-to-end test
holds requests in place by stopping the target process, and reads the queue from metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from orchestrator.admission import Admission
from tandem.errors import ResourceExhausted
from tandem.launch import Process, Stack, spawn, wait_serving


def test_admission_runs_queues_then_refuses() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queued=1)
        release = asyncio.Event()
        order: list[str] = []

        async def request(name: str) -> None:
            async with admission.slot():
                order.append(name)
                await release.wait()

        running = asyncio.create_task(request("a"))
        queued = asyncio.create_task(request("b"))
        await asyncio.sleep(0)
        assert (order, admission.admitted) == (["a"], 2)
        with pytest.raises(ResourceExhausted, match="--max-concurrent-requests.*--max-queued-requests"):
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(running, queued)
        assert (order, admission.admitted) == (["a", "b"], 0)

    asyncio.run(scenario())


def test_a_cancelled_waiter_gives_its_place_back() -> None:
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queued=0)
        hold = asyncio.Event()

        async def request() -> None:
            async with admission.slot():
                await hold.wait()

        running = asyncio.create_task(request())
        await asyncio.sleep(0)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert admission.admitted == 0
        async with admission.slot():  # the slot is free again
            pass

    asyncio.run(scenario())


@pytest.mark.parametrize("running, queued", [(0, 0), (1, -1)])
def test_limits_must_be_sane(running: int, queued: int) -> None:
    with pytest.raises(ValueError, match="--max-concurrent-requests"):
        Admission(running, queued)


# --- End to end, with real processes ---

@pytest.fixture(scope="module")
def one_at_a_time(tiny_stack: Stack, tiny_target: Path) -> Iterator[Stack]:
    """An orchestrator on the shared replicas that runs one request and queues one more."""
    process = spawn(["orchestrator", "--draft", tiny_stack.drafts[0].address,
                     "--target", tiny_stack.targets[0].address, "--tokenizer", str(tiny_target),
                     "--max-concurrent-requests", "1", "--max-queued-requests", "1",
                     "--metrics-port", "0"])
    try:
        wait_serving(process)
        yield Stack(tiny_stack.drafts, tiny_stack.targets, process)
    finally:
        process.stop()


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def in_flight(process: Process) -> tuple[float, float]:
    samples = process.metrics()
    return samples.get("tandem_requests_in_flight", 0.0), samples.get("tandem_requests_queued", 0.0)


def test_beyond_running_plus_queued_requests_are_refused(one_at_a_time: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    stack, target = one_at_a_time, one_at_a_time.targets[0].proc
    prompt, length = "hello world", 12

    def generate() -> list[int]:
        with stack.client() as client:
            return list(client.generate(prompt, max_new_tokens=length, ignore_eos=True).token_ids)

    assert generate() == reference(prompt, length)  # channels to the replicas are up
    with ThreadPoolExecutor(max_workers=2) as pool:
        os.kill(target.pid, signal.SIGSTOP)  # the running request waits on the target
        try:
            running = pool.submit(generate)
            wait_until(lambda: in_flight(stack.orchestrator) == (1, 0))
            queued = pool.submit(generate)
            wait_until(lambda: in_flight(stack.orchestrator) == (2, 1))
            with stack.client() as client, pytest.raises(grpc.RpcError) as err:
                client.generate(prompt, max_new_tokens=length)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 requests running (--max-concurrent-requests)" in err.value.details()
            assert "1 queued (--max-queued-requests)" in err.value.details()
        finally:
            os.kill(target.pid, signal.SIGCONT)
        assert running.result(timeout=60) == queued.result(timeout=60) == reference(prompt, length)
    assert in_flight(stack.orchestrator) == (0, 0)
