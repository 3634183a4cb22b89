"""What the draft and target services share: hosting one model and its sessions.

A `ModelHost` loads the model with its placement, describes it, runs forward passes
one at a time on a worker thread (the asyncio loop stays free for I/O; a batching
scheduler can replace the single worker later without touching the services), and
turns a bidirectional stream into a session whose KV cache is freed when the stream
ends, however it ends.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoConfig, AutoTokenizer, DynamicCache

from tandem import batching, decode_graph, head, host, llama, matmul, models, parallel, topology
from tandem.config import option
from tandem.errors import BudgetHeld, InvalidRequest, Unavailable
from tandem.grammar import Grammars, GrammarState, spec_from
from tandem.kv import KVSession, SessionTable, copy_cache, fork_cache, free_cache
from tandem.lm import Capabilities, CausalLM
from tandem.metrics import ReplicaMetrics
from tandem.prefix import PrefixCache
from tandem.sampling import SamplingParams, validate
from tandem.security import ServerSecurityConfig
from tandem.server import MAX_MESSAGE_BYTES, handle_errors, serve_liveness
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

BOOT_ID = "/proc/sys/kernel/random/boot_id"
TRANSFORMERS, LLAMA_CPP = "transformers", "llama.cpp"
BACKENDS = (models.AUTO, TRANSFORMERS, LLAMA_CPP)


def accelerator_ids(model: torch.nn.Module) -> list[str]:
    """UUIDs of the GPUs holding the model's weights (none on a CPU)."""
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    return sorted(str(getattr(torch.cuda.get_device_properties(d), "uuid", d)) for d in devices)


def boot_id() -> str:
    """This machine's boot id, shared by every process and container on it ("" where unknown)."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""
R = TypeVar("R")
# The prefix cache's bound where no KV budget sets one (--prefix-cache-tokens 0).
DEFAULT_PREFIX_TOKENS = 16384
# Entries the prefix cache keeps at most: on llama.cpp each holds one of its sequences.
PREFIX_ENTRIES = 64
LLAMA_PREFIX_ENTRIES = 32
# How long a fresh session's first step waits for sessions closed with a pass still running to
# be kept (their passes were cancelled: they end within a pass).
KEEP_WAIT_S = 1.0
# How long a step waits for room in the KV budget held by running passes before RESOURCE_EXHAUSTED.
BUDGET_WAIT_S = 30.0


@dataclass(frozen=True)
class ModelServiceConfig(ServerSecurityConfig):
    """Configuration of a draft or target service (TLS fields: ServerSecurityConfig)."""

    model: str = option("", "model: local path, hub id, or a built-in name; a draft may also "
                        "name a .gguf file or a directory holding one")
    backend: str = option("auto", "what runs the model: transformers, llama.cpp (a GGUF model, "
                          "through llama-cpp-python), or auto. A draft under auto: llama.cpp for a "
                          "GGUF model (a built-in one included) where it is installed, else "
                          "transformers. A target under auto on a CPU, for a model both can run "
                          "(a built-in one): each is loaded and timed at start-up and the one "
                          "expected to serve more tokens per second with speculation is kept; "
                          "llama.cpp for a GGUF file alone; transformers on a GPU or otherwise")
    gguf_file: str = option("", "the GGUF file to load from a directory holding several")
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "port to bind (0 picks a free one)")
    device: str = option("cpu", "cpu, cuda, cuda:N, or an accelerate device map: auto, balanced, "
                         "sequential, or a JSON {module: device} map")
    dtype: str = option("float32", "float32, bfloat16, float16, or auto: the model's own dtype on "
                        "a GPU, bfloat16 on a CPU with bf16 instructions, else float32")
    max_memory: str = option("", "accelerate max_memory for device maps, e.g. 0=70GiB,1=70GiB")
    quantize: str = option("", "draft only: int8-dynamic quantizes the Linear layers (CPU, float32), "
                           "or auto: where the timing at start-up (--matmul auto) finds int8 "
                           "cheaper than float32 on this CPU; "
                           "changes acceptance, never the output")
    matmul: str = option("auto", "how the linear layers multiply on a CPU: auto (time each "
                         "weight shape on each path at start-up, keep the faster), default "
                         "(torch's own kernels), or onednn (weights prepacked for oneDNN)")
    threads: int = option(0, "torch intra-op threads (0: torch's default; per rank)")
    cpu_affinity: str = option("", "pin the service to these CPUs, e.g. 0, 2-3 or 0,2-3 (empty: "
                               "not pinned); with --threads, lets one machine emulate separate "
                               "hardware for the draft and the target")
    max_batch_sessions: int = option(32, "most sessions whose steps share one forward pass (1: "
                                     "one session per pass, the unbatched baseline)")
    max_batch_tokens: int = option(512, "most tokens in one forward pass over its sessions (a "
                                   "longer single step, such as a prefill, still runs alone)")
    batch_token_buckets: str = option("auto", "pad each batched pass's tokens up to one of these "
                                      "sizes: auto and off pad nothing (no batched pass is captured "
                                      "as a CUDA graph); or sizes like 8,16,32")
    decode_graph: str = option("auto", "target only: a decode run's one-token passes, for a session "
                               "alone in its pass, through a static KV slot and one compiled step: "
                               "compile (torch.compile; on a GPU captured as a CUDA graph), eager "
                               "(the same step uncompiled), off, or auto: compile on cuda, else off")
    decode_graph_tokens: int = option(4096, "target only: positions in the decode graph's static KV "
                                      "slot (passes of longer sessions run uncaptured)")
    vocab_slice_bytes: int = option(1 << 20, "target only, on a CPU: a greedy pass reads each row's "
                                    "argmax from its output projection one slice of the vocabulary "
                                    "at a time, each slice this many bytes of logits, never holding "
                                    "the whole row (0: through the whole head's logits)")
    tensor_parallel_size: int = option(1, "shard the model over N ranks with torch.distributed "
                                       "(gloo on CPU, NCCL on CUDA, one GPU per rank); rank 0 "
                                       "serves. Without --tp-rank (or torchrun's RANK), rank 0 "
                                       "starts ranks 1..N-1 on this machine")
    tp_rank: int = option(-1, "this process's rank in a tensor-parallel group that spans "
                          "machines (-1: RANK from the environment, as torchrun sets it, or "
                          "LWS_WORKER_INDEX, as a LeaderWorkerSet does; else 0, with the other "
                          "ranks started locally)")
    tp_master: str = option("", "rank 0's rendezvous HOST:PORT for a group that spans machines "
                            "(default: MASTER_ADDR:MASTER_PORT, as torchrun sets them, or a "
                            "LeaderWorkerSet's LWS_LEADER_ADDRESS on MASTER_PORT or 29500)")
    tp_timeout_s: float = option(60.0, "a rank that fails or stalls a collective for this long "
                                 "stops the replica: NOT_SERVING, then exit non-zero; a "
                                 "follower's liveness (gRPC health on its --port) turns "
                                 "NOT_SERVING when rank 0 has not reached it for this long")
    tp_start_timeout_s: float = option(1800.0, "how long the ranks of a tensor-parallel group "
                                       "wait for each other to join and to load")
    max_sessions: int = option(256, "most concurrent sessions (streams) on this replica")
    kv_budget_tokens: int = option(0, "most tokens held in KV caches over all sessions; when a step "
                                   "needs room, idle sessions' caches are evicted least recently "
                                   "used first and rebuilt from history on their next step (0: "
                                   "no budget; the log gives the bytes per token)")
    prefix_cache: str = option("on", "on: the KV of a finished session is kept, and a new session "
                               "whose prompt starts with kept tokens computes only the rest "
                               "(conversations, shared system prompts); off: every session "
                               "computes its whole prompt")
    prefix_cache_tokens: int = option(0, "most tokens the prefix cache keeps (0: the KV budget where "
                                      "--kv-budget-tokens or llama.cpp's context sets one, since "
                                      "kept prefixes are evicted before any session's cache; else "
                                      f"{DEFAULT_PREFIX_TOKENS})")
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, "largest request message accepted, in "
                                    "bytes; a larger one gets RESOURCE_EXHAUSTED")
    lookahead: str = option("5,3,5", "target only: Lookahead decoding's window W, n-gram size N and "
                            "candidates G as W,N,G (off: do not offer it)")
    grace_s: float = option(30.0, "seconds to drain in-flight streams on SIGTERM")
    metrics_port: int = option(-1, "port for Prometheus metrics over HTTP (0 picks a free one; "
                               "-1: none)")
    log_level: str = option("INFO", "logging level")
    medusa_heads: str = option("", "target only: Medusa heads (a directory or hub id in the "
                               "published format, e.g. from tandem train-medusa); offers proposer "
                               "medusa")
    medusa_choices: str = option("", "target only: the Medusa tree as a JSON list of paths of "
                                 "top-k indices, e.g. [[0],[1],[0,0]] (default: a 14-node tree "
                                 "of depth 3, sized for CPUs)")


@dataclass(frozen=True)
class Step:
    """One step's cache bookkeeping, common to draft and target requests."""

    cache_position: int
    new_token_ids: list[int]


#: The acceptance rate `choose_backend` weighs speculation at: near the middle of what the
#: built-in pair accepts on code (about 0.8) and on prose (about 0.4).
CHOICE_ACCEPTANCE = 0.6


def choose_backend(timings: dict[str, dict[int, float]]) -> tuple[str, dict[str, float]]:
    """--backend auto's choice from each backend's v(T): the one expected to serve the most
    tokens per second with speculation, and each one's figure.

    A pass of T tokens verifies T - 1 drafted ones and yields E(T - 1) tokens, where
    E(k) = (1 - a^(k+1)) / (1 - a) at acceptance a (Leviathan et al. 2023); a backend's figure
    is the best E(T - 1) / v(T) over the sizes timed, T = 1 (no speculation) included, so a
    backend whose blocks cost as much as their tokens one by one is judged on its plain
    decoding. Ties go to the first backend named.
    """
    a = CHOICE_ACCEPTANCE

    def rate(v: dict[int, float]) -> float:
        return max((1000.0 * (1 - a ** t) / (1 - a) / ms for t, ms in v.items() if ms > 0), default=0.0)

    rates = {backend: rate(v) for backend, v in timings.items()}
    return max(rates, key=lambda b: rates[b]), rates


@dataclass(eq=False)
class _Opened:
    """A model loaded on one backend and timed, not yet serving."""

    engine: Any  # the transformers model (its rank's shard) or the LlamaEngine
    pass_times: dict[int, float]  # v(T), ms
    started: float  # perf_counter() when its load began
    dtype: str = ""  # transformers: what its weights run in
    group: parallel.Group | None = None  # transformers: its tensor-parallel group
    path: Path | None = None  # llama.cpp: its GGUF file


class ModelHost:
    def __init__(self, config: ModelServiceConfig, tensor_parallel: topology.Topology | None = None
                 ) -> None:
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.model: CausalLM | None = None
        # Why the replica stopped itself (a tensor-parallel rank failed): it exits non-zero.
        self.failure: BaseException | None = None
        self.info: common_pb2.ModelInfo | None = None
        self.tokenizer: Any = None
        self.grammars: Grammars | None = None  # the requests' grammars, from the first one
        self.sessions = SessionTable(config.max_sessions, config.kv_budget_tokens)
        # Why sessions cannot share a pass, found on the float weights before a quantized model
        # is served (otherwise the probe finds it out on the served model).
        self.batch_refusal: str | None = None
        self.matmul_path = matmul.DEFAULT
        self.new_cache: Callable[[], Any] = DynamicCache  # a session's empty cache
        self.quantized = ""  # what --quantize (auto: the timing) chose
        self.serves_decode_runs = False  # a target's host: --decode-graph and the sliced head apply
        self.head: head.VocabChunks | None = None
        # What the loaded backend does besides plain passes (set by load()).
        self.capabilities = Capabilities(TRANSFORMERS, token_trees=True, hidden_states=True)
        self.metrics = ReplicaMetrics.for_model(config.model, config.max_sessions)
        self.scheduler = batching.StepScheduler(
            config.max_batch_sessions, config.max_batch_tokens,
            lambda stats: self.metrics.forward_pass(stats.sessions, stats.tokens, stats.split), self.sessions,
            batching.parse_buckets(config.batch_token_buckets, config.max_batch_tokens, config.device))

    def _load_model(self) -> tuple[CausalLM, str, parallel.Group | None]:
        """This rank's model (its shard, in a tensor-parallel group), its dtype, and its group."""
        cfg, top = self.config, self.tensor_parallel
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        log.info("CPU threads: %d, OMP_WAIT_POLICY=%s", torch.get_num_threads(),
                 os.environ.get("OMP_WAIT_POLICY", "(unset)"))
        dtype = cfg.dtype
        if dtype == models.AUTO_DTYPE:  # int8-dynamic quantizes float32 weights
            dtype = "float32" if cfg.quantize in models.QUANTIZATIONS \
                else models.auto_dtype(cfg.model, cfg.device)
        device = cfg.device
        group = None
        if top is not None:
            if device.startswith("cuda"):
                device = f"cuda:{top.local_rank}"
                torch.cuda.set_device(device)
            group = parallel.Group(top, device, cfg.tp_timeout_s, cfg.tp_start_timeout_s,
                                   f"model {cfg.model!r} in {dtype} over {top.size} ranks")
        placement = models.Placement(device, dtype, cfg.max_memory, tensor_parallel_size=top.size if top else 1)
        if top is not None:
            topology.check_shardable(AutoConfig.from_pretrained(models.resolve(cfg.model)), top.size)
        model = models.load_model(cfg.model, placement)
        batching.use_batched_attention(model)
        quantize = cfg.quantize
        if group is None and placement.device_map is None and quantize != matmul.INT8:
            self.matmul_path, _ = matmul.apply(
                model, cfg.matmul, matmul.TIMED_ROWS,
                may_quantize=quantize == models.AUTO and placement.device == "cpu")
            quantize = self.matmul_path if self.matmul_path == matmul.INT8 else ""
        elif quantize == models.AUTO:
            quantize = ""  # int8-dynamic runs on one CPU device
        if quantize:
            self.matmul_path = quantize
            # int8-dynamic scales a pass's activations as one tensor, so a session's q moves
            # with the sessions that share its pass: the probe could not tell that from a leak.
            # It checks the architecture on the float weights instead. A draft's q may depend on
            # anything but this request's acceptance draws and stays exact (it is what the draft
            # sampled from); a target is never quantized.
            self.batch_refusal = batching.batching_refusal(model)
            model = models.quantize(model, replace(placement, quantize=quantize))
        self.quantized = quantize
        if self.serves_decode_runs and group is None and placement.device_map is None and cfg.vocab_slice_bytes:
            self.head = head.install(model, cfg.vocab_slice_bytes)  # a head oneDNN packed stays whole
        if group is not None:
            group.loaded(cfg.tp_start_timeout_s)  # health stays NOT_SERVING until every rank has
        return model, dtype, group

    def load(self) -> None:
        """Load the model on the backend --backend names (the CLI resolved it), or, under
        auto (a model both backends can run, on a CPU), on each in turn, timed at the pass sizes
        it will serve; the faster serves (`choose_backend`) and the other is dropped."""
        backend = self.config.backend
        if backend == models.AUTO:  # as the CLI resolves it; a host built in code may leave it
            gguf = models.find_gguf(self.config.model, self.config.gguf_file) if llama.available() else None
            backend = TRANSFORMERS if gguf is None else models.AUTO if self.serves_decode_runs else LLAMA_CPP
        if backend == LLAMA_CPP:
            self._serve_llama(self._open_llama())
        elif backend == TRANSFORMERS:
            self._serve_transformers(self._open_transformers())
        else:
            on_llama = self._open_llama()
            on_hf = self._open_transformers()
            timings = {LLAMA_CPP: on_llama.pass_times, TRANSFORMERS: on_hf.pass_times}
            chosen, rates = choose_backend(timings)
            log.info("--backend auto: %s (expected tokens/s with speculation: %s; passes, tokens: ms: %s)",
                     chosen, ", ".join(f"{b} {r:.2f}" for b, r in rates.items()),
                     "; ".join(f"{b} " + ", ".join(f"{t}: {ms:.1f}" for t, ms in v.items())
                               for b, v in timings.items()))
            if chosen == LLAMA_CPP:
                del on_hf
                self.head = None  # the sliced head read the dropped model's weights
                gc.collect()  # its weights are freed before the service takes requests
                self._serve_llama(on_llama)
            else:
                on_llama.engine.close()
                self._serve_transformers(on_hf)
            assert self.info is not None
            self.info.backend_timings.extend(
                common_pb2.BackendTiming(backend=b, expected_tokens_per_s=rates[b],
                                         pass_times=[common_pb2.PassTime(token_count=t, pass_ms=ms)
                                                     for t, ms in v.items()])
                for b, v in timings.items())

    def _open_transformers(self) -> _Opened:
        started = time.perf_counter()
        model, dtype, group = self._load_model()
        if self.config.device == "cpu":  # after loading, so the weights' own blocks are not kept
            log.info("C allocator: %s", host.keep_freed_memory())
        # v(T) on the path kept, where one process holds the whole model on one device.
        pass_times = {} if group is not None or models.Placement(self.config.device).device_map \
            else matmul.time_passes(model, matmul.PASS_TOKENS)
        return _Opened(model, pass_times, started, dtype, group)

    def _serve_transformers(self, opened: _Opened) -> None:
        model, dtype, group, pass_times = opened.engine, opened.dtype, opened.group, opened.pass_times
        accelerators = accelerator_ids(model)
        tokenizer = models.load_tokenizer(self.config.model)
        device = str(getattr(model, "hf_device_map", None) or self.config.device)
        if group is not None:
            model = parallel.Lockstep(model, group, self._stop_on_failure)
            device += f", tensor-parallel over {group.top.size} ranks"
        self.info = common_pb2.ModelInfo(
            model=self.config.model,
            vocab_size=models.logits_width(model),
            tokenizer_fingerprint=models.tokenizer_fingerprint(tokenizer),
            max_context_tokens=models.max_context_tokens(model),
            eos_token_ids=models.eos_token_ids(model, tokenizer),
            dtype=dtype + (f"+{self.quantized}" if self.quantized else ""),
            device=device,
            boot_id=boot_id(),
            cpu_ids=sorted(os.sched_getaffinity(0)),
            accelerator_ids=accelerators,
            matmul_path=self.matmul_path,
            pass_times=[common_pb2.PassTime(token_count=t, pass_ms=ms)
                        for t, ms in pass_times.items()],
            backend=TRANSFORMERS,
        )
        self.tokenizer = tokenizer
        self.capabilities = Capabilities(TRANSFORMERS, token_trees=True, hidden_states=True,
                                         exact_positions=models.exact_positions(model))
        refusal = self.batch_refusal if self.quantized else batching.batching_refusal(model)
        runner = batching.TorchRunner(model, head=self.head)
        self.scheduler.start(runner, refusal, pass_times)
        if self.serves_decode_runs and group is None and not self.quantized:
            # Compiled with the scheduler's hooks on the layers, as it will run.
            runner.decode = decode_graph.build(model, self.config.decode_graph, self.config.decode_graph_tokens,
                                               self.config.device)
        window = models.sliding_window(model)
        # A cache that a decode run's static slot may view is kept as a copy of its own (the
        # slot is written over by its next owner); any other is kept as it is. Tensor-parallel
        # ranks copy their mirrors as rank 0 copies its cache (parallel.Lockstep.fork).
        self._keep_prefixes(PREFIX_ENTRIES, copy_cache if runner.decode is not None else None,
                            f"its attention has a sliding window ({window} tokens), whose cache "
                            "cannot be cut to a shorter prefix" if window is not None else None,
                            fork=model.fork if isinstance(model, parallel.Lockstep) else fork_cache)
        self.model = model
        log.info("loaded %s on %s (%s, matmul %s) in %.1fs, %d threads; passes (tokens: ms) "
                 "%s; KV cache: %d bytes per token, budget %s",
                 self.config.model, self.info.device, self.info.dtype, self.matmul_path,
                 time.perf_counter() - opened.started, torch.get_num_threads(),
                 ", ".join(f"{t}: {ms:.1f}" for t, ms in pass_times.items()) or "not timed",
                 models.kv_bytes_per_token(model), self.config.kv_budget_tokens or "none")

    def _open_llama(self) -> _Opened:
        """The model's GGUF file on llama.cpp (tandem.llama): one context, a sequence per
        session cache; its v(T) timed."""
        started = time.perf_counter()
        cfg = self.config
        path = models.find_gguf(cfg.model, cfg.gguf_file)
        assert path is not None, "the CLI checked that the model is a GGUF file"
        # The context's cells are the KV budget: sessions are evicted before it runs out.
        budget = cfg.kv_budget_tokens or llama.DEFAULT_CONTEXT_TOKENS
        engine = llama.LlamaEngine(str(path), context_tokens=budget,
                                   max_batch_tokens=cfg.max_batch_tokens, threads=cfg.threads,
                                   gpu_layers=-1 if cfg.device.startswith("cuda") else 0)
        return _Opened(engine, engine.time_passes(matmul.PASS_TOKENS), started, path=path)

    def _serve_llama(self, opened: _Opened) -> None:
        cfg, engine, path, pass_times = self.config, opened.engine, opened.path, opened.pass_times
        assert isinstance(engine, llama.LlamaEngine) and path is not None
        budget = cfg.kv_budget_tokens or llama.DEFAULT_CONTEXT_TOKENS
        self.sessions.kv_budget_tokens = budget
        self.sessions.cells = engine.cells  # copies share cells: the budget counts the pool's
        # Kept prefixes hold sequences of their own; a draft keeps half the rest for drafting
        # ahead's copies; a target copies none.
        free = llama.MAX_SEQUENCES - (LLAMA_PREFIX_ENTRIES if cfg.prefix_cache == "on" else 0)
        most = free if self.serves_decode_runs else free // 2
        if cfg.max_sessions > most:
            self.sessions.max_sessions = most
            log.info("--max-sessions %d: llama.cpp serves %d sequences here, so at most %d sessions",
                     cfg.max_sessions, llama.MAX_SEQUENCES, most)
        # The tokenizer files beside the GGUF where there are any (a built-in model's are in
        # its converted directory), else the GGUF's own vocabulary.
        tokenizer = models.load_tokenizer(cfg.model) if cfg.model in models.BUILTIN_MODELS \
            else AutoTokenizer.from_pretrained(path.parent) if (
                path.parent / "tokenizer_config.json").exists() \
            else AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        builtin = models.BUILTIN_MODELS.get(cfg.model)
        eos = {int(t) for t in (tokenizer.eos_token_id,) if t is not None} | set(
            builtin.eos_token_ids if builtin else ())
        self.info = common_pb2.ModelInfo(
            model=cfg.model, vocab_size=engine.vocab_size,
            tokenizer_fingerprint=models.tokenizer_fingerprint(tokenizer),
            # One session holds at most the context's cells (the budget), however long the model's own.
            max_context_tokens=min(engine.trained_context, budget), eos_token_ids=sorted(eos),
            dtype=f"gguf {engine.metadata('general.file_type') or '?'}", device=cfg.device,
            boot_id=boot_id(), cpu_ids=sorted(os.sched_getaffinity(0)),
            matmul_path=LLAMA_CPP,
            pass_times=[common_pb2.PassTime(token_count=t, pass_ms=ms) for t, ms in pass_times.items()],
            backend=LLAMA_CPP,
        )
        self.tokenizer, self.new_cache = tokenizer, engine.new_cache
        self._keep_prefixes(LLAMA_PREFIX_ENTRIES, None, None, fork=fork_cache)
        self.capabilities = Capabilities(LLAMA_CPP, token_trees=False, hidden_states=False,
                                         exact_positions=engine.trained_context)
        self.scheduler.start(engine, None, pass_times)
        self.model = engine
        log.info("loaded %s (%s, %s) on llama.cpp in %.1fs, %d threads; passes (tokens: ms) %s; "
                 "KV cache: %d bytes per token, %d tokens over all sessions", path,
                 engine.describe(), self.info.dtype, time.perf_counter() - opened.started, engine.threads,
                 ", ".join(f"{t}: {ms:.1f}" for t, ms in pass_times.items()),
                 engine.kv_bytes_per_token(), budget)

    def _keep_prefixes(self, entries: int, keep: Callable[[Any], Any] | None, refusal: str | None,
                       fork: Callable[[Any, int], Any]) -> None:
        """The prefix cache, where --prefix-cache is on and the model's caches allow it."""
        cfg = self.config
        if cfg.prefix_cache != "on":
            return
        if refusal is not None:
            log.warning("prefix cache off: %s", refusal)
            return
        most = cfg.prefix_cache_tokens or self.sessions.kv_budget_tokens or DEFAULT_PREFIX_TOKENS
        self.sessions.prefix = PrefixCache(
            max_tokens=most, max_entries=entries, fork=fork, keep=keep or (lambda cache: cache),
            on_evict=lambda tokens: self.metrics.prefix_evicted(),
            on_change=lambda: self.metrics.prefix_held(self.prefix_tokens), free=free_cache)
        log.info("prefix cache: up to %d tokens in %d entries, evicted before any session's cache",
                 most, entries)

    @property
    def prefix_tokens(self) -> int:
        return self.sessions.prefix.tokens if self.sessions.prefix is not None else 0

    async def reuse_prefix(self, session: KVSession, token_ids: list[int]) -> int:
        """Before a fresh session's first pass over its whole history `token_ids`: start its
        cache from the longest kept prefix (`SessionTable.start_from_prefix`); the tokens reused."""
        if self.sessions.prefix is None or session.length or session.token_ids:
            return 0
        await self.sessions.kept(KEEP_WAIT_S)
        reused = self.sessions.start_from_prefix(session, token_ids)
        self.metrics.prefix_lookup(reused)
        return reused

    async def start_step(self, session: KVSession, step: Step) -> tuple[Step, int]:
        """A target step as it runs: a fresh session's first step over its whole history starts
        from the longest kept prefix of it and appends only the rest; and the tokens reused."""
        if step.cache_position:
            return step, 0
        reused = await self.reuse_prefix(session, step.new_token_ids)
        return (Step(reused, step.new_token_ids[reused:]) if reused else step), reused

    def follow(self, label: str) -> None:
        """A follower rank's life: load its shard, then repeat rank 0's forward calls.

        It ignores SIGTERM and SIGINT: rank 0 drains in-flight requests on a stop, which needs
        every rank, and then tells the followers to exit (or they find it gone). From the
        start it answers gRPC health for a liveness probe, in plaintext, on --health-port where
        that is set, else --port: NOT_SERVING once rank 0 has not reached it within
        --tp-timeout-s (parallel.Pulse).
        """
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        cfg, top = self.config, self.tensor_parallel
        assert top is not None and not top.is_leader, "only ranks 1..N-1 of a group follow"
        pulse = parallel.Pulse(cfg.tp_timeout_s)
        liveness, _ = serve_liveness(f"{label} rank {top.rank}", cfg.host,
                                  cfg.health_port if cfg.health_port >= 0 else cfg.port, pulse.alive)
        try:
            model, _, group = self._load_model()
            assert group is not None
            log.info("tensor-parallel rank %d of %d: loaded %s, following rank 0",
                     top.rank, top.size, cfg.model)
            try:
                parallel.follow(model, group, model.get_input_embeddings().weight.device, pulse)
            finally:
                group.close()
        finally:
            liveness.stop(0)

    def _stop_on_failure(self, exc: BaseException) -> None:
        """A rank failed: refuse the rest (Lockstep does), drain, and exit non-zero."""
        self.failure = exc
        os.kill(os.getpid(), signal.SIGTERM)  # serve() drains as on any stop, NOT_SERVING first

    def close(self) -> None:
        """After serving: a tensor-parallel group's followers exit with rank 0."""
        if isinstance(self.model, parallel.Lockstep):
            self.model.stop()
            self.model.group.close()

    async def grammar_for(self, request: Any, session: KVSession, history: list[int]) -> GrammarState | None:
        """The session's grammar state after `history`, where the step names a grammar (kept
        with the session, brought to each step's history, rebuilt from it when lost)."""
        spec = spec_from(request.grammar)
        if spec is None:
            session.states.pop(GrammarState)
            return None
        assert self.info is not None
        start = request.grammar_start_position
        if start > len(history):
            raise InvalidRequest(f"grammar_start_position {start} is past the history's {len(history)} tokens")
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.info.vocab_size, list(self.info.eos_token_ids))
        await asyncio.to_thread(self.grammars.warm)  # the tokenizer's byte view: seconds, once
        state = session.states.get(GrammarState)
        if state is None or state.spec != spec or state.start != start:
            state = self.grammars.state(spec, start)
            session.states.put(state)
        if state.follow(history) < len(history) - start:
            raise InvalidRequest(f"the history breaks the grammar at position {start + len(state.consumed)}"
                                 f" ({state.failed or 'a token it does not allow'})")
        return state

    def ready_model(self) -> CausalLM:
        if self.model is None:
            raise Unavailable("the model is still loading; wait for health SERVING")
        return self.model

    async def run_step(self, session: KVSession, tokens: int,
                       fn: Callable[..., Awaitable[R]], *args: Any) -> tuple[R, float]:
        """Run `await fn(forward, *args)` for `session`; its result and wall time in ms.

        fn submits its forward passes through `forward` (the step scheduler), which runs
        them with other sessions' passes. `tokens` is what the session may hold during the
        step (its cache position, new tokens, and drafted or scored tokens): the KV budget
        is reserved for it first, so call this only once the request is validated (a bad
        request never costs another session its cache). The session can be evicted between
        its passes (another step's reservation), never during one: its next pass then fails
        NOT_FOUND and the orchestrator rebuilds it.
        """
        started = time.perf_counter()
        while True:
            try:
                self.sessions.reserve(session, tokens)
                break
            except BudgetHeld:
                # Steps and passes under way hold the room; it may free when one ends.
                left = BUDGET_WAIT_S - (time.perf_counter() - started)
                if left <= 0:
                    raise
                await self.sessions.room_freed(left)
        session.in_step = True
        try:
            result = await fn(self.scheduler, *args)
        finally:
            session.in_step = False
            self.sessions.settle(session)
        return result, (time.perf_counter() - started) * 1000.0

    async def session_stream(self, requests: AsyncIterator[Any]) -> AsyncIterator[tuple[KVSession, Any]]:
        """Yield (session, request) for each message of a stream; the session dies with the stream."""
        self.ready_model()
        handle: int | None = None
        try:
            async for request in requests:
                if handle is None:
                    assert self.info is not None
                    handle, session = self.sessions.open(request.session_id, self.info.vocab_size,
                                                         self.new_cache)
                    self.metrics.session_opened()
                with self.metrics.step():
                    yield session, request
                self.metrics.kv_total(self.sessions.cached_tokens)
        finally:
            if handle is not None:
                self.sessions.close(handle)
                self.metrics.session_closed()
                self.metrics.kv_total(self.sessions.cached_tokens)


def step_from(request: Any, session: KVSession, held: int | None = None) -> Step:
    """Validate the cache fields every step carries (`held`: see KVSession.check_position)."""
    new = list(request.new_token_ids)
    if not new:
        raise InvalidRequest("new_token_ids must hold at least one token (the last committed one)")
    session.check_tokens("new_token_ids", new)
    session.check_position(request.cache_position, held)
    return Step(cache_position=request.cache_position, new_token_ids=new)


def sampling_from(proto: common_pb2.SamplingParams) -> SamplingParams:
    params = SamplingParams(temperature=proto.temperature, top_k=proto.top_k,
                            top_p=proto.top_p if proto.top_p != 0 else 1.0)
    try:
        validate(params)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    return params


class ModelServicer:
    """What the draft and target servicers share: the host, start-up, and GetModelInfo."""

    name: str

    def __init__(self, host: ModelHost) -> None:
        self.host = host

    def load(self) -> None:
        self.host.load()

    @handle_errors
    async def GetModelInfo(
        self, request: common_pb2.GetModelInfoRequest, context: Any
    ) -> common_pb2.GetModelInfoResponse:
        self.host.ready_model()
        return common_pb2.GetModelInfoResponse(info=self.host.info)


def parse_cpus(spec: str) -> set[int]:
    """--cpu-affinity: "0", "2-3" or "0,2-3" -> {0, 2, 3}; refused in one line otherwise."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise InvalidRequest(f"--cpu-affinity must list CPUs like 0, 2-3 or 0,2-3, got {spec!r}") from None
        if low < 0 or high < low:
            raise InvalidRequest(f"--cpu-affinity range {part!r} is empty or negative")
        cpus.update(range(low, high + 1))
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise InvalidRequest(f"--cpu-affinity names CPUs {sorted(cpus - available)} that this process "
                             f"cannot use (it may use {sorted(available)})")
    return cpus
