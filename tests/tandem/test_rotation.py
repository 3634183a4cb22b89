"""Certificates rotate while serving: every service reads its TLS files again when they change.

A real stack on tiny models with mutual TLS between the orchestrator and the replicas and TLS on
the public API, all from files in one directory, replaced the way a Kubernetes Secret volume
replaces them (a new file renamed over the old). Under a steady load of streaming requests the
CA is rotated the way cert-manager's trust-manager does it: the new CA joins the bundle, every
leaf certificate is reissued by it, the old CA leaves the bundle. No request may fail, and
afterwards every new connection needs the new CA: certificates of the old one are refused.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import Authority, Pair, issue, make_ca
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import security
from tandem.client import TandemClient
from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.slow  # a stack of real processes under load

PROMPT = "def fib(n):"
LENGTH = 24
CLIENTS = 4


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to `path` as a Secret volume does: whole, under another name, then renamed."""
    fresh = path.with_name(f".{path.name}.new")
    fresh.write_bytes(data)
    os.replace(fresh, path)


class Live:
    """The files the services read: one CA bundle, the server's pair, the orchestrator's pair."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.bundle, self.server, self.client = (directory / "ca.crt", Pair(directory / "tls.crt",
                                                 directory / "tls.key"),
                                                 Pair(directory / "client.crt", directory / "client.key"))

    def trust(self, *cas: Authority) -> None:
        _replace(self.bundle, b"".join(ca.path.read_bytes() for ca in cas))

    def install(self, ca: Authority, name: str) -> None:
        """Leaf certificates issued by `ca`, the key before the certificate (a reader between the
        two sees a key that does not match its certificate, and keeps the old pair)."""
        server = issue(ca, self.dir / "issued", f"{name}-server", server=True)
        client = issue(ca, self.dir / "issued", f"{name}-client", server=False)
        for new, live in ((server, self.server), (client, self.client)):
            _replace(live.key, new.key.read_bytes())
            _replace(live.cert, new.cert.read_bytes())


def _tls(ca: Authority, pair: Pair | None) -> security.ClientTls:
    return security.ClientTls(root_ca=ca.path.read_bytes(),
                              cert_chain=pair.cert.read_bytes() if pair else None,
                              private_key=pair.key.read_bytes() if pair else None)


def _describe(address: str, tls: security.ClientTls) -> grpc.StatusCode:
    """The status of one call on a fresh connection."""
    with security.channel(address, tls) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture()
def rotating(tmp_path: Path, tiny_draft: Path, tiny_target: Path) -> Iterator[tuple[Stack, Live, Authority]]:
    (tmp_path / "issued").mkdir()
    old = make_ca(tmp_path, "old-ca")
    live = Live(tmp_path)
    live.trust(old)
    live.install(old, "old")
    serve = ["--tls-cert", str(live.server.cert), "--tls-key", str(live.server.key)]
    replica = [*serve, "--tls-client-ca", str(live.bundle)]
    orchestrator = [*serve, "--upstream-tls-ca", str(live.bundle), "--upstream-tls-cert",
                    str(live.client.cert), "--upstream-tls-key", str(live.client.key)]
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=replica, target_args=replica,
                        orchestrator_args=orchestrator, tls=_tls(old, live.client))
    yield stack, live, old
    stack.stop()


class Load:
    """CLIENTS streaming clients, each on a channel of its own, sending requests until stopped;
    every new request opens sessions on the replicas, so each meets whatever TLS files are in
    place. The clients trust both CAs: this is the rotation of the servers' side."""

    def __init__(self, address: str, tls: security.ClientTls) -> None:
        self.address, self.tls = address, tls
        self.done: list[list[int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self) -> None:
        async with security.aio_channel(self.address, self.tls) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while not self.stop.is_set():
                request = orchestrator_pb2.GenerateRequest(
                    prompt=PROMPT, max_new_tokens=LENGTH, ignore_eos=True,
                    sampling=common_pb2.SamplingParams(temperature=0.0))
                tokens: list[int] = []
                try:
                    async for message in stub.Generate(request, timeout=120):
                        tokens.extend(message.delta.token_ids)
                except grpc.aio.AioRpcError as exc:
                    self.errors.append(f"{exc.code().name}: {exc.details()}")
                    continue
                self.done.append(tokens)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(CLIENTS)))

    def wait_for(self, requests: int, timeout: float = 120.0) -> None:
        """Until `requests` more have finished (some of them begun before this was called)."""
        target = len(self.done) + requests
        stopped = threading.Event()
        while len(self.done) < target and not stopped.wait(0.05):
            timeout -= 0.05
            assert timeout > 0, f"the load stalled: {self.errors[-3:]}"
            assert not self.errors, self.errors


def test_certificates_and_the_ca_rotate_under_load_without_an_error(
        rotating: tuple[Stack, Live, Authority], tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    stack, live, old = rotating
    new = make_ca(tmp_path, "new-ca")
    both = security.ClientTls(root_ca=old.path.read_bytes() + new.path.read_bytes())
    load = Load(stack.address, both)
    load.thread.start()
    try:
        load.wait_for(2 * CLIENTS)
        live.trust(old, new)  # 1. the new CA joins every bundle
        load.wait_for(2 * CLIENTS)
        live.install(new, "new")  # 2. every certificate reissued by it
        load.wait_for(2 * CLIENTS)
        live.trust(new)  # 3. the old CA leaves
        load.wait_for(3 * CLIENTS)
    finally:
        load.stop.set()
        load.thread.join(timeout=120)
    assert not load.thread.is_alive()
    assert load.errors == []
    expected = reference(PROMPT, LENGTH)
    assert len(load.done) >= 9 * CLIENTS and all(tokens == expected for tokens in load.done)

    old_client = issue(old, tmp_path / "issued", "late-old-client", server=False)
    new_client = issue(new, tmp_path / "issued", "late-new-client", server=False)
    for replica in (*stack.drafts, *stack.targets):
        # A new connection: the replica presents the new certificate and trusts only the new CA.
        assert _describe(replica.address, _tls(new, new_client)) == grpc.StatusCode.OK
        assert _describe(replica.address, _tls(old, new_client)) == grpc.StatusCode.UNAVAILABLE
        assert _describe(replica.address, _tls(new, old_client)) == grpc.StatusCode.UNAVAILABLE
    # The orchestrator reaches the replicas with its new certificate: a request after the old CA
    # left could not open its sessions otherwise.
    with TandemClient(stack.address, tls=_tls(new, None)) as client:  # and serves the new one
        reply = client.generate(PROMPT, max_new_tokens=LENGTH, ignore_eos=True)
    assert list(reply.token_ids) == expected
    for process in (stack.orchestrator, *stack.drafts, *stack.targets):
        assert any("changed: reloaded" in line for line in process.lines), process.address


def test_a_file_that_does_not_load_keeps_the_current_certificate(tmp_path: Path) -> None:
    """In process: a half-written or mismatched set is logged and skipped; the next whole set loads."""
    (tmp_path / "issued").mkdir()
    ca = make_ca(tmp_path, "ca")
    live = Live(tmp_path)
    live.trust(ca)
    live.install(ca, "first")
    tls = security.load_server_tls(str(live.server.cert), str(live.server.key), str(live.bundle))
    assert tls is not None
    files = security.Reloading(tls.paths, lambda: security.load_server_tls(*tls.paths), tls, "test")
    assert files.current() is tls  # nothing changed
    second = issue(ca, tmp_path / "issued", "second", server=True)
    _replace(live.server.key, second.key.read_bytes())  # the key first: a mismatched pair
    assert files.current() is tls and files.reloads == 0
    _replace(live.server.cert, second.cert.read_bytes())
    reloaded = files.current()
    assert reloaded is not tls and files.reloads == 1
    assert reloaded is not None and reloaded.cert_chain == second.cert.read_bytes()
    _replace(live.bundle, b"")  # an empty CA bundle
    assert files.current() is reloaded


def test_a_mismatched_pair_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "issued").mkdir()
    ca = make_ca(tmp_path, "ca")
    one, two = (issue(ca, tmp_path / "issued", name, server=True) for name in ("one", "two"))
    with pytest.raises(security.SecurityConfigError, match="not a certificate and its private key"):
        security.load_server_tls(str(one.cert), str(two.key))
    with pytest.raises(security.SecurityConfigError, match="--upstream-tls-cert"):
        security.load_client_tls(str(ca.path), str(one.cert), str(two.key), flag="--upstream-tls")



def test_the_bearer_token_file_is_followed_and_may_hold_an_old_and_a_new_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    auth = security.BearerTokenAuth(security.token_file(str(path)))

    def refusal(token: str) -> str | None:
        return auth.refusal([("authorization", "Bearer " + token)])

    assert refusal("first") is None and refusal("second") == "invalid bearer token"
    _replace(path, b"first\nsecond\n")  # the new token joins while clients move to it
    assert refusal("first") is None and refusal("second") is None
    _replace(path, b"second\n")  # the old one leaves
    assert refusal("second") is None and refusal("first") == "invalid bearer token"
    _replace(path, b"two words\n")  # does not load: the current tokens stay
    assert refusal("second") is None and refusal("two words") is not None
