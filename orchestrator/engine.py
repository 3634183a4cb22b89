"""The engine: one generation as domain events, apart from any wire.

`Engine.generate(request, deadline_s)` validates a GenerationRequest, waits for an admission
slot, runs the speculation loop against the replicas, streams text (stop strings included),
and yields Delta events, then one Summary. It knows no front end: the gRPC servicer
(orchestrator/service.py) and the HTTP API (orchestrator/http.py) convert to and from it.
Errors are tandem.errors exceptions; each front end maps them to its own status codes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from orchestrator import discovery, remote
from orchestrator.admission import Admission
from orchestrator.config import OrchestratorConfig
from orchestrator.constraint import NO_CONSTRAINT, Constraint
from orchestrator.domain import (
    EMPTY_BLOCK,
    REGISTRY,
    Delta,
    Event,
    FinishReason,
    Generation,
    GenerationRequest,
    ModelInfo,
    Step,
    Summary,
    Usage,
    check_proposer,
    shares_compute,
)
from orchestrator.policy import POLICIES, BatchTable, CostModel, Deployment
from orchestrator.proposers import AutoProposer, DraftModelProposer, PromptLookupProposer, Proposer
from orchestrator.remote import (
    DRAFT_STUB,
    TARGET_STUB,
    DraftSession,
    ReplicaPool,
    TargetSession,
    fetch_model_info,
    fetch_tokenizer,
)
from orchestrator.speculation import speculate
from orchestrator.suffix import MAX_PATTERN, SuffixIndex, SuffixProposer
from orchestrator.text import TextStream
from tandem import metrics, models
from tandem.config import MAX_BLOCK_TOKENS, MAX_SUPPORT_SIZE, MAX_TOP_LOGPROBS
from tandem.errors import InvalidRequest, Unavailable
from tandem.grammar import Grammars
from tandem.sampling import SamplingParams, choice_seed, validate
from tandem.security import ClientTls

OVERLAP_SETTINGS = ("auto", "on", "off")  # --overlap

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
# A text prompt longer than this many characters per token of the target's context cannot
# fit (tokens of real vocabularies are far shorter): refused before it is tokenized.
MAX_CHARS_PER_TOKEN = 100
MAX_STOP_STRING_CHARS = 256
# Discovery: a replica Kubernetes calls ready is already SERVING, so describing it is quick;
# the first request waits at most DISCOVERY_SYNC_S for the first listing's replicas.
ADMIT_WAIT_S = 30.0
DISCOVERY_SYNC_S = 30.0


def _addresses(spec: str) -> list[str]:
    return [a.strip() for a in spec.split(",") if a.strip()]


def _incompatibility(info: ModelInfo, reference: ModelInfo) -> str | None:
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


class Engine:
    """Generations against a deployment's draft and target replicas."""

    def __init__(self, config: OrchestratorConfig) -> None:
        if bool(_addresses(config.target)) == bool(config.target_service_name):
            raise ValueError("set exactly one of --target (replica addresses) and "
                             "--target-service-name (discovery in Kubernetes)")
        if _addresses(config.draft) and config.draft_service_name:
            raise ValueError("set at most one of --draft and --draft-service-name")
        self.config = config
        self._upstream_tls = config.upstream_tls()
        self._upstream_files = self._upstream_tls.reloading() if self._upstream_tls else None
        self.tokenizer: Any = None
        self.grammars: Grammars | None = None  # the requests' grammars, over the target's tokenizer
        self.target_info: ModelInfo | None = None
        self.drafts: ReplicaPool | None = None
        self.targets: ReplicaPool | None = None
        if config.overlap not in OVERLAP_SETTINGS:
            raise ValueError(f"--overlap must be one of {', '.join(OVERLAP_SETTINGS)}, got {config.overlap!r}")
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
        self.has_drafts = bool(_addresses(config.draft) or config.draft_service_name)
        if config.proposer and check_proposer(config.proposer) in ("draft-model", "auto") \
                and not self.has_drafts:
            raise ValueError(f"--proposer {config.proposer} needs draft replicas (--draft or "
                             "--draft-service-name)")
        if config.suffix_cache_tokens < 0:
            raise ValueError(f"--suffix-cache-tokens must be at least 0, got {config.suffix_cache_tokens}")
        # Acceptance and draft cost differ per proposer; verify costs are the target's, shared.
        # overlap, auto: on until a draft replica turns out to share a target replica's hardware.
        self.deployment = Deployment(overlap=config.overlap != "off", by_batch=BatchTable.parse(
            config.speculation_by_batch, config.max_speculative_tokens))
        target_costs = CostModel(deployment=self.deployment)
        self.costs: dict[str, CostModel] = collections.defaultdict(target_costs.for_proposer)
        self.default_proposer = config.proposer or ("auto" if self.has_drafts else "none")
        # Recent outputs of every request, for suffix decoding to match (a cache of traffic).
        self.suffix_index = SuffixIndex(config.suffix_cache_tokens)
        metrics.SUFFIX_INDEX_TOKENS.set_function(lambda: self.suffix_index.tokens)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests)
        for waiting in (metrics.REQUESTS_QUEUED, metrics.EPP_WAITING):
            waiting.set_function(lambda: self.admission.waiting)
        metrics.EPP_RUNNING.set_function(lambda: self.admission.running)
        metrics.EPP_KV_USAGE.set_function(self.kv_usage)
        self._kube: Any = None  # the DiscoveryV1Api client, when discovering replicas
        self._namespace = config.namespace
        self._discoveries: list[discovery.ServiceDiscovery] = []
        self._discovery_synced: asyncio.Future[None] | None = None
        self._draftless = False  # no draft replica was ready for the last request

    # --- start-up ---------------------------------------------------------------------------

    def load(self) -> None:
        if self.config.target_service_name or self.config.draft_service_name:
            self._kube = discovery.connect(self.config.kubeconfig)
            self._namespace = self._namespace or discovery.default_namespace()
        reference = asyncio.run(self._check_replicas())
        if self.config.tokenizer:
            self.tokenizer, source = (models.load_tokenizer(self.config.tokenizer),
                                      f"tokenizer {self.config.tokenizer!r}")
        else:  # the reference target's own: no copy of the model here
            files = asyncio.run(fetch_tokenizer(reference, self.upstream_tls))
            self.tokenizer = models.tokenizer_from_files(files)
            source = f"the tokenizer target {reference} serves"
        fingerprint = models.tokenizer_fingerprint(self.tokenizer)
        assert self.target_info is not None
        if self.default_proposer not in self.offered():
            runs = ", ".join(sorted(self.target_info.proposers)) or "none"
            raise SystemExit(f"--proposer {self.config.proposer}: no target replica runs it (the "
                             f"target {self.target_info.model!r} runs: {runs}); start the targets "
                             "with it (--lookahead, --medusa-heads) or choose another")
        self.grammars = Grammars(self.tokenizer, self.target_info.vocab_size, self.target_info.eos_token_ids)
        if fingerprint != self.target_info.tokenizer_fingerprint:
            raise SystemExit(
                f"{source} does not match the target {self.target_info.model!r}; pass "
                "--tokenizer with the target's tokenizer")

    @property
    def upstream_tls(self) -> ClientTls | None:
        """How to reach the replicas: the --upstream-tls-* files as they are now."""
        return self._upstream_files.current() if self._upstream_files else self._upstream_tls

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.target_info is not None

    async def _check_replicas(self) -> str:
        """Wait for every replica, and refuse a draft/target pair that do not share a tokenizer.

        Returns the reference target's address.
        """
        cfg, wait = self.config, self.config.replica_wait_s
        target_addresses = _addresses(cfg.target)
        if not target_addresses:  # discovery: one ready target is the reference; the watch admits all
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
        self.costs["draft-model"].seed_verify(reference.pass_ms)  # v(T) is shared by proposers
        for address, draft in zip(_addresses(self.config.draft), drafts, strict=True):
            self._check_placement(draft, targets, address)
        return target_addresses[0]

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
        assert self.target_info is not None
        try:
            info = await fetch_model_info(address, stub_class, ADMIT_WAIT_S, self.upstream_tls)
        except Unavailable as exc:
            raise discovery.ReplicaRejected(f"cannot describe its model: {exc}") from exc
        problem = _incompatibility(info, self.target_info)
        if problem:
            raise discovery.ReplicaRejected(problem)
        if stub_class is DRAFT_STUB:
            self._check_placement(info, [self.target_info], address)

    def _check_placement(self, draft: ModelInfo, targets: Sequence[ModelInfo], address: str) -> None:
        """A draft on a target's hardware: the load rule charges drafting the draft's time too, and
        --overlap auto takes turns, since drafting ahead would take the verify's cycles (on
        this project's 2-core CPU, one client: 4.56 tokens/s taking turns against 3.27
        drafting ahead; docs/BENCHMARKS.md)."""
        if not any(shares_compute(draft, target) for target in targets):
            return
        self.deployment.draft_shares_target = True
        if self.config.overlap == "auto" and self.deployment.overlap:
            self.deployment.overlap = False
            log.info("--overlap auto: draft %s shares the target's hardware (%s), so draft and "
                     "target take turns (--overlap on drafts ahead anyway)", address,
                     "CPUs " + ",".join(map(str, sorted(draft.cpu_ids))) if draft.device.startswith("cpu")
                     else draft.device)

    def kv_usage(self) -> float:
        """The mean share of their KV budgets the target replicas here route to last reported."""
        replicas = [r for r in self.targets.replicas if not r.removed] if self.targets else []
        return sum(r.kv_usage for r in replicas) / len(replicas) if replicas else 0.0

    async def close(self) -> None:
        """Stop discovery and close the replicas' channels (tests; a process just exits)."""
        for watched in self._discoveries:
            await watched.close()
        await remote.streams_ended()
        for pool in (self.drafts, self.targets):
            if pool is not None:
                await pool.close()

    # --- requests ---------------------------------------------------------------------------

    def offered(self) -> set[str]:
        """The proposers requests may choose: the orchestrator's own, the drafts', the targets'."""
        assert self.target_info is not None
        offered = {name for name, spec in REGISTRY.items() if spec.runs_on == "orchestrator"}
        offered |= self.target_info.proposers
        if self.has_drafts:
            offered |= {"draft-model", "auto"}
        return offered

    def _proposer(self, requested: str, k: int, fixed: bool) -> str:
        """The proposer a request runs with: its own choice, else the deployment's; k=0 means
        none. A request that fixes k and leaves the proposer to an `auto` deployment gets the
        draft model: auto, like the adaptive k, chooses blocks by measured costs and other
        requests' outputs, and a fixed k means fixed blocks (a seeded request reproducible)."""
        name = requested or self.default_proposer
        if name not in (offered := self.offered()):
            raise InvalidRequest(f"proposer {name} is not offered by this deployment; "
                                 f"choose one of: {', '.join(sorted(offered))}")
        if name == "auto" and fixed and not requested:
            name = "draft-model"
        return "none" if k == 0 else name

    async def validate(self, request: GenerationRequest) -> tuple[Generation, tuple[str, ...]]:
        if not self.ready:
            raise Unavailable("the orchestrator is still connecting to its replicas")
        cfg, info = self.config, self.target_info
        assert info is not None
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
        params = SamplingParams(request.temperature, request.top_k, request.top_p)
        try:
            validate(params)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        explicit = request.num_speculative_tokens is not None
        k = request.num_speculative_tokens if explicit else cfg.num_speculative_tokens
        assert k is not None
        policy = "fixed" if explicit else cfg.speculation_policy
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise InvalidRequest(
                f"num_speculative_tokens must be in [0, {cfg.max_speculative_tokens}], got {k}")
        proposer = self._proposer(request.proposer, k, policy == "fixed")
        stops = request.stop_strings
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidRequest(
                f"stop_strings: at most {MAX_STOP_STRINGS}, each 1..{MAX_STOP_STRING_CHARS} characters")
        seed = request.seed if request.seed is not None else \
            int.from_bytes(os.urandom(8), "little") >> 2
        eos = frozenset() if request.ignore_eos else frozenset(info.eos_token_ids)
        await self._check_constraints(request, proposer)
        return Generation(tuple(prompt), max_new, params, seed, k, policy, proposer, eos,
                          max_free_tokens=k if explicit else cfg.max_speculative_tokens,
                          grammar=request.grammar, top_logprobs=request.logprobs), stops

    async def _check_constraints(self, request: GenerationRequest, proposer: str) -> None:
        """A request's grammar compiles (once per text, off the event loop) and its grammar and
        log-probabilities go with its proposer."""
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.logprobs}")
        wants = [what for what, on in (("grammar", request.grammar is not None),
                                       ("logprobs", request.logprobs is not None)) if on]
        if wants and REGISTRY[proposer].runs_on == "target":
            raise InvalidRequest(f"{' and '.join(wants)}: proposer {proposer} verifies token trees inside "
                                 "the target, which neither masks them nor returns log-probabilities; "
                                 "choose another proposer")
        if request.grammar is None:
            return
        if request.ignore_eos:
            raise InvalidRequest("ignore_eos cannot go with a grammar: the grammar ends the reply")
        assert self.grammars is not None
        await asyncio.to_thread(self.grammars.compile, request.grammar)

    async def generate(self, request: GenerationRequest, deadline_s: float | None = None
                       ) -> AsyncGenerator[Event, None]:
        """Delta events as tokens are committed, then one Summary.

        `deadline_s`: seconds the caller still waits (None: no deadline); it bounds every call
        to the replicas, and its passing ends the generation with DeadlineExceeded.
        """
        started = time.perf_counter()
        if not 1 <= request.n <= self.config.max_choices:
            raise InvalidRequest(f"n must be in [1, {self.config.max_choices}] (--max-choices), got {request.n}")
        gen, stops = await self.validate(request)
        async with self.admission.slot():
            events = self._generate(gen, stops, deadline_s, started) if request.n == 1 else \
                self._choices(gen, stops, deadline_s, started, request.n)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event

    async def _choices(self, gen: Generation, stops: tuple[str, ...], deadline_s: float | None,
                       started: float, n: int) -> AsyncGenerator[Event, None]:
        """n choices from one prompt: the prompt prefilled once (`_prefill`), then every choice
        generated at once, starting from it, each with its own seed; events tagged by choice."""
        cached = await self._prefill(gen, deadline_s)
        events: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

        async def run(choice: int) -> None:
            mine = dataclasses.replace(gen, seed=choice_seed(gen.seed, choice))
            try:
                async with contextlib.aclosing(self._generate(mine, stops, deadline_s, started)) as own:
                    async for event in own:
                        if isinstance(event, Summary):  # the prompt's reuse is the shared prefill's
                            event = dataclasses.replace(event, usage=dataclasses.replace(
                                event.usage, target_cached_tokens=cached[0], draft_cached_tokens=cached[1]))
                        await events.put(dataclasses.replace(event, choice=choice))
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which ends
                await events.put(exc)
            finally:
                await events.put(None)

        tasks = [asyncio.ensure_future(run(i)) for i in range(n)]
        try:
            ended = 0
            while ended < n:
                item = await events.get()
                if item is None:
                    ended += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _prefill(self, gen: Generation, deadline_s: float | None) -> tuple[int, int]:
        """The prompt's KV computed once on a target replica (and a draft replica, where the
        choices will draft from the start), in sessions that end at once: the replicas keep it
        in their prefix caches, and the choices' sessions, routed by the same prompt, start
        from it. The prompt tokens the prefill itself took from the caches (target, draft)."""
        drafts, targets = await self._pools()
        deadline = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
        session_id, prompt = uuid.uuid4().hex, list(gen.prompt_token_ids)
        target = TargetSession(targets, session_id, deadline, retry_s=self.config.replica_retry_s)
        drafting = gen.proposer in ("draft-model", "auto") and drafts is not None and drafts.ready and not (
            self.deployment.draft_shares_target and not self.deployment.overlap)
        draft = DraftSession(drafts, session_id, deadline) if drafting and drafts is not None else None
        try:
            scored = target.score(prompt, EMPTY_BLOCK, gen.sampling, gen.seed)
            if draft is None:
                result, block = await scored, EMPTY_BLOCK
            else:
                result, block = await asyncio.gather(scored, draft.propose(
                    prompt, 0, gen.sampling, self.config.max_support_size, gen.seed))
            await asyncio.gather(target.finish(), *(draft.finish(),) if draft else ())
        finally:
            await target.close()
            if draft is not None:
                await draft.close()
        return result.cached, block.cached

    def _orchestrator_proposer(self, name: str, drafts: ReplicaPool | None, session_id: str,
                               deadline: float | None) -> Proposer | None:
        """The proposer run here for `name`, or None when the target decodes (or proposes) alone.

        With discovery, every draft replica can be gone or draining at once (a rollout, the
        drain of the only one's node). Decoding without a draft is just as exact, only slower,
        so requests go on without one: counted, and logged when it starts.
        """
        if name == "prompt-lookup":
            return PromptLookupProposer(self.config.prompt_lookup_min_ngram,
                                        self.config.prompt_lookup_max_ngram)
        suffix = SuffixProposer(self.suffix_index)
        if name == "suffix":
            return suffix
        if name not in ("draft-model", "auto") or drafts is None:
            return None
        if drafts.ready:
            self._draftless = False
            draft = DraftModelProposer(DraftSession(drafts, session_id, deadline),
                                       self.config.max_support_size, self.deployment.overlap)
            return AutoProposer(draft, suffix) if name == "auto" else draft
        if not self._draftless:
            log.warning("no draft replica is ready: decoding with the target alone until one is")
            self._draftless = True
        metrics.DRAFTLESS_REQUESTS.inc()
        return suffix if name == "auto" else None

    async def _generate(self, gen: Generation, stops: tuple[str, ...], deadline_s: float | None,
                        started: float) -> AsyncGenerator[Event, None]:
        drafts, targets = await self._pools()
        deadline = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
        session_id = uuid.uuid4().hex
        proposer = self._orchestrator_proposer(gen.proposer, drafts, session_id, deadline)
        target_proposer = gen.proposer if REGISTRY[gen.proposer].runs_on == "target" else ""
        target = TargetSession(targets, session_id, deadline, retry_s=self.config.replica_retry_s,
                               proposer=target_proposer)
        if gen.top_logprobs is not None:
            target.top_logprobs = gen.top_logprobs
        constraint = NO_CONSTRAINT
        if gen.grammar is not None:
            assert self.grammars is not None
            start = len(gen.prompt_token_ids)
            constraint = Constraint(self.grammars.state(gen.grammar, start))
            for session in (target, *_draft_sessions(proposer)):
                session.grammar, session.grammar_start = gen.grammar, start
        text = TextStream(self.tokenizer, stops, gen.prompt_token_ids)
        usage = Usage(proposer=proposer.name if proposer else target_proposer or "none",
                      prompt_tokens=len(gen.prompt_token_ids))
        reason = FinishReason.LENGTH
        costs = self.costs[usage.proposer]
        self.deployment.active += 1
        output: list[int] = []
        try:
            async for step in speculate(gen, proposer, target, costs, constraint):
                output += step.token_ids
                kept = text.add_all(step.token_ids)
                usage = usage.fold(step, kept)
                _observe(step, first=usage.target_forward_passes == 1, started=started)
                if text.stopped:
                    reason = FinishReason.STOP_STRING
                elif step.finished_by_eos:
                    reason = FinishReason.EOS
                elif step.dead_end:
                    reason = FinishReason.GRAMMAR_DEAD_END
                yield Delta(tuple(step.token_ids[:kept]), text.take(), logprobs=step.logprobs[:kept])
                if text.stopped:
                    break
            rest = text.take(final=True)  # may complete a stop string (an incomplete last character)
            if text.stopped:
                reason = FinishReason.STOP_STRING
            if rest:
                yield Delta((), rest)
            wire_bytes = target.wire_bytes + (proposer.wire_bytes if proposer else 0)
            yield Summary(reason, usage, wire_bytes, (time.perf_counter() - started) * 1000.0)
        finally:
            self.deployment.active -= 1
            if output and self.suffix_index.max_tokens:  # with the prompt's end it may follow
                self.suffix_index.add([*gen.prompt_token_ids[-MAX_PATTERN:], *output])
            metrics.observe_tokens(prompt=usage.prompt_tokens, completion=usage.completion_tokens)
            await target.close()
            if proposer is not None:
                await proposer.close()


def _draft_sessions(proposer: Proposer | None) -> list[DraftSession]:
    """The draft replica's session a proposer drafts in (none for those that read the history)."""
    draft = proposer.draft if isinstance(proposer, AutoProposer) else proposer
    return [draft.session] if isinstance(draft, DraftModelProposer) else []


def _observe(step: Step, *, first: bool, started: float) -> None:
    """A step's metrics, from its own record (prefill's compute is not a decode step's)."""
    metrics.observe_step(drafted=step.drafted, accepted=step.accepted,
                         draft_s=0.0 if step.prefill else step.draft_ms / 1000.0,
                         verify_s=0.0 if step.prefill else step.target_ms / 1000.0,
                         step_s=step.wall_ms / 1000.0)
    if step.drafted and not step.prefill and step.draft_hit is not None:
        metrics.DRAFT_WAIT_SECONDS.observe(step.draft_wait_ms / 1000.0)
        metrics.DRAFT_CACHE.labels("hit" if step.draft_hit else "miss").inc()
    for service, cached in (("draft", step.draft_cached), ("target", step.target_cached)):
        if cached:
            metrics.CACHED_PROMPT_TOKENS.labels(service).inc(cached)
    if first and step.token_ids:
        metrics.TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - started)
