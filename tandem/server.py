"""One bootstrap for every Tandem gRPC server.

`start_server` builds a `grpc.aio` server with health (NOT_SERVING until the service
has loaded), reflection, and the services' handlers, and binds it (port 0 picks a
free port, for tests). `serve` runs it: it loads the model off the event loop,
flips health to SERVING, and on SIGTERM/SIGINT turns NOT_SERVING, refuses new work
and drains in-flight streams within the grace period. With a metrics port it also serves
Prometheus metrics over HTTP, from before loading until the drain is over.

Security is set up here too, the same way for every service: TLS (mutual TLS with a client
CA) from `tandem.security.ServerTls`, and with a token, bearer-token authentication on
everything but health and reflection. The kubelet's gRPC probes speak neither TLS nor
tokens, so a health port can serve health alone in plaintext beside a TLS port.

`handle_errors` is the one place that turns domain exceptions into gRPC statuses; the
`RejectUndecodable` interceptor answers a request that does not parse (invalid UTF-8 in a
string field) with INVALID_ARGUMENT naming the field, where grpc would answer UNKNOWN.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import metrics
from tandem.errors import TandemError
from tandem.security import (
    OPEN_SERVICES,
    BearerTokenAuth,
    Reloading,
    ServerTls,
    refusing,
    server_credentials,
)

log = logging.getLogger(__name__)

# Generous message limits: prompts can be long. Each service can lower what it receives
# (--max-message-bytes); grpc answers a larger request with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_message_bytes)]


class Service(Protocol):
    """What the bootstrap needs from a service."""

    #: Fully qualified proto service name, e.g. "tandem.v1.DraftService".
    name: str

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register the gRPC handlers."""

    def load(self) -> None:
        """Blocking start-up work (loading weights). Runs in a worker thread."""


class Companion(Protocol):
    """Another front end served beside gRPC in the same event loop (the HTTP API)."""

    async def start(self, host: str) -> str:
        """Listen on host; a line saying where (printed after the server's label)."""

    async def stop(self) -> None:
        """Stop listening, letting what is in flight end briefly."""


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    names: tuple[str, ...]
    # Plaintext, health-only server for probes (None: health is on the main port only).
    health_server: grpc.aio.Server | None = None
    health_port: int = -1
    draining: RefuseWhileDraining | None = None

    async def stop(self, grace_s: float | None) -> None:
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.names):
            await self.health.set(name, status)


async def start_server(services: list[Service], host: str = "127.0.0.1", port: int = 0, *,
                       tls: ServerTls | None = None, auth_token: str | Reloading[tuple[str, ...]] | None = None,
                       health_port: int = -1,
                       max_message_bytes: int = MAX_MESSAGE_BYTES) -> RunningServer:
    """Build, bind and start the server (not yet SERVING).

    tls: serve TLS (mutual TLS when it has a client CA) instead of plaintext.
    auth_token: require `authorization: Bearer <token>` on every call but health and reflection.
    health_port: also serve health alone, in plaintext, on this port (0 picks one; -1: none).
    max_message_bytes: the largest request message accepted.
    """
    if max_message_bytes < 1:
        raise ValueError(f"--max-message-bytes must be >= 1, got {max_message_bytes}")
    draining = RefuseWhileDraining()
    interceptors: list[grpc.aio.ServerInterceptor] = [draining]
    if auth_token:
        interceptors.append(BearerTokenAuth(auth_token))
    interceptors.append(RejectUndecodable())
    server = grpc.aio.server(options=server_options(max_message_bytes), interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(s.name for s in services)
    for service in services:
        service.add_to(server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    bound = _bind(server, host, port, tls)
    health_server = None
    if health_port >= 0:
        # NOTE: plaintext by design: it answers only "SERVING or not", for the kubelet.
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = _bind(health_server, host, health_port, None)
    await server.start()
    if health_server is not None:
        await health_server.start()
    running = RunningServer(server=server, port=bound, health=health_servicer, names=names,
                            health_server=health_server, health_port=health_port,
                            draining=draining)
    await running.set_serving(False)
    return running


def _bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None) -> int:
    address = f"{host}:{port}"
    bound: int
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, server_credentials(tls))
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    return bound


async def serve(services: list[Service], label: str, host: str, port: int,
                grace_s: float = 30.0, metrics_port: int = -1, *, tls: ServerTls | None = None,
                auth_token: str | Reloading[tuple[str, ...]] | None = None, health_port: int = -1,
                max_message_bytes: int = MAX_MESSAGE_BYTES,
                companions: Sequence[Companion] = ()) -> None:
    """Run until SIGTERM/SIGINT. Prints one line when listening and one when serving.

    metrics_port: serve Prometheus metrics on http://host:metrics_port/metrics (0 picks a
    free port; negative: no metrics endpoint). tls, auth_token, health_port,
    max_message_bytes: as in start_server. companions: other front ends (the HTTP API),
    started once gRPC listens and stopped with it.
    """
    # Handle SIGTERM before the port is announced: whoever reads "listening on" (`tandem up`,
    # the tests, a kubelet) may signal at once, and the default action kills without a drain.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start_server(services, host, port, tls=tls, auth_token=auth_token,
                                 health_port=health_port, max_message_bytes=max_message_bytes)
    security = ("plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS") + \
        (", bearer token required" if auth_token else "")
    log.info("%s: %s", label, security)
    if running.health_server is not None:
        print(f"tandem {label} health (plaintext) on {host}:{running.health_port}", flush=True)
    # Machine-readable: `tandem up` and the tests read the port from this line.
    print(f"tandem {label} listening on {host}:{running.port}", flush=True)
    for companion in companions:
        print(f"tandem {label} {await companion.start(host)}", flush=True)
    exporter = metrics.start_metrics_server(host, metrics_port) if metrics_port >= 0 else None
    if exporter is not None:
        print(f"tandem {label} metrics on http://{host}:{exporter.port}/metrics", flush=True)
    try:
        await _run_until_signal(services, label, host, running, grace_s, stop, companions)
    finally:
        if exporter is not None:
            exporter.stop()


class _Liveness(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """gRPC health that asks `alive` at every check, whichever service it names."""

    def __init__(self, alive: Callable[[], bool]) -> None:
        self.alive = alive

    def Check(self, request: Any, context: Any) -> Any:
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if self.alive()
            else health_pb2.HealthCheckResponse.NOT_SERVING)


def serve_liveness(label: str, host: str, port: int,
                   alive: Callable[[], bool]) -> tuple[grpc.Server, int]:
    """Serve gRPC health alone, in plaintext, on threads of its own, for a process that serves
    nothing else (a tensor-parallel follower): SERVING while `alive()`. Prints where; returns
    the server and its port."""
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="liveness"))
    health_pb2_grpc.add_HealthServicer_to_server(_Liveness(alive), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    print(f"tandem {label} liveness (plaintext) on {host}:{bound}", flush=True)
    return server, bound


def _on_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """fn() on a daemon thread. A load can take minutes (weights, waiting for replicas); a
    SIGTERM meanwhile must not wait for it, and the default executor's threads are joined
    when the process exits, daemon threads are not."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # cancelled: the server stopped without it
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting loop
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is gone: the process is stopping

    threading.Thread(target=run, name="load", daemon=True).start()
    return future


async def _run_until_signal(services: list[Service], label: str, host: str,
                            running: RunningServer, grace_s: float, stop: asyncio.Event,
                            companions: Sequence[Companion] = ()) -> None:
    load: asyncio.Future[Any] = asyncio.gather(*(_on_daemon_thread(s.load) for s in services))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
    if load.done():
        if load.exception() is not None:
            await running.stop(0)
            load.result()  # re-raise the load failure: the process exits non-zero
        await running.set_serving(True)
        print(f"tandem {label} serving on {host}:{running.port}", flush=True)
        await waiter
    else:
        load.cancel()
    log.info("%s: draining for up to %.0fs", label, grace_s)
    if running.draining is not None:
        running.draining.active = True
    await running.health.enter_graceful_shutdown()
    await asyncio.gather(running.stop(grace_s), *(c.stop() for c in companions))
    log.info("%s: stopped", label)


class RefuseWhileDraining(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Once the server drains (SIGTERM), new calls but health get UNAVAILABLE; streams in
    flight go on until they end or the grace period does."""

    def __init__(self) -> None:
        self.active = False

    async def intercept_service(self, continuation: Callable[..., Any],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if not self.active or handler is None or handler_call_details.method.startswith(OPEN_SERVICES):
            return handler
        return refusing(handler, grpc.StatusCode.UNAVAILABLE,
                        "this replica is shutting down; retry on another one")


def abort_status(exc: TandemError) -> tuple[grpc.StatusCode, str]:
    return exc.code, str(exc)


F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(method: F) -> F:
    """Wrap a servicer method (coroutine or async generator) so domain errors become statuses."""

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in method(self, request, context):
                    yield item
            except TandemError as exc:
                await context.abort(*abort_status(exc))

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except TandemError as exc:
            await context.abort(*abort_status(exc))

    return unary_wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Undecodable:
    """What the lenient deserializer hands on for bytes that do not parse as the request type."""

    reason: str


def _bad_string_field(raw: bytes, descriptor: Descriptor, path: str = "") -> str | None:
    """The name of the first string field of `raw` (wire format) that is not valid UTF-8."""

    def varint(pos: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            byte = raw[pos]
            result |= (byte & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
            if not byte & 0x80:
                return result, pos

    pos = 0
    try:
        while pos < len(raw):
            tag, pos = varint(pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, pos = varint(pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, start = varint(pos)
                pos = start + size
                chunk = raw[start:pos]
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = f"{path}{field.name}"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = _bad_string_field(chunk, field.message_type, f"{name}.")
                    if inner:
                        return inner
            else:  # groups: not used by any Tandem message
                return None
    except IndexError:
        return None
    return None


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def run(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            message_type = getattr(deserialize, "__self__", None)
            descriptor = getattr(message_type, "DESCRIPTOR", None)
            field = _bad_string_field(raw, descriptor) if descriptor is not None else None
            if field:
                return Undecodable(f"{field} is not valid UTF-8 (string fields must be UTF-8; "
                                   "send binary data as token ids)")
            return Undecodable(f"the request does not parse: {exc}")

    return run


class RejectUndecodable(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answer a request that does not parse with INVALID_ARGUMENT naming the field.

    Without this, the generated deserializer raises DecodeError inside grpc, and the caller
    gets UNKNOWN. Here the deserializer hands on an `Undecodable`, and the handler aborts
    before the servicer sees it. Every Tandem handler is an async function or generator.
    """

    async def intercept_service(self, continuation: Callable[..., Any],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = _lenient(handler.request_deserializer)
        serialize = handler.response_serializer
        kind = (("stream" if handler.request_streaming else "unary") + "_"
                + ("stream" if handler.response_streaming else "unary"))
        behavior = _checked(getattr(handler, kind), handler.request_streaming)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(behavior, request_deserializer=deserialize, response_serializer=serialize)


async def _reject(item: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(item, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.reason)


def _checked(behavior: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """`behavior`, refusing an Undecodable request (or stream message) before it runs on it."""

    async def prepared(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not request_streaming:
            await _reject(request, context)
            return request

        async def messages() -> AsyncIterator[Any]:
            async for item in request:
                await _reject(item, context)
                yield item

        return messages()

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in behavior(await prepared(request, context), context):
                yield item

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await prepared(request, context), context)

    return unary


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
