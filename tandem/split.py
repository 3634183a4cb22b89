"""Where forward passes' time went (`PassSplit`), and its wire form: kept apart from
tandem.host, which needs torch, so that the orchestrator's metrics and the CLI's client
commands load without it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.v1 import common_pb2


@dataclass(frozen=True)
class PassSplit:
    """One pass's time by stage, and what it copied to the host."""

    before_ms: float  # host work before the forward: the pass's layout, mask and cache
    forward_ms: float  # the model's forward, the device's work included
    after_ms: float  # host work after it: sampling, scoring, what the steps read back
    host_bytes: int  # bytes read from device tensors into host memory
    passes: int = 1  # passes summed here
    captured: int = 0  # of them, through the decode graph (tandem.decode_graph)

    def __add__(self, other: PassSplit) -> PassSplit:
        return PassSplit(self.before_ms + other.before_ms, self.forward_ms + other.forward_ms,
                         self.after_ms + other.after_ms, self.host_bytes + other.host_bytes,
                         self.passes + other.passes, self.captured + other.captured)


NO_SPLIT = PassSplit(0.0, 0.0, 0.0, 0, passes=0)


def split_to_proto(split: PassSplit) -> common_pb2.PassSplit:
    return common_pb2.PassSplit(host_before_ms=split.before_ms, forward_ms=split.forward_ms,
                                host_after_ms=split.after_ms, host_bytes=split.host_bytes,
                                pass_count=split.passes, captured_count=split.captured)


def split_from_proto(proto: common_pb2.PassSplit) -> PassSplit:
    return PassSplit(proto.host_before_ms, proto.forward_ms, proto.host_after_ms, proto.host_bytes,
                     proto.pass_count, proto.captured_count)
