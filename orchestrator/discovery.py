"""Live replica discovery: follow the EndpointSlices of the draft and target Services.

Kubernetes publishes the pods behind a Service as EndpointSlices labelled
`kubernetes.io/service-name=<service>`; each endpoint carries the conditions `ready` and
`terminating`. The orchestrator lists them, then watches for changes, and keeps each
`ReplicaPool` in step:

- an endpoint that is ready and not terminating becomes a replica, once its model info
  passes the same compatibility check as static replicas at start-up (`admit`);
- one that turns terminating or unready takes no new sessions; in-flight ones finish
  (the pod's preStop sleep and gRPC drain give them the time);
- one that disappears is removed; its channel closes when its last session ends;
- a watch that ends or breaks resumes from the last resourceVersion it saw; a 410 Gone
  (that version was compacted away) relists, so changes missed meanwhile are not lost.

The kubernetes client is synchronous (urllib3), so each watch blocks on its own daemon
thread and hands whole snapshots to the event loop, where every pool change happens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from orchestrator.remote import ReplicaPool
from tandem import metrics

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
HTTP_GONE = 410


class DiscoveryError(Exception):
    """Discovery cannot start: no cluster credentials, or no ready replica in time."""


class ReplicaRejected(Exception):
    """A discovered replica is not routed to: unreachable, or its model cannot pair with the
    target. `admit` callbacks raise it; anything else they raise is a bug and propagates."""


@dataclass(frozen=True)
class Endpoint:
    """One pod behind a Service, as its EndpointSlices describe it."""

    address: str  # host:port, ready for grpc.aio.insecure_channel
    ready: bool
    terminating: bool

    @property
    def routable(self) -> bool:
        return self.ready and not self.terminating


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def slice_endpoints(item: Any, port_name: str) -> list[Endpoint]:
    """The endpoints of one V1EndpointSlice on the port called `port_name`."""
    if item.address_type not in ("IPv4", "IPv6"):
        return []  # FQDN slices are not produced for pods and have no defined semantics
    port = next((p.port for p in item.ports or () if p.name == port_name and p.port), None)
    if port is None:
        return []  # the slice controller publishes ports with the endpoints; none yet
    found = []
    for endpoint in item.endpoints or ():
        conditions = endpoint.conditions
        # The API defines a missing `ready` as true and a missing `terminating` as false.
        ready = conditions is None or conditions.ready is None or bool(conditions.ready)
        terminating = conditions is not None and bool(conditions.terminating)
        # The controller writes exactly one address per pod; further ones have no meaning.
        found.append(Endpoint(_address(endpoint.addresses[0], port), ready, terminating))
    return found


class SliceSet:
    """The endpoints of one Service, merged over its EndpointSlices."""

    def __init__(self, port_name: str) -> None:
        self.port_name = port_name
        self._slices: dict[str, list[Endpoint]] = {}

    def replace(self, items: Iterable[Any]) -> None:
        """Start over from a full listing."""
        self._slices = {item.metadata.name: slice_endpoints(item, self.port_name) for item in items}

    def apply(self, event_type: str, item: Any) -> None:
        if event_type == "DELETED":
            self._slices.pop(item.metadata.name, None)
        else:  # ADDED or MODIFIED
            self._slices[item.metadata.name] = slice_endpoints(item, self.port_name)

    def endpoints(self) -> dict[str, Endpoint]:
        # A pod can sit in two slices while the controller rebalances them. Terminating never
        # reverts, so the cautious merge (routable only if every copy says so) is the right one.
        merged: dict[str, Endpoint] = {}
        for found in self._slices.values():
            for endpoint in found:
                seen = merged.get(endpoint.address)
                if seen is not None:
                    endpoint = Endpoint(endpoint.address, seen.ready and endpoint.ready,
                                        seen.terminating or endpoint.terminating)
                merged[endpoint.address] = endpoint
        return merged


@dataclass(frozen=True)
class WatchSettings:
    watch_timeout_s: int = 300  # the API server ends each watch then; it resumes at once
    connect_timeout_s: float = 10.0
    retry_s: float = 0.5  # first pause after a failure, doubled up to max_retry_s
    max_retry_s: float = 30.0


class EndpointSliceWatcher:
    """List, then watch, one Service's EndpointSlices; call `on_change` with every new snapshot.

    `run` blocks (run it on a thread) until `stop`; `on_change` is called on that thread.
    """

    def __init__(self, api: client.DiscoveryV1Api, namespace: str, service: str, port_name: str,
                 on_change: Callable[[dict[str, Endpoint]], None],
                 settings: WatchSettings = WatchSettings()) -> None:
        self.api = api
        self.namespace = namespace
        self.service = service
        self.on_change = on_change
        self.settings = settings
        self.slices = SliceSet(port_name)
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._stopped = threading.Event()
        self._response: Any = None  # the open watch's HTTP response, for stop() to cut
        # Where to resume: the newest resourceVersion applied, from the listing, an event or a
        # bookmark. None: (re)list first.
        self._resource_version: str | None = None

    def stop(self) -> None:
        self._stopped.set()
        _cut(self._response)

    def run(self) -> None:
        delay = self.settings.retry_s
        gone_again = False  # a 410 right after relisting backs off instead of spinning
        while not self._stopped.is_set():
            try:
                if self._resource_version is None:
                    self._list()
                self._watch_from()
                delay, gone_again = self.settings.retry_s, False
                continue
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    log.info("%s: resourceVersion %s expired (410 Gone); relisting",
                             self.service, self._resource_version)
                    self._restarted("gone")
                    self._resource_version = None
                    if not gone_again:  # relist at once; a second 410 in a row backs off
                        gone_again = True
                        continue
                else:
                    hint = (" (RBAC: the orchestrator needs list and watch on endpointslices)"
                            if exc.status in (401, 403) else "")
                    log.warning("%s: EndpointSlice API error %s %s%s; relisting in %.1fs",
                                self.service, exc.status, exc.reason, hint, delay)
                    self._restarted("error")
                    self._resource_version = None
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if self._stopped.is_set():
                    break
                # A dropped connection loses nothing: the watch resumes where it stopped,
                # and if that point has been compacted meanwhile the resume gets a 410.
                log.warning("%s: EndpointSlice watch disconnected (%s); resuming in %.1fs",
                            self.service, exc, delay)
                self._restarted("disconnect")
            except Exception:
                log.exception("%s: unexpected failure of the EndpointSlice watch; relisting in "
                              "%.1fs", self.service, delay)
                self._restarted("error")
                self._resource_version = None
            self._stopped.wait(delay)
            delay = min(2 * delay, self.settings.max_retry_s)

    def _restarted(self, reason: str) -> None:
        metrics.DISCOVERY_RESTARTS.labels(self.service, reason).inc()

    def _list(self) -> None:
        listing = self.api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector,
            _request_timeout=(self.settings.connect_timeout_s, self.settings.watch_timeout_s))
        self.slices.replace(listing.items)
        self.on_change(self.slices.endpoints())
        assert listing.metadata is not None  # the API server always sets list metadata
        self._resource_version = str(listing.metadata.resource_version)

    def _open(self, *args: Any, **kwargs: Any) -> Any:
        """Send the watch request, keeping its response so that stop() can cut it."""
        response = self.api.list_namespaced_endpoint_slice(*args, **kwargs)
        self._response = response
        if self._stopped.is_set():  # stop() ran while the request was on its way
            _cut(response)
        return response

    def _watch_from(self) -> None:
        """Follow changes after the current resourceVersion until the watch ends or breaks."""
        if self._stopped.is_set():
            return
        stream = watch.Watch(return_type=client.V1EndpointSlice)  # type: ignore[no-untyped-call]
        # timeout_seconds makes the client return when the server ends the watch, instead of
        # retrying by itself, so resuming and relisting are decided here. The read timeout
        # outlasts it, so a silent half-open connection is noticed too.
        events = stream.stream(  # type: ignore[no-untyped-call]
            self._open, self.namespace,
            label_selector=self._selector, resource_version=self._resource_version,
            allow_watch_bookmarks=True, timeout_seconds=self.settings.watch_timeout_s,
            _request_timeout=(self.settings.connect_timeout_s,
                              self.settings.watch_timeout_s + 30))
        for event in events:
            if self._stopped.is_set():
                break
            if not isinstance(event, dict):
                continue  # a line that was not JSON
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self.slices.apply(event["type"], event["object"])
                self.on_change(self.slices.endpoints())
            # The client records each event's (and each BOOKMARK's) resourceVersion.
            self._resource_version = stream.resource_version or self._resource_version


def _cut(response: Any) -> None:
    """Shut down a streaming response's socket, so a read blocked on it returns at once."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


class ServiceDiscovery:
    """Keeps one ReplicaPool in step with one Service's endpoints. Lives on the event loop."""

    def __init__(self, api: client.DiscoveryV1Api, namespace: str, service: str, port_name: str,
                 pool: ReplicaPool, pool_label: str, admit: Callable[[str], Awaitable[None]],
                 settings: WatchSettings = WatchSettings(), retry_rejected_s: float = 60.0) -> None:
        self.service = service
        self.pool = pool
        self.pool_label = pool_label
        self.admit = admit
        self.retry_rejected_s = retry_rejected_s
        self._api_args = (api, namespace, service, port_name)
        self._settings = settings
        self._latest: dict[str, Endpoint] = {}
        self._admitting: dict[str, asyncio.Task[None]] = {}
        # Refused replicas are checked again after retry_rejected_s (a failure may have been
        # passing), or at once when they turn unready and ready again (a restart).
        self._rejected: set[str] = set()
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._synced = asyncio.Event()
        self._first_admissions: asyncio.Task[Any] | None = None
        self._watcher: EndpointSliceWatcher | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()

        def post(found: dict[str, Endpoint]) -> None:
            try:
                loop.call_soon_threadsafe(self._update, found)
            except RuntimeError:  # the loop has closed without close(): nobody is listening
                watcher.stop()

        watcher = self._watcher = EndpointSliceWatcher(*self._api_args, on_change=post,
                                                       settings=self._settings)
        self._thread = threading.Thread(target=self._watcher.run, daemon=True,
                                        name=f"watch-{self.service}")
        self._thread.start()

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the first listing is applied and its replicas admitted (or refused)."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        for task in self._admitting.values():
            task.cancel()
        for retry in self._retries.values():
            retry.cancel()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def _update(self, found: dict[str, Endpoint]) -> None:
        self._latest = found
        for address, endpoint in found.items():
            if not endpoint.routable:
                self.pool.mark_terminating(address)
                self._rejected.discard(address)
            elif self.pool.get(address) is not None:
                self.pool.add(address)  # e.g. ready again after a failed readiness probe
            elif address not in self._admitting and address not in self._rejected:
                self._admitting[address] = asyncio.get_running_loop().create_task(
                    self._admit(address))
        for replica in list(self.pool.replicas):
            if replica.address not in found:
                log.info("%s: replica %s is gone", self.service, replica.address)
                self.pool.remove(replica.address)
        self._rejected &= found.keys()
        self._publish()
        if self._first_admissions is None:
            # The first snapshot is the listing: synced once its admissions are decided.
            pending = list(self._admitting.values())
            self._first_admissions = asyncio.get_running_loop().create_task(
                asyncio.wait(pending) if pending else asyncio.sleep(0))
            self._first_admissions.add_done_callback(lambda _: self._synced.set())

    async def _admit(self, address: str) -> None:
        try:
            await self.admit(address)
        except ReplicaRejected as exc:
            log.error("%s: not routing to %s (checking again in %.0fs): %s", self.service,
                      address, self.retry_rejected_s, exc)
            metrics.REPLICAS_REJECTED.labels(self.service).inc()
            self._rejected.add(address)
            earlier = self._retries.pop(address, None)
            if earlier is not None:
                earlier.cancel()
            self._retries[address] = asyncio.get_running_loop().call_later(
                self.retry_rejected_s, self._retry, address)
            return
        finally:
            self._admitting.pop(address, None)
        latest = self._latest.get(address)
        if latest is not None and latest.routable:  # it may have changed while being checked
            log.info("%s: replica %s is ready", self.service, address)
            self.pool.add(address)
            self._publish()

    def _retry(self, address: str) -> None:
        self._retries.pop(address, None)
        self._rejected.discard(address)
        self._update(self._latest)

    def _publish(self) -> None:
        terminating = sum(r.terminating for r in self.pool.replicas)
        metrics.set_replicas(self.pool_label, len(self.pool.replicas) - terminating, terminating)


def connect(kubeconfig: str = "") -> client.DiscoveryV1Api:
    """A client for the cluster: the kubeconfig file if given, else the pod's service account,
    else the default kubeconfig ($KUBECONFIG or ~/.kube/config), for runs outside a cluster."""
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration, persist_config=False)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration)
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration, persist_config=False)
    except (config.ConfigException, OSError) as exc:
        raise DiscoveryError(
            f"cannot reach the Kubernetes API for replica discovery ({exc}); run in a cluster "
            "with a service account, or pass --kubeconfig") from exc
    return client.DiscoveryV1Api(client.ApiClient(configuration))


def default_namespace() -> str:
    """The pod's own namespace, or "default" outside a cluster."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def list_endpoints(api: client.DiscoveryV1Api, namespace: str, service: str,
                   port_name: str) -> Mapping[str, Endpoint]:
    """One listing, without watching."""
    slices = SliceSet(port_name)
    try:
        listing = api.list_namespaced_endpoint_slice(
            namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}", _request_timeout=(10, 30))
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise DiscoveryError(f"cannot list the EndpointSlices of {namespace}/{service}: "
                             f"{exc}") from exc
    slices.replace(listing.items)
    return slices.endpoints()


async def first_ready(api: client.DiscoveryV1Api, namespace: str, service: str, port_name: str,
                      wait_s: float, poll_s: float = 2.0) -> str:
    """Start-up: the address of a ready endpoint of `service`, waiting up to wait_s for one."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            found = await asyncio.to_thread(list_endpoints, api, namespace, service, port_name)
            ready = sorted(a for a, e in found.items() if e.routable)
            if ready:
                return ready[0]
            problem = "no endpoint is ready yet"
        except DiscoveryError as exc:  # e.g. the API server restarting: retried until the deadline
            problem = str(exc)
        if asyncio.get_running_loop().time() > deadline:
            raise DiscoveryError(f"no ready replica behind Service {namespace}/{service} within "
                                 f"{wait_s:.0f}s: {problem}")
        log.info("waiting for a ready replica behind %s/%s: %s", namespace, service, problem)
        await asyncio.sleep(poll_s)
