"""Transport security and authentication, in one place.

- `ServerTls` / `server_credentials`: a server's certificate, and with a client CA, mutual
  TLS (clients must present a certificate that CA signed). `tandem.server.start_server`
  is the only caller.
- `ClientTls` / `channel` / `aio_channel`: the only way Tandem opens a gRPC channel, so
  every caller (the orchestrator's replica pools, the client, the launcher) gets TLS the
  same way. Plaintext stays the default: no TLS settings, an insecure channel.
- `BearerTokenAuth`: a server interceptor that lets a call through only with
  `authorization: Bearer <token>`; health and reflection stay open for probes and tools.

Certificates rotate without a restart. A server reads its --tls-* files again when they change
(as a Kubernetes Secret volume updates them, cert-manager renewing): gRPC asks for the current
certificate at every new handshake (`grpc.dynamic_ssl_server_credentials`), so new connections
take the new one while established ones go on. The orchestrator's replica channels follow its
--upstream-tls-* files the same way (orchestrator.remote.ReplicaPool). A change that does not
load (a key that does not match its certificate, a half-written file) is logged and the
current files stay in use until a complete set is there.

Key and token bytes are kept out of every repr, so logging a config never leaks them.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeAlias, TypeVar

import grpc

from tandem.config import option

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
BEARER = "Bearer "
# Reachable without a token: Kubernetes probes and grpcurl-style tools do not send one.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


class SecurityConfigError(ValueError):
    """TLS or token settings that cannot work (a cert without its key, an empty token...)."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read {what} {path!r}: {exc.strerror}") from exc
    if not data.strip():
        raise SecurityConfigError(f"{what} {path!r} is empty")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key (PEM); with `client_ca`, clients must present a
    certificate signed by it (mutual TLS)."""

    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = field(default=None, repr=False)
    # The files these came from (cert, key, client CA), read again when they change; (): fixed.
    paths: tuple[str, str, str] | tuple[()] = ()

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None


def _check_pair(cert: str, key: str, flag: str) -> None:
    """Refuse a key that does not belong to its certificate (one of the two half-updated)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise SecurityConfigError(f"{flag}-cert {cert!r} and {flag}-key {key!r} are not a "
                                  f"certificate and its private key: {exc}") from exc


def load_server_tls(cert: str, key: str, client_ca: str = "") -> ServerTls | None:
    """From file paths; None (plaintext) when none is set."""
    if not (cert or key or client_ca):
        return None
    if not (cert and key):
        raise SecurityConfigError("TLS needs both --tls-cert and --tls-key"
                                  + (" (--tls-client-ca alone cannot turn on TLS)" if client_ca else ""))
    tls = ServerTls(_read(cert, "--tls-cert"), _read(key, "--tls-key"),
                    _read(client_ca, "--tls-client-ca") if client_ca else None, (cert, key, client_ca))
    _check_pair(cert, key, "--tls")
    return tls


T = TypeVar("T")


class Reloading(Generic[T]):
    """A value loaded from files, loaded again when any of them changes (checked on `current()`).

    A load that fails, or files that change while they are read, keep the last good value: the
    next call tries again, and each failing set of files is logged once.
    """

    def __init__(self, paths: Sequence[str], load: Callable[[], T], initial: T, what: str) -> None:
        self._paths = tuple(p for p in paths if p)
        self._load, self._what = load, what
        self._stamp = self._failed = self._stat()
        self.value = initial
        self.reloads = 0

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in self._paths:
            try:  # follows symlinks: a Secret volume swaps a directory link under the names
                st = os.stat(path)
                stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((0, 0, 0))
        return tuple(stamps)

    def current(self) -> T:
        stamp = self._stat()
        if stamp == self._stamp:
            return self.value
        try:
            value = self._load()
        except SecurityConfigError as exc:
            if stamp != self._failed:
                self._failed = stamp
                log.warning("%s changed but cannot be loaded; keeping the current ones: %s",
                            self._what, exc)
            return self.value
        if self._stat() != stamp:  # written to while read: the next call reads them whole
            return self.value
        self._stamp, self.value = stamp, value
        self.reloads += 1
        log.info("%s changed: reloaded (%s)", self._what, ", ".join(self._paths))
        return value


def _server_configuration(tls: ServerTls) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(tls.private_key, tls.cert_chain)], root_certificates=tls.client_ca)


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials that serve `tls`; when it came from files, whatever they hold at each handshake."""
    if not tls.paths:
        return grpc.ssl_server_credentials(
            [(tls.private_key, tls.cert_chain)], root_certificates=tls.client_ca,
            require_client_auth=tls.mutual)

    def load() -> ServerTls:
        reloaded = load_server_tls(*tls.paths)
        assert reloaded is not None
        if reloaded.mutual != tls.mutual:  # whether clients must present a certificate is fixed
            raise SecurityConfigError("--tls-client-ca cannot be removed or added while serving")
        return reloaded

    files = Reloading(tls.paths, load, tls, "the server's TLS files")
    served = [tls]

    def fetch() -> Any:  # gRPC asks at every new handshake; None keeps the configuration it has
        current = files.current()
        if current is served[0]:
            return None
        served[0] = current
        return _server_configuration(current)

    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(tls), fetch, require_client_authentication=tls.mutual)


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (`root_ca`; None: the system roots), the certificate it presents
    for mutual TLS, and the name to verify the server's certificate against when the address
    is not that name (replicas found by discovery are dialled by pod IP)."""

    root_ca: bytes | None = field(default=None, repr=False)
    cert_chain: bytes | None = field(default=None, repr=False)
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str = ""
    # The files these came from (CA, cert, key), and the flags' prefix; (): fixed.
    paths: tuple[str, str, str] | tuple[()] = ()
    flag: str = "--tls"

    def reloading(self) -> Reloading[ClientTls] | None:
        """These settings, following their files as they change; None when they came from none."""
        if not any(self.paths):
            return None
        ca, cert, key = self.paths or ("", "", "")

        def load() -> ClientTls:
            return load_client_tls(ca, cert, key, self.server_name, enabled=True,
                                   flag=self.flag) or self

        return Reloading(self.paths, load, self, f"{self.flag}-* files")


def load_client_tls(ca: str = "", cert: str = "", key: str = "", server_name: str = "",
                    *, enabled: bool = False, flag: str = "--tls") -> ClientTls | None:
    """From file paths; None (plaintext) unless a path or server name is set, or `enabled`
    (TLS with the system's trusted roots). `flag` prefixes the flag names in error messages."""
    if not (ca or cert or key or server_name or enabled):
        return None
    if bool(cert) != bool(key):
        raise SecurityConfigError(f"a client certificate needs both {flag}-cert and {flag}-key")
    tls = ClientTls(
        root_ca=_read(ca, f"{flag}-ca") if ca else None,
        cert_chain=_read(cert, f"{flag}-cert") if cert else None,
        private_key=_read(key, f"{flag}-key") if key else None,
        server_name=server_name, paths=(ca, cert, key), flag=flag)
    if cert:
        _check_pair(cert, key, flag)
    return tls


def _secure(tls: ClientTls, options: Sequence[tuple[str, Any]]
            ) -> tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.root_ca, private_key=tls.private_key,
        certificate_chain=tls.cert_chain)
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return credentials, [*options, *extra]


def channel(address: str, tls: ClientTls | None,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking channel: TLS when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials, secure_options = _secure(tls, options)
    return grpc.secure_channel(address, credentials, options=secure_options)


def aio_channel(address: str, tls: ClientTls | None,
                options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel: TLS when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    credentials, secure_options = _secure(tls, options)
    return grpc.aio.secure_channel(address, credentials, options=secure_options)


def read_token(path: str) -> str:
    """A bearer token from a file (a mounted Kubernetes Secret); surrounding whitespace dropped."""
    token = _read(path, "--auth-token-file").decode().strip()
    if any(c.isspace() for c in token) or not token.isprintable():
        raise SecurityConfigError("--auth-token-file must hold one token without spaces")
    return token


def read_tokens(path: str) -> tuple[str, ...]:
    """The bearer tokens a server accepts: one per line of `path` (two while clients move from
    an old token to a new one)."""
    tokens = tuple(line.strip() for line in _read(path, "--auth-token-file").decode().splitlines()
                   if line.strip())
    if any(any(c.isspace() for c in t) or not t.isprintable() for t in tokens):
        raise SecurityConfigError("--auth-token-file must hold one token per line, without spaces")
    return tokens


def token_file(path: str) -> Reloading[tuple[str, ...]]:
    """The tokens in `path`, read again when the file changes (a rotated Secret)."""
    return Reloading([path], lambda: read_tokens(path), read_tokens(path), "--auth-token-file")


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((AUTHORIZATION, BEARER + token),) if token else ()


Handler: TypeAlias = Any  # grpc.RpcMethodHandler (grpc ships no type information)
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]


class BearerTokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Lets a call through only with `authorization: Bearer <token>`, except OPEN_SERVICES.

    Denied calls end UNAUTHENTICATED before the request is read. Neither the expected nor
    the presented token is ever logged.
    """

    def __init__(self, token: str | Reloading[tuple[str, ...]]) -> None:
        """`token`: the token, or a token file (`token_file`) that may change while serving."""
        if isinstance(token, str):
            if not token:
                raise SecurityConfigError("an empty bearer token would let everyone in")
            self._tokens: Callable[[], tuple[str, ...]] = lambda: (token,)
        else:
            self._tokens = token.current

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        values = [v for k, v in metadata or () if k == AUTHORIZATION]
        if not values:
            return ("missing bearer token: send the metadata 'authorization: Bearer <token>' "
                    "(tandem generate --auth-token-file)")
        value = values[0]
        presented = value.encode() if isinstance(value, str) else value
        if len(values) > 1 or not presented.startswith(BEARER.encode()):
            return "malformed authorization metadata: expected one 'Bearer <token>'"
        # Every accepted token is compared, in constant time, whichever matches.
        matches = [hmac.compare_digest(presented[len(BEARER):], t.encode()) for t in self._tokens()]
        if not any(matches):
            return "invalid bearer token"
        return None

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method: str = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        refusal = self.refusal(handler_call_details.invocation_metadata)
        if refusal is None:
            return await continuation(handler_call_details)
        log.warning("refused %s: %s", method, refusal)
        handler = await continuation(handler_call_details)
        return None if handler is None else refusing(handler, grpc.StatusCode.UNAUTHENTICATED, refusal)


def refusing(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    """A handler of the same shape as `handler` that ends every call with `code`."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover  (an async generator, as streaming handlers are)

    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        denying = grpc.stream_stream_rpc_method_handler(deny_stream, **codecs)
    elif handler.request_streaming:
        denying = grpc.stream_unary_rpc_method_handler(deny, **codecs)
    elif handler.response_streaming:
        denying = grpc.unary_stream_rpc_method_handler(deny_stream, **codecs)
    else:
        denying = grpc.unary_unary_rpc_method_handler(deny, **codecs)
    return denying


@dataclass(frozen=True)
class ServerSecurityConfig:
    """The TLS settings every service has; each service's config extends this."""

    tls_cert: str = option("", "PEM certificate chain to serve TLS with (empty: plaintext)")
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_client_ca: str = option("", "PEM CA bundle: require client certificates it signed "
                                "(mutual TLS); needs --tls-cert")
    health_port: int = option(-1, "also serve gRPC health alone, in plaintext, on this port, for "
                              "probes that cannot speak TLS (kubelet); 0 picks one, -1: none")

    def server_tls(self) -> ServerTls | None:
        return load_server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)
