"""Replicas of the draft and target services, and one session's stream to each.

A session on a service is one bidirectional stream. The orchestrator tracks
`synced`, the prefix of its history that the remote KV cache is known to hold;
every step sends `cache_position=synced` (the service rolls back to it) and the
history tokens after it. Rebuilding a lost cache is therefore just `synced = 0`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from orchestrator import wire
from orchestrator.domain import DraftBlock, ModelInfo, TargetResult, TargetScores, TreeCommit
from orchestrator.routing import PrefixRoutes, block_keys, choose
from tandem import metrics, sampling
from tandem.errors import DeadlineExceeded, ReplicaRefused, ResourceExhausted, Unavailable
from tandem.grammar import GrammarSpec, spec_to
from tandem.models import TokenizerFile
from tandem.security import ClientTls, aio_channel
from tandem.server import CHANNEL_OPTIONS
from tandem.split import split_from_proto
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass(eq=False)  # one channel each: compared by identity
class Link:
    """A channel to a replica, and how many sessions it carries."""

    channel: Any = field(repr=False)
    stub: Any = field(repr=False)
    sessions: int = 0


@dataclass
class Replica:
    address: str
    link: Link
    active_sessions: int = 0
    # Set by discovery: a terminating replica takes no new sessions while its in-flight ones
    # finish; a removed one has also left the pool and is closed after its last session.
    terminating: bool = False
    removed: bool = False
    # Channels opened with TLS files since replaced: each closes after its last session.
    retired: list[Link] = field(default_factory=list)
    # Set when a session on it broke: new sessions avoid it until then (event-loop time).
    failed_until: float = 0.0
    # The share of its KV budget its caches held at its last answer (targets report it); 0
    # again once no session of this orchestrator's is open there (what this one routes to it).
    kv_usage: float = 0.0

    @property
    def stub(self) -> Any:
        return self.link.stub

    @property
    def channel(self) -> Any:
        return self.link.channel


# A replica that broke a session is avoided this long; a restarted one is found again soon
# after, as the channel retries its connection at most this often.
FAILED_COOLDOWN_S = 5.0
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200),
                     ("grpc.min_reconnect_backoff_ms", 200),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


def _channel_options(address: str) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS]
    if address.startswith("dns:"):
        # A dns:/// name of a headless Service resolves to every pod; round_robin spreads
        # streams (sessions) over them, where the default pick_first would send all to one.
        options.append(("grpc.lb_policy_name", "round_robin"))
    return options


class ReplicaPool:
    """Replicas of one service; a new session goes to the routable one likely to hold its
    prefix, within a load bound (orchestrator/routing.py), and stays there.

    The replicas are the constructor's static addresses, or come and go through discovery:
    `add`, `mark_terminating` (no new sessions; in-flight ones finish) and `remove`. Every
    method runs on the event loop that owns the channels.
    """

    def __init__(self, addresses: Sequence[str], stub_class: type,
                 tls: ClientTls | None = None) -> None:
        self.stub_class = stub_class
        self.service = stub_class.__name__.removesuffix("ServiceStub").lower()  # "draft", "target"
        self.tls = tls
        self._tls_files = tls.reloading() if tls is not None else None
        self.replicas: list[Replica] = []
        self.routes = PrefixRoutes()
        self._closing: set[asyncio.Task[None]] = set()
        for address in addresses:
            self.add(address)

    @property
    def ready(self) -> bool:
        """Whether some replica takes new sessions."""
        return any(not r.terminating for r in self.replicas)

    def get(self, address: str) -> Replica | None:
        return next((r for r in self.replicas if r.address == address), None)

    def add(self, address: str) -> Replica:
        """Route new sessions to `address`; a replica marked terminating takes them again."""
        replica = self.get(address)
        if replica is None:
            replica = Replica(address=address, link=self._link(address))
            self.replicas.append(replica)
        replica.terminating = False
        return replica

    def _link(self, address: str) -> Link:
        channel = aio_channel(address, self.tls, _channel_options(address))
        return Link(channel, self.stub_class(channel))

    def _follow_tls_files(self) -> None:
        """New sessions use the --upstream-tls-* files as they are now: when they have changed,
        each replica gets a channel with them, and the old one closes after its last session."""
        if self._tls_files is None or (tls := self._tls_files.current()) is self.tls:
            return
        self.tls = tls
        for replica in self.replicas:
            old, replica.link = replica.link, self._link(replica.address)
            if old.sessions:
                replica.retired.append(old)
            else:
                self._close(old)

    def mark_terminating(self, address: str) -> None:
        """No new sessions on `address`; the sessions already there run to their end."""
        replica = self.get(address)
        if replica is not None:
            replica.terminating = True

    def remove(self, address: str) -> None:
        """Forget `address`; its channel closes now, or when its last session ends."""
        replica = self.get(address)
        if replica is None:
            return
        self.replicas.remove(replica)
        self.routes.forget(address)
        replica.terminating = replica.removed = True
        if replica.active_sessions == 0:
            self._close(replica.link)

    def acquire(self, tried: Collection[str] = (), history: Sequence[int] = ()) -> Replica:
        """A routable replica for a session whose history is `history`: among those that have
        not just failed, then those whose address is not in `tried` (those a step has already
        tried), the one `routing.choose` picks."""
        self._follow_tls_files()
        routable = [r for r in self.replicas if not r.terminating]
        if not routable:
            state = (f"{len(self.replicas)} known, all terminating" if self.replicas
                     else "none discovered yet")
            raise Unavailable(f"no replica is ready to take a new session ({state})")
        now = asyncio.get_running_loop().time()
        healthy = [r for r in routable if r.failed_until <= now]
        # A cooldown that is over counts for nothing: the replica competes on load again.
        def rank(r: Replica) -> tuple[bool, float]:
            return r.address in tried, max(r.failed_until, now)

        best = min(map(rank, healthy or routable))
        group = {r.address: r for r in healthy or routable if rank(r) == best}
        keys = block_keys(history)
        replica = group[choose({a: r.active_sessions for a, r in group.items()}, keys, self.routes)]
        self.routes.record(keys, replica.address)
        replica.active_sessions += 1
        replica.link.sessions += 1
        return replica

    @property
    def healthy(self) -> bool:
        """Whether some routable replica has not just failed."""
        now = asyncio.get_running_loop().time()
        return any(not r.terminating and r.failed_until <= now for r in self.replicas)

    def mark_failed(self, replica: Replica) -> None:
        replica.failed_until = asyncio.get_running_loop().time() + FAILED_COOLDOWN_S

    def release(self, replica: Replica, link: Link | None = None) -> None:
        """A session that `acquire` placed on `replica` (over `link`: the channel it opened on,
        by default the replica's current one) has ended."""
        link = link or replica.link
        replica.active_sessions -= 1
        link.sessions -= 1
        if replica.active_sessions == 0:
            replica.kv_usage = 0.0
        if link in replica.retired and link.sessions == 0:
            replica.retired.remove(link)
            self._close(link)
        if replica.removed and replica.active_sessions == 0:
            self._close(replica.link)

    def _close(self, link: Link) -> None:
        # Closing a channel cancels its calls, so only a channel without sessions is closed.
        task = asyncio.get_running_loop().create_task(link.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every channel (in-flight calls are cancelled)."""
        for replica in self.replicas:
            for link in (replica.link, *replica.retired):
                await link.channel.close()
        self.replicas.clear()
        if self._closing:
            await asyncio.gather(*self._closing)


# A step whose session is evicted again and again (a replica short of KV room) gives up.
_MAX_EVICTIONS_PER_STEP = 8
# After these, the session is rebuilt from the history, on another replica when one is
# healthy: the replica died, restarted or is shutting down (UNAVAILABLE, CANCELLED), evicted
# the session's cache (NOT_FOUND), lost track of it (OUT_OF_RANGE), or is full.
_REBUILD = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                      grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
# ...of which these say the replica itself is up, so it is not avoided afterwards.
_REPLICA_ALIVE = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                            grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass
class RemoteSession:
    """One session's stream to one replica, rebuilt elsewhere if it is lost.

    Not safe for concurrent steps (one session, one step at a time). `deadline` is the
    request's (event-loop time) and bounds every call; `retry_s` is how long a lost session
    keeps waiting for some replica to take it over (a restart), once every replica was tried.
    """

    pool: ReplicaPool
    session_id: str
    deadline: float | None
    retry_s: float = 0.0
    synced: int = 0
    wire_bytes: int = 0
    rebuilds: int = 0
    replica: Replica | None = None
    # The request's grammar, and where its generated tokens begin (sent with every step).
    grammar: GrammarSpec | None = None
    grammar_start: int = 0
    _link: Link | None = field(default=None, repr=False)  # the channel the session opened on
    _call: Any = field(default=None, repr=False)
    # Whether every answer to the last request sent has been read: the stream is at rest, and
    # `close` may end it by half-closing (see there) rather than cancelling it.
    _settled: bool = field(default=False, repr=False)

    def _open(self, method: str, tried: Collection[str] = (), history: Sequence[int] = ()) -> Any:
        if self._call is None:
            self.replica = self.pool.acquire(tried, history)
            self._link = self.replica.link
            timeout = (None if self.deadline is None
                       else max(0.0, self.deadline - asyncio.get_running_loop().time()))
            self._call = getattr(self.replica.stub, method)(timeout=timeout)
        return self._call

    async def _step(self, method: str, build: Callable[[int], Any]) -> Any:
        """Send the step `build(synced)` and return its answer; if the session is lost,
        rebuild it from the history.

        The history is the orchestrator's, and a step's seed fixes its draws, so resending a
        step from cache position 0 on any replica gives exactly the answer the lost one would.
        """
        async with contextlib.aclosing(self._stream(method, build)) as answers:
            async for response in answers:
                self._settled = True  # a step has one answer
                return response
        raise AssertionError("a stream yields until it is closed or fails")

    async def _stream(self, method: str, build: Callable[[int], Any]) -> AsyncGenerator[Any, None]:
        """Send `build(synced)` and yield every response to it until the caller stops reading
        (a step has one, a decode run one per token). If the session is lost, rebuild it from
        the history: `build(synced)` again, from what the caller made history meanwhile."""
        loop = asyncio.get_running_loop()
        give_up, backoff, attempts, evictions = loop.time() + self.retry_s, 0.05, 0, 0
        tried: set[str] = set()  # replicas that failed this step for a reason other than eviction
        while True:
            request = build(self.synced)
            # A session opens with its whole history (synced is 0): it routes by its prefix.
            call = self._open(method, tried, request.new_token_ids)
            where = self.replica.address if self.replica else "?"
            self.wire_bytes += request.ByteSize()
            written, self._settled = False, False
            try:
                await call.write(request)
                written = True
                while (response := await call.read()) is not grpc.aio.EOF:
                    self.wire_bytes += response.ByteSize()
                    yield response
                    # An answer came: a later loss is a later step's, with its own attempts.
                    give_up, backoff, attempts, evictions = loop.time() + self.retry_s, 0.05, 0, 0
                    tried.clear()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                # A stream that ended between two steps (its replica died) refuses the write:
                # with InvalidStateError once the channel has seen the loss (the status is the
                # call's), with INTERNAL while it has not. Either way the step reached no replica.
                if isinstance(exc, grpc.aio.AioRpcError):
                    code, details = exc.code(), exc.details()
                else:
                    code, details = await call.code(), await call.details()
                if not written and code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.OK):
                    code = grpc.StatusCode.UNAVAILABLE
                # Callers see what went wrong downstream, never a bare UNKNOWN.
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded("the request's deadline passed while generating") from exc
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ReplicaRefused(f"{method} on replica {where} refused this request: "
                                         f"{details}") from exc
                if code not in _REBUILD:
                    raise Unavailable(f"{method} on replica {where} failed: {code.name}: "
                                      f"{details}") from exc
                problem = f"{code.name}: {details}"
            else:
                code, problem = grpc.StatusCode.UNAVAILABLE, "the stream ended without a status"
            failed = self.replica
            await self.close()
            if failed is not None and code not in _REPLICA_ALIVE:
                self.pool.mark_failed(failed)
            self.synced = 0
            # An eviction (NOT_FOUND) says nothing against the replica: rebuild there again, a
            # few times. Otherwise every replica gets a chance, and only a dead one (which may
            # restart) is waited for.
            if code == grpc.StatusCode.NOT_FOUND:
                evictions += 1
            else:
                attempts += 1
                tried.add(where)
            if evictions > _MAX_EVICTIONS_PER_STEP or (attempts > len(self.pool.replicas) and (
                    code in _REPLICA_ALIVE or loop.time() >= give_up)):
                error = ResourceExhausted if code == grpc.StatusCode.RESOURCE_EXHAUSTED else Unavailable
                raise error(f"{method} on replica {where} failed ({problem}); no replica could "
                            f"take the session over after {attempts + evictions} attempts")
            self.rebuilds += 1
            metrics.SESSION_REBUILDS.labels(self.pool.service).inc()
            log.warning("session %s lost on %s replica %s (%s): rebuilding it from the history",
                        self.session_id, self.pool.service, where, problem)
            if not self.pool.healthy:
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 1.0)

    async def finish(self) -> None:
        """End the session's stream and wait for the replica to end it too: by then it has
        kept the session's cache in its prefix cache."""
        call, self._call = self._call, None
        if call is not None:
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        await self.close()

    def advance(self, cache_length: int, valid_length: int) -> None:
        """After a step: the cache holds `cache_length` tokens, of which `valid_length` are history."""
        self.synced = min(cache_length, valid_length)

    async def close(self) -> None:
        """End the session. A stream at rest is half-closed and read to its end in the
        background (the replica's handler then ends as a finished stream does, and the caller
        does not wait); one with answers outstanding (a step cut short, a decode run stopped
        early) is cancelled, which stops the replica's work on it. A cancelled grpc.aio stream
        costs the replica about 100 bytes of native memory that are never freed (upstream:
        grpc/grpc#43360), so cancelling is kept for the streams that need it."""
        call, self._call = self._call, None
        if call is not None:
            how = "half-closed" if self._settled else "cancelled"
            if how == "half-closed":
                ending = asyncio.get_running_loop().create_task(_end(call))
                _ENDING.add(ending)
                ending.add_done_callback(_ENDING.discard)
            else:
                call.cancel()
            metrics.SESSION_STREAMS_ENDED.labels(self.pool.service, how).inc()
        if self.replica is not None:
            self.pool.release(self.replica, self._link)
            self.replica = self._link = None


# Streams being ended in the background (`RemoteSession.close`), held until they end.
_ENDING: set[asyncio.Task[None]] = set()
# How long a stream at rest may take to end once half-closed before it is cancelled.
END_TIMEOUT_S = 10.0


async def streams_ended() -> None:
    """Until the streams being ended in the background have ended (at most END_TIMEOUT_S)."""
    loop = asyncio.get_running_loop()
    ending = [task for task in _ENDING if task.get_loop() is loop]
    if ending:
        await asyncio.wait(ending, timeout=END_TIMEOUT_S)


async def _end(call: Any) -> None:
    try:
        async with asyncio.timeout(END_TIMEOUT_S):
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, TimeoutError):
        call.cancel()


class DraftSession(RemoteSession):
    async def propose(self, history: list[int], num_speculative_tokens: int,
                      params: sampling.SamplingParams, max_support_size: int, seed: int,
                      ahead: int = 0) -> DraftBlock:
        """A block of k tokens after `history`; with `ahead`, the replica then drafts that many
        tokens of the next step's likely block while the target verifies this one."""
        response = await self._step("ProposeBlocks", lambda synced: draft_pb2.ProposeBlocksRequest(
            session_id=self.session_id, cache_position=synced,
            new_token_ids=history[synced:], num_speculative_tokens=num_speculative_tokens,
            sampling=wire.sampling_to_proto(params), max_support_size=max_support_size, seed=seed,
            draft_ahead_tokens=ahead, grammar=spec_to(self.grammar), grammar_start_position=self.grammar_start))
        dists = tuple(wire.distribution_from_proto(d) for d in response.distributions)
        probs = tuple(d.probs[d.token_ids.index(t)] for t, d in zip(response.token_ids, dists))
        return DraftBlock(tuple(response.token_ids), dists, probs, response.cache_length,
                          response.compute_ms, response.prebuilt_tokens if ahead else -1,
                          response.ahead_hit, split_from_proto(response.pass_split),
                          response.cached_token_count)


@dataclass
class TargetSession(RemoteSession):
    # A proposer the target runs itself ("lookahead", "medusa"); "": none.
    proposer: str = ""
    top_logprobs: int | None = None  # each scored row's log-probabilities and its top N (None: none)

    def _constrain(self, request: target_pb2.ScoreBlocksRequest) -> target_pb2.ScoreBlocksRequest:
        """The request's grammar and log-probabilities, on a step's request."""
        if self.grammar is not None:
            request.grammar.CopyFrom(spec_to(self.grammar))
            request.grammar_start_position = self.grammar_start
        if self.top_logprobs is not None:
            request.top_logprobs = self.top_logprobs
        return request

    async def score(self, history: list[int], block: DraftBlock,
                    params: sampling.SamplingParams, seed: int) -> TargetResult:
        """Score `block`, or with `proposer` set, have the target propose and verify a tree:
        TargetScores, or TreeCommit."""
        response = await self._step("ScoreBlocks", lambda synced: self._constrain(wire.score_request_to_proto(
            self.session_id, synced, history[synced:], block, self.proposer, params, seed)))
        if self.proposer:
            return self._result(response, "target_proposal step", TreeCommit)
        return self._result(response, "draft_proposal step", TargetScores)

    def _result(self, response: target_pb2.ScoreBlocksResponse, sent: str, kind: type[R]) -> R:
        """The answer's result, which must be of `kind` (the protocol `sent` speaks); the
        replica's KV usage, as it reports it, noted for routing."""
        if self.replica is not None:
            self.replica.kv_usage = response.kv_cache_usage
        result = wire.target_result_from_proto(response)
        if not isinstance(result, kind):
            where = self.replica.address if self.replica else "?"
            raise Unavailable(f"target replica {where} answered a {sent} with "
                              f"{response.WhichOneof('result') or 'no result'}; is it of another "
                              "Tandem version than this orchestrator?")
        return result

    async def decode(self, history: list[int], params: sampling.SamplingParams, seed: int, end: int,
                     stop_token_ids: frozenset[int]) -> AsyncGenerator[TargetScores, None]:
        """The target decoding alone: one token after another, each a block of none's bonus
        token, until `history` (which the caller extends with each token before reading the
        next) holds `end` tokens or ends with a stop token. One request for the whole run: a
        lost session is rebuilt from the history and the run resent for what is left, and
        since each token's draw is keyed by its position, the resent run draws the same."""
        left = [0]  # answers the run sent last owes

        def build(synced: int) -> target_pb2.ScoreBlocksRequest:
            left[0] = end - len(history)
            return self._constrain(wire.decode_request_to_proto(
                self.session_id, synced, history[synced:], params, seed, left[0], stop_token_ids))

        async with contextlib.aclosing(self._stream("ScoreBlocks", build)) as answers:
            async for response in answers:
                result = self._result(response, "decode_run", TargetScores)
                left[0] -= 1
                # The run's last answer: its length, or a stop token.
                self._settled = left[0] <= 0 or result.scored.bonus_token_id in stop_token_ids
                yield result


async def fetch_model_info(address: str, stub_class: type, wait_s: float,
                           tls: ClientTls | None = None) -> ModelInfo:
    """Wait until the replica's model is loaded (health SERVING), then describe it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with aio_channel(address, tls, CHANNEL_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = asyncio.get_running_loop().time() + wait_s
        last_error = ""
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError as exc:
                # A TLS mismatch looks like a replica still starting; keep why, to report it.
                last_error = f" (last error: {exc.code().name}: {exc.details()})"
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(f"replica {address} did not become SERVING within "
                                  f"{wait_s:.0f}s{last_error}")
            await asyncio.sleep(0.5)
        try:
            response = await stub_class(channel).GetModelInfo(common_pb2.GetModelInfoRequest(),
                                                              timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"replica {address} cannot describe its model: "
                              f"{exc.code().name}: {exc.details()}") from exc
        return wire.model_info_from_proto(response.info)


async def fetch_tokenizer(address: str, tls: ClientTls | None = None) -> tuple[TokenizerFile, ...]:
    """The files of the tokenizer a (SERVING) target replica serves."""
    async with aio_channel(address, tls, CHANNEL_OPTIONS) as channel:
        try:
            response = await target_pb2_grpc.TargetServiceStub(channel).GetTokenizer(
                target_pb2.GetTokenizerRequest(), timeout=60)
        except grpc.aio.AioRpcError as exc:
            hint = (" (a target older than this orchestrator: pass --tokenizer)"
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED else "")
            raise Unavailable(f"target replica {address} cannot serve its tokenizer: "
                              f"{exc.code().name}: {exc.details()}{hint}") from exc
    return wire.tokenizer_files_from_proto(response)


DRAFT_STUB = draft_pb2_grpc.DraftServiceStub
TARGET_STUB = target_pb2_grpc.TargetServiceStub
