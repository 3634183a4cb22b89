"""What a forward pass costs besides the forward: the host's time around it, and the bytes it
copies from the device to the host.

The scheduler's worker opens a `PassClock` for each pass; the runner marks where the
model's forward begins and ends (waiting for the device there, so the split is honest on a
GPU, whose kernels run behind the host); everything that reads a device tensor into host
memory during the pass goes through `to_host`, which counts the bytes. On a CPU nothing is
copied (the tensors are already in host memory) but the same reads are counted, so a test
on a CPU sees what a GPU would copy.

`keep_freed_memory` tunes the C allocator of a process that serves a model on a CPU, where a
pass's transient tensors (a few rows of vocabulary-wide probabilities, their float64
cumulative sums) are megabytes each.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.split import PassSplit


@dataclass
class PassClock:
    started: float
    forward_from: float | None = None
    forward_to: float | None = None
    forward_s: float = 0.0
    host_bytes: int = 0
    captured: bool = False  # the pass ran through the decode graph

    def split(self) -> PassSplit:
        ended = time.perf_counter()
        first = self.forward_from if self.forward_from is not None else ended
        last = self.forward_to if self.forward_to is not None else ended
        return PassSplit(before_ms=(first - self.started) * 1000.0, forward_ms=self.forward_s * 1000.0,
                         after_ms=(ended - last) * 1000.0, host_bytes=self.host_bytes,
                         captured=int(self.captured))


_current = threading.local()


def begin() -> PassClock:
    """The worker, before a pass: the clock that `forward` and `to_host` mark on this thread."""
    clock = PassClock(time.perf_counter())
    _current.clock = clock
    return clock


def _clock() -> PassClock | None:
    return getattr(_current, "clock", None)


class forward:
    """Around a model's forward call: `with host.forward(device): out = model(...)`."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        self.began = 0.0

    def __enter__(self) -> None:
        self.began = time.perf_counter()
        clock = _clock()
        if clock is not None and clock.forward_from is None:
            clock.forward_from = self.began

    def __exit__(self, *exc: object) -> None:
        if self.device is not None and self.device.type == "cuda" and exc[0] is None:
            torch.cuda.synchronize(self.device)  # the kernels ran behind the host until here
        ended = time.perf_counter()
        clock = _clock()
        if clock is not None:
            clock.forward_to = ended
            clock.forward_s += ended - self.began


def captured() -> None:
    """The pass on this thread runs through the decode graph (tandem.decode_graph)."""
    clock = _clock()
    if clock is not None:
        clock.captured = True


def count(nbytes: int) -> None:
    """Bytes a pass copied to the host outside `to_host` (an engine's own logits buffer)."""
    clock = _clock()
    if clock is not None:
        clock.host_bytes += nbytes


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory, its bytes counted against the running pass."""
    count(t.numel() * t.element_size())
    return t.cpu()


def values(t: torch.Tensor) -> list[Any]:
    """`t.tolist()`, its bytes counted: how a pass's step reads a device tensor."""
    return to_host(t).tolist()


# glibc's mallopt parameters, and the values a model service sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks below this come from the heap, whose freed memory the next pass reuses (glibc's
#: largest mmap threshold on a 64-bit machine).
KEEP_BELOW_BYTES = 32 << 20
#: Free memory at the heap's top is handed back to the system only past this.
KEEP_FREE_BYTES = 256 << 20


def keep_freed_memory() -> str:
    """Have the C allocator keep freed blocks of up to `KEEP_BELOW_BYTES` for reuse; returns
    what it did, for the log.

    glibc maps each block past its mmap threshold (128 KiB, raised towards 32 MiB only as such
    blocks are freed) afresh and unmaps it when freed, and trims the heap's top once twice that
    lies free: a pass's megabyte-sized tensors then fault every page in again, pass after pass
    (a sampled 5-row score on a 152k vocabulary: 15 ms instead of 5). Fixed thresholds keep
    that memory in the process (at most `KEEP_FREE_BYTES` of it idle). Where the environment
    sets glibc's own `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`, or the C library is
    not glibc, nothing is changed."""
    if platform.libc_ver()[0] != "glibc":
        return "left as it is (not glibc)"
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return "left as the environment sets it"
    libc = ctypes.CDLL(None)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREE_BYTES)):
        return "left as it is (mallopt refused)"
    return f"freed blocks under {KEEP_BELOW_BYTES >> 20} MiB kept for reuse"
