"""Replica discovery with the real kubernetes client against an in-test Kubernetes API.

`FakeKubeAPI` speaks just enough of the API over real HTTP for EndpointSlices: list, and
watch (chunked JSON lines) with resourceVersions, bookmarks, 410 Gone after compaction,
and connections it can cut. Replicas are in-process gRPC servers on distinct loopback
addresses (127.0.0.2, .3, ...) sharing one port, as pods behind one Service do.
Every wait polls a condition with a timeout; nothing asserts on durations.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

import grpc
import pytest
from prometheus_client import REGISTRY
from tiny import make_tokenizer

from orchestrator import discovery
from orchestrator.domain import EMPTY_BLOCK, TargetScores
from orchestrator.remote import TARGET_STUB, ReplicaPool, TargetSession
from orchestrator.service import OrchestratorConfig, OrchestratorService
from tandem import models, sampling
from tandem.server import RunningServer, start_server
from tandem.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

NAMESPACE = "tandem"
TOKEN = "test-token"
WAIT_S = 20.0
FAST = discovery.WatchSettings(retry_s=0.05, max_retry_s=0.5)
DRAFT_TOKEN, BONUS_TOKEN = 4, 5  # ids in the tiny tokenizer, neither of them EOS


# --- a Kubernetes API for EndpointSlices ------------------------------------------------

Endpoint = tuple[str, bool, bool]  # ip, ready, terminating


class FakeKubeAPI:
    """List and watch of namespaced EndpointSlices over HTTP, with a history of versions."""

    PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.version = 100
        self.slices: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object)
        self.oldest = 0  # a watch from an older version gets 410 Gone
        self.generation = 0  # bumped to cut every open watch
        self.ended = 0  # bumped to end every open watch cleanly, as timeoutSeconds does
        self.requests: list[dict[str, str]] = []  # query of every request, plus its auth
        self.delivered = 0  # the newest version some watch has written to its socket
        self.failing_lists: list[int] = []  # statuses for the next list requests
        self.closing = False
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                query["auth"] = self.headers.get("Authorization", "")
                if query.get("watch", "").lower() != "true":
                    with api.cond:
                        api.requests.append(query)
                with api.cond:
                    failure = (api.failing_lists.pop(0) if api.failing_lists
                               and query.get("watch", "").lower() != "true" else None)
                if url.path != api.PATH:
                    self._send_json(404, {"kind": "Status", "code": 404, "message": url.path})
                elif failure is not None:
                    self._send_json(failure, {"kind": "Status", "apiVersion": "v1",
                                              "status": "Failure", "code": failure,
                                              "reason": "Forbidden", "message": "no"})
                elif query.get("watch", "").lower() == "true":
                    api.serve_watch(self, query)
                else:
                    self._send_json(200, api.listing(query.get("labelSelector", "")))

            def _send_json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # cut connections are the point of some tests

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # -- what tests do to the cluster

    def set_slice(self, name: str, service: str, port: int, endpoints: list[Endpoint]) -> None:
        with self.cond:
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.version += 1
            item = {
                "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"name": name, "namespace": NAMESPACE,
                             "resourceVersion": str(self.version),
                             "labels": {discovery.SERVICE_NAME_LABEL: service}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": [ip], "conditions": {
                    "ready": ready, "serving": not terminating or ready, "terminating": terminating}}
                    for ip, ready, terminating in endpoints],
                "ports": [{"name": "grpc", "port": port, "protocol": "TCP"},
                          {"name": "metrics", "port": 9090, "protocol": "TCP"}],
            }
            self.slices[name] = item
            self.history.append((self.version, kind, copy.deepcopy(item)))
            self.cond.notify_all()

    def delete_slice(self, name: str) -> None:
        with self.cond:
            item = self.slices.pop(name)
            self.version += 1
            self.history.append((self.version, "DELETED", copy.deepcopy(item)))
            self.cond.notify_all()

    def bookmark(self) -> int:
        """Other objects changed: the version moves on, and open watches are told."""
        with self.cond:
            self.version += 1
            self.history.append((self.version, "BOOKMARK", {
                "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)}}))
            self.cond.notify_all()
            return self.version

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream, as a restarting API server would."""
        with self.cond:
            self.generation += 1
            self.cond.notify_all()

    def end_watches(self) -> None:
        with self.cond:
            self.ended += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: resuming from any older version than now gets 410 Gone."""
        with self.cond:
            self.oldest = self.version

    def lists(self) -> list[dict[str, str]]:
        with self.cond:
            return [r for r in self.requests if r.get("watch", "").lower() != "true"]

    def watches(self) -> list[dict[str, str]]:
        with self.cond:
            return [r for r in self.requests if r.get("watch", "").lower() == "true"]

    # -- the wire format

    def listing(self, selector: str) -> dict[str, Any]:
        with self.cond:
            return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": [copy.deepcopy(s) for s in self.slices.values() if _selected(s, selector)]}

    def serve_watch(self, handler: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            handler.wfile.flush()

        selector = query.get("labelSelector", "")
        position = int(query.get("resourceVersion") or 0)
        with self.cond:
            # Recorded with the state it started in: a test that saw this watch open can cut it.
            self.requests.append(query)
            generation, ended = self.generation, self.ended
            if position < self.oldest:
                send({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {position}"}})
                handler.wfile.write(b"0\r\n\r\n")
                return
        def wake() -> bool:
            return (self.closing or self.generation != generation or self.ended != ended
                    or bool(self.history and self.history[-1][0] > position))

        while True:
            with self.cond:
                self.cond.wait_for(wake, timeout=0.1)
                if self.closing or self.generation != generation:
                    # No final chunk: the client sees the connection break mid-stream.
                    handler.close_connection = True
                    handler.connection.shutdown(socket.SHUT_RDWR)
                    return
                if self.ended != ended:
                    handler.wfile.write(b"0\r\n\r\n")
                    return
                events = [(v, t, o) for v, t, o in self.history if v > position]
            for version, kind, item in events:
                position = version
                if kind == "BOOKMARK" or _selected(item, selector):
                    send({"type": kind, "object": item})
            with self.cond:
                self.delivered = max(self.delivered, position)


def _selected(item: dict[str, Any], selector: str) -> bool:
    key, _, value = selector.partition("=")
    return not key or item.get("metadata", {}).get("labels", {}).get(key) == value


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(json.dumps({  # JSON is YAML: the client reads it as a kubeconfig
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                 "namespace": NAMESPACE}}],
    }))
    return path


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[FakeKubeAPI, Path]]:
    with FakeKubeAPI() as api:
        yield api, write_kubeconfig(tmp_path / "kubeconfig", api.url)


async def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.02)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- replicas ---------------------------------------------------------------------------

class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """Accepts every drafted token. Steps after a session's first wait while `hold` is clear."""

    name = "tandem.v1.TargetService"

    def __init__(self, info: common_pb2.ModelInfo) -> None:
        self.info = info
        self.sessions: list[str] = []
        self.parked = 0  # steps waiting on hold now
        self.hold = asyncio.Event()
        self.hold.set()

    def add_to(self, server: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, server)

    def load(self) -> None:
        pass

    async def ScoreBlocks(self, requests: AsyncIterator[target_pb2.ScoreBlocksRequest],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[target_pb2.ScoreBlocksResponse]:
        steps = 0
        async for request in requests:
            if steps == 0:
                self.sessions.append(request.session_id)
            drafted = list(request.draft_proposal.token_ids)
            held = request.cache_position + len(request.new_token_ids) + len(drafted)
            # A decode run is answered token by token, each a step of its own.
            for i in range(request.decode_run.max_tokens if request.HasField("decode_run") else 1):
                steps += 1
                if steps > 1 and not self.hold.is_set():
                    self.parked += 1
                    await self.hold.wait()
                    self.parked -= 1
                yield target_pb2.ScoreBlocksResponse(
                    block_scores=target_pb2.BlockScores(
                        target_probs=[1.0] * len(drafted), recovered_token_ids=drafted,
                        bonus_token_id=BONUS_TOKEN),
                    cache_length=held + i)

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.GetModelInfoResponse:
        return common_pb2.GetModelInfoResponse(info=self.info)


class FakeDraft(draft_pb2_grpc.DraftServiceServicer):
    """Always proposes DRAFT_TOKEN, with probability one."""

    name = "tandem.v1.DraftService"

    def __init__(self, info: common_pb2.ModelInfo) -> None:
        self.info = info

    def add_to(self, server: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self, server)

    def load(self) -> None:
        pass

    async def ProposeBlocks(self, requests: AsyncIterator[draft_pb2.ProposeBlocksRequest],
                            context: grpc.aio.ServicerContext) -> AsyncIterator[draft_pb2.ProposeBlocksResponse]:
        async for request in requests:
            k = request.num_speculative_tokens
            yield draft_pb2.ProposeBlocksResponse(
                token_ids=[DRAFT_TOKEN] * k,
                distributions=[common_pb2.SparseDistribution(token_ids=[DRAFT_TOKEN], probs=[1.0])] * k,
                cache_length=request.cache_position + len(request.new_token_ids) + max(k - 1, 0))

    async def GetModelInfo(self, request: common_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.GetModelInfoResponse:
        return common_pb2.GetModelInfoResponse(info=self.info)


class Replicas:
    """In-process replicas on 127.0.0.N, all on one port (pods behind one Service)."""

    def __init__(self) -> None:
        self.port = 0
        self.running: list[RunningServer] = []
        self._next_ip = 2

    async def start(self, service: Any) -> str:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        running = await start_server([service], ip, self.port)
        self.port = running.port
        await running.set_serving(True)
        self.running.append(running)
        return ip

    async def stop(self) -> None:
        for running in self.running:
            await running.server.stop(None)


def model_info(tokenizer_dir: Path, fingerprint: str | None = None) -> common_pb2.ModelInfo:
    tokenizer = models.load_tokenizer(str(tokenizer_dir))
    return common_pb2.ModelInfo(
        model=str(tokenizer_dir), vocab_size=len(tokenizer),
        tokenizer_fingerprint=fingerprint or models.tokenizer_fingerprint(tokenizer),
        max_context_tokens=512, eos_token_ids=[0], dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer().save_pretrained(path)
    return path


# --- the pure part ----------------------------------------------------------------------

def test_endpoints_merge_over_slices_with_the_api_defaults() -> None:
    from kubernetes import client

    def make(name: str, endpoints: list[dict[str, Any]], port_name: str = "grpc") -> Any:
        return client.V1EndpointSlice.from_dict({
            "addressType": "IPv4", "metadata": {"name": name},
            "ports": [{"name": port_name, "port": 50051}], "endpoints": endpoints})

    slices = discovery.SliceSet("grpc")
    slices.replace([
        make("a", [{"addresses": ["10.0.0.1"]},  # no conditions: ready, not terminating
                   {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                   {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}}]),
        # The same pod in a second slice, already terminating there: the cautious copy wins.
        make("b", [{"addresses": ["10.0.0.1"], "conditions": {"ready": False, "terminating": True}}]),
        make("c", [{"addresses": ["10.0.0.9"]}], port_name="metrics"),  # no gRPC port: ignored
    ])
    found = slices.endpoints()
    assert set(found) == {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"}
    assert [a for a, e in sorted(found.items()) if e.routable] == []
    slices.apply("DELETED", make("b", []))
    assert [a for a, e in sorted(slices.endpoints().items()) if e.routable] == ["10.0.0.1:50051"]
    ipv6 = client.V1EndpointSlice.from_dict({
        "addressType": "IPv6", "metadata": {"name": "v6"}, "ports": [{"name": "grpc", "port": 1}],
        "endpoints": [{"addresses": ["fd00::1"]}]})
    assert [e.address for e in discovery.slice_endpoints(ipv6, "grpc")] == ["[fd00::1]:1"]


# --- ServiceDiscovery against the API ---------------------------------------------------

class Admissions:
    """An admit callback that lets everyone in, and remembers whom."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, address: str) -> None:
        self.seen.append(address)


async def _discovery(kubeconfig: Path, pool: ReplicaPool,
                     admit: Callable[[str], Any] | None = None) -> discovery.ServiceDiscovery:
    api = discovery.connect(str(kubeconfig))
    watched = discovery.ServiceDiscovery(api, NAMESPACE, "tandem-target", "grpc", pool, "target",
                                         admit or Admissions(), settings=FAST,
                                         retry_rejected_s=0.2)
    watched.start()
    assert await watched.wait_synced(WAIT_S)
    return watched


def _routable(pool: ReplicaPool) -> set[str]:
    return {r.address for r in pool.replicas if not r.terminating}


def test_replicas_appear_turn_terminating_and_vanish(kube: tuple[FakeKubeAPI, Path]) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        admissions = Admissions()
        api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False),
                                                      ("10.0.0.2", False, False)])
        api.set_slice("d-1", "tandem-draft", 50051, [("10.0.9.9", True, False)])  # other Service
        watched = await _discovery(kubeconfig, pool, admissions)
        try:
            assert _routable(pool) == {"10.0.0.1:50051"}  # synced means the first listing is in
            assert all(r["auth"] == f"Bearer {TOKEN}" for r in api.requests)  # the kubeconfig's
            assert api.lists()[0]["labelSelector"] == "kubernetes.io/service-name=tandem-target"

            api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False),
                                                          ("10.0.0.2", True, False)])
            await eventually(lambda: _routable(pool) == {"10.0.0.1:50051", "10.0.0.2:50051"},
                             "the second replica is ready")
            assert sorted(admissions.seen) == ["10.0.0.1:50051", "10.0.0.2:50051"]
            assert sample("tandem_replicas", pool="target", state="routable") == 2

            api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", False, True),
                                                          ("10.0.0.2", True, False)])
            await eventually(lambda: _routable(pool) == {"10.0.0.2:50051"}, "10.0.0.1 terminates")
            assert pool.get("10.0.0.1:50051") is not None  # still there for its sessions
            assert {pool.acquire().address for _ in range(3)} == {"10.0.0.2:50051"}
            assert sample("tandem_replicas", pool="target", state="terminating") == 1

            api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.2", True, False)])
            await eventually(lambda: pool.get("10.0.0.1:50051") is None, "10.0.0.1 is removed")
            api.delete_slice("t-1")
            await eventually(lambda: not pool.replicas, "the Service has no endpoints left")
            assert not api.lists()[1:], "every change came through the watch, without relisting"
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


def test_a_refused_replica_is_checked_again_later(kube: tuple[FakeKubeAPI, Path]) -> None:
    api, kubeconfig = kube
    attempts: list[str] = []

    async def flaky(address: str) -> None:
        attempts.append(address)
        if len(attempts) == 1:
            raise discovery.ReplicaRejected("GetModelInfo timed out")

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False)])
        watched = await _discovery(kubeconfig, pool, flaky)
        try:
            assert not pool.replicas, "refused at first"
            await eventually(lambda: _routable(pool) == {"10.0.0.1:50051"}, "admitted on retry")
            assert attempts == ["10.0.0.1:50051"] * 2
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


def test_a_dropped_watch_resumes_where_it_stopped(kube: tuple[FakeKubeAPI, Path]) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False)])
        watched = await _discovery(kubeconfig, pool)
        before = sample("tandem_discovery_restarts_total", service="tandem-target", reason="disconnect")
        try:
            await eventually(lambda: len(api.watches()) == 1, "the watch is open")
            seen = api.bookmark()
            # Written before the cut, so read before it: TCP keeps the order.
            await eventually(lambda: api.delivered >= seen, "the bookmark is on the wire")
            with api.cond:  # cut the watch and change the Service while it is down
                api.drop_watches()
                api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False),
                                                              ("10.0.0.3", True, False)])
            await eventually(lambda: "10.0.0.3:50051" in _routable(pool), "the change arrives")
            assert len(api.lists()) == 1, "resumed the watch instead of relisting"
            assert int(api.watches()[-1]["resourceVersion"]) == seen, "from the bookmark"
            assert sample("tandem_discovery_restarts_total", service="tandem-target",
                          reason="disconnect") == before + 1
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


def test_api_errors_are_retried_with_a_hint(kube: tuple[FakeKubeAPI, Path],
                                             caplog: pytest.LogCaptureFixture) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False)])
        api.failing_lists = [403, 503]
        before = sample("tandem_discovery_restarts_total", service="tandem-target", reason="error")
        watched = await _discovery(kubeconfig, pool)
        try:
            assert _routable(pool) == {"10.0.0.1:50051"}
            assert len(api.lists()) == 3
            assert sample("tandem_discovery_restarts_total", service="tandem-target",
                          reason="error") == before + 2
            assert "needs list and watch on endpointslices" in caplog.text
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


def test_a_watch_the_server_ends_resumes_at_once(kube: tuple[FakeKubeAPI, Path]) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        watched = await _discovery(kubeconfig, pool)
        restarts = sum(sample("tandem_discovery_restarts_total", service="tandem-target", reason=r)
                       for r in ("disconnect", "gone", "error"))
        try:
            await eventually(lambda: len(api.watches()) == 1, "the watch is open")
            api.end_watches()
            await eventually(lambda: len(api.watches()) == 2, "the watch is renewed")
            api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False)])
            await eventually(lambda: _routable(pool) == {"10.0.0.1:50051"}, "the change arrives")
            assert len(api.lists()) == 1
            assert sum(sample("tandem_discovery_restarts_total", service="tandem-target", reason=r)
                       for r in ("disconnect", "gone", "error")) == restarts, "an ordinary renewal"
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


def test_410_gone_relists_and_catches_up(kube: tuple[FakeKubeAPI, Path]) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        pool = ReplicaPool([], TARGET_STUB)
        api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.1", True, False),
                                                      ("10.0.0.2", True, False)])
        watched = await _discovery(kubeconfig, pool)
        before = sample("tandem_discovery_restarts_total", service="tandem-target", reason="gone")
        try:
            await eventually(lambda: len(api.watches()) == 1, "the watch is open")
            with api.cond:  # while the watch is down, the history it needs is compacted away
                api.drop_watches()
                api.set_slice("t-1", "tandem-target", 50051, [("10.0.0.2", True, False)])
                api.set_slice("t-2", "tandem-target", 50051, [("10.0.0.4", True, False)])
                api.compact()
            await eventually(lambda: _routable(pool) == {"10.0.0.2:50051", "10.0.0.4:50051"},
                             "the relist shows the new endpoints")
            assert pool.get("10.0.0.1:50051") is None, "its deletion was only visible by relisting"
            assert len(api.lists()) == 2
            assert sample("tandem_discovery_restarts_total", service="tandem-target",
                          reason="gone") == before + 1
            api.set_slice("t-2", "tandem-target", 50051, [("10.0.0.5", True, False)])
            await eventually(lambda: _routable(pool) == {"10.0.0.2:50051", "10.0.0.5:50051"},
                             "the watch from the new listing delivers changes")
            assert len(api.lists()) == 2, "one relist, then watching again"
        finally:
            await watched.close()
            await pool.close()

    asyncio.run(scenario())


# --- the orchestrator, discovering real gRPC replicas -----------------------------------

def test_terminating_replica_finishes_its_session_while_new_ones_go_elsewhere(
        kube: tuple[FakeKubeAPI, Path], tokenizer_dir: Path) -> None:
    api, kubeconfig = kube

    async def scenario() -> None:
        info = model_info(tokenizer_dir)
        targets = [FakeTarget(info), FakeTarget(info)]
        replicas, draft_replicas = Replicas(), Replicas()
        draft_replicas._next_ip = 20
        target_ips = [await replicas.start(t) for t in targets]
        draft_ip = await draft_replicas.start(FakeDraft(info))
        api.set_slice("t-1", "tandem-target", replicas.port, [(ip, True, False) for ip in target_ips])
        api.set_slice("d-1", "tandem-draft", draft_replicas.port, [(draft_ip, True, False)])
        service = OrchestratorService(OrchestratorConfig(
            target_service_name="tandem-target", draft_service_name="tandem-draft",
            namespace=NAMESPACE, kubeconfig=str(kubeconfig), tokenizer=str(tokenizer_dir),
            replica_wait_s=WAIT_S, port=0))
        orchestrator: RunningServer | None = None
        try:
            await asyncio.to_thread(service.load)
            orchestrator = await start_server([service], "127.0.0.1", 0)
            await orchestrator.set_serving(True)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
                stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

                def generate() -> Any:
                    return stub.GenerateUnary(orchestrator_pb2.GenerateUnaryRequest(
                        prompt="abc", max_new_tokens=20, ignore_eos=True,
                        num_speculative_tokens=3), timeout=WAIT_S)

                for target in targets:
                    target.hold.clear()
                first = asyncio.ensure_future(generate())
                await eventually(lambda: any(t.parked for t in targets), "a session is mid-way")
                busy = next(i for i, t in enumerate(targets) if t.parked)
                idle = 1 - busy
                busy_address = f"{target_ips[busy]}:{replicas.port}"

                api.set_slice("t-1", "tandem-target", replicas.port, [
                    (target_ips[busy], False, True), (target_ips[idle], True, False)])
                await eventually(lambda: service.engine.targets is not None
                                 and busy_address not in _routable(service.engine.targets),
                                 "the orchestrator sees the replica terminating")
                targets[idle].hold.set()
                second = await generate()
                assert len(second.token_ids) == 20
                assert len(targets[idle].sessions) == 1, "the new session went to the ready replica"
                assert len(targets[busy].sessions) == 1, "and not to the terminating one"
                assert not first.done()

                targets[busy].hold.set()
                reply = await first
                assert len(reply.token_ids) == 20, "the in-flight session ran to its end"
                assert reply.finish_reason == orchestrator_pb2.FINISH_REASON_LENGTH
                assert reply.usage.accepted_tokens == reply.usage.drafted_tokens > 0

                api.set_slice("t-1", "tandem-target", replicas.port, [(target_ips[idle], True, False)])
                await eventually(lambda: service.engine.targets is not None
                                 and service.engine.targets.get(busy_address) is None, "it is removed")

                # A replica whose model cannot pair with the target is never routed to.
                rejected = sample("tandem_replicas_rejected_total", service="tandem-target")
                stranger_ip = await replicas.start(FakeTarget(model_info(tokenizer_dir, "x" * 64)))
                api.set_slice("t-1", "tandem-target", replicas.port, [
                    (target_ips[idle], True, False), (stranger_ip, True, False)])
                await eventually(lambda: sample("tandem_replicas_rejected_total",
                                                service="tandem-target") == rejected + 1,
                                 "the stranger is refused")
                assert service.engine.targets is not None
                assert _routable(service.engine.targets) == {f"{target_ips[idle]}:{replicas.port}"}

                # With every draft draining, requests go on without one (exact, just slower).
                draftless = sample("tandem_draftless_requests_total")
                api.set_slice("d-1", "tandem-draft", draft_replicas.port, [(draft_ip, False, True)])
                await eventually(lambda: service.engine.drafts is not None and not service.engine.drafts.ready,
                                 "the only draft is draining")
                alone = await generate()
                assert len(alone.token_ids) == 20 and alone.usage.drafted_tokens == 0
                assert sample("tandem_draftless_requests_total") == draftless + 1
                assert sample("tandem_requests_total", method="GenerateUnary", code="OK") >= 3
        finally:
            await service.close()
            if orchestrator is not None:
                await orchestrator.server.stop(None)
            await replicas.stop()
            await draft_replicas.stop()

    asyncio.run(scenario())


# --- without discovery ------------------------------------------------------------------

def test_static_addresses_and_dns_names_still_work(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        replicas = Replicas()
        replicas._next_ip = 1
        ip = await replicas.start(FakeTarget(model_info(tokenizer_dir)))
        pool = ReplicaPool([f"{ip}:{replicas.port}", f"dns:///{ip}:{replicas.port}"], TARGET_STUB)
        try:
            deadline = asyncio.get_running_loop().time() + WAIT_S
            sessions = [TargetSession(pool, f"s{i}", deadline) for i in range(2)]
            params = sampling.SamplingParams(temperature=0.0)
            for session in sessions:  # least-loaded: one session on each replica
                scores = await session.score([7, 8, 9], EMPTY_BLOCK, params, seed=1)
                assert isinstance(scores, TargetScores)
                assert scores.scored.bonus_token_id == BONUS_TOKEN
            assert sorted(r.active_sessions for r in pool.replicas) == [1, 1]
            for session in sessions:
                await session.close()
            assert [r.active_sessions for r in pool.replicas] == [0, 0]
        finally:
            await pool.close()
            await replicas.stop()

    asyncio.run(scenario())


def test_config_needs_exactly_one_way_to_find_targets() -> None:
    with pytest.raises(ValueError, match="exactly one of --target"):
        OrchestratorService(OrchestratorConfig())
    with pytest.raises(ValueError, match="exactly one of --target"):
        OrchestratorService(OrchestratorConfig(target="a:1", target_service_name="t"))
    with pytest.raises(ValueError, match="at most one of --draft"):
        OrchestratorService(OrchestratorConfig(target="a:1", draft="b:1", draft_service_name="d"))
    OrchestratorService(OrchestratorConfig(target_service_name="t", draft_service_name="d"))


def test_removed_replica_closes_only_after_its_last_session() -> None:
    async def scenario() -> None:
        pool = ReplicaPool(["10.0.0.1:1", "10.0.0.2:1"], TARGET_STUB)
        held = pool.acquire()
        pool.remove(held.address)
        assert pool.get(held.address) is None and held.removed
        assert held.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN
        assert pool.acquire().address != held.address
        pool.release(held)
        await eventually(lambda: held.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN,
                         "the idle removed replica's channel is closed")
        await pool.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("fields, needle", [
    ({"max_speculative_tokens": 65}, "--max-speculative-tokens 65 exceeds the 64 tokens"),
    ({"num_speculative_tokens": 20}, "--num-speculative-tokens 20 must be in [0, --max-speculative-tokens 16]"),
    ({"num_speculative_tokens": -1}, "--num-speculative-tokens -1 must be in [0,"),
    # Settings that would refuse, or silently degrade, every request that leaves them unset.
    ({"max_new_tokens_cap": 100}, "--default-max-new-tokens 256 must be in [1, --max-new-tokens-cap 100]"),
    ({"default_max_new_tokens": 0}, "--default-max-new-tokens 0 must be in [1,"),
    ({"max_support_size": 0}, "--max-support-size 0 must be in [1, 1024]"),
    ({"max_support_size": 1025}, "--max-support-size 1025 must be in [1, 1024]"),
    ({"proposer": "draft-model"}, "--proposer draft-model needs draft replicas (--draft or --draft-service-name)"),
])
def test_config_keeps_k_within_what_the_services_score(fields: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError) as err:
        OrchestratorService(OrchestratorConfig(target="a:1", **fields))
    assert needle in str(err.value)
