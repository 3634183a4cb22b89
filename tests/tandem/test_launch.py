"""The local launcher (`tandem up`, the tests' stacks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import Output, stop
from replicas import alive, children

from tandem.launch import spawn, start_stack

pytestmark = pytest.mark.slow  # real processes, tandem up and stacks, per test (CI runs it)


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


def test_a_failed_start_stops_the_services_already_started(tiny_draft: Path, tiny_target: Path) -> None:
    import socket

    before = children(os.getpid())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(RuntimeError, match="orchestrator exited"):
            start_stack(str(tiny_draft), str(tiny_target), port=busy.getsockname()[1])
    assert children(os.getpid()) == before, "the draft and target were left running"


@contextlib.contextmanager
def _tandem_up(tiny_draft: Path, tiny_target: Path,
               log_dir: Path) -> Iterator[tuple[subprocess.Popen[str], Output]]:
    """`tandem up` on the tiny pair, in a process group of its own: on the way out, whatever
    the test left of it and of the services it started is killed."""
    up = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--draft", str(tiny_draft),
                           "--target", str(tiny_target), "--port", "0", "--http-port", "0",
                           "--log-dir", str(log_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    assert up.stdout is not None
    try:
        yield up, Output(up.stdout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        up.wait()


def _wait_for_children(pid: int, count: int, timeout: float = 120.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while len(kids := children(pid)) < count:
        assert time.monotonic() < deadline, f"{pid} started {len(kids)} of {count} services"
        time.sleep(0.05)
    return kids


def test_sigterm_while_tandem_up_starts_stops_every_service(tiny_draft: Path, tiny_target: Path,
                                                            tmp_path: Path) -> None:
    """`kill`, `docker stop` or systemd during the minutes the models load."""
    with _tandem_up(tiny_draft, tiny_target, tmp_path) as (up, output):
        output.wait_for("loading models")  # the replicas are spawned; the orchestrator waits for them
        kids = _wait_for_children(up.pid, 2)
        assert stop(up, timeout=60) != 0
        assert not any(map(alive, kids)), "services outlived tandem up"


def test_sigterm_to_a_bench_stops_the_stacks_it_started(tiny_draft: Path, tiny_target: Path,
                                                       tmp_path: Path) -> None:
    """A sweep killed with SIGTERM used to leave every stack it had started running."""
    sweep = subprocess.Popen([sys.executable, "-m", "tandem.cli", "bench-load", "--sweep", "--draft",
                              str(tiny_draft), "--target", str(tiny_target), "--draft-args", "",
                              "--target-args", "", "--concurrency", "1", "--max-new-tokens", "400",
                              "--min-requests", "50", "--out", str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    assert sweep.stdout is not None
    output = Output(sweep.stdout)
    try:
        # Three modes: two targets (per-session, batched), a draft, an orchestrator per mode.
        kids = _wait_for_children(sweep.pid, 6)
        assert stop(sweep, timeout=60) == 130, output.text
        assert not any(map(alive, kids)), "services outlived the bench"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sweep.pid, signal.SIGKILL)
        sweep.wait()


def test_tandem_up_exits_nonzero_when_a_service_dies(tiny_draft: Path, tiny_target: Path,
                                                     tmp_path: Path) -> None:
    with _tandem_up(tiny_draft, tiny_target, tmp_path) as (up, output):
        output.wait_for("Tandem is ready")
        kids = children(up.pid)
        target = next(k for k in kids if b"target-service" in (Path("/proc") / str(k) / "cmdline").read_bytes())
        os.kill(target, signal.SIGKILL)
        assert up.wait(timeout=60) != 0, "a crashed stack must not look like a clean exit"
        output.closed.wait(timeout=10)
        assert "the target service exited" in output.text
        assert not any(map(alive, kids))


def _blocked(pid: int | str) -> int:
    """The signal mask of a process (or of this thread: "thread-self")."""
    status = (Path("/proc") / str(pid) / "status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)


def test_spawn_holds_sigint_and_sigterm_only_while_it_forks(tiny_target: Path) -> None:
    """spawn holds SIGINT and SIGTERM while Popen forks (so a stop cannot orphan a half-started
    service); afterwards the caller has them again, and the service takes them at start-up, so
    it stops on SIGTERM as before."""
    bits = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
    process = spawn(["target-service", "--model", str(tiny_target)])
    try:
        assert not _blocked("thread-self") & bits
        # glibc blocks every signal for the instant a thread is created, so one reading may
        # catch that; a mask that stays held never reads clear.
        deadline = time.monotonic() + 10
        while _blocked(process.proc.pid) & bits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _blocked(process.proc.pid) & bits
    finally:
        assert process.stop(sig_timeout=60) == 0  # a graceful drain, not a kill
