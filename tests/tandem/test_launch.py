"""The local launcher (`tandem up`, the tests' stacks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.launch import start_stack


def test_the_orchestrator_binds_the_host_asked_for_and_the_replicas_stay_local(tiny_target: Path) -> None:
    # `tandem up --host 0.0.0.0` used to parse the flag and bind 127.0.0.1 anyway.
    stack = start_stack(None, str(tiny_target), host="0.0.0.0")
    try:
        assert stack.orchestrator.address.startswith("0.0.0.0:")
        assert all(t.address.startswith("127.0.0.1:") for t in stack.targets)
        with stack.client() as client:
            assert client.generate("ab", max_new_tokens=2).usage.completion_tokens == 2
    finally:
        stack.stop()


def _children(pid: int) -> set[int]:
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


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


def test_a_failed_start_stops_the_services_already_started(tiny_draft: Path, tiny_target: Path) -> None:
    import socket

    import pytest

    before = _children(os.getpid())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(RuntimeError, match="orchestrator exited"):
            start_stack(str(tiny_draft), str(tiny_target), port=busy.getsockname()[1])
    assert _children(os.getpid()) == before, "the draft and target were left running"


def _tandem_up(tiny_draft: Path, tiny_target: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--draft", str(tiny_draft),
                             "--target", str(tiny_target), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigterm_while_tandem_up_starts_stops_every_service(tiny_draft: Path, tiny_target: Path) -> None:
    """`kill`, `docker stop` or systemd during the minutes the models load."""
    up = _tandem_up(tiny_draft, tiny_target)
    assert up.stdout is not None
    for line in up.stdout:  # the replicas are spawned; the orchestrator waits for them
        if "loading models" in line:
            break
    while len(kids := _children(up.pid)) < 2:
        time.sleep(0.05)
    up.send_signal(signal.SIGTERM)
    up.communicate(timeout=60)
    assert up.returncode != 0
    assert not _alive(kids), "services outlived tandem up"


def test_tandem_up_exits_nonzero_when_a_service_dies(tiny_draft: Path, tiny_target: Path) -> None:
    up = _tandem_up(tiny_draft, tiny_target)
    assert up.stdout is not None
    for line in up.stdout:
        if "Tandem is ready" in line:
            break
    kids = _children(up.pid)
    target = next(k for k in kids if b"target-service" in (Path("/proc") / str(k) / "cmdline").read_bytes())
    os.kill(target, signal.SIGKILL)
    output = up.communicate(timeout=60)[0]
    assert "a service exited" in output
    assert up.returncode != 0, "a crashed stack must not look like a clean exit"
    assert not _alive(kids)
