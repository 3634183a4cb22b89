"""OrchestratorService: the public API. Validates a request, runs the speculation loop, streams text."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc

from orchestrator.admission import Admission
from orchestrator.policy import POLICIES, CostModel
from orchestrator.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from orchestrator.remote import (
    DRAFT_STUB,
    TARGET_STUB,
    DraftSession,
    ReplicaPool,
    TargetSession,
    fetch_model_info,
)
from orchestrator.speculation import Generation, Step, Usage, speculate
from orchestrator.text import TextStream
from tandem import metrics, models
from tandem.config import MAX_BLOCK_TOKENS, MAX_SUPPORT_SIZE, option
from tandem.errors import InvalidRequest, Unavailable
from tandem.model_service import sampling_from
from tandem.security import ClientTls, ServerSecurityConfig, load_client_tls
from tandem.server import MAX_MESSAGE_BYTES, handle_errors
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

if TYPE_CHECKING:
    # Imported where used: the kubernetes client takes ~0.6 s to import, and only discovery
    # needs it.
    from orchestrator import discovery

log = logging.getLogger(__name__)

FinishReason: TypeAlias = orchestrator_pb2.FinishReason

MAX_STOP_STRINGS = 16
# A text prompt longer than this many characters per token of the target's context cannot
# fit (tokens of real vocabularies are far shorter): refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 100
MAX_STOP_STRING_CHARS = 256
# Discovery: a replica Kubernetes calls ready is already SERVING, so describing it is quick;
# the first request waits at most DISCOVERY_SYNC_S for the first listing's replicas.
ADMIT_WAIT_S = 30.0
DISCOVERY_SYNC_S = 30.0


@dataclass(frozen=True)
class OrchestratorConfig(ServerSecurityConfig):
    """Configuration of the orchestrator (TLS of its public API: ServerSecurityConfig)."""

    draft: str = option("", "draft replica addresses, comma-separated (empty: no draft)")
    target: str = option("", "target replica addresses, comma-separated")
    draft_service_name: str = option("", "Kubernetes Service whose EndpointSlices list the draft "
                                     "replicas (live discovery, instead of --draft)")
    target_service_name: str = option("", "Kubernetes Service whose EndpointSlices list the "
                                      "target replicas (live discovery, instead of --target)")
    namespace: str = option("", "namespace of those Services (empty: the pod's own)")
    kubeconfig: str = option("", "kubeconfig file for discovery from outside the cluster (empty: "
                             "the pod's service account, else $KUBECONFIG or ~/.kube/config)")
    service_port_name: str = option("grpc", "name of the gRPC port in those Services")
    tokenizer: str = option(models.DEFAULT_TARGET, "tokenizer: path, hub id or built-in name "
                            "(must match the replicas' tokenizer)")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(50051, "port to bind (0 picks a free one)")
    num_speculative_tokens: int = option(4, "default draft block length k, the most k under the "
                                         "adaptive policy (0: plain target decoding)")
    speculation_policy: str = option("adaptive", "adaptive: choose k per step from measured acceptance "
                                     "and costs (falls to 0 when speculation does not pay); fixed: "
                                     "always k. A request that sets num_speculative_tokens gets fixed k")
    max_speculative_tokens: int = option(16, "largest k a request may ask for")
    max_support_size: int = option(8, "K: support of each draft distribution sent over the wire")
    proposer: str = option("", "default proposer: draft-model, prompt-lookup, lookahead, medusa or "
                           "none (empty: draft-model when draft replicas are configured, else none)")
    prompt_lookup_min_ngram: int = option(2, "prompt lookup: shortest n-gram matched in the history")
    prompt_lookup_max_ngram: int = option(3, "prompt lookup: longest n-gram matched (tried first)")
    max_new_tokens_cap: int = option(4096, "largest max_new_tokens a request may ask for")
    default_max_new_tokens: int = option(256, "max_new_tokens when a request leaves it unset")
    replica_retry_s: float = option(10.0, "how long a request whose target session was lost waits "
                                    "for a target replica to rebuild it on (e.g. a restart), once "
                                    "every replica was tried")
    max_concurrent_requests: int = option(256, "requests generating at once; more wait in the "
                                          "queue")
    max_queued_requests: int = option(1024, "requests waiting for a running slot; beyond running "
                                      "+ queued, a request gets RESOURCE_EXHAUSTED")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest request message accepted, in "
                                    "bytes; a larger one gets RESOURCE_EXHAUSTED")
    replica_wait_s: float = option(600.0, "how long start-up waits for replicas to be SERVING")
    grace_s: float = option(30.0, "seconds to drain in-flight streams on SIGTERM")
    metrics_port: int = option(-1, "port for Prometheus metrics over HTTP (0 picks a free one; "
                               "-1: none)")
    log_level: str = option("INFO", "logging level")
    auth_token_file: str = option("", "file holding the bearer token every public API call must "
                                  "send (empty: no authentication); health and reflection "
                                  "stay open")
    upstream_tls_ca: str = option("", "PEM CA bundle to verify draft/target certificates with "
                                  "(setting any --upstream-tls-* turns on TLS to the replicas)")
    upstream_tls_cert: str = option("", "PEM client certificate to present to the replicas "
                                    "(mutual TLS)")
    upstream_tls_key: str = option("", "PEM private key of --upstream-tls-cert")
    upstream_tls_server_name: str = option("", "name to verify replica certificates against "
                                           "(discovered replicas are dialled by pod IP)")

    def upstream_tls(self) -> ClientTls | None:
        return load_client_tls(self.upstream_tls_ca, self.upstream_tls_cert,
                               self.upstream_tls_key, self.upstream_tls_server_name,
                               flag="--upstream-tls")


def proposer_kind(name: str) -> int:
    """common_pb2.Proposer from a flag value such as "prompt-lookup"."""
    try:
        kind: int = common_pb2.Proposer.Value("PROPOSER_" + name.upper().replace("-", "_"))
    except ValueError:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(PROPOSER_NAMES)}") from None
    if kind == common_pb2.PROPOSER_UNSPECIFIED:
        raise ValueError(f"unknown proposer {name!r}; choose one of {', '.join(PROPOSER_NAMES)}")
    return kind


PROPOSER_NAMES = ("none", "draft-model", "prompt-lookup", "lookahead", "medusa")


def _addresses(spec: str) -> list[str]:
    return [a.strip() for a in spec.split(",") if a.strip()]


def _incompatibility(info: common_pb2.ModelInfo, reference: common_pb2.ModelInfo) -> str | None:
    """Why a replica cannot pair with the reference target, or None."""
    if info.tokenizer_fingerprint != reference.tokenizer_fingerprint:
        return (f"model {info.model!r} does not share a tokenizer with target "
                f"{reference.model!r}: their token ids mean different things, so its drafts "
                "cannot be verified. Use a draft from the target's model family.")
    if info.vocab_size > reference.vocab_size:
        return (f"model {info.model!r} has {info.vocab_size} output rows but target "
                f"{reference.model!r} has {reference.vocab_size}; a draft could propose ids "
                "the target cannot score")
    return None


async def _observed_steps(steps: AsyncIterator[Step], usage: Usage) -> AsyncIterator[Step]:
    """Pass the loop's steps through, recording each step's metrics from the usage it added,
    so the speculation loop itself stays free of instrumentation."""
    started = resumed = time.perf_counter()
    before = dataclasses.replace(usage)
    first = True
    async for step in steps:
        now = time.perf_counter()
        metrics.observe_step(drafted=usage.drafted_tokens - before.drafted_tokens,
                             accepted=usage.accepted_tokens - before.accepted_tokens,
                             draft_s=(usage.draft_ms - before.draft_ms) / 1000.0,
                             verify_s=(usage.target_ms - before.target_ms) / 1000.0,
                             step_s=now - resumed)
        if first and step.token_ids:
            metrics.TIME_TO_FIRST_TOKEN.observe(now - started)
            first = False
        before = dataclasses.replace(usage)
        yield step
        resumed = time.perf_counter()


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    name = "tandem.v1.OrchestratorService"

    def __init__(self, config: OrchestratorConfig) -> None:
        if bool(_addresses(config.target)) == bool(config.target_service_name):
            raise ValueError("set exactly one of --target (replica addresses) and "
                             "--target-service-name (discovery in Kubernetes)")
        if _addresses(config.draft) and config.draft_service_name:
            raise ValueError("set at most one of --draft and --draft-service-name")
        self.config = config
        self.upstream_tls = config.upstream_tls()
        self.tokenizer: Any = None
        self.target_info: common_pb2.ModelInfo | None = None
        self.drafts: ReplicaPool | None = None
        self.targets: ReplicaPool | None = None
        if config.speculation_policy not in POLICIES:
            raise ValueError(f"--speculation-policy must be one of {POLICIES}")
        if config.max_speculative_tokens > MAX_BLOCK_TOKENS:
            raise ValueError(f"--max-speculative-tokens {config.max_speculative_tokens} exceeds the "
                             f"{MAX_BLOCK_TOKENS} tokens the draft and target services score per block")
        if not 0 <= config.num_speculative_tokens <= config.max_speculative_tokens:
            raise ValueError(f"--num-speculative-tokens {config.num_speculative_tokens} must be in [0, "
                             f"--max-speculative-tokens {config.max_speculative_tokens}]")
        if not 1 <= config.default_max_new_tokens <= config.max_new_tokens_cap:
            raise ValueError(f"--default-max-new-tokens {config.default_max_new_tokens} must be in [1, "
                             f"--max-new-tokens-cap {config.max_new_tokens_cap}]")
        if not 1 <= config.max_support_size <= MAX_SUPPORT_SIZE:
            raise ValueError(f"--max-support-size {config.max_support_size} must be in [1, "
                             f"{MAX_SUPPORT_SIZE}] (what a draft service sends per token)")
        has_drafts = bool(_addresses(config.draft) or config.draft_service_name)
        if config.proposer and proposer_kind(config.proposer) == common_pb2.PROPOSER_DRAFT_MODEL \
                and not has_drafts:
            raise ValueError("--proposer draft-model needs draft replicas (--draft or "
                             "--draft-service-name)")
        # Acceptance and draft cost differ per proposer; verify costs are the target's, shared.
        target_costs = CostModel()
        self.costs: dict[int, CostModel] = collections.defaultdict(target_costs.for_proposer)
        self.default_proposer = proposer_kind(config.proposer) if config.proposer else (
            common_pb2.PROPOSER_DRAFT_MODEL if has_drafts else common_pb2.PROPOSER_NONE)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests)
        self._kube: Any = None  # the DiscoveryV1Api client, when discovering replicas
        self._namespace = config.namespace
        self._discoveries: list[discovery.ServiceDiscovery] = []
        self._discovery_synced: asyncio.Future[None] | None = None
        self._draftless = False  # no draft replica was ready for the last request

    def add_to(self, server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(self, server)

    def load(self) -> None:
        if self.config.target_service_name or self.config.draft_service_name:
            from orchestrator import discovery

            self._kube = discovery.connect(self.config.kubeconfig)
            self._namespace = self._namespace or discovery.default_namespace()
        asyncio.run(self._check_replicas())
        self.tokenizer = models.load_tokenizer(self.config.tokenizer)
        fingerprint = models.tokenizer_fingerprint(self.tokenizer)
        assert self.target_info is not None
        if self.default_proposer not in self._offered():
            runs = ", ".join(common_pb2.Proposer.Name(p) for p in self.target_info.proposers) or "none"
            raise SystemExit(f"--proposer {self.config.proposer}: no target replica runs it (the "
                             f"target {self.target_info.model!r} runs: {runs}); start the targets "
                             "with it (--lookahead, --medusa-heads) or choose another")
        if fingerprint != self.target_info.tokenizer_fingerprint:
            raise SystemExit(
                f"tokenizer {self.config.tokenizer!r} does not match the target "
                f"{self.target_info.model!r}; pass --tokenizer with the target's tokenizer")

    async def _check_replicas(self) -> None:
        """Wait for every replica, and refuse a draft/target pair that do not share a tokenizer."""
        cfg, wait = self.config, self.config.replica_wait_s
        target_addresses = _addresses(cfg.target)
        if not target_addresses:  # discovery: one ready target is the reference; the watch admits all
            from orchestrator import discovery

            target_addresses = [await discovery.first_ready(
                self._kube, self._namespace, cfg.target_service_name, cfg.service_port_name, wait)]
        targets = await asyncio.gather(*(fetch_model_info(a, TARGET_STUB, wait, self.upstream_tls)
                                         for a in target_addresses))
        # Discovered drafts are checked one by one as they appear (_admit).
        drafts = await asyncio.gather(*(fetch_model_info(a, DRAFT_STUB, wait, self.upstream_tls)
                                        for a in _addresses(self.config.draft)))
        reference = targets[0]
        for info in (*targets, *drafts):
            problem = _incompatibility(info, reference)
            if problem:
                raise SystemExit(problem)
        self.target_info = reference

    async def _pools(self) -> tuple[ReplicaPool | None, ReplicaPool]:
        # Channels bind to the serving event loop, so they are made on first use, not in load().
        if self.targets is None:
            self.targets = ReplicaPool(_addresses(self.config.target), TARGET_STUB,
                                       self.upstream_tls)
            drafts = _addresses(self.config.draft)
            self.drafts = (ReplicaPool(drafts, DRAFT_STUB, self.upstream_tls)
                           if drafts or self.config.draft_service_name else None)
            self._discovery_synced = asyncio.ensure_future(self._start_discovery())
        assert self._discovery_synced is not None
        await asyncio.shield(self._discovery_synced)
        return self.drafts, self.targets

    async def _start_discovery(self) -> None:
        """Follow the configured Services' EndpointSlices; return once the first listing is in."""
        cfg = self.config
        if not (cfg.target_service_name or cfg.draft_service_name):
            return
        from orchestrator import discovery

        services = [(cfg.target_service_name, self.targets, TARGET_STUB, "target"),
                    (cfg.draft_service_name, self.drafts, DRAFT_STUB, "draft")]
        for service, pool, stub, label in services:
            if service and pool is not None:
                watched = discovery.ServiceDiscovery(
                    self._kube, self._namespace, service, cfg.service_port_name, pool, label,
                    functools.partial(self._admit, stub))
                watched.start()
                self._discoveries.append(watched)
        await asyncio.gather(*(d.wait_synced(DISCOVERY_SYNC_S) for d in self._discoveries))

    async def _admit(self, stub_class: type, address: str) -> None:
        """Let a discovered replica in only if it pairs with the target, as at start-up."""
        from orchestrator.discovery import ReplicaRejected

        assert self.target_info is not None
        try:
            info = await fetch_model_info(address, stub_class, ADMIT_WAIT_S, self.upstream_tls)
        except (Unavailable, grpc.aio.AioRpcError) as exc:
            raise ReplicaRejected(f"cannot describe its model: {exc}") from exc
        problem = _incompatibility(info, self.target_info)
        if problem:
            raise ReplicaRejected(problem)

    def _orchestrator_proposer(self, kind: int, drafts: ReplicaPool | None, session_id: str,
                               deadline: float | None) -> Proposer | None:
        """The proposer run here for `kind`, or None when the target decodes (or proposes) alone.

        With discovery, every draft replica can be gone or draining at once (a rollout, the
        drain of the only one's node). Decoding without a draft is just as exact, only slower,
        so requests go on without one: counted, and logged when it starts.
        """
        if kind == common_pb2.PROPOSER_PROMPT_LOOKUP:
            return PromptLookupProposer(self.config.prompt_lookup_min_ngram,
                                        self.config.prompt_lookup_max_ngram)
        if kind != common_pb2.PROPOSER_DRAFT_MODEL or drafts is None:
            return None
        if drafts.ready:
            self._draftless = False
            return DraftModelProposer(DraftSession(drafts, session_id, deadline),
                                      self.config.max_support_size)
        if not self._draftless:
            log.warning("no draft replica is ready: decoding with the target alone until one is")
            self._draftless = True
        metrics.DRAFTLESS_REQUESTS.inc()
        return None

    async def close(self) -> None:
        """Stop discovery and close the replicas' channels (tests; a process just exits)."""
        for watched in self._discoveries:
            await watched.close()
        for pool in (self.drafts, self.targets):
            if pool is not None:
                await pool.close()

    async def _validate(self, request: Any) -> tuple[Generation, tuple[str, ...]]:
        if self.tokenizer is None or self.target_info is None:
            raise Unavailable("the orchestrator is still connecting to its replicas")
        cfg, info = self.config, self.target_info
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("set exactly one of prompt and prompt_token_ids, not both")
        if request.prompt_token_ids:
            prompt = list(request.prompt_token_ids)
            bad = [t for t in prompt if not 0 <= t < info.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt_token_ids must be in [0, {info.vocab_size}); got {bad[:5]}")
        elif request.prompt:
            most = MAX_CHARS_PER_TOKEN * info.max_context_tokens
            if info.max_context_tokens and len(request.prompt) > most:
                raise InvalidRequest(
                    f"prompt has {len(request.prompt)} characters, more than {MAX_CHARS_PER_TOKEN} per "
                    f"token of the target's {info.max_context_tokens}-token context ({most}); shorten it")
            # Off the event loop: a long prompt takes a while to tokenize, and other streams go on.
            prompt = await asyncio.to_thread(self.tokenizer.encode, request.prompt)
        else:
            raise InvalidRequest("prompt is empty: set prompt (text) or prompt_token_ids")
        max_new = request.max_new_tokens or cfg.default_max_new_tokens
        if not 1 <= max_new <= cfg.max_new_tokens_cap:
            raise InvalidRequest(f"max_new_tokens must be in [1, {cfg.max_new_tokens_cap}], got {max_new}")
        if info.max_context_tokens and len(prompt) + max_new > info.max_context_tokens:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) exceeds the target's "
                f"context of {info.max_context_tokens} tokens; shorten the prompt or max_new_tokens")
        params = sampling_from(request.sampling)
        explicit = request.HasField("num_speculative_tokens")
        k = request.num_speculative_tokens if explicit else cfg.num_speculative_tokens
        policy = "fixed" if explicit else cfg.speculation_policy
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise InvalidRequest(
                f"num_speculative_tokens must be in [0, {cfg.max_speculative_tokens}], got {k}")
        proposer = self._proposer(request.proposer, k)
        stops = tuple(request.stop_strings)
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidRequest(
                f"stop_strings: at most {MAX_STOP_STRINGS}, each 1..{MAX_STOP_STRING_CHARS} characters")
        seed = request.seed if request.HasField("seed") else int.from_bytes(os.urandom(8), "little") >> 2
        eos = frozenset() if request.ignore_eos else frozenset(info.eos_token_ids)
        return Generation(tuple(prompt), max_new, params, seed, k, policy, proposer, eos), stops

    def _offered(self) -> set[int]:
        """The proposers requests may choose: the orchestrator's own, the drafts', the targets'."""
        assert self.target_info is not None
        offered = {common_pb2.PROPOSER_NONE, common_pb2.PROPOSER_PROMPT_LOOKUP,
                   *self.target_info.proposers}
        if self.config.draft or self.config.draft_service_name:
            offered.add(common_pb2.PROPOSER_DRAFT_MODEL)
        return offered

    def _proposer(self, requested: int, k: int) -> int:
        """The proposer a request runs with: its own choice, else the deployment's; k=0 means none."""
        kind = requested or self.default_proposer
        if kind not in (offered := self._offered()):
            names = ", ".join(common_pb2.Proposer.Name(p) for p in sorted(offered))
            what = (common_pb2.Proposer.Name(kind) if kind in common_pb2.Proposer.values()
                    else f"value {kind}")
            raise InvalidRequest(f"proposer {what} is not offered by this deployment; "
                                 f"choose one of: {names}")
        return common_pb2.PROPOSER_NONE if k == 0 else kind

    async def _run(self, request: Any, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[tuple[list[int], str, FinishReason, Usage, int]]:
        """Yield (token_ids, text, finish_reason, usage, wire_bytes) per step; finish_reason 0 until the end."""
        gen, stops = await self._validate(request)
        async with self.admission.slot():
            async for step in self._generate(gen, stops, context):
                yield step

    async def _generate(self, gen: Generation, stops: tuple[str, ...],
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[tuple[list[int], str, FinishReason, Usage, int]]:
        drafts, targets = await self._pools()
        remaining = context.time_remaining()
        deadline = (asyncio.get_running_loop().time() + remaining
                    if remaining is not None and math.isfinite(remaining) else None)
        session_id = uuid.uuid4().hex
        proposer = self._orchestrator_proposer(gen.proposer, drafts, session_id, deadline)
        target_proposer = (gen.proposer if gen.proposer in (common_pb2.PROPOSER_LOOKAHEAD,
                                                            common_pb2.PROPOSER_MEDUSA) else 0)
        target = TargetSession(targets, session_id, deadline, retry_s=self.config.replica_retry_s,
                               proposer=target_proposer)
        text = TextStream(self.tokenizer, stops, gen.prompt_token_ids)
        usage = Usage()
        reason: FinishReason = orchestrator_pb2.FINISH_REASON_LENGTH
        usage.proposer = proposer.kind if proposer else target_proposer or common_pb2.PROPOSER_NONE
        costs = self.costs[usage.proposer]
        try:
            async for step in _observed_steps(speculate(gen, proposer, target, usage, costs), usage):
                kept = []
                for token in step.token_ids:
                    kept.append(token)
                    text.add(token)
                    if text.stopped:
                        break
                if text.stopped:
                    usage.completion_tokens -= len(step.token_ids) - len(kept)
                    usage.accepted_tokens -= step.accepted - min(step.accepted, len(kept))
                    reason = orchestrator_pb2.FINISH_REASON_STOP_STRING
                elif step.finished_by_eos:
                    reason = orchestrator_pb2.FINISH_REASON_EOS
                wire = target.wire_bytes + (proposer.wire_bytes if proposer else 0)
                yield kept, text.take(), orchestrator_pb2.FINISH_REASON_UNSPECIFIED, usage, wire
                if text.stopped:
                    break
            wire = target.wire_bytes + (proposer.wire_bytes if proposer else 0)
            rest = text.take(final=True)  # may complete a stop string (an incomplete last character)
            if text.stopped:
                reason = orchestrator_pb2.FINISH_REASON_STOP_STRING
            yield [], rest, reason, usage, wire
        finally:
            metrics.observe_tokens(prompt=usage.prompt_tokens, completion=usage.completion_tokens)
            await target.close()
            if proposer is not None:
                await proposer.close()

    @staticmethod
    def _usage(usage: Usage, wire_bytes: int, started: float) -> orchestrator_pb2.Usage:
        return orchestrator_pb2.Usage(
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            drafted_tokens=usage.drafted_tokens, accepted_tokens=usage.accepted_tokens,
            rejected_tokens=usage.rejected_tokens,
            target_forward_passes=usage.target_forward_passes, wire_bytes=wire_bytes,
            draft_ms=usage.draft_ms, target_ms=usage.target_ms, prefill_ms=usage.prefill_ms,
            proposer=cast(common_pb2.Proposer, usage.proposer),
            total_ms=(time.perf_counter() - started) * 1000.0)

    @handle_errors
    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        started = time.perf_counter()
        with metrics.track_request("Generate"):
            async for token_ids, text, reason, usage, wire in self._run(request, context):
                if token_ids or text:
                    yield orchestrator_pb2.GenerateResponse(
                        delta=orchestrator_pb2.TokenDelta(token_ids=token_ids, text=text))
                if reason:
                    yield orchestrator_pb2.GenerateResponse(summary=orchestrator_pb2.GenerationSummary(
                        finish_reason=reason, usage=self._usage(usage, wire, started)))

    @handle_errors
    async def GenerateUnary(
        self, request: orchestrator_pb2.GenerateUnaryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GenerateUnaryResponse:
        started = time.perf_counter()
        reply = orchestrator_pb2.GenerateUnaryResponse()
        with metrics.track_request("GenerateUnary"):
            async for token_ids, text, reason, usage, wire in self._run(request, context):
                reply.token_ids.extend(token_ids)
                reply.text += text
                if reason:
                    reply.finish_reason = reason
                    reply.usage.CopyFrom(self._usage(usage, wire, started))
        return reply
