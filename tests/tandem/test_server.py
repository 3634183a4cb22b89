"""The bootstrap: NOT_SERVING until the service has loaded, SERVING after, drained on SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import grpc
from fakes import SlowService, sigterm_and_wait
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import server


async def _status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


def test_not_serving_until_loaded_then_graceful_stop(capsys) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        service = SlowService()
        task = asyncio.create_task(server.serve([service], "test", "127.0.0.1", 0, grace_s=1))
        while "listening on" not in (out := capsys.readouterr().out):
            await asyncio.sleep(0.05)
        address = out.strip().rsplit(" ", 1)[1]
        assert await _status(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        service.release.set()
        for _ in range(100):
            if await _status(address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert await _status(address) == health_pb2.HealthCheckResponse.SERVING
        await sigterm_and_wait(task)

    asyncio.run(scenario())


def test_sigterm_while_loading_stops_the_process_without_waiting_for_the_load() -> None:
    """An orchestrator still waiting (up to 10 min here) for a target that never comes is
    deleted: it exits on SIGTERM, rather than when the wait ends or the kubelet kills it."""
    from tandem.launch import spawn

    process = spawn(["orchestrator", "--target", "127.0.0.1:1", "--replica-wait-s", "600"])
    process.proc.send_signal(signal.SIGTERM)
    assert process.proc.wait(timeout=60) == 0, "".join(process.lines)


def test_sigterm_is_handled_from_the_moment_the_port_is_announced(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`tandem up`, the tests and a kubelet may signal as soon as "listening on" is printed;
    a SIGTERM then must drain the server, not kill the process with the default action."""
    import io
    import sys

    handlers_when_announced: list[object] = []

    class Watch(io.StringIO):
        def write(self, text: str) -> int:
            if "listening on" in text:
                handlers_when_announced.append(signal.getsignal(signal.SIGTERM))
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Watch())

    async def scenario() -> None:
        service = SlowService()
        task = asyncio.create_task(server.serve([service], "test", "127.0.0.1", 0, grace_s=1))
        while not handlers_when_announced:
            await asyncio.sleep(0.01)
        service.release.set()
        await sigterm_and_wait(task)

    default = signal.getsignal(signal.SIGTERM)
    asyncio.run(scenario())
    assert handlers_when_announced[0] is not default, "SIGTERM still had its default action"
