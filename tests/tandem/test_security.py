"""TLS, mutual TLS and bearer tokens, through real processes with tiny models.

The stack under test: draft and target require client certificates (mutual TLS); the
orchestrator serves its public API over TLS, requires a bearer token, and presents its
client certificate to the replicas. Certificates are made at test time (tests/certs.py).
Every refusal asserts its exact status code, against a positive control on the same server.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from certs import Authority, Pair, issue, make_ca
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny import speculated

from tandem import security, server
from tandem.client import TandemClient
from tandem.launch import Process, Stack, start_stack
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

LENGTH = 16
PROMPT = "def fib(n):"


@dataclass(frozen=True)
class Pki:
    ca: Authority
    other_ca: Authority  # trusted by nobody
    server: Pair
    client: Pair  # the orchestrator's (and the tests') client certificate
    rogue_client: Pair  # signed by other_ca
    token_file: Path
    token: str

    def client_tls(self, *, cert: bool = True) -> security.ClientTls:
        tls = security.load_client_tls(str(self.ca.path), str(self.client.cert) if cert else "",
                                       str(self.client.key) if cert else "")
        assert tls is not None
        return tls


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(directory, "tandem-ca"), make_ca(directory, "other-ca")
    token_file = directory / "token"
    token = secrets.token_urlsafe(32)
    token_file.write_text(token + "\n")
    return Pki(ca, other_ca, issue(ca, directory, "server", server=True),
               issue(ca, directory, "client", server=False),
               issue(other_ca, directory, "rogue", server=False), token_file, token)


@pytest.fixture(scope="module")
def secure_stack(pki: Pki, tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    serve_tls = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    replica = [*serve_tls, "--tls-client-ca", str(pki.ca.path), "--health-port", "0"]
    orchestrator = [*serve_tls, "--auth-token-file", str(pki.token_file),
                    "--upstream-tls-ca", str(pki.ca.path), "--upstream-tls-cert",
                    str(pki.client.cert), "--upstream-tls-key", str(pki.client.key)]
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=replica,
                        target_args=replica, orchestrator_args=orchestrator,
                        tls=pki.client_tls(), token=pki.token)
    yield stack
    stack.stop()


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    code: grpc.StatusCode = caught.value.code()  # type: ignore[attr-defined]
    return code


# --- end to end -------------------------------------------------------------------------

def test_generation_over_tls_and_mutual_tls_matches_greedy(secure_stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    with secure_stack.client() as client:
        reply = client.generate(PROMPT, max_new_tokens=LENGTH, ignore_eos=True)
        streamed, _ = speculated(client, PROMPT, LENGTH, 4)  # the draft drafted every step, over mTLS
    assert list(reply.token_ids) == reference(PROMPT, LENGTH)
    assert streamed == reference(PROMPT, LENGTH)


def test_tandem_generate_with_tls_and_token(secure_stack: Stack, pki: Pki, reference) -> None:  # type: ignore[no-untyped-def]
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", PROMPT, "--address", secure_stack.address,
         "--tls-ca", str(pki.ca.path), "--auth-token-file", str(pki.token_file), "--json",
         "--max-new-tokens", str(LENGTH), "--ignore-eos"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == reference(PROMPT, LENGTH)


def _tandem_generate(address: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", PROMPT, "--address", address, "--json",
         "--max-new-tokens", str(LENGTH), "--ignore-eos", *args],
        capture_output=True, text=True, timeout=120, check=False, env={**clean, **env})


def test_tandem_generate_reads_its_own_client_tls_environment(secure_stack: Stack, pki: Pki, reference) -> None:  # type: ignore[no-untyped-def]
    result = _tandem_generate(secure_stack.address, {
        "TANDEM_CLIENT_TLS_CA": str(pki.ca.path), "TANDEM_AUTH_TOKEN_FILE": str(pki.token_file)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == reference(PROMPT, LENGTH)


def test_tandem_generate_ignores_the_services_tls_environment(tiny_stack: Stack, pki: Pki, reference) -> None:  # type: ignore[no-untyped-def]
    """A shell (or pod) set up to serve TLS has TANDEM_TLS_CERT/KEY: the server's own pair.
    `tandem generate` there must not present it as a client certificate, nor turn on TLS."""
    result = _tandem_generate(tiny_stack.address, {"TANDEM_TLS_CERT": str(pki.server.cert),
                                                   "TANDEM_TLS_KEY": str(pki.server.key)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"] == reference(PROMPT, LENGTH)


# --- bearer token -----------------------------------------------------------------------

@pytest.mark.parametrize("token, message", [(None, "missing bearer token"),
                                            ("not-the-token", "invalid bearer token")])
@pytest.mark.parametrize("streaming", [False, True])
def test_calls_without_the_right_token_are_unauthenticated(
        secure_stack: Stack, pki: Pki, token: str | None, message: str, streaming: bool) -> None:
    tls = pki.client_tls(cert=False)
    with TandemClient(secure_stack.address, tls=tls, token=token) as client, \
            pytest.raises(grpc.RpcError) as caught:
        if streaming:
            list(client.generate_stream(PROMPT, max_new_tokens=2))
        else:
            client.generate(PROMPT, max_new_tokens=2)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert message in caught.value.details()  # type: ignore[attr-defined]
    # The control: the same client with the right token gets through.
    with TandemClient(secure_stack.address, tls=pki.client_tls(cert=False), token=pki.token) as client:
        assert len(client.generate(PROMPT, max_new_tokens=2, ignore_eos=True).token_ids) == 2


def test_health_and_reflection_need_no_token(secure_stack: Stack, pki: Pki) -> None:
    with security.channel(secure_stack.address, pki.client_tls(cert=False)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.OrchestratorService"), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "tandem.v1.OrchestratorService" in names


# --- TLS and mutual TLS -----------------------------------------------------------------

def _process(stack: Stack, which: str) -> Process:
    return {"orchestrator": stack.orchestrator, "draft": stack.drafts[0],
            "target": stack.targets[0]}[which]


def _describe(address: str, tls: security.ClientTls | None, stub: type = draft_pb2_grpc.DraftServiceStub) -> None:
    with security.channel(address, tls) as channel:
        stub(channel).GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)


@pytest.mark.parametrize("which", ["orchestrator", "draft", "target"])
def test_a_plaintext_client_cannot_talk_to_a_tls_server(secure_stack: Stack, which: str) -> None:
    address = _process(secure_stack, which).address
    with grpc.insecure_channel(address) as channel:
        code = _code(lambda: health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("which, stub", [("draft", draft_pb2_grpc.DraftServiceStub),
                                         ("target", target_pb2_grpc.TargetServiceStub)])
def test_replicas_refuse_callers_without_a_trusted_client_certificate(
        secure_stack: Stack, pki: Pki, which: str, stub: type) -> None:
    address = _process(secure_stack, which).address
    _describe(address, pki.client_tls(), stub)  # the control: the orchestrator's certificate works
    no_cert = pki.client_tls(cert=False)
    assert _code(lambda: _describe(address, no_cert, stub)) == grpc.StatusCode.UNAVAILABLE
    rogue = security.ClientTls(root_ca=pki.ca.path.read_bytes(),
                               cert_chain=pki.rogue_client.cert.read_bytes(),
                               private_key=pki.rogue_client.key.read_bytes())
    assert _code(lambda: _describe(address, rogue, stub)) == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_server_is_refused(secure_stack: Stack, pki: Pki) -> None:
    distrustful = security.ClientTls(root_ca=pki.other_ca.path.read_bytes(),
                                     cert_chain=pki.client.cert.read_bytes(),
                                     private_key=pki.client.key.read_bytes())
    address = secure_stack.drafts[0].address
    assert _code(lambda: _describe(address, distrustful)) == grpc.StatusCode.UNAVAILABLE


def test_the_health_port_serves_only_health_in_plaintext(secure_stack: Stack) -> None:
    draft = secure_stack.drafts[0]
    [line] = [line for line in draft.lines if " health (plaintext) on " in line]
    address = line.rsplit(" ", 1)[1].strip()
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.DraftService"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        code = _code(lambda: draft_pb2_grpc.DraftServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=10))
    assert code == grpc.StatusCode.UNIMPLEMENTED


# --- nothing secret in the logs -----------------------------------------------------------

def test_no_token_or_key_reaches_the_logs(secure_stack: Stack, pki: Pki) -> None:
    wrong = secrets.token_urlsafe(32)
    with TandemClient(secure_stack.address, tls=pki.client_tls(cert=False), token=wrong) as client:
        assert _code(lambda: client.generate(PROMPT, max_new_tokens=2)) == \
            grpc.StatusCode.UNAUTHENTICATED
    with secure_stack.client() as client:
        client.generate(PROMPT, max_new_tokens=2)
    processes = [secure_stack.orchestrator, *secure_stack.drafts, *secure_stack.targets]
    log = "".join(line for p in processes for line in list(p.lines))
    assert "refused /tandem.v1.OrchestratorService/GenerateUnary: invalid bearer token" in log
    assert "mutual TLS" in log  # the log is captured, and says how each service is secured
    key_lines = {line for pair in (pki.server, pki.client)
                 for line in pair.key.read_text().splitlines() if "-----" not in line}
    for secret in (pki.token, wrong, *key_lines):
        assert secret not in log


# --- configuration (no processes) ---------------------------------------------------------

def test_tls_settings_that_cannot_work_are_refused(pki: Pki, tmp_path: Path) -> None:
    assert security.load_server_tls("", "", "") is None
    assert security.load_client_tls() is None
    with pytest.raises(security.SecurityConfigError, match="--tls-key"):
        security.load_server_tls(str(pki.server.cert), "", "")
    with pytest.raises(security.SecurityConfigError, match="--tls-client-ca alone"):
        security.load_server_tls("", "", str(pki.ca.path))
    with pytest.raises(security.SecurityConfigError, match="cannot read --tls-key"):
        security.load_server_tls(str(pki.server.cert), str(tmp_path / "missing"), "")
    with pytest.raises(security.SecurityConfigError, match="--upstream-tls-cert and"):
        security.load_client_tls(cert=str(pki.client.cert), flag="--upstream-tls")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(security.SecurityConfigError, match="empty"):
        security.read_token(str(empty))
    with pytest.raises(security.SecurityConfigError):
        security.BearerTokenAuth("")
    assert security.read_token(str(pki.token_file)) == pki.token


def test_a_server_name_alone_means_tls_with_the_system_roots() -> None:
    """Naming the server to verify asks for TLS, as --upstream-tls-server-name does on the
    orchestrator; before, `tandem generate --tls-server-name` alone went plaintext, sending
    any bearer token in the clear."""
    tls = security.load_client_tls(server_name="tandem.example.com")
    assert tls is not None and tls.root_ca is None and tls.server_name == "tandem.example.com"


def test_key_material_stays_out_of_reprs(pki: Pki) -> None:
    server = security.load_server_tls(str(pki.server.cert), str(pki.server.key), str(pki.ca.path))
    client = pki.client_tls()
    assert server is not None and server.mutual
    key = pki.server.key.read_text().splitlines()[1]
    assert key not in repr(server) and pki.client.key.read_text().splitlines()[1] not in repr(client)


def test_token_is_compared_in_constant_time_and_exactly(pki: Pki) -> None:
    auth = security.BearerTokenAuth(pki.token)
    assert auth.refusal([("authorization", f"Bearer {pki.token}")]) is None
    assert auth.refusal([("authorization", f"Bearer {pki.token}x")]) == "invalid bearer token"
    assert auth.refusal([("authorization", pki.token)]) is not None  # no scheme
    assert auth.refusal([]) is not None
    assert auth.refusal([("authorization", f"Bearer {pki.token}")] * 2) is not None


class EchoService:
    """Echoes bytes through each of the four RPC shapes."""

    name = "test.Echo"

    def add_to(self, server: grpc.aio.Server) -> None:
        async def unary(request: bytes, context: object) -> bytes:
            return request

        async def stream(request: bytes, context: object) -> AsyncIterator[bytes]:
            yield request

        async def gather(requests: AsyncIterator[bytes], context: object) -> bytes:
            return b"".join([r async for r in requests])

        async def echo(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
            async for request in requests:
                yield request

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.name, {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(stream),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(gather),
            "StreamStream": grpc.stream_stream_rpc_method_handler(echo),
        }),))

    def load(self) -> None:
        pass


def test_the_token_guards_every_rpc_shape_in_process() -> None:
    async def call(channel: grpc.aio.Channel, shape: str, metadata: tuple[tuple[str, str], ...]) -> bytes:
        method = f"/test.Echo/{shape}"
        if shape == "UnaryUnary":
            reply: bytes = await channel.unary_unary(method)(b"hi", metadata=metadata)
            return reply
        if shape == "UnaryStream":
            return b"".join([r async for r in channel.unary_stream(method)(b"hi", metadata=metadata)])
        if shape == "StreamUnary":
            reply = await channel.stream_unary(method)(iter([b"h", b"i"]), metadata=metadata)
            return reply
        return b"".join([r async for r in channel.stream_stream(method)(iter([b"hi"]), metadata=metadata)])

    async def scenario() -> None:
        running = await server.start_server([EchoService()], auth_token="s3cret")
        await running.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                for shape in ("UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"):
                    assert await call(channel, shape, security.bearer_metadata("s3cret")) == b"hi"
                    for metadata in ((), security.bearer_metadata("s3cre7")):
                        with pytest.raises(grpc.aio.AioRpcError) as caught:
                            await call(channel, shape, metadata)
                        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, shape
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="test.Echo"), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await running.stop(0)

    asyncio.run(scenario())
