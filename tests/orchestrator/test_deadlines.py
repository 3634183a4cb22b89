"""The client's deadline reaches every downstream call, reopened streams included.

Seen from the replicas: the orchestrator is frozen (SIGSTOP) mid-request, so nothing it does
can close its streams; the replicas' sessions must still end at the request's deadline, which
only a deadline carried on those streams does. One target is killed first, so the session
that must end is one the orchestrator reopened on the other target.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tiny import PROMPTS

from tandem.launch import Process, Stack, start_stack

pytestmark = pytest.mark.slow  # its own stack of real processes, frozen and resumed (CI runs it)

DEADLINE_S = 10.0  # the client's; generous, so the first tokens come well before it


@pytest.fixture
def watched(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    metrics = ["--metrics-port", "0"]
    stack = start_stack(str(tiny_draft), str(tiny_target), num_targets=2, draft_args=metrics,
                        target_args=metrics)
    yield stack
    os.kill(stack.orchestrator.proc.pid, signal.SIGCONT)  # whatever the test left it in
    stack.stop()


def open_sessions(process: Process) -> float:
    return process.metrics().get("tandem_sessions_active", 0.0)


def test_replicas_end_their_sessions_at_the_deadline_while_the_orchestrator_is_frozen(watched: Stack) -> None:
    orchestrator = watched.orchestrator.proc
    draft, dead, survivor = watched.drafts[0], watched.targets[0], watched.targets[1]
    seen: list[tuple[float, float]] = []  # the sessions open when the orchestrator froze

    def freeze_once_reopened() -> None:
        # The orchestrator runs ahead of the stream's reader: watch the replica for the reopened
        # stream itself, and freeze the orchestrator while it is open.
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if open_sessions(survivor) == 1:
                os.kill(orchestrator.pid, signal.SIGSTOP)
                seen.append((open_sessions(draft), open_sessions(survivor)))
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=freeze_once_reopened)
    with watched.client() as client, pytest.raises(grpc.RpcError) as err:
        for _ in client.generate_stream(PROMPTS[0], max_new_tokens=480, ignore_eos=True,
                                        num_speculative_tokens=4, timeout=DEADLINE_S):
            if watcher.ident is None:  # the first tokens
                # The first session went to the first target: a later step reopens on the other.
                dead.proc.send_signal(signal.SIGKILL)
                watcher.start()
    watcher.join()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen == [(1, 1)], "the orchestrator was not frozen with both sessions open"
    assert any("lost on target replica" in line for line in watched.orchestrator.lines)

    # The orchestrator stays frozen: only the deadline on the replicas' streams can end them,
    # at the moment the client's own ended. (Without it, the replicas' transports give up on
    # the frozen peer only when a ping goes unanswered for grpc's ping timeout, a minute.)
    deadline = time.monotonic() + 20
    while (open_sessions(draft), open_sessions(survivor)) != (0, 0):
        assert time.monotonic() < deadline, (
            f"sessions still open on the replicas: draft {open_sessions(draft)}, target "
            f"{open_sessions(survivor)}; the request's deadline did not reach their streams")
        time.sleep(0.2)
    assert orchestrator.poll() is None

    os.kill(orchestrator.pid, signal.SIGCONT)
    with watched.client() as client:  # thawed, it serves again
        reply = client.generate(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
    assert len(reply.token_ids) == 10
