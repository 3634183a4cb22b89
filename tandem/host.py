"""What a forward pass costs besides the forward: the host's time around it, and the bytes it
copies from the device to the host.

The scheduler's worker opens a `PassClock` for each pass; the runner marks where the
model's forward begins and ends (waiting for the device there, so the split is honest on a
GPU, whose kernels run behind the host); everything that reads a device tensor into host
memory during the pass goes through `to_host`, which counts the bytes. On a CPU nothing is
copied (the tensors are already in host memory) but the same reads are counted, so a test
on a CPU sees what a GPU would copy.
"""

from __future__ import annotations

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
