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

`handle_errors` is the one place that turns domain exceptions into gRPC statuses.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import metrics
from tandem.errors import TandemError
from tandem.security import BearerTokenAuth, ServerTls, server_credentials

log = logging.getLogger(__name__)

# Generous message limits: prompts can be long; one place to change them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class Service(Protocol):
    """What the bootstrap needs from a service."""

    #: Fully qualified proto service name, e.g. "tandem.v1.DraftService".
    name: str

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register the gRPC handlers."""

    def load(self) -> None:
        """Blocking start-up work (loading weights). Runs in a worker thread."""


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    names: tuple[str, ...]
    # Plaintext, health-only server for probes (None: health is on the main port only).
    health_server: grpc.aio.Server | None = None
    health_port: int = -1

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
                       tls: ServerTls | None = None, auth_token: str | None = None,
                       health_port: int = -1) -> RunningServer:
    """Build, bind and start the server (not yet SERVING).

    tls: serve TLS (mutual TLS when it has a client CA) instead of plaintext.
    auth_token: require `authorization: Bearer <token>` on every call but health and reflection.
    health_port: also serve health alone, in plaintext, on this port (0 picks one; -1: none).
    """
    interceptors = [BearerTokenAuth(auth_token)] if auth_token else []
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
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
                            health_server=health_server, health_port=health_port)
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
                auth_token: str | None = None, health_port: int = -1) -> None:
    """Run until SIGTERM/SIGINT. Prints one line when listening and one when serving.

    metrics_port: serve Prometheus metrics on http://host:metrics_port/metrics (0 picks a
    free port; negative: no metrics endpoint). tls, auth_token, health_port: as in start_server.
    """
    running = await start_server(services, host, port, tls=tls, auth_token=auth_token,
                                 health_port=health_port)
    security = ("plaintext" if tls is None else "mutual TLS" if tls.mutual else "TLS") + \
        (", bearer token required" if auth_token else "")
    log.info("%s: %s", label, security)
    if running.health_server is not None:
        print(f"tandem {label} health (plaintext) on {host}:{running.health_port}", flush=True)
    # Machine-readable: `tandem up` and the tests read the port from this line.
    print(f"tandem {label} listening on {host}:{running.port}", flush=True)
    exporter = metrics.start_metrics_server(host, metrics_port) if metrics_port >= 0 else None
    if exporter is not None:
        print(f"tandem {label} metrics on http://{host}:{exporter.port}/metrics", flush=True)
    try:
        await _run_until_signal(services, label, host, running, grace_s)
    finally:
        if exporter is not None:
            exporter.stop()


async def _run_until_signal(services: list[Service], label: str, host: str,
                            running: RunningServer, grace_s: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load: asyncio.Future[Any] = asyncio.gather(*(asyncio.to_thread(s.load) for s in services))
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
    await running.health.enter_graceful_shutdown()
    await running.stop(grace_s)
    log.info("%s: stopped", label)


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


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
