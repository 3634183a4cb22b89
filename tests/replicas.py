"""What the tests read off a stack's replicas: open sessions and cached tokens, polled back to
a baseline with a deadline (sessions close just after a stream's last message); and the
processes behind them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from tiny import PROMPTS

from tandem.launch import Stack

GAUGES = ("tandem_sessions_active", "tandem_kv_cached_tokens")


def replica_state(stack: Stack) -> dict[str, float]:
    """Open sessions, cached tokens, sessions ever opened and steps served, per replica."""
    state = {}
    for role, replica in (("draft", stack.drafts[0]), ("target", stack.targets[0])):
        samples = replica.metrics()
        for name in (*GAUGES, "tandem_sessions_total", "tandem_replica_step_duration_seconds_count"):
            state[f"{role} {name}"] = samples.get(name, 0.0)
    return state


def wait_for_baseline(stack: Stack, baseline: dict[str, float], timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        state = replica_state(stack)
        gauges = {k: v for k, v in state.items() if k.endswith(GAUGES)}
        if gauges == {k: v for k, v in baseline.items() if k.endswith(GAUGES)}:
            return state
        assert time.monotonic() < deadline, f"replicas did not return to {baseline}: {state}"
        time.sleep(0.1)


FAULT_LENGTH = 300  # tokens: long enough that a fault lands mid-request


def stream_with_fault(stack: Stack, fault: Callable[[], None], **kwargs: Any) -> tuple[list[int], Any]:
    """Stream PROMPTS[0] (EOS ignored, FAULT_LENGTH tokens); run `fault` once the first tokens
    arrive. Returns (tokens, the summary or the call's error)."""
    tokens: list[int] = []
    with stack.client() as client:
        try:
            for message in client.generate_stream(PROMPTS[0], max_new_tokens=FAULT_LENGTH,
                                                  **{"ignore_eos": True, **kwargs}):
                if message.HasField("delta"):
                    if not tokens:
                        fault()
                    tokens.extend(message.delta.token_ids)
                else:
                    return tokens, message.summary
        except grpc.RpcError as exc:
            return tokens, exc
    raise AssertionError("the stream ended without a summary")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.1)


def children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is pid."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
