"""Prometheus metrics of every Tandem service, and the small helpers that record them.

The metrics live in prometheus_client's default registry, as the library intends: one
process runs one service, and `serve()` exposes the registry over HTTP on its own port
(`--metrics-port`), next to the process and GC collectors the library adds. Names follow
the Prometheus conventions: base units (seconds), `_total` on counters.

The acceptance rate is deliberately not a stored number: it is
`rate(tandem_accepted_tokens_total) / rate(tandem_drafted_tokens_total)`, which, unlike a
gauge, aggregates correctly over replicas and time windows. Its shape per step is
`tandem_accepted_tokens_per_step`.

Who records what:
- orchestrator: requests, tokens, each speculation step (`observe_step`), replica counts;
- draft and target services: sessions, steps in flight (queue depth) and KV use, through
  `ReplicaMetrics`, labelled with the model so two services in one test process stay apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from tandem.errors import TandemError
from tandem.split import NO_SPLIT, PassSplit

# Latency buckets from half a millisecond (a draft step of a tiny model) to a minute (a
# long request); the same ladder serves steps, stages and whole requests.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
# One bucket per accepted length up to 16 (the default --max-speculative-tokens).
ACCEPTED_LENGTH_BUCKETS = (*range(17), float("inf"))

# Stages of one speculation step, the values of the `stage` label.
STAGE_DRAFT = "draft"  # draft forward passes, as the draft service measured them
STAGE_VERIFY = "verify"  # the target's scoring pass, as the target service measured it
STAGE_OTHER = "other"  # the rest of the step's wall time: network, serialization, the orchestrator

# --- orchestrator: the public API -------------------------------------------------------
REQUESTS = Counter("tandem_requests", "Finished requests by RPC method and gRPC status code.",
                   ["method", "code"])
REQUESTS_IN_FLIGHT = Gauge("tandem_requests_in_flight", "Requests being served now.", ["method"])
REQUESTS_QUEUED = Gauge("tandem_requests_queued",
                        "Admitted requests waiting for a running slot (--max-concurrent-requests).")
# The signals an endpoint picker reads to route a request to an orchestrator, as the Gateway
# API Inference Extension's model-server protocol defines them (queued requests, running
# requests, KV-cache utilisation as a fraction), named in vLLM's style under Tandem's prefix
# (k8s/overlays/inference-gateway maps them for the picker). Set from the engine at scrape time.
EPP_WAITING = Gauge("tandem:num_requests_waiting",
                    "Requests admitted here and waiting for a running slot.")
EPP_RUNNING = Gauge("tandem:num_requests_running", "Requests generating here now.")
EPP_KV_USAGE = Gauge("tandem:kv_cache_usage_perc",
                     "Share of the KV budget (--kv-budget-tokens) the target replicas' caches hold, "
                     "0 to 1: the mean over the replicas this orchestrator routes to, as each last "
                     "reported it (0 for one without a budget).")
REQUEST_SECONDS = Histogram("tandem_request_duration_seconds", "Wall time of a request.",
                            ["method"], buckets=SECONDS_BUCKETS)
TIME_TO_FIRST_TOKEN = Histogram("tandem_time_to_first_token_seconds",
                                "From a request's arrival to its first committed token.",
                                buckets=SECONDS_BUCKETS)
PROMPT_TOKENS = Counter("tandem_prompt_tokens", "Prompt tokens of served requests.")
COMPLETION_TOKENS = Counter("tandem_completion_tokens", "Tokens generated and returned.")

# --- orchestrator: speculation ----------------------------------------------------------
DRAFTED_TOKENS = Counter("tandem_drafted_tokens", "Tokens proposed by draft replicas.")
ACCEPTED_TOKENS = Counter("tandem_accepted_tokens", "Drafted tokens the target accepted.")
BONUS_TOKENS = Counter("tandem_bonus_tokens",
                       "Tokens the target sampled after accepting a whole drafted block.")
RECOVERED_TOKENS = Counter("tandem_recovered_tokens",
                           "Tokens the target resampled at the first rejected draft position.")
SUFFIX_INDEX_TOKENS = Gauge("tandem_suffix_index_tokens",
                            "Tokens of recent outputs the orchestrator keeps for suffix decoding "
                            "(--suffix-cache-tokens bounds them).")
DRAFTLESS_REQUESTS = Counter("tandem_draftless_requests",
                             "Requests decoded by the target alone: no draft replica was ready.")
SESSION_STREAMS_ENDED = Counter(
    "tandem_session_streams_ended", "Session streams to replicas this orchestrator ended, by service "
    "and how: half-closed (at rest: the replica's handler ends as a finished stream does) or "
    "cancelled (work of it outstanding, which the cancel stops).", ["service", "how"])
SESSION_REBUILDS = Counter("tandem_session_rebuilds",
                           "Sessions rebuilt from the history after a replica lost them (died, "
                           "restarted, evicted the KV cache), by service.", ["service"])
CACHED_PROMPT_TOKENS = Counter("tandem_cached_prompt_tokens",
                               "History tokens the replicas took from their prefix caches instead of "
                               "computing them, by service (draft or target).", ["service"])
DRAFT_FALLBACKS = Counter("tandem_draft_fallbacks",
                          "Requests that went on with the target alone after losing every draft "
                          "replica mid-request.")
TARGET_ONLY_STEPS = Counter("tandem_target_only_steps",
                            "Steps without a drafted block (prefill, k=0, or no draft replica).")
DRAFT_CACHE = Counter("tandem_draft_cache_steps",
                      "Decode steps that drafted with overlap on, by outcome: hit (the draft had "
                      "guessed the step's history and drafted its block ahead, or begun to) or "
                      "miss.",
                      ["outcome"])
DRAFT_WAIT_SECONDS = Histogram("tandem_draft_wait_seconds",
                               "Time a decode step waited for its drafted block (the draft on "
                               "the critical path, round trip included).", buckets=SECONDS_BUCKETS)
ACCEPTED_PER_STEP = Histogram("tandem_accepted_tokens_per_step",
                              "Accepted length of each step that verified a drafted block.",
                              buckets=ACCEPTED_LENGTH_BUCKETS)
STAGE_SECONDS = Histogram("tandem_stage_duration_seconds",
                          "Time per speculation step and stage: draft, verify, other.",
                          ["stage"], buckets=SECONDS_BUCKETS)

# --- orchestrator: replicas -------------------------------------------------------------
REPLICAS = Gauge("tandem_replicas", "Replicas the orchestrator knows, by pool and state "
                 "(routable: takes new sessions; terminating: finishing its sessions).",
                 ["pool", "state"])
DISCOVERY_RESTARTS = Counter("tandem_discovery_restarts",
                             "EndpointSlice watches restarted, by Service and reason "
                             "(disconnect: resumed; gone: relisted after 410; error: relisted).",
                             ["service", "reason"])
REPLICAS_REJECTED = Counter("tandem_replicas_rejected",
                            "Discovered replicas not admitted (unreachable or incompatible model).",
                            ["service"])

# --- draft and target services ----------------------------------------------------------
AHEAD_TOKENS = Counter("tandem_draft_ahead_tokens",
                       "Tokens a draft replica drafted ahead (while the target verified), by fate: "
                       "used by the next step, or wasted (its guess of the history was wrong).",
                       ["model", "fate"])
AHEAD_CACHED_TOKENS = Gauge("tandem_draft_ahead_cached_tokens",
                            "Tokens drafted ahead that sessions' KV caches hold, waiting for the "
                            "next step (the first room the KV budget takes back).", ["model"])
SESSIONS_ACTIVE = Gauge("tandem_sessions_active", "Open sessions (streams) on this replica.",
                        ["model"])
SESSIONS_LIMIT = Gauge("tandem_sessions_limit", "Most open sessions this replica accepts.",
                       ["model"])
SESSIONS = Counter("tandem_sessions", "Sessions opened on this replica.", ["model"])
STEPS_IN_FLIGHT = Gauge("tandem_steps_in_flight",
                        "Steps received and not yet answered (a target's decode run: until its "
                        "last token): queued for or running on the forward worker. The queue "
                        "depth to scale replicas on.", ["model"])
STEP_SECONDS = Histogram("tandem_replica_step_duration_seconds",
                         "Time from receiving a step to answering it, queueing included (a "
                         "target's decode run: to its last token).",
                         ["model"], buckets=SECONDS_BUCKETS)
KV_CACHED_TOKENS = Gauge("tandem_kv_cached_tokens",
                         "Tokens held in this replica's KV caches, over all sessions.", ["model"])
PREFIX_LOOKUPS = Counter("tandem_prefix_cache_lookups",
                        "Fresh sessions' first steps looked up in this replica's prefix cache, by "
                        "outcome: hit (a kept prefix was reused) or miss.", ["model", "outcome"])
PREFIX_REUSED_TOKENS = Counter("tandem_prefix_cache_reused_tokens",
                               "Prompt tokens whose KV came from the prefix cache (not computed).",
                               ["model"])
PREFIX_EVICTIONS = Counter("tandem_prefix_cache_evictions",
                           "Kept prefixes dropped for room (least recently used first).", ["model"])
PREFIX_HELD_TOKENS = Gauge("tandem_prefix_cache_tokens",
                           "Tokens held in this replica's prefix cache.", ["model"])
BATCH_SESSIONS = Histogram("tandem_batch_sessions", "Sessions whose steps shared one forward pass.",
                           ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128))
BATCH_TOKENS = Histogram("tandem_batch_tokens", "Tokens in one forward pass, over its sessions.",
                         ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))

PASS_STAGE_SECONDS = Histogram("tandem_pass_stage_duration_seconds",
                               "One forward pass's time by stage: host work before the forward "
                               "(before), the forward itself (forward), host work after it "
                               "(after: sampling, scoring, reading results).",
                               ["model", "stage"], buckets=SECONDS_BUCKETS)
PASS_HOST_BYTES = Counter("tandem_pass_host_bytes",
                          "Bytes forward passes read from device tensors into host memory.", ["model"])


def observe_step(*, drafted: int, accepted: int, draft_s: float, verify_s: float,
                 step_s: float) -> None:
    """Record one speculation step.

    `drafted` and `accepted` are this step's counts; `draft_s` and `verify_s` the compute
    times the services reported; `step_s` the step's wall time at the orchestrator. Each
    step commits its accepted tokens plus one more: a bonus token when the whole block was
    accepted, else a recovered one.
    """
    if drafted:
        DRAFTED_TOKENS.inc(drafted)
        ACCEPTED_TOKENS.inc(accepted)
        ACCEPTED_PER_STEP.observe(accepted)
        (BONUS_TOKENS if accepted == drafted else RECOVERED_TOKENS).inc()
    else:
        TARGET_ONLY_STEPS.inc()
    STAGE_SECONDS.labels(STAGE_DRAFT).observe(draft_s)
    STAGE_SECONDS.labels(STAGE_VERIFY).observe(verify_s)
    # NOTE: when drafting overlaps verification (the prefill step runs both at once) the
    # stages overlap too, and `other` is an underestimate, never negative.
    STAGE_SECONDS.labels(STAGE_OTHER).observe(max(0.0, step_s - draft_s - verify_s))


def observe_tokens(*, prompt: int, completion: int) -> None:
    PROMPT_TOKENS.inc(prompt)
    COMPLETION_TOKENS.inc(completion)


def status_code(exc: BaseException | None) -> str:
    """The gRPC status name a request ends with, for the `code` label."""
    code = grpc.StatusCode.OK
    if isinstance(exc, TandemError):
        code = exc.code
    elif isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
    elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        code = grpc.StatusCode.CANCELLED
    elif exc is not None:
        code = grpc.StatusCode.UNKNOWN
    return str(code.name)


@contextlib.contextmanager
def track_request(method: str) -> Iterator[None]:
    """Count a request, its status and its duration; works around an async generator's body."""
    in_flight = REQUESTS_IN_FLIGHT.labels(method)
    in_flight.inc()
    started = time.perf_counter()
    failure: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        failure = exc
        raise
    finally:
        in_flight.dec()
        REQUESTS.labels(method, status_code(failure)).inc()
        REQUEST_SECONDS.labels(method).observe(time.perf_counter() - started)


def set_replicas(pool: str, routable: int, terminating: int) -> None:
    REPLICAS.labels(pool, "routable").set(routable)
    REPLICAS.labels(pool, "terminating").set(terminating)


@dataclass(frozen=True)
class ReplicaMetrics:
    """The metrics of one draft or target replica, bound to its model label."""

    sessions_active: Gauge
    sessions: Counter
    steps_in_flight: Gauge
    step_seconds: Histogram
    kv_cached_tokens: Gauge
    batch_sessions: Histogram
    batch_tokens: Histogram
    model: str = ""

    @classmethod
    def for_model(cls, model: str, max_sessions: int) -> ReplicaMetrics:
        SESSIONS_LIMIT.labels(model).set(max_sessions)
        return cls(SESSIONS_ACTIVE.labels(model), SESSIONS.labels(model),
                   STEPS_IN_FLIGHT.labels(model), STEP_SECONDS.labels(model),
                   KV_CACHED_TOKENS.labels(model), BATCH_SESSIONS.labels(model),
                   BATCH_TOKENS.labels(model), model)

    def forward_pass(self, sessions: int, tokens: int, split: PassSplit = NO_SPLIT) -> None:
        """One forward pass of the step scheduler: how many sessions and tokens it served,
        and where its time went."""
        self.batch_sessions.observe(sessions)
        self.batch_tokens.observe(tokens)
        if split.passes:
            for stage, ms in (("before", split.before_ms), ("forward", split.forward_ms),
                              ("after", split.after_ms)):
                PASS_STAGE_SECONDS.labels(self.model, stage).observe(ms / 1000.0)
            PASS_HOST_BYTES.labels(self.model).inc(split.host_bytes)

    def session_opened(self) -> None:
        self.sessions.inc()
        self.sessions_active.inc()

    def session_closed(self) -> None:
        self.sessions_active.dec()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around answering one step: queue depth and latency."""
        self.steps_in_flight.inc()
        started = time.perf_counter()
        try:
            yield
        finally:
            self.steps_in_flight.dec()
            self.step_seconds.observe(time.perf_counter() - started)

    def kv_total(self, tokens: int) -> None:
        self.kv_cached_tokens.set(tokens)

    def prefix_lookup(self, reused: int) -> None:
        """A fresh session's first step looked up in the prefix cache: `reused` tokens came
        from it (0: a miss)."""
        PREFIX_LOOKUPS.labels(self.model, "hit" if reused else "miss").inc()
        PREFIX_REUSED_TOKENS.labels(self.model).inc(reused)

    def prefix_evicted(self) -> None:
        PREFIX_EVICTIONS.labels(self.model).inc()

    def prefix_held(self, tokens: int) -> None:
        PREFIX_HELD_TOKENS.labels(self.model).set(tokens)


@dataclass
class MetricsServer:
    """The HTTP endpoint that serves /metrics (on its own thread, so a busy event loop or a
    forward pass never delays a scrape)."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(host: str, port: int) -> MetricsServer:
    """Serve the default registry on http://host:port/metrics (port 0 picks a free port)."""
    server, thread = start_http_server(port, addr=host)
    return MetricsServer(server, thread)
