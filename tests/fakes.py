"""Stand-ins for the server bootstrap's tests: a service whose start-up waits to be released."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import grpc


class SlowService:
    """Registers no handlers; `load()` blocks until `release` is set (or 30 s pass)."""

    name = "tandem.v1.TestService"

    def __init__(self) -> None:
        self.release = threading.Event()

    def add_to(self, grpc_server: grpc.aio.Server) -> None:
        pass

    def load(self) -> None:
        self.release.wait(timeout=30)


async def sigterm_and_wait(serving: asyncio.Task[None]) -> None:
    """SIGTERM this process, as a kubelet would, wait for `server.serve` to drain and return,
    then give the signals back to the test runner."""
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serving, timeout=10)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
