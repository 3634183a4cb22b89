"""`tandem bench-load --overload`: twice the load the orchestrator admits, and what it does.

The orchestrator runs with --max-concurrent-requests R and --max-queued-requests Q (tiny
random models unless --draft/--target name others). First, R clients send one request each:
the time a request takes when R share the passes (the service time). Then 2 (R + Q) clients
send requests (greedy, a fixed length) without pause, until --requests have been admitted;
a refused client waits a moment and sends again, as a polite client would. It reports:

- admitted requests: errors (must be none), latency p50/p99, and p99 over the service time
  beside the bound the queue sets: a request waits for at most Q / R others' turns, so about
  1 + Q / R service times;
- refused requests: that they got RESOURCE_EXHAUSTED (and nothing else), and how fast;
- each process's RSS before and after (the KV budget and the queue bound it), and the replicas
  back to no session and no cached token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.load import Job, Outcome, drive, one_request, percentile, rss, settle
from bench.tiny import make_pair
from tandem.launch import Stack, start_stack
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import orchestrator_pb2_grpc

JOB = Job("def fib(n):", 16, 0.0, 1.0, 0, 0, None, True)
RETRY_S = 0.05  # a refused client's pause before it sends again


@dataclass
class OverloadReport:
    running: int
    queued: int
    clients: int
    service_s: float  # one request's latency with `running` of them sharing the passes
    admitted: int
    refused: int
    errors: list[str]  # anything but success or RESOURCE_EXHAUSTED
    admitted_p50_s: float
    admitted_p99_s: float
    refused_p99_ms: float
    queue_bound: float  # 1 + Q / R service times
    gauges_after: dict[str, dict[str, float]]
    rss_before: dict[str, int]
    rss_after: dict[str, int]

    def problems(self) -> list[str]:
        found = [f"error: {e}" for e in self.errors]
        found += [f"{name} still holds {g} after the load"
                  for name, g in self.gauges_after.items() if any(g.values())]
        if not self.refused:
            found.append("nothing was refused: the load did not exceed what the orchestrator admits")
        return found


async def _overload(address: str, clients: int, admitted_wanted: int) -> list[Outcome]:
    outcomes: list[Outcome] = []

    async def client() -> None:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            while sum(o.error is None for o in outcomes) < admitted_wanted:
                outcome = await one_request(stub, JOB)
                outcomes.append(outcome)
                if outcome.error is not None:
                    await asyncio.sleep(RETRY_S)

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


def run_overload(stack: Stack, running: int, queued: int, admitted_wanted: int) -> OverloadReport:
    asyncio.run(drive(stack.address, [JOB] * running, running))  # warm-up
    calibration, _ = asyncio.run(drive(stack.address, [JOB] * running, running))
    service = statistics.median(o.latency_s for o in calibration)
    settle(stack)
    rss_before = rss(stack)
    clients = 2 * (running + queued)
    outcomes = asyncio.run(_overload(stack.address, clients, admitted_wanted))
    gauges_after = settle(stack)
    admitted = [o.latency_s for o in outcomes if o.error is None]
    refused = [o.latency_s * 1000 for o in outcomes
               if o.error is not None and o.error.startswith("RESOURCE_EXHAUSTED")]
    errors = [o.error for o in outcomes
              if o.error is not None and not o.error.startswith("RESOURCE_EXHAUSTED")]
    return OverloadReport(
        running=running, queued=queued, clients=clients, service_s=service,
        admitted=len(admitted), refused=len(refused), errors=errors,
        admitted_p50_s=statistics.median(admitted), admitted_p99_s=percentile(admitted, 99),
        refused_p99_ms=percentile(refused, 99), queue_bound=1 + math.ceil(queued / running),
        gauges_after=gauges_after, rss_before=rss_before, rss_after=rss(stack))


def summary(report: OverloadReport) -> str:
    lines = [
        (f"overload: {report.clients} clients against {report.running} running + {report.queued} "
         f"queued: {report.admitted} admitted, {report.refused} refused (RESOURCE_EXHAUSTED, "
         f"p99 {report.refused_p99_ms:.0f} ms), {len(report.errors)} other errors"),
        (f"admitted latency p50 {report.admitted_p50_s:.2f}s, p99 {report.admitted_p99_s:.2f}s = "
         f"{report.admitted_p99_s / report.service_s:.1f} service times of {report.service_s:.2f}s "
         f"(the queue's bound: about {report.queue_bound:.0f})"),
    ]
    for name, after in report.rss_after.items():
        lines.append(f"  {name}: RSS {report.rss_before[name] / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load --overload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=8, help="--max-concurrent-requests")
    parser.add_argument("--queued", type=int, default=8, help="--max-queued-requests")
    parser.add_argument("--requests", type=int, default=200, help="admitted requests to wait for")
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
        limits = ["--max-concurrent-requests", str(args.running), "--max-queued-requests", str(args.queued)]
        stack = start_stack(draft, target, threads=args.threads, draft_args=metrics,
                            target_args=metrics, orchestrator_args=limits)
        try:
            report = run_overload(stack, args.running, args.queued, args.requests)
        finally:
            stack.stop()
    print(summary(report))
    problems = report.problems()
    for problem in problems[:20]:
        print(f"FAIL {problem}", file=sys.stderr)
    path = Path(args.json) if args.json else \
        Path("bench/results") / f"overload-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "problems": problems}, indent=2))
    print(f"wrote {path}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
