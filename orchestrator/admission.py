"""Admission control: at most N requests generate at once, at most M more wait, the rest are refused.

A refused request gets RESOURCE_EXHAUSTED at once, naming the limits, so a client (or a load
balancer) retries elsewhere or later, instead of the orchestrator queueing without bound and
every request slowing down together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tandem.errors import ResourceExhausted


class Admission:
    """A semaphore for the running requests, and a count of the admitted ones (running + queued)."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"--max-concurrent-requests must be >= 1 and --max-queued-requests "
                             f">= 0, got {max_running} and {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)
        self.admitted = 0  # running + queued
        self.waiting = 0  # queued

    @property
    def running(self) -> int:
        return self.admitted - self.waiting

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a running slot for the body; wait in the queue for one, or raise ResourceExhausted."""
        if self.admitted >= self.max_running + self.max_queued:
            raise ResourceExhausted(
                f"the orchestrator is at capacity: {self.max_running} requests running "
                f"(--max-concurrent-requests) and {self.max_queued} queued "
                "(--max-queued-requests); retry later")
        self.admitted += 1
        try:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            try:
                yield
            finally:
                self._slots.release()
        finally:
            self.admitted -= 1
