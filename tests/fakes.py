"""Stand-ins for the server bootstrap's tests, and reading a child process's output.

`slow_server()` runs `server.serve` in a child process, around a service whose start-up
waits to be released. The tests SIGTERM that child, as a kubelet would: a regression in
the signal handling then fails one test, instead of killing the test runner.

Run as a script, this file is that child: `python fakes.py [--metrics-port N]
[--sigterm-on-announce]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

import grpc

from tandem.launch import Process


class SlowService:
    """Registers no handlers; `load()` blocks until a line arrives on stdin (or stdin closes)."""

    name = "tandem.v1.TestService"

    def add_to(self, grpc_server: grpc.aio.Server) -> None:
        pass

    def load(self) -> None:
        sys.stdin.readline()


class Output:
    """Every line a child writes, read on a thread so that waiting for one has a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self.closed = threading.Event()

        def read() -> None:
            for line in stream:
                self.lines.append(line)
            self.closed.set()

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, needle: str, timeout: float = 120.0) -> str:
        """The first line containing `needle`; AssertionError if none comes within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in list(self.lines) if needle in line), None)
            if found is not None:
                return found
            if self.closed.is_set():
                raise AssertionError(f"the process ended without printing {needle!r}:\n{self.text}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} within {timeout}s:\n{self.text}")
            time.sleep(0.02)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Send `sig` and wait for the exit; SIGKILL (and fail) if it does not come within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"pid {proc.pid} outlived signal {sig} by {timeout}s; killed") from None


@contextlib.contextmanager
def slow_server(*flags: str) -> Iterator[tuple[Process, Output]]:
    """The child announced its gRPC address; its load waits for `release(process)`.
    Killed on the way out if the test left it running."""
    proc = subprocess.Popen([sys.executable, __file__, *flags], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = Output(proc.stdout)
    try:
        address = output.wait_for(" listening on ").rsplit(" ", 1)[1].strip()
        yield Process(proc, address, output.lines), output
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def release(process: Process) -> None:
    """Let the child's load finish."""
    assert process.proc.stdin is not None
    process.proc.stdin.write("loaded\n")
    process.proc.stdin.flush()


class _SigtermOnAnnounce:
    """stdout that sends this process SIGTERM the moment "listening on" is written: whoever
    reads that line may signal at once, so the drain must already be armed by then."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def write(self, text: str) -> int:
        written = self.out.write(text)
        if " listening on " in text:
            self.out.flush()
            os.kill(os.getpid(), signal.SIGTERM)
        return written

    def flush(self) -> None:
        self.out.flush()


def _main() -> None:
    import argparse

    from tandem import server

    parser = argparse.ArgumentParser()
    parser.add_argument("--metrics-port", type=int, default=-1)
    parser.add_argument("--sigterm-on-announce", action="store_true")
    args = parser.parse_args()
    if args.sigterm_on_announce:
        sys.stdout = _SigtermOnAnnounce(sys.stdout)  # type: ignore[assignment]
    asyncio.run(server.serve([SlowService()], "test", "127.0.0.1", 0, grace_s=1,
                             metrics_port=args.metrics_port))


if __name__ == "__main__":
    _main()
