"""A model still loading gets UNAVAILABLE: on the replicas, and through the orchestrator.

The replicas are the real draft and target services in their own processes, whose load
waits for the test (tests/gated_replica.py). While they load, every step, GetModelInfo and
the target's GetTokenizer are refused with UNAVAILABLE, and so is Generate on an orchestrator
still waiting for them; once they have loaded, the same request is served (the orchestrator,
started without --tokenizer, loads the one the target serves).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny import PROMPTS, make_tokenizer

from tandem.launch import Process, Stack, spawn, wait_serving
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow  # its own stacks of real processes (CI runs it)

GATED = Path(__file__).parent.parent / "gated_replica.py"


def start_gated(role: str, model: Path) -> Process:
    """The service listening, its model not loaded until `release`."""
    proc = subprocess.Popen([sys.executable, str(GATED), role, str(model)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if " listening on " in line:
            threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()
            return Process(proc, line.rsplit(" ", 1)[1].strip(), lines)
    raise RuntimeError(f"the gated {role} exited with {proc.wait()}:\n{''.join(lines)}")


def release(process: Process) -> None:
    assert process.proc.stdin is not None
    process.proc.stdin.write("load\n")
    process.proc.stdin.flush()


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status)


@pytest.fixture
def loading(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    """A draft and a target still loading, and an orchestrator waiting for them."""
    started: list[Process] = []
    try:
        started.append(start_gated("draft", tiny_draft))
        started.append(start_gated("target", tiny_target))
        # No --tokenizer: once the target has loaded, the orchestrator loads the one it serves.
        started.append(spawn(["orchestrator", "--draft", started[0].address, "--target", started[1].address,
                              "--replica-wait-s", "600"]))
        yield Stack([started[0]], [started[1]], started[2])
    finally:
        for process in reversed(started):
            process.stop()


def test_requests_while_models_load_get_unavailable_then_are_served(loading: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    draft, target = loading.drafts[0], loading.targets[0]
    prompt = make_tokenizer().encode(PROMPTS[0])
    for process in (draft, target, loading.orchestrator):
        assert health(process.address) == health_pb2.HealthCheckResponse.NOT_SERVING

    calls = {
        "ProposeBlocks": lambda channel: list(draft_pb2_grpc.DraftServiceStub(channel).ProposeBlocks(
            iter([draft_pb2.ProposeBlocksRequest(new_token_ids=prompt, num_speculative_tokens=2,
                                                 max_support_size=4)]), timeout=30)),
        "ScoreBlocks": lambda channel: list(target_pb2_grpc.TargetServiceStub(channel).ScoreBlocks(
            iter([target_pb2.ScoreBlocksRequest(new_token_ids=prompt, draft_proposal=target_pb2.DraftProposal())]), timeout=30)),
        "draft GetModelInfo": lambda channel: draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=30),
        "target GetModelInfo": lambda channel: target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=30),
        "target GetTokenizer": lambda channel: target_pb2_grpc.TargetServiceStub(channel).GetTokenizer(
            target_pb2.GetTokenizerRequest(), timeout=30),
    }
    for name, call in calls.items():
        address = (draft if name.startswith(("Propose", "draft")) else target).address
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
            call(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert "the model is still loading" in err.value.details(), name

    with loading.client() as client:
        for stream in (False, True):
            with pytest.raises(grpc.RpcError) as err:
                if stream:
                    list(client.generate_stream(PROMPTS[0], max_new_tokens=8))
                else:
                    client.generate(PROMPTS[0], max_new_tokens=8)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "still connecting to its replicas" in err.value.details()

    # The models load: the orchestrator finds its replicas, and the same request is served.
    release(draft)
    release(target)
    for process in (draft, target, loading.orchestrator):
        wait_serving(process, timeout=300)
    with loading.client() as client:
        reply = client.generate(PROMPTS[0], max_new_tokens=20, num_speculative_tokens=4, ignore_eos=True)
    assert list(reply.token_ids) == reference(PROMPTS[0], 20)
    assert reply.usage.drafted_tokens > 0
