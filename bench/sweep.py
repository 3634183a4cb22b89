"""`tandem bench-load --sweep`: throughput and latency against concurrency, three ways.

The same greedy requests (HumanEval prompts, EOS ignored, a fixed number of tokens) from 1,
2, 4, ... concurrent streaming clients, against three stacks on the same models:

- per-session k=0: the target alone, one session per forward pass (--max-batch-sessions 1),
  the way every service ran before the step scheduler;
- batched k=0: the target alone, every ready session in one pass;
- batched speculation: the draft model under the adaptive policy, both services batching.
- batched speculation per-step (only when named in --modes): the same with the per-step
  cost model alone (a --speculation-by-batch table that lets every load draft up to k_max);
- batched speculation no-overlap (likewise): the same, taking turns (--overlap off);
- batched k=0 twin (likewise): batched k=0 again through a second orchestrator, whose ratio to
  the first is the noise floor between two measurements of the same work.

Every mode's stack is started first and held for the whole sweep. Modes whose services run
with the same flags share those processes, each mode with its own orchestrator: batched k=0,
its twin and batched speculation measure one target process, so their ratios hold only what
the orchestrator did (and three float32 targets need not fit in memory). The modes take turns
point by point: at each concurrency, each mode runs once per repeat, in an order that rotates
by one mode per repeat. So a slow spell of the machine falls on every mode alike, rather than
on whichever mode's whole sweep it happened to meet, and the ratios between modes stay true.
Idle stacks cost nothing: their threads sleep (OMP_WAIT_POLICY=PASSIVE).

Per point, the median over the repeats of: tokens/s (all completion tokens over the wall
time), p50/p99 time to first token, p50/p99 inter-token latency (the gap before each
streamed delta, spread over its tokens), the target's mean sessions per pass and the share of
the wall time it spent in passes (busy); beside it every repeat's tokens/s. `--placement split`
pins the target and the draft to disjoint halves of the CPUs: the draft on hardware of its
own, the split this project is for. It writes JSON, a Markdown table and a PNG under
bench/results/sweep-<time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.load import percentile
from bench.prompts import prompts as bench_prompts
from tandem import models
from tandem.launch import Process, Stack, spawn, wait_serving
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc


@dataclass(frozen=True)
class Mode:
    services: tuple[str, ...] = ()  # flags of both services
    drafting: bool = False  # whether the stack runs the draft model
    k: int | None = None  # per request; None: the policy's
    orchestrator: tuple[str, ...] = ()
    draft: tuple[str, ...] = ()  # flags of the draft service alone


MODES = {
    "per-session k=0": Mode(services=("--max-batch-sessions", "1"), k=0),
    "batched k=0": Mode(k=0),
    "batched speculation": Mode(drafting=True),
    # The same with the per-step cost model alone (no load rule: every load may draft k_max).
    "batched speculation per-step": Mode(drafting=True, orchestrator=("--speculation-by-batch", "1-:16")),
    # The same without drafting ahead: on shared cores the guesses take the target's cycles.
    "batched speculation no-overlap": Mode(drafting=True, orchestrator=("--overlap", "off")),
    # Batched k=0 through a second orchestrator (an A/A control): its ratio to batched k=0 is the
    # noise floor between two runs of the same computation, against which any other ratio is read.
    "batched k=0 twin": Mode(k=0),
    # The draft's GGUF file on llama.cpp instead of transformers (the --draft-args' quantize
    # does not apply: a GGUF file carries its own).
    "batched speculation llama.cpp": Mode(drafting=True, draft=("--backend", "llama.cpp", "--quantize", "")),
}
DEFAULT_MODES = ("per-session k=0", "batched k=0", "batched speculation")


@dataclass
class Point:
    mode: str
    clients: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    mean_batch_sessions: float
    target_busy: float = 0.0  # the share of the wall time the target spent in passes
    drafted_per_token: float = 0.0  # drafted tokens per completion token: how much the policy drafted
    accepted_per_token: float = 0.0  # of those, accepted
    runs_tokens_per_s: list[float] = field(default_factory=list)  # every repeat, in run order


Result = tuple[int, float, list[float], int, int]  # tokens, TTFT s, gaps s, drafted, accepted


async def _one(stub: Any, prompt: str, max_new_tokens: int, k: int | None) -> Result:
    request = orchestrator_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                                               sampling=common_pb2.SamplingParams(temperature=0.0))
    if k is not None:
        request.num_speculative_tokens = k
    started = last = time.perf_counter()
    tokens, ttft, gaps, drafted, accepted = 0, 0.0, [], 0, 0
    async for message in stub.Generate(request, timeout=3600):
        if message.HasField("summary"):
            usage = message.summary.usage
            drafted, accepted = usage.drafted_tokens, usage.accepted_tokens
        if message.HasField("delta") and message.delta.token_ids:
            now = time.perf_counter()
            n = len(message.delta.token_ids)
            if tokens == 0:
                ttft = now - started
            else:
                gaps.extend([(now - last) / n] * n)
            tokens, last = tokens + n, now
    return tokens, ttft, gaps, drafted, accepted


async def _drive(address: str, prompts: Sequence[str], clients: int, max_new_tokens: int,
                 k: int | None) -> tuple[list[Result], float]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[Result] = []

    async def client() -> None:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while not queue.empty():
                results.append(await _one(stub, queue.get_nowait(), max_new_tokens, k))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return results, time.perf_counter() - started


def _batch_counts(target: Process) -> tuple[float, float, float]:
    """Sessions over every pass, passes, and seconds in passes, so far."""
    samples = target.metrics()
    return (samples.get("tandem_batch_sessions_sum", 0.0), samples.get("tandem_batch_sessions_count", 0.0),
            samples.get("tandem_pass_stage_duration_seconds_sum", 0.0))


def _measure(stack: Stack, mode: str, prompts: Sequence[str], clients: int, max_new_tokens: int,
             k: int | None) -> Point:
    before = _batch_counts(stack.targets[0])
    results, wall = asyncio.run(_drive(stack.address, prompts, clients, max_new_tokens, k))
    after = _batch_counts(stack.targets[0])
    tokens = sum(r[0] for r in results)
    ttfts = [r[1] * 1000 for r in results]
    gaps = [g * 1000 for r in results for g in r[2]]
    passes = after[1] - before[1]
    return Point(mode, clients, len(results), tokens, wall, tokens / wall,
                 statistics.median(ttfts), percentile(ttfts, 99),
                 statistics.median(gaps) if gaps else 0.0, percentile(gaps, 99),
                 (after[0] - before[0]) / passes if passes else 0.0, (after[2] - before[2]) / wall,
                 sum(r[3] for r in results) / tokens, sum(r[4] for r in results) / tokens)


def median_point(runs: Sequence[Point]) -> Point:
    """One point from repeats of it: the median of each figure, and every run's tokens/s."""
    def med(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in runs))

    first = runs[0]
    return Point(first.mode, first.clients, first.requests, first.tokens, med("wall_s"),
                 med("tokens_per_s"), med("ttft_p50_ms"), med("ttft_p99_ms"), med("itl_p50_ms"),
                 med("itl_p99_ms"), med("mean_batch_sessions"), med("target_busy"), med("drafted_per_token"),
                 med("accepted_per_token"), [round(r.tokens_per_s, 3) for r in runs])


def rotated(modes: Sequence[str], repeat: int) -> list[str]:
    """The order the modes run in at one repeat: shifted by one mode per repeat."""
    shift = repeat % len(modes)
    return [*modes[shift:], *modes[:shift]]


PLACEMENTS = ("shared", "split")


def orchestrator_argv(spec: Mode, drafts: Sequence[str], target: str) -> list[str]:
    """A mode's orchestrator. Its speculation runs the draft model (`auto` would also take
    suffix proposals from the replies of earlier runs of the same prompts, and measure those)."""
    proposer = ["--proposer", "draft-model"] if spec.drafting else []
    return ["orchestrator", "--draft", ",".join(drafts), "--target", target, *proposer, *spec.orchestrator]


def split_cpus(cpus: Iterable[int]) -> tuple[str, str]:
    """--placement split: the target's CPUs (the first half, rounded up) and the draft's (the
    rest), as --cpu-affinity lists."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        raise SystemExit("--placement split needs at least two CPUs; this process may use "
                         f"{ordered}")
    half = (len(ordered) + 1) // 2
    return ",".join(map(str, ordered[:half])), ",".join(map(str, ordered[half:]))


def _start(draft: str, target: str, modes: Sequence[str], *, draft_args: Sequence[str],
           target_args: Sequence[str], threads: int, log_dir: Path | None,
           placement: str = "shared") -> dict[str, Stack]:
    """One orchestrator per mode, over replicas shared by every mode that runs them alike.

    Modes that differ only in the orchestrator (the policy, k, the A/A twin) measure the same
    target and draft processes, so a ratio between them holds nothing but what the orchestrator
    did: no second process's start-up choices (the matmul path each service times for itself,
    where its memory landed) and no second copy of the weights in memory. Their prefix caches
    are off: every mode and repeat sends the same prompts, and each must prefill them as the
    first did. `placement` "split" pins the target and the draft to disjoint CPUs
    (`split_cpus`), the split this project is for; "shared" leaves both on every CPU.
    """
    if placement == "split":
        on_target, on_draft = split_cpus(os.sched_getaffinity(0))
        target_args = [*target_args, "--cpu-affinity", on_target]
        draft_args = [*draft_args, "--cpu-affinity", on_draft]
    replicas: dict[tuple[str, ...], Process] = {}

    def replica(argv: list[str]) -> Process:
        if tuple(argv) not in replicas:
            name = f"{argv[0].removesuffix('-service')}-{sum(key[0] == argv[0] for key in replicas)}"
            replicas[tuple(argv)] = spawn(argv, log_file=log_dir / f"{name}.log" if log_dir else None)
        return replicas[tuple(argv)]

    common, metrics = ["--threads", str(threads), "--prefix-cache", "off"], ["--metrics-port", "0"]
    stacks: dict[str, Stack] = {}
    try:
        for mode in modes:
            spec = MODES[mode]
            drafts = [replica(["draft-service", "--model", draft, "--dtype", "float32", *common, *draft_args, *spec.services,
                               *spec.draft, *metrics])] if spec.drafting else []
            targets = [replica(["target-service", "--model", target, "--dtype", "float32", *common, *target_args,
                                *spec.services, *metrics])]
            for process in (*drafts, *targets):
                wait_serving(process)
            log_file = log_dir / f"orchestrator-{mode.replace(' ', '-')}.log" if log_dir else None
            orchestrator = spawn(orchestrator_argv(spec, [p.address for p in drafts], targets[0].address),
                                 log_file=log_file)
            stacks[mode] = Stack(drafts, targets, orchestrator)
            wait_serving(orchestrator)
            asyncio.run(_drive(orchestrator.address, ["warm up"], 1, 4, spec.k))
    except BaseException:
        _stop(stacks, replicas.values())
        raise
    return stacks


def _stop(stacks: dict[str, Stack], replicas: Iterable[Process]) -> None:
    for stack in stacks.values():
        stack.orchestrator.stop()
    for process in replicas:
        process.stop()


def sweep(draft: str, target: str, *, draft_args: Sequence[str], target_args: Sequence[str],
          concurrency: Sequence[int], max_new_tokens: int, min_requests: int, threads: int,
          modes: Sequence[str], prompt_chars: int = 0, log_dir: Path | None = None,
          repeats: int = 1, per_session_up_to: int = 0, placement: str = "shared") -> list[Point]:
    texts = [p.text[-prompt_chars:] if prompt_chars else p.text
             for p in bench_prompts(num_code=max(*concurrency, min_requests), num_prose=0)]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    stacks = _start(draft, target, modes, draft_args=draft_args, target_args=target_args,
                    threads=threads, log_dir=log_dir, placement=placement)
    try:
        points: list[Point] = []
        for clients in concurrency:
            prompts = texts[:max(clients, min_requests)]
            here = [m for m in modes if not (m == "per-session k=0" and 0 < per_session_up_to < clients)]
            runs: dict[str, list[Point]] = {mode: [] for mode in here}
            for repeat in range(repeats):
                for mode in rotated(here, repeat):
                    run = _measure(stacks[mode], mode, prompts, clients, max_new_tokens, MODES[mode].k)
                    runs[mode].append(run)
                    print(f"{mode:>30} x{clients:<3} run {repeat + 1}/{repeats}: "
                          f"{run.tokens_per_s:7.2f} tokens/s, TTFT p50 {run.ttft_p50_ms:.0f} ms, "
                          f"ITL p50 {run.itl_p50_ms:.0f} ms, {run.mean_batch_sessions:.1f} sessions/pass, "
                          f"target busy {run.target_busy:.0%}, "
                          f"{run.drafted_per_token:.2f} drafted per token",
                          flush=True)
            points.extend(median_point(runs[mode]) for mode in here)
    finally:
        _stop(stacks, {id(p): p for s in stacks.values() for p in (*s.drafts, *s.targets)}.values())
    return sorted(points, key=lambda p: (list(modes).index(p.mode), p.clients))


def ratio(point: Point, base: Point) -> float:
    """How many times `base`'s tokens/s `point` reached: the median of the repeats' ratios, each
    between two runs made one beside the other (so drift between repeats cancels)."""
    pairs = list(zip(point.runs_tokens_per_s, base.runs_tokens_per_s, strict=False))
    if len(point.runs_tokens_per_s) != len(base.runs_tokens_per_s) or not pairs:
        return point.tokens_per_s / base.tokens_per_s
    return float(statistics.median(a / b for a, b in pairs))


def markdown(points: Sequence[Point]) -> str:
    base = {p.clients: p for p in points if p.mode == "per-session k=0"}
    batched = {p.clients: p for p in points if p.mode == "batched k=0"}
    header = ("| mode | clients | tokens/s | vs per-session k=0 | vs batched k=0 | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms | sessions per pass | target busy | drafted (accepted) per token | "
              "tokens/s per run |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        vs_base = f"{ratio(p, base[p.clients]):.2f}x" if p.clients in base else "-"
        vs_batched = f"{ratio(p, batched[p.clients]):.2f}x" if p.clients in batched else "-"
        lines.append(f"| {p.mode} | {p.clients} | {p.tokens_per_s:.2f} | {vs_base} | {vs_batched} | "
                     f"{p.ttft_p50_ms:.0f} / {p.ttft_p99_ms:.0f} | {p.itl_p50_ms:.0f} / {p.itl_p99_ms:.0f} | "
                     f"{p.mean_batch_sessions:.1f} | {p.target_busy:.0%} | {p.drafted_per_token:.2f} ({p.accepted_per_token:.2f}) | "
                     f"{', '.join(f'{t:.2f}' for t in p.runs_tokens_per_s)} |")
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [p for p in points if p.mode == mode]
        clients = [p.clients for p in mine]
        axes[0].plot(clients, [p.tokens_per_s for p in mine], marker="o", label=mode)
        axes[1].plot(clients, [p.ttft_p50_ms for p in mine], marker="o", label=mode)
        axes[2].plot(clients, [p.itl_p50_ms for p in mine], marker="o", label=mode)
    for ax, label in zip(axes, ("tokens/s", "time to first token, p50 (ms)",
                                "inter-token latency, p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load --sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--draft-args",
                        default="--backend transformers --quantize int8-dynamic --dtype float32",
                        help="extra draft-service flags (default: the int8 transformers draft)")
    parser.add_argument("--target-args", default="--dtype auto", help="extra target-service flags")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--min-requests", type=int, default=4, help="requests per point, at least")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every mode at each concurrency, interleaved; the median is kept")
    parser.add_argument("--prompt-chars", type=int, default=0,
                        help="keep only each prompt's last N characters (0: whole prompts)")
    parser.add_argument("--per-session-up-to", type=int, default=0,
                        help="run the per-session k=0 baseline only up to this many clients (0: at "
                             "every concurrency); one session a pass, it takes most of a sweep's time")
    parser.add_argument("--placement", choices=PLACEMENTS, default="shared",
                        help="split: pin the target to the first half of this process's CPUs and the "
                             "draft to the rest; shared: both on every CPU")
    parser.add_argument("--out", default="", help="directory for the results")
    args = parser.parse_args(argv)
    out = Path(args.out or f"bench/results/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    points = sweep(args.draft, args.target, draft_args=args.draft_args.split(),
                   target_args=args.target_args.split(),
                   concurrency=[int(c) for c in args.concurrency.split(",")],
                   max_new_tokens=args.max_new_tokens, min_requests=args.min_requests,
                   threads=args.threads, modes=args.modes.split(","), prompt_chars=args.prompt_chars,
                   log_dir=out / "logs", repeats=args.repeats, per_session_up_to=args.per_session_up_to,
                   placement=args.placement)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(points)
    (out / "sweep.json").write_text(json.dumps({"args": vars(args), "points": [asdict(p) for p in points]},
                                               indent=2))
    (out / "sweep.md").write_text(table + "\n")
    plot(points, out / "sweep.png")
    print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
