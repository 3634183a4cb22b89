"""The bootstrap: NOT_SERVING until the service has loaded, SERVING after, drained on SIGTERM.

The servers under test run in child processes (tests/fakes.py): the SIGTERMs land there.
"""

from __future__ import annotations

import signal

import grpc
import pytest
from fakes import release, slow_server, stop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.launch import Stack, wait_serving


def _status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


def test_not_serving_until_loaded_then_graceful_stop() -> None:
    with slow_server() as (process, _):
        assert _status(process.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        release(process)
        wait_serving(process, timeout=60)
        assert stop(process.proc) == 0, "".join(process.lines)


def test_sigterm_while_loading_stops_the_process_without_waiting_for_the_load() -> None:
    """An orchestrator still waiting (up to 10 min here) for a target that never comes is
    deleted: it exits on SIGTERM, rather than when the wait ends or the kubelet kills it."""
    from tandem.launch import spawn

    process = spawn(["orchestrator", "--target", "127.0.0.1:1", "--replica-wait-s", "600"])
    assert stop(process.proc, timeout=60) == 0, "".join(process.lines)


def test_sigterm_is_handled_from_the_moment_the_port_is_announced() -> None:
    """`tandem up`, the tests and a kubelet may signal as soon as "listening on" is printed;
    a SIGTERM then must drain the server, not kill the process with the default action.
    The child signals itself from inside the print, so there is no window to miss."""
    with slow_server("--sigterm-on-announce") as (process, output):
        code = process.proc.wait(timeout=60)
        assert code == 0, f"exit {code} (-{int(signal.SIGTERM)}: killed undrained):\n{output.text}"


@pytest.mark.parametrize("role", ["drafts", "targets", "orchestrator"])
def test_every_service_serves_health_and_reflection(tiny_stack: Stack, role: str) -> None:
    process = tiny_stack.orchestrator if role == "orchestrator" else getattr(tiny_stack, role)[0]
    with grpc.insecure_channel(process.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = list(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    expected = {"drafts": "tandem.v1.DraftService", "targets": "tandem.v1.TargetService",
                "orchestrator": "tandem.v1.OrchestratorService"}[role]
    assert {expected, "grpc.health.v1.Health"} <= names
