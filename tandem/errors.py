"""Domain exceptions. The server bootstrap is the one place that maps them to gRPC codes."""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """Base class; `code` is the gRPC status a caller sees."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(TandemError, ValueError):
    """The request is malformed; the message names the field and its allowed range."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class CacheMismatch(TandemError):
    """A step assumed more cached tokens than the session holds (e.g. it was evicted)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class SessionEvicted(TandemError):
    """The session's KV cache was evicted to make room; the caller resends its history."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(TandemError):
    """A configured limit was hit; the message names the limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class BudgetHeld(ResourceExhausted):
    """The KV budget is held by forward passes running now: room frees when they end."""


class DeadlineExceeded(TandemError):
    """The caller's deadline passed before the request could finish."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(TandemError):
    """The service cannot serve now (still loading, draining, or no replica left)."""

    code = grpc.StatusCode.UNAVAILABLE


class ReplicaRefused(Unavailable):
    """A replica answered INVALID_ARGUMENT to a step the orchestrator built from a valid
    request: the replica cannot serve this request (e.g. a draft whose vocabulary is smaller
    than the tokenizer's refuses ids past its rows), though it is alive and serves others."""
