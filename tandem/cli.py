"""The `tandem` command: run services, start a local stack, generate text, benchmark, train Medusa heads."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from tandem import config, models
from tandem.security import (
    SecurityConfigError,
    ServerSecurityConfig,
    ServerTls,
    load_client_tls,
    read_token,
)

log = logging.getLogger("tandem.cli")


def _serve_model(args: argparse.Namespace, label: str) -> None:
    from tandem.model_service import ModelHost, ModelServiceConfig
    from tandem.server import configure_logging, serve

    cfg = config.from_args(ModelServiceConfig, args)
    if not cfg.model:
        sys.exit(f"{label}: --model is required (a path, a hub id, or one of {sorted(models.BUILTIN_MODELS)})")
    if cfg.quantize and label == "target-service":
        sys.exit("target-service: --quantize is for drafts only; Tandem never changes the target's "
                 "output. Choose the target's precision with --dtype.")
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
    configure_logging(cfg.log_level)
    host = ModelHost(cfg)
    if label == "draft-service":
        from draft_service.service import DraftService
        service: object = DraftService(host)
    else:
        from target_service.service import TargetService
        service = TargetService(host)
    asyncio.run(serve([service], label, cfg.host, cfg.port, cfg.grace_s,  # type: ignore[list-item]
                      metrics_port=cfg.metrics_port, tls=tls, health_port=cfg.health_port,
                      max_message_bytes=cfg.max_message_bytes))


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
    configure_logging(cfg.log_level)
    try:
        service = OrchestratorService(cfg)  # SecurityConfigError is a ValueError
        token = read_token(cfg.auth_token_file) if cfg.auth_token_file else None
    except ValueError as exc:
        sys.exit(f"orchestrator: {exc}")
    if token and tls is None:
        log.warning("--auth-token-file without --tls-cert: the token crosses the network in "
                    "plaintext")
    asyncio.run(serve([service], "orchestrator", cfg.host, cfg.port, cfg.grace_s,
                      metrics_port=cfg.metrics_port, tls=tls, auth_token=token,
                      health_port=cfg.health_port, max_message_bytes=cfg.max_message_bytes))


def _up(args: argparse.Namespace) -> None:
    from tandem.launch import start_stack

    # Prepare built-in models here, once, with a progress bar, before the services load them.
    for ref in (args.draft, args.target):
        models.resolve(ref)
    print(f"starting draft {args.draft} ({args.draft_dtype}) and target {args.target} "
          f"({args.target_dtype}); loading models...", flush=True)
    # From here on SIGTERM (kill, docker stop, systemd) unwinds like Ctrl-C, so whatever has
    # started is stopped, even while the models still load.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        stack = start_stack(args.draft, args.target, draft_dtype=args.draft_dtype,
                            target_dtype=args.target_dtype, threads=0, port=args.port, host=args.host,
                            draft_args=["--quantize", args.draft_quantize] if args.draft_quantize else [])
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"Tandem is ready: orchestrator listening on {stack.address}\n"
          f"  try: tandem generate --address {stack.address} \"def fibonacci(n):\"", flush=True)
    processes = [stack.orchestrator, *stack.drafts, *stack.targets]
    try:
        while all(p.proc.poll() is None for p in processes):
            time.sleep(1.0)
        died = next(p for p in processes if p.proc.poll() is not None)
        print(f"a service exited ({died.address}, code {died.proc.returncode}); stopping the others",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


def _generate(args: argparse.Namespace) -> None:
    import grpc

    from tandem.client import TandemClient
    from tandem.v1 import common_pb2, orchestrator_pb2

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
            for message in stream:
                if message.HasField("delta"):
                    token_ids.extend(message.delta.token_ids)
                    text.append(message.delta.text)
                    if not args.json:
                        print(message.delta.text, end="", flush=True)
                else:
                    summary = message.summary
        except grpc.RpcError as exc:
            if text and not args.json:
                print(flush=True)
            sys.exit(f"generate: {exc.code().name}: {exc.details()}")
        except ValueError as exc:  # a request the client cannot build (e.g. an unknown proposer)
            sys.exit(f"generate: {exc}")
    assert summary is not None
    usage = summary.usage
    if args.json:
        print(json.dumps({
            "text": "".join(text), "token_ids": token_ids,
            "finish_reason": orchestrator_pb2.FinishReason.Name(summary.finish_reason),
            "usage": {
                "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens,
                "target_forward_passes": usage.target_forward_passes, "wire_bytes": usage.wire_bytes,
                "draft_ms": round(usage.draft_ms, 3), "target_ms": round(usage.target_ms, 3),
                "prefill_ms": round(usage.prefill_ms, 3),
                "total_ms": round(usage.total_ms, 3),
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


def build_parser() -> argparse.ArgumentParser:
    from orchestrator.service import OrchestratorConfig
    from tandem.model_service import ModelServiceConfig

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start draft, target and orchestrator as local processes")
    up.add_argument("--draft", default=models.DEFAULT_DRAFT, help="draft model (path, hub id or built-in)")
    up.add_argument("--target", default=models.DEFAULT_TARGET, help="target model")
    up.add_argument("--draft-dtype", default="float32")
    up.add_argument("--target-dtype", default="float32")
    up.add_argument("--draft-quantize", default="", help="int8-dynamic: a cheaper CPU draft")
    up.add_argument("--host", default="127.0.0.1",
                    help="address the orchestrator binds (the draft and target stay on 127.0.0.1)")
    up.add_argument("--port", type=int, default=os.environ.get("TANDEM_PORT", "50051"),
                    help="orchestrator port [env TANDEM_PORT]")
    up.set_defaults(func=_up)

    for label in ("draft-service", "target-service"):
        p = sub.add_parser(label, help=f"run one {label}")
        config.add_arguments(p, ModelServiceConfig)
        p.set_defaults(func=lambda a, label=label: _serve_model(a, label))

    orch = sub.add_parser("orchestrator", help="run the orchestrator (public API)")
    config.add_arguments(orch, OrchestratorConfig)
    orch.set_defaults(func=_serve_orchestrator)

    gen = sub.add_parser("generate", help="stream text from a running orchestrator")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=os.environ.get("TANDEM_ADDRESS", "127.0.0.1:50051"))
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="draft block length k; 0 is plain target decoding (default: the server's)")
    gen.add_argument("--proposer", default=None,
                     help="draft-model, prompt-lookup, lookahead, medusa or none (default: the server's)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    env = os.environ.get
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
    gen.set_defaults(func=_generate)

    train = sub.add_parser("train-medusa", help="train Medusa heads for a target on its own text",
                           description="Medusa-1 heads by self-distillation: the frozen target "
                           "continues training prompts, the heads learn to predict its tokens "
                           "t+2.., and are saved in the published Medusa format.")
    from target_service import medusa_train

    medusa_train.add_arguments(train)
    train.set_defaults(func=medusa_train.main)

    sub.add_parser("bench", help="benchmark every mode side by side (tandem bench --help)")
    sub.add_parser("bench-load", help="concurrent clients: errors, exactness, leaks, latency "
                   "(tandem bench-load --help)")
    prep = sub.add_parser("prepare-models", help="assemble and convert the built-in models now")
    prep.add_argument("models", nargs="*")
    prep.set_defaults(func=_prepare)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own flags: tandem bench --help
        from bench.run import main as bench_main

        bench_main(argv[1:])
        return
    if argv[:1] == ["bench-load"]:  # tandem bench-load --help
        from bench.load import main as load_main

        load_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
