"""`tandem bench-load` (or `python -m bench.load`): correctness and leaks under concurrent load.

Many streaming clients send a few hundred requests of mixed lengths and sampling settings to
one stack (tiny random models unless --draft/--target name others). Then:

- no request may fail;
- every deterministic request (greedy, or seeded with a fixed k) must return exactly what the
  same request returns when it runs alone;
- the draft and target replicas must hold no session and no cached token once the clients
  are done (read from their Prometheus endpoints), and each process's RSS is compared with
  its RSS before the load.

It prints throughput and p50/p99 latencies and writes them, with the checks, as JSON
(bench/results/load-<time>.json unless --json names a file). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.tiny import make_pair
from tandem.launch import Process, Stack, start_stack
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

PROMPTS = ("a", "def fib(n):", "hello world", "x = (a, b)\n", "import os\nprint(os.getcwd())\n",
           "the quick brown fox jumps over the lazy dog. " * 4, "class point:\n  def __init__(self):",
           "for i in range(10):\n    total = total + i * i\n" * 3)
LENGTHS = (4, 8, 16, 32, 64)
# (temperature, top_p, top_k): greedy, nucleus, top-k.
SAMPLINGS = ((0.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 20))
KS = (None, 0, 2, 4)  # None: the server's default (adaptive) policy
GAUGES = ("tandem_sessions_active", "tandem_kv_cached_tokens")
RSS_SLACK_BYTES = 64 * 1024 * 1024  # RSS growth beyond this after the load counts as a leak
SETTLE_S = 60.0  # how long the replicas may take to close the last sessions


@dataclass(frozen=True)
class Job:
    """One request of the workload."""

    prompt: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    num_speculative_tokens: int | None
    ignore_eos: bool

    @property
    def deterministic(self) -> bool:
        """Whether running alone must give the same tokens: greedy, or seeded with a fixed k.
        (Under the adaptive policy k follows measured timings, and so do the random draws.)"""
        return self.temperature == 0.0 or self.num_speculative_tokens is not None

    def request(self) -> orchestrator_pb2.GenerateRequest:
        request = orchestrator_pb2.GenerateRequest(
            prompt=self.prompt, max_new_tokens=self.max_new_tokens, seed=self.seed,
            sampling=common_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p,
                                               top_k=self.top_k),
            ignore_eos=self.ignore_eos)
        if self.num_speculative_tokens is not None:
            request.num_speculative_tokens = self.num_speculative_tokens
        return request


def workload(requests: int, seed: int = 0, distinct: int = 48) -> list[Job]:
    """`requests` jobs drawn from `distinct` ones, so each reference run serves several."""
    rng = random.Random(seed)
    pool = [Job(rng.choice(PROMPTS), rng.choice(LENGTHS), *rng.choice(SAMPLINGS),
                seed=rng.randrange(2**32), num_speculative_tokens=rng.choice(KS),
                ignore_eos=rng.random() < 0.8)
            for _ in range(distinct)]
    return [rng.choice(pool) for _ in range(requests)]


@dataclass
class Outcome:
    job: Job
    token_ids: list[int] = field(default_factory=list)
    latency_s: float = 0.0
    ttft_s: float = 0.0
    error: str | None = None


async def one_request(stub: Any, job: Job) -> Outcome:
    outcome = Outcome(job)
    started = time.perf_counter()
    try:
        async for message in stub.Generate(job.request(), timeout=600):
            if message.HasField("delta"):
                if not outcome.token_ids and message.delta.token_ids:
                    outcome.ttft_s = time.perf_counter() - started
                outcome.token_ids.extend(message.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"{exc.code().name}: {exc.details()}"
    outcome.latency_s = time.perf_counter() - started
    return outcome


async def drive(address: str, jobs: Sequence[Job], clients: int,
                more: Callable[[int], bool] | None = None,
                outcomes: list[Outcome] | None = None) -> tuple[list[Outcome], float]:
    """Run the jobs from `clients` concurrent streaming clients, each on its own channel.

    The jobs are sent in order, each once, or with `more`, round and round while `more(sent)`
    holds. Outcomes are appended to `outcomes` as they finish, for whoever watches the load.
    """
    more = more or (lambda sent: sent < len(jobs))
    outcomes = [] if outcomes is None else outcomes
    sent = 0

    async def client() -> None:
        nonlocal sent
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while more(sent):
                job, sent = jobs[sent % len(jobs)], sent + 1
                outcomes.append(await one_request(stub, job))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes, time.perf_counter() - started


def replicas(stack: Stack) -> list[tuple[str, Process]]:
    return ([(f"draft{i}", p) for i, p in enumerate(stack.drafts)]
            + [(f"target{i}", p) for i, p in enumerate(stack.targets)])


def replica_gauges(stack: Stack) -> dict[str, dict[str, float]]:
    """Open sessions and cached KV tokens of each replica."""
    return {name: {g: p.metrics().get(g, 0.0) for g in GAUGES} for name, p in replicas(stack)}


def rss(stack: Stack) -> dict[str, int]:
    processes = [("orchestrator", stack.orchestrator), *replicas(stack)]
    return {name: int(psutil.Process(p.proc.pid).memory_info().rss) for name, p in processes}


def settle(stack: Stack, timeout: float = SETTLE_S) -> dict[str, dict[str, float]]:
    """The replicas' gauges once every session has closed, or as they are when time is up."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = replica_gauges(stack)
        if all(v == 0 for g in gauges.values() for v in g.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.1)


# The orchestrator's counters of what it did about lost replicas, and of drafting ahead.
COUNTERS = ("tandem_session_rebuilds_total", "tandem_draft_fallbacks_total",
            "tandem_draftless_requests_total", "tandem_draft_cache_steps_total")


def orchestrator_counters(stack: Stack) -> dict[str, float]:
    """Session rebuilds and draft fallbacks so far, when the orchestrator serves metrics."""
    if stack.orchestrator.metrics_url is None:
        return {}
    samples = stack.orchestrator.metrics()
    return {name: samples.get(name, 0.0) for name in COUNTERS}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Report:
    clients: int
    requests: int
    wall_s: float
    completion_tokens: int
    requests_per_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    errors: list[str]
    mismatches: list[str]
    deterministic_checked: int
    gauges_before: dict[str, dict[str, float]]
    gauges_after: dict[str, dict[str, float]]
    rss_before: dict[str, int]
    rss_after: dict[str, int]
    events: list[str] = field(default_factory=list)  # what ran beside the load: faults, samples
    counters: dict[str, float] = field(default_factory=dict)  # the orchestrator's, when it has metrics

    def problems(self, rss_slack_bytes: int = RSS_SLACK_BYTES) -> list[str]:
        found = [f"error: {e}" for e in self.errors] + [f"mismatch: {m}" for m in self.mismatches]
        for name, gauges in self.gauges_after.items():
            if any(gauges.values()):
                found.append(f"{name} still holds {gauges} after the load")
        for name, after in self.rss_after.items():
            if after - self.rss_before[name] > rss_slack_bytes:
                found.append(f"{name} RSS grew by {(after - self.rss_before[name]) / 2**20:.0f} MiB")
        return found


def run_load(stack: Stack, jobs: Sequence[Job], clients: int,
             beside: Callable[[list[Outcome]], list[str]] | None = None) -> Report:
    """Warm up, load the stack, let it settle, then check every deterministic job run alone.

    `beside` runs in a thread while the load runs (faults, samples), watching the outcomes as
    they arrive; the clients go round the jobs again until it returns. What it returns (what it
    did) goes into the report.
    """
    asyncio.run(drive(stack.address, jobs[:clients], clients))  # warm-up: allocators, channels
    gauges_before = settle(stack)
    rss_before = rss(stack)
    outcomes: list[Outcome] = []
    events: list[str] = []
    over = threading.Event()
    failed: list[BaseException] = []

    def watch() -> None:
        try:
            events.extend(beside(outcomes) if beside else ())
        except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
            failed.append(exc)
        finally:
            over.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, wall = asyncio.run(drive(stack.address, jobs, clients, outcomes=outcomes,
                                more=lambda sent: sent < len(jobs) or not over.is_set()))
    watcher.join()
    if failed:
        raise failed[0]
    gauges_after = settle(stack)
    rss_after = rss(stack)

    alone: dict[Job, Outcome] = {}
    for job in dict.fromkeys(o.job for o in outcomes if o.job.deterministic and not o.error):
        alone[job] = asyncio.run(drive(stack.address, [job], 1))[0][0]
    mismatches = [f"{o.job}: {o.token_ids} under load, {alone[o.job].token_ids} alone"
                  for o in outcomes if o.job in alone and o.token_ids != alone[o.job].token_ids]
    mismatches += [f"{o.job}: {len(o.token_ids)} tokens, more than max_new_tokens"
                   for o in outcomes if len(o.token_ids) > o.job.max_new_tokens]
    errors = [f"{o.job}: {o.error}" for o in outcomes if o.error]
    errors += [f"{job} alone: {o.error}" for job, o in alone.items() if o.error]

    tokens = sum(len(o.token_ids) for o in outcomes)
    latencies = [o.latency_s for o in outcomes]
    ttfts = [o.ttft_s for o in outcomes if o.token_ids]
    return Report(
        clients=clients, requests=len(outcomes), wall_s=wall, completion_tokens=tokens,
        requests_per_s=len(outcomes) / wall, tokens_per_s=tokens / wall,
        latency_p50_s=statistics.median(latencies), latency_p99_s=percentile(latencies, 99),
        ttft_p50_s=statistics.median(ttfts) if ttfts else 0.0, ttft_p99_s=percentile(ttfts, 99),
        errors=errors, mismatches=mismatches,
        deterministic_checked=sum(o.job in alone for o in outcomes),
        gauges_before=gauges_before, gauges_after=gauges_after,
        rss_before=rss_before, rss_after=rss_after, events=events,
        counters=orchestrator_counters(stack))


def _summary(report: Report) -> str:
    lines = [
        (f"{report.requests} requests from {report.clients} streaming clients in "
         f"{report.wall_s:.1f}s: {report.requests_per_s:.1f} req/s, "
         f"{report.tokens_per_s:.0f} tokens/s ({report.completion_tokens} tokens)"),
        (f"latency p50 {report.latency_p50_s * 1000:.0f} ms, p99 {report.latency_p99_s * 1000:.0f} ms; "
         f"time to first token p50 {report.ttft_p50_s * 1000:.0f} ms, "
         f"p99 {report.ttft_p99_s * 1000:.0f} ms"),
        (f"{len(report.errors)} errors; {report.deterministic_checked} deterministic outputs "
         f"checked against the request run alone, {len(report.mismatches)} differ"),
    ]
    for name, after in report.rss_after.items():
        before = report.rss_before[name]
        gauges = report.gauges_after.get(name)
        held = (f", {gauges['tandem_sessions_active']:.0f} sessions, "
                f"{gauges['tandem_kv_cached_tokens']:.0f} KV tokens after") if gauges else ""
        lines.append(f"  {name}: RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB{held}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--draft", default="", help="draft model (default: a tiny random one)")
    parser.add_argument("--target", default="", help="target model (default: a tiny random one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    parser.add_argument("--json", default="", help="write the report here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        draft, target = args.draft, args.target
        if not (draft and target):
            made = make_pair(Path(tmp))
            draft, target = str(made[0]), str(made[1])
        metrics = ["--metrics-port", "0"]
        stack = start_stack(draft, target, threads=args.threads, draft_args=metrics,
                            target_args=metrics)
        try:
            report = run_load(stack, workload(args.requests, args.seed), args.clients)
        finally:
            stack.stop()

    print(_summary(report))
    problems = report.problems()
    for problem in problems[:20]:
        print(f"FAIL {problem}", file=sys.stderr)
    path = Path(args.json) if args.json else \
        Path("bench/results") / f"load-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "problems": problems}, indent=2, default=str))
    print(f"wrote {path}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
