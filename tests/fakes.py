"""Stand-ins for the server bootstrap's tests: a service whose start-up waits to be released."""

from __future__ import annotations

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
