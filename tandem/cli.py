"""The `tandem` command: run services, start a local stack, generate text, benchmark, train Medusa heads."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem import (  # none imports torch: `tandem generate` never loads it
    config,
    models,
    topology,
)
from tandem.security import (
    SecurityConfigError,
    ServerSecurityConfig,
    ServerTls,
    load_client_tls,
    read_token,
    token_file,
)

log = logging.getLogger("tandem.cli")

# Set for every process the `tandem` command starts, before anything loads torch (its OpenMP
# runtime reads them once, at load); a value the user exported wins.
# OMP_WAIT_POLICY=PASSIVE: a thread that waits for work sleeps instead of spinning. Services
# sharing cores (a draft beside its target, as `tandem up` and the load bench run them) each
# run a thread pool; spinning threads take the cores from the other service's working ones.
# Measured on this project's 2-core CPU, both services at 2 threads, a target pass while the
# draft runs passes: 1016 ms spinning against 565 ms passive (353 and 331 ms alone), and the
# draft's 224 against 83 ms (docs/BENCHMARKS.md, "Threads that wait").
PROCESS_ENV_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def apply_process_defaults(environ: MutableMapping[str, str]) -> None:
    """PROCESS_ENV_DEFAULTS, where `environ` does not set them."""
    for name, value in PROCESS_ENV_DEFAULTS.items():
        environ.setdefault(name, value)


def _serve_model(args: argparse.Namespace, label: str) -> None:
    from tandem import matmul
    from tandem.model_service import ModelHost, ModelServiceConfig
    from tandem.server import configure_logging, serve

    cfg = config.from_args(ModelServiceConfig, args)
    if not cfg.model:
        sys.exit(f"{label}: --model is required (a path, a hub id, or one of {sorted(models.BUILTIN_MODELS)})")
    if cfg.dtype != models.AUTO_DTYPE and cfg.dtype not in models.DTYPES:
        sys.exit(f"{label}: --dtype must be one of {', '.join(models.DTYPES)} or auto, got {cfg.dtype!r}")
    _check_model(label, "--model", cfg.model)
    if cfg.matmul not in matmul.CHOICES:
        sys.exit(f"{label}: --matmul must be one of {', '.join(matmul.CHOICES)}, got {cfg.matmul!r}")
    if cfg.matmul == matmul.ONEDNN and (cfg.device != "cpu" or cfg.tensor_parallel_size > 1):
        sys.exit(f"{label}: --matmul onednn runs a whole model on --device cpu (not sharded, "
                 "not on a GPU or a device map)")
    if cfg.quantize and label == "target-service":
        sys.exit("target-service: --quantize is for drafts only; Tandem never changes the target's "
                 "output. Choose the target's precision with --dtype.")
    cfg = replace(cfg, backend=_backend(cfg, label))
    if cfg.backend != "transformers" and cfg.medusa_heads:
        if cfg.backend == "llama.cpp":
            sys.exit(f"{label}: --medusa-heads reads the target's hidden states, which the llama.cpp "
                     "target does not return; serve it with --backend transformers")
        cfg = replace(cfg, backend="transformers")  # auto: Medusa asked for, so transformers
    if cfg.backend == "llama.cpp" and cfg.quantize in models.QUANTIZATIONS:
        sys.exit(f"{label}: --quantize {cfg.quantize} is for the transformers backend; a GGUF "
                 "file carries its own quantization")
    if cfg.quantize not in ("", models.AUTO, *models.QUANTIZATIONS):
        sys.exit(f"{label}: --quantize must be {', '.join(models.QUANTIZATIONS)} or auto, got "
                 f"{cfg.quantize!r}")
    tls = _server_tls(cfg, label)
    if cfg.medusa_heads and label == "draft-service":
        sys.exit("draft-service: --medusa-heads is for the target service (the heads read the "
                 "target's hidden states)")
    if cfg.medusa_choices:
        from target_service.medusa import parse_choices

        try:
            parse_choices(cfg.medusa_choices)
        except ValueError as exc:
            sys.exit(f"{label}: {exc}")
    if label == "target-service":
        from target_service.lookahead import LookaheadConfig

        try:
            LookaheadConfig.parse(cfg.lookahead)
        except ValueError as exc:
            sys.exit(f"{label}: {exc}")
    from tandem.batching import parse_buckets
    from tandem.errors import InvalidRequest
    from tandem.model_service import parse_cpus

    if cfg.cpu_affinity:
        try:
            os.sched_setaffinity(0, parse_cpus(cfg.cpu_affinity))  # before the model loads
        except InvalidRequest as exc:
            sys.exit(f"{label}: {exc}")

    try:
        parse_buckets(cfg.batch_token_buckets, cfg.max_batch_tokens, cfg.device)
    except ValueError as exc:
        sys.exit(f"{label}: {exc}")
    from tandem import decode_graph  # the model services' own: it imports torch
    if cfg.decode_graph not in decode_graph.MODES or cfg.decode_graph_tokens < 1:
        sys.exit(f"{label}: --decode-graph must be one of {', '.join(decode_graph.MODES)}, and "
                 "--decode-graph-tokens at least 1")
    if cfg.vocab_slice_bytes < 0:
        sys.exit(f"{label}: --vocab-slice-bytes must be >= 0 (0: through the whole head's logits), "
                 f"got {cfg.vocab_slice_bytes}")
    if cfg.max_batch_sessions < 1 or cfg.max_batch_tokens < 1:
        sys.exit(f"{label}: --max-batch-sessions and --max-batch-tokens must be >= 1")
    top = _tensor_parallel(cfg, label)
    configure_logging(cfg.log_level)
    host = ModelHost(cfg, top)
    if top is not None and not top.is_leader:
        try:
            host.follow(label)
        except Exception as exc:  # noqa: BLE001 - a follower's end is its exit status
            log.error("tensor-parallel rank %d: %s: %s", top.rank, type(exc).__name__, exc)
            sys.exit(1)
        return
    followers = topology.spawn_followers(top, cfg, label) if top and top.spawns_followers else []
    if label == "draft-service":
        from draft_service.service import DraftService
        service: object = DraftService(host)
    else:
        from target_service.service import TargetService
        service = TargetService(host)
    try:
        asyncio.run(serve([service], label, cfg.host, cfg.port, cfg.grace_s,  # type: ignore[list-item]
                          metrics_port=cfg.metrics_port, tls=tls, health_port=cfg.health_port,
                          max_message_bytes=cfg.max_message_bytes))
    finally:
        host.close()
        _reap(followers, 0 if host.failure else cfg.tp_timeout_s)
    if host.failure is not None:
        sys.exit(f"{label}: stopped: a tensor-parallel rank failed ({host.failure})")


def _tensor_parallel(cfg: Any, label: str) -> Any:
    """This process's place in a tensor-parallel group (None: one rank); refuses, in one line,
    a group that cannot form or a model that cannot be sharded."""

    if cfg.tensor_parallel_size < 1:
        sys.exit(f"{label}: --tensor-parallel-size must be >= 1, got {cfg.tensor_parallel_size}")
    if cfg.tensor_parallel_size == 1:
        return None
    if models.Placement(cfg.device).device_map is not None or cfg.max_memory:
        sys.exit(f"{label}: --tensor-parallel-size shards the model over ranks; it does not "
                 "combine with a device map (--device auto/balanced/..., --max-memory)")
    if cfg.quantize:
        sys.exit(f"{label}: --quantize does not combine with --tensor-parallel-size")
    try:
        from transformers import AutoConfig

        topology.check_shardable(AutoConfig.from_pretrained(models.resolve(cfg.model)),
                                 cfg.tensor_parallel_size)
        return topology.topology(cfg.tensor_parallel_size, cfg.tp_rank, cfg.tp_master)
    except topology.ParallelError as exc:
        sys.exit(f"{label}: {exc}")


def _reap(followers: Sequence[Any], timeout_s: float) -> None:
    """Wait for locally started ranks to exit (rank 0 told them to); kill what lingers (at
    once after a failure: a stalled rank never would)."""
    deadline = time.monotonic() + timeout_s
    for child in followers:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            child.kill()
            child.wait()


def _backend(cfg: Any, label: str) -> str:
    """--backend resolved: llama.cpp or transformers; refused in one line where it cannot run."""
    from tandem import llama
    from tandem.model_service import BACKENDS, LLAMA_CPP, TRANSFORMERS

    if cfg.backend not in BACKENDS:
        sys.exit(f"{label}: --backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if label == "target-service" and cfg.backend != TRANSFORMERS and (
            cfg.tensor_parallel_size > 1 or models.Placement(cfg.device).device_map is not None):
        if cfg.backend == LLAMA_CPP:
            sys.exit("target-service: --backend llama.cpp runs a whole model in one process: it "
                     "does not combine with --tensor-parallel-size or a device map")
        return TRANSFORMERS
    if label == "target-service" and cfg.backend == models.AUTO and cfg.device != "cpu" \
            and _transformers_loads(cfg.model):
        return TRANSFORMERS  # on a GPU: captured decode, token trees (a GGUF file alone: below)
    if cfg.backend == models.AUTO and cfg.device != "cpu" and llama.available() and not llama.offloads_to_gpu():
        log.info("%s: this llama-cpp-python runs on the CPU only: the model runs on transformers on %s",
                 label, cfg.device)
        return TRANSFORMERS
    if cfg.backend == models.AUTO and cfg.model in models.BUILTIN_MODELS and not llama.available():
        log.info("%s: llama-cpp-python is not installed: the built-in model runs on transformers",
                 label)
        return TRANSFORMERS
    try:
        gguf = models.find_gguf(cfg.model, cfg.gguf_file) if cfg.backend != TRANSFORMERS else None
    except models.ModelError as exc:
        sys.exit(f"{label}: {exc}")
    if cfg.backend == LLAMA_CPP:
        if gguf is None:
            sys.exit(f"{label}: --backend llama.cpp needs a GGUF model (a .gguf file, a directory "
                     f"holding one, or a built-in model); {cfg.model!r} is none")
        if not llama.available():
            sys.exit(f"{label}: --backend llama.cpp needs llama-cpp-python (make install builds "
                     "it; pip install llama-cpp-python)")
        return _loadable(gguf, label)
    if cfg.backend == models.AUTO and gguf is not None:
        if llama.available():
            backend = _loadable(gguf, label)
            # A target both backends can run is timed on each at start-up (ModelHost.load).
            return models.AUTO if label == "target-service" and _transformers_loads(cfg.model) \
                else backend
        log.warning("%s: %s is a GGUF model but llama-cpp-python is not installed: running it on "
                    "transformers", label, cfg.model)
    if gguf is not None and not _transformers_loads(cfg.model):
        sys.exit(f"{label}: {cfg.model} is a GGUF file, which transformers does not load here; "
                 "install llama-cpp-python or pass a Hugging Face model directory")
    return TRANSFORMERS


def _transformers_loads(ref: str) -> bool:
    """Whether transformers loads `ref` here: a built-in model (converted once) or a Hugging
    Face model directory; a GGUF file alone it does not."""
    return ref in models.BUILTIN_MODELS or Path(ref).is_dir() and (Path(ref) / "config.json").exists()


def _loadable(gguf: Path, label: str) -> str:
    """llama.cpp, once it is known to load `gguf`; refused in one line otherwise."""
    from tandem import llama
    from tandem.model_service import LLAMA_CPP

    try:
        llama.check(str(gguf))
    except llama.LlamaError as exc:
        sys.exit(f"{label}: {exc}")
    return LLAMA_CPP


def _check_model(label: str, flag: str, ref: str) -> None:
    """Refuse a model that cannot load now, in one line, before the port is announced."""
    try:
        models.check_reference(ref)
    except models.ModelError as exc:
        sys.exit(f"{label}: {flag}: {exc}")


def _server_tls(cfg: ServerSecurityConfig, label: str) -> ServerTls | None:
    try:
        return cfg.server_tls()
    except SecurityConfigError as exc:
        sys.exit(f"{label}: {exc}")


def _serve_orchestrator(args: argparse.Namespace) -> None:
    from orchestrator.service import OrchestratorConfig, OrchestratorService
    from tandem.server import configure_logging, serve

    cfg = config.from_args(OrchestratorConfig, args)
    tls = _server_tls(cfg, "orchestrator")
    if cfg.tokenizer:
        _check_model("orchestrator", "--tokenizer", cfg.tokenizer)
    configure_logging(cfg.log_level)
    try:
        service = OrchestratorService(cfg)  # SecurityConfigError is a ValueError
        token = token_file(cfg.auth_token_file) if cfg.auth_token_file else None
    except ValueError as exc:
        sys.exit(f"orchestrator: {exc}")
    if token and tls is None:
        log.warning("--auth-token-file without --tls-cert: the token crosses the network in "
                    "plaintext")
    companions = []
    if cfg.http_port >= 0:
        from orchestrator.http import HttpApi

        companions.append(HttpApi(service.engine, cfg.http_port, token, cfg.served_model_name))
    asyncio.run(serve([service], "orchestrator", cfg.host, cfg.port, cfg.grace_s,
                      metrics_port=cfg.metrics_port, tls=tls, auth_token=token,
                      health_port=cfg.health_port, max_message_bytes=cfg.max_message_bytes,
                      companions=companions))


def _up(args: argparse.Namespace) -> None:
    from tandem.launch import start_stack

    for flag, ref in (("--draft", args.draft), ("--target", args.target)):
        _check_model("up", flag, ref)
    # Prepare built-in models here, once, with progress, before the services load them.
    for ref in (args.draft, args.target):
        models.resolve(ref)
    draft_dtype, target_dtype = args.draft_dtype or args.dtype, args.target_dtype or args.dtype
    # auto: timed by a float32 draft on a CPU (one in bfloat16 stays so).
    quantize = "" if args.draft_quantize == "none" or (
        args.draft_quantize == models.AUTO and args.device != "cpu") else args.draft_quantize
    if quantize not in ("", models.AUTO, *models.QUANTIZATIONS):
        sys.exit(f"up: --draft-quantize must be {', '.join(models.QUANTIZATIONS)}, auto or none, "
                 f"got {args.draft_quantize!r}")
    if quantize in models.QUANTIZATIONS and draft_dtype == models.AUTO_DTYPE:
        draft_dtype = "float32"  # int8-dynamic quantizes float32 weights
    draft_dtype, target_dtype = (
        models.auto_dtype(ref, args.device) if dtype == models.AUTO_DTYPE else dtype
        for ref, dtype in ((args.draft, draft_dtype), (args.target, target_dtype)))
    logs = Path(args.log_dir).expanduser()
    logs.mkdir(parents=True, exist_ok=True)
    # What the draft service's --backend auto picks: llama.cpp for a GGUF model.
    from tandem import llama

    on_llama = llama.available() and models.find_gguf(args.draft) is not None
    # The target service's --backend auto on a CPU: a model both backends run is timed on each.
    target_timed = args.target_backend == models.AUTO and args.device == "cpu" and llama.available() \
        and args.target in models.BUILTIN_MODELS
    target_on = f"llama.cpp or transformers {target_dtype}, the faster as timed at start-up" \
        if target_timed else "llama.cpp, its GGUF file" if args.target_backend == "llama.cpp" else target_dtype
    print(f"starting draft {args.draft} "
          f"({'llama.cpp, its GGUF file' if on_llama else draft_dtype}"
          f"{', quantize ' + quantize if quantize and not on_llama else ''}) and target {args.target} "
          f"({target_on}) on {args.device}\n"
          f"  logs: {logs}/{{draft,target,orchestrator}}.log\n"
          f"loading models (the first load on a CPU takes a minute or two)...", flush=True)
    started = time.monotonic()

    def ready(role: str) -> None:
        print(f"  {role} ready ({time.monotonic() - started:.0f}s)", flush=True)

    unwind_on_sigterm()
    device = ["--device", args.device, "--matmul", args.matmul]
    try:
        stack = start_stack(args.draft, args.target, draft_dtype=draft_dtype,
                            target_dtype=target_dtype, threads=0, port=args.port, host=args.host,
                            draft_args=[*device, *(["--quantize", quantize] if quantize else [])],
                            target_args=[*device, "--backend", args.target_backend], log_dir=logs,
                            on_ready=ready,
                            orchestrator_args=["--http-port", str(args.http_port)]
                            if args.http_port >= 0 else [])
    except KeyboardInterrupt:
        print("stopped", flush=True)
        sys.exit(130)
    except RuntimeError as exc:
        sys.exit(f"up: a service failed to start; see {logs}\n{exc}")
    processes = {"orchestrator": stack.orchestrator, "draft": stack.drafts[0],
                 "target": stack.targets[0]}
    try:  # from here on, whatever ends `tandem up` (Ctrl-C included) stops the services
        http = stack.orchestrator.wait_http_url() if args.http_port >= 0 else None
        # Machine-readable: the first line ends with the gRPC address (the tests read it).
        print(f"Tandem is ready: orchestrator listening on {stack.address}\n"
              + (f"  OpenAI-compatible HTTP API: {http}/v1\n" if http else "") +
              f"  try, in another shell: tandem generate --address {stack.address} "
              f"\"def fibonacci(n):\"\n"
              f"  stop with Ctrl-C (or SIGTERM); logs in {logs}", flush=True)
        while all(p.proc.poll() is None for p in processes.values()):
            time.sleep(1.0)
        role, died = next((r, p) for r, p in processes.items() if p.proc.poll() is not None)
        tail = "".join(died.lines[-15:])
        print(f"the {role} service exited (code {died.proc.returncode}); stopping the others. "
              f"Its last lines ({logs}/{role}.log):\n{tail}", file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping...", flush=True)
        stack.stop()
        print("stopped", flush=True)


def _generate(args: argparse.Namespace) -> None:
    import grpc

    from tandem.client import TandemClient

    try:
        tls = load_client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name,
                              enabled=args.tls)
        token = (read_token(args.auth_token_file) if args.auth_token_file
                 else os.environ.get("TANDEM_AUTH_TOKEN") or None)
    except SecurityConfigError as exc:
        sys.exit(f"generate: {exc}")
    text, token_ids, summary = [], [], None
    with TandemClient(args.address, tls=tls, token=token) as client:
        try:
            stream = client.generate_stream(
                args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                num_speculative_tokens=args.num_speculative_tokens, stop=args.stop or None,
                ignore_eos=args.ignore_eos, proposer=args.proposer)
            with stream:  # Ctrl-C leaves it: the call is cancelled and its caches freed
                for message in stream:
                    if message.HasField("delta"):
                        token_ids.extend(message.delta.token_ids)
                        text.append(message.delta.text)
                        if not args.json:
                            print(message.delta.text, end="", flush=True)
                    else:
                        summary = message.summary
        except KeyboardInterrupt:
            if text and not args.json:
                print(flush=True)
            sys.exit(130)
        except grpc.RpcError as exc:
            if text and not args.json:
                print(flush=True)
            sys.exit(f"generate: {exc.code().name}: {exc.details()}")
        except ValueError as exc:  # a request the client cannot build (e.g. an unknown proposer)
            sys.exit(f"generate: {exc}")
    assert summary is not None
    _print_summary(summary, "".join(text), token_ids, as_json=args.json)


def _print_summary(summary: Any, text: str, token_ids: list[int], *, as_json: bool) -> None:
    from tandem.v1 import common_pb2, orchestrator_pb2

    usage = summary.usage
    if as_json:
        print(json.dumps({
            "text": text, "token_ids": token_ids,
            "finish_reason": orchestrator_pb2.FinishReason.Name(summary.finish_reason),
            "usage": {
                "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens,
                "target_forward_passes": usage.target_forward_passes, "wire_bytes": usage.wire_bytes,
                "draft_ms": round(usage.draft_ms, 3), "target_ms": round(usage.target_ms, 3),
                "prefill_ms": round(usage.prefill_ms, 3),
                "total_ms": round(usage.total_ms, 3),
                "draft_wait_ms": round(usage.draft_wait_ms, 3),
                "draft_cache_hits": usage.draft_cache_hits,
                "draft_cache_misses": usage.draft_cache_misses,
                "proposer": common_pb2.Proposer.Name(usage.proposer),
            },
        }))
    else:
        rate = usage.accepted_tokens / usage.drafted_tokens if usage.drafted_tokens else 0.0
        print(f"\n[{usage.completion_tokens} tokens, {usage.target_forward_passes} target passes, "
              f"acceptance {rate:.0%}, {usage.total_ms / 1000:.1f}s]", file=sys.stderr)


def _prepare(args: argparse.Namespace) -> None:
    for ref in args.models or sorted(models.BUILTIN_MODELS):
        print(models.resolve(ref))


def _bounded(kind: Callable[[str], Any], low: float, high: float, *, low_open: bool = False,
             hint: str = "") -> Callable[[str], Any]:
    """argparse `type`: a number in [low, high] ((low, high] with low_open); argparse names
    the flag in its error."""
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a {kind.__name__}") from None
        if not (low < value if low_open else low <= value) or not value <= high \
                or (isinstance(value, float) and not math.isfinite(value)):
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{raw} is outside {bounds}{hint}")
        return value
    parse.__name__ = kind.__name__
    return parse


UINT32, UINT64 = 2**32 - 1, 2**64 - 1


def _add_up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--draft", default=models.DEFAULT_DRAFT,
                    help="draft model: local path, hub id or built-in name (default: %(default)s)")
    up.add_argument("--target", default=models.DEFAULT_TARGET,
                    help="target model (default: %(default)s)")
    up.add_argument("--device", default="cpu",
                    help="where both models run: cpu, cuda, cuda:N, or a device map such as auto "
                         "(default: %(default)s)")
    up.add_argument("--dtype", default=models.AUTO_DTYPE,
                    help="both models' dtype: float32, bfloat16, float16, or auto: the model's own "
                         "on a GPU, bfloat16 on a CPU with bf16 instructions (avx512_bf16 or AMX), "
                         "else float32 (default: %(default)s)")
    up.add_argument("--draft-dtype", default="", help="the draft's dtype, if not --dtype")
    up.add_argument("--target-dtype", default="", help="the target's dtype, if not --dtype")
    up.add_argument("--draft-quantize", default=models.AUTO,
                    help="int8-dynamic: a cheaper CPU draft; auto: int8-dynamic where the draft "
                         "service times it cheaper than float32 on this CPU (with --matmul auto); "
                         "none: float32 (default: %(default)s)")
    up.add_argument("--matmul", default=os.environ.get("TANDEM_MATMUL", "auto"),
                    help="how both models' linear layers multiply on a CPU: auto (each service "
                         "times each path at start-up and keeps the faster), default (torch's "
                         "own kernels) or onednn (prepacked weights) [env TANDEM_MATMUL; "
                         "default auto]")
    up.add_argument("--target-backend", default=os.environ.get("TANDEM_TARGET_BACKEND", "auto"),
                    help="what runs the target: llama.cpp (its GGUF file), transformers, or auto: "
                         "on a CPU, each timed at start-up and the faster kept [env "
                         "TANDEM_TARGET_BACKEND; default auto]")
    up.add_argument("--host", default="127.0.0.1",
                    help="address the orchestrator binds (the draft and target stay on 127.0.0.1)")
    up.add_argument("--port", type=int, default=os.environ.get("TANDEM_PORT", "50051"),
                    help="orchestrator port [env TANDEM_PORT; default 50051]")
    up.add_argument("--http-port", type=int, default=8000,
                    help="port of the OpenAI-compatible HTTP API (0 picks a free one; -1: none; "
                         "default: %(default)s)")
    up.add_argument("--log-dir", default=str(models.cache_dir() / "logs"),
                    help="where each service's log goes (default: %(default)s)")


def _add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    env = os.environ.get
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--address", default=env("TANDEM_ADDRESS", "127.0.0.1:50051"),
                     help="the orchestrator, host:port [env TANDEM_ADDRESS; default %(default)s]")
    gen.add_argument("--max-new-tokens", type=_bounded(int, 1, UINT32), default=128,
                     help="most tokens to generate (default: %(default)s; on the wire 0 means "
                          "unset: the orchestrator's --default-max-new-tokens)")
    gen.add_argument("--temperature", type=_bounded(float, 0, math.inf), default=0.0,
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=_bounded(float, 0, 1, low_open=True), default=1.0,
                     help="nucleus sampling: keep the smallest set of tokens holding this "
                          "probability; 1 keeps all (default: %(default)s)")
    gen.add_argument("--top-k", type=_bounded(int, 0, UINT32), default=0,
                     help="keep the k most likely tokens; 0 keeps all (default: %(default)s)")
    gen.add_argument("--seed", type=_bounded(int, 0, UINT64), default=None,
                     help="seed for every random draw: the same seed gives the same text at a "
                          "fixed k (default: a fresh random seed)")
    gen.add_argument("--num-speculative-tokens", type=_bounded(int, 0, UINT32), default=None,
                     help="draft block length k; 0 is plain target decoding (default: the server's)")
    gen.add_argument("--proposer", default=None,
                     help="auto, draft-model, suffix, prompt-lookup, lookahead, medusa or none (default: the server's)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    # TANDEM_CLIENT_TLS_*, not the services' TANDEM_TLS_*: in a shell or pod set up to serve
    # TLS those name the server's own certificate, which a client must not present.
    gen.add_argument("--tls", action=argparse.BooleanOptionalAction,
                     default=env("TANDEM_CLIENT_TLS", "").lower() in ("1", "true", "yes", "on"),
                     help="connect over TLS, trusting the system's roots unless --tls-ca "
                          "[env TANDEM_CLIENT_TLS]; any --tls-* value implies it")
    gen.add_argument("--tls-ca", default=env("TANDEM_CLIENT_TLS_CA", ""),
                     help="PEM CA bundle to verify the orchestrator with [env TANDEM_CLIENT_TLS_CA]")
    gen.add_argument("--tls-cert", default=env("TANDEM_CLIENT_TLS_CERT", ""),
                     help="PEM client certificate, for mutual TLS [env TANDEM_CLIENT_TLS_CERT]")
    gen.add_argument("--tls-key", default=env("TANDEM_CLIENT_TLS_KEY", ""),
                     help="PEM private key of --tls-cert [env TANDEM_CLIENT_TLS_KEY]")
    gen.add_argument("--tls-server-name", default=env("TANDEM_CLIENT_TLS_SERVER_NAME", ""),
                     help="name to verify the certificate against, when the address is not it "
                          "(e.g. through port-forward) [env TANDEM_CLIENT_TLS_SERVER_NAME]")
    gen.add_argument("--auth-token-file", default=env("TANDEM_AUTH_TOKEN_FILE", ""),
                     help="file holding the orchestrator's bearer token [env "
                          "TANDEM_AUTH_TOKEN_FILE; or the token itself in TANDEM_AUTH_TOKEN]")


def _add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="*", help="built-in model names (default: all)")


def _add_model_service_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.model_service import ModelServiceConfig

    config.add_arguments(parser, ModelServiceConfig)


def _add_orchestrator_arguments(parser: argparse.ArgumentParser) -> None:
    from orchestrator.config import OrchestratorConfig

    config.add_arguments(parser, OrchestratorConfig)


def _add_medusa_arguments(parser: argparse.ArgumentParser) -> None:
    from target_service import medusa_train

    medusa_train.add_arguments(parser)


def _train_medusa(args: argparse.Namespace) -> None:
    from target_service import medusa_train

    medusa_train.main(args)


# name: (help, adds the arguments, runs it). Arguments are added only for the command being
# run: the services' configs import torch, and `tandem generate --help` must not wait for it.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], None]]] = {
    "up": ("start draft, target and orchestrator as local processes", _add_up_arguments, _up),
    "draft-service": ("run one draft-service", _add_model_service_arguments,
                      lambda a: _serve_model(a, "draft-service")),
    "target-service": ("run one target-service", _add_model_service_arguments,
                       lambda a: _serve_model(a, "target-service")),
    "orchestrator": ("run the orchestrator (public API)", _add_orchestrator_arguments,
                     _serve_orchestrator),
    "generate": ("stream text from a running orchestrator", _add_generate_arguments, _generate),
    "train-medusa": ("train Medusa heads for a target on its own text", _add_medusa_arguments,
                     _train_medusa),
    "prepare-models": ("assemble and convert the built-in models now",
                       _add_prepare_arguments, _prepare),
}
MEDUSA_DESCRIPTION = ("Medusa-1 heads by self-distillation: the frozen target continues training "
                      "prompts, the heads learn to predict its tokens t+2.., and are saved in the "
                      "published Medusa format.")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the arguments of that command alone."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text,
                           description=MEDUSA_DESCRIPTION if name == "train-medusa" else help_text)
        p.set_defaults(func=run)
        if only is None or only == name:
            add_arguments(p)
    sub.add_parser("bench", help="benchmark every mode side by side (tandem bench --help)")
    sub.add_parser("bench-load", help="concurrent clients: errors, exactness, leaks, latency; "
                   "--sweep: throughput against concurrency, batched and not; --chaos: faults "
                   "under load; --overload: twice the admitted load; --duration 1h: a soak; "
                   "--conversations: multi-turn traffic with the prefix cache on and off "
                   "(tandem bench-load [--sweep|--chaos|--overload|--duration 1h|--conversations] --help)")
    return parser


def unwind_on_sigterm() -> None:
    """From here on SIGTERM (kill, docker stop, systemd) unwinds like Ctrl-C, so that a command
    that started services (`tandem up`, the benches' stacks) stops them on its way out, even
    while the models still load."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))


def main(argv: Sequence[str] | None = None) -> None:
    apply_process_defaults(os.environ)  # first: nothing has loaded torch yet
    from tandem.launch import HELD_SIGNALS

    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)  # spawn forks services with them held
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] in (["bench"], ["bench-load"]):
            unwind_on_sigterm()  # their stacks are stopped on the way out
        if argv[:1] == ["bench"]:  # the benchmark has its own flags: tandem bench --help
            from bench.run import main as bench_main

            bench_main(argv[1:])
        elif argv[:1] == ["bench-load"] and "--sweep" in argv:  # tandem bench-load --sweep --help
            from bench.sweep import main as sweep_main

            sweep_main([a for a in argv[1:] if a != "--sweep"])
        elif argv[:1] == ["bench-load"] and "--chaos" in argv:  # tandem bench-load --chaos --help
            from bench.chaos import main as chaos_main

            chaos_main([a for a in argv[1:] if a != "--chaos"])
        elif argv[:1] == ["bench-load"] and "--conversations" in argv:  # multi-turn traffic
            from bench.conversations import main as conversations_main

            conversations_main([a for a in argv[1:] if a != "--conversations"])
        elif argv[:1] == ["bench-load"] and "--overload" in argv:  # tandem bench-load --overload
            from bench.overload import main as overload_main

            overload_main([a for a in argv[1:] if a != "--overload"])
        elif argv[:1] == ["bench-load"] and any(a.startswith("--duration") for a in argv):
            from bench.soak import main as soak_main  # tandem bench-load --duration 1h

            soak_main(argv[1:])
        elif argv[:1] == ["bench-load"]:  # tandem bench-load --help
            from bench.load import main as load_main

            load_main(argv[1:])
        else:
            args = build_parser(only=argv[0] if argv else "").parse_args(argv)
            args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: what was running has been stopped; no traceback
        sys.exit(130)


if __name__ == "__main__":
    main()
