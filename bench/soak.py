"""`tandem bench-load --duration 60m --sample-every 60s`: a soak, looking for slow leaks.

The bench-load workload runs round and round against one stack (tiny random models unless
--draft/--target name others) for --duration. Every --sample-every it samples each process
(orchestrator, draft, target): resident memory, open file descriptors, threads, the open
streams it serves (the replicas' session streams, the orchestrator's running requests), and
the tokens a replica's prefix cache holds. After
the run: each figure's slope per hour, fitted by least squares over the samples after the
warm-up (the first fifth of the run), beside its first and last value. The same checks as
bench-load follow (no errors, exactness against requests run alone, nothing left open).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench.load import Outcome, Report, replicas, run_load, workload
from bench.tiny import make_pair
from tandem.launch import Stack, start_stack

FIGURES = ("rss_mib", "fds", "threads", "streams", "prefix_tokens")
WARM_UP_SHARE = 0.2  # the first fifth of the samples is warm-up: allocators and caches growing
# Counted growth that is a leak over a few hundred requests: descriptors and threads come back
# to where they were (these allow a channel's or a pool's worth of slack); memory settles.
FD_SLACK, THREAD_SLACK, RSS_SLACK_MIB = 8, 4, 48.0


@dataclass(frozen=True)
class Sample:
    at_s: float  # since the load started
    requests: int  # finished by then
    figures: dict[str, dict[str, float]]  # process -> figure -> value


def sample(stack: Stack, started: float, requests: int) -> Sample:
    figures: dict[str, dict[str, float]] = {}
    for name, process in [("orchestrator", stack.orchestrator), *replicas(stack)]:
        proc = psutil.Process(process.proc.pid)
        metrics = process.metrics() if process.metrics_url else {}
        streams = metrics.get("tandem_sessions_active", metrics.get("tandem:num_requests_running", 0.0))
        figures[name] = {"rss_mib": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
                         "threads": proc.num_threads(), "streams": streams,
                         "prefix_tokens": metrics.get("tandem_prefix_cache_tokens", 0.0)}
    return Sample(time.monotonic() - started, requests, figures)


def sampler(stack: Stack, samples: list[Sample], *, every_s: float = 0.0, every_requests: int = 0,
            duration_s: float = 0.0, count: int = 0) -> Callable[[list[Outcome]], list[str]]:
    """What runs beside the load: a sample every `every_s` seconds or `every_requests` requests,
    until `duration_s` has passed or `count` samples are taken."""

    def run(outcomes: list[Outcome]) -> list[str]:
        started = time.monotonic()
        tick = threading.Event()
        while True:
            if every_requests:
                mark = len(outcomes) + every_requests
                while len(outcomes) < mark:
                    tick.wait(0.05)
            else:
                tick.wait(max(0.0, started + (len(samples) + 1) * every_s - time.monotonic()))
            samples.append(sample(stack, started, len(outcomes)))
            if (count and len(samples) >= count) or \
                    (duration_s and time.monotonic() - started >= duration_s):
                return [f"{len(samples)} samples over {len(outcomes)} requests"]

    return run


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 for fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in points) / var


def trends(samples: Sequence[Sample]) -> dict[str, dict[str, dict[str, float]]]:
    """Per process and figure: its value after warm-up, at the end, and its slope per hour."""
    settled = samples[int(len(samples) * WARM_UP_SHARE):]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in settled[0].figures if settled else ():
        out[name] = {figure: {
            "first": settled[0].figures[name][figure], "last": settled[-1].figures[name][figure],
            "per_hour": slope([(s.at_s / 3600, s.figures[name][figure]) for s in settled])}
            for figure in FIGURES}
    return out


def growth(samples: Sequence[Sample]) -> list[str]:
    """Counted growth after warm-up beyond the slack: descriptors, threads, memory."""
    found = []
    for name, figures in trends(samples).items():
        for figure, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK), ("rss_mib", RSS_SLACK_MIB)):
            grew = figures[figure]["last"] - figures[figure]["first"]
            if grew > slack:
                found.append(f"{name}: {figure} grew by {grew:.0f} after warm-up "
                             f"({figures[figure]['first']:.0f} -> {figures[figure]['last']:.0f})")
    return found


def table(samples: Sequence[Sample]) -> str:
    lines = ["| process | figure | after warm-up | at the end | slope per hour |", "|---|---|---|---|---|"]
    for name, figures in trends(samples).items():
        for figure, t in figures.items():
            lines.append(f"| {name} | {figure} | {t['first']:.1f} | {t['last']:.1f} | {t['per_hour']:+.2f} |")
    return "\n".join(lines)


def run_soak(stack: Stack, samples: list[Sample], *, clients: int, requests: int, seed: int,
             every_s: float = 0.0, every_requests: int = 0, duration_s: float = 0.0,
             count: int = 0) -> Report:
    """The bench-load workload with samples beside it (see `sampler`)."""
    return run_load(stack, workload(requests, seed), clients, beside=sampler(
        stack, samples, every_s=every_s, every_requests=every_requests, duration_s=duration_s,
        count=count))


def seconds(text: str) -> float:
    """'90', '90s', '15m', '1h' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 15m or 1h, got {text!r}")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load --duration", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=seconds, required=True, help="how long: 90s, 15m, 1h")
    parser.add_argument("--sample-every", type=seconds, default=60.0, help="sampling interval")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--draft", default="", help="draft model (default: a tiny random one)")
    parser.add_argument("--target", default="", help="target model (default: a tiny random one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    parser.add_argument("--json", default="", help="write the report here")
    args = parser.parse_args(argv)
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory() as tmp:
        draft, target = args.draft, args.target
        if not (draft and target):
            made = make_pair(Path(tmp))
            draft, target = str(made[0]), str(made[1])
        metrics = ["--metrics-port", "0"]
        stack = start_stack(draft, target, threads=args.threads, draft_args=metrics,
                            target_args=metrics, orchestrator_args=metrics)
        try:
            report = run_soak(stack, samples, clients=args.clients, requests=args.clients,
                              seed=args.seed, every_s=args.sample_every, duration_s=args.duration)
        finally:
            stack.stop()
    print(table(samples))
    print(f"{report.requests} requests in {report.wall_s / 60:.1f} min, {len(report.errors)} errors, "
          f"{len(report.mismatches)} mismatches of {report.deterministic_checked} checked")
    problems = report.problems() + growth(samples)
    for problem in problems[:20]:
        print(f"FAIL {problem}", file=sys.stderr)
    path = Path(args.json) if args.json else \
        Path("bench/results") / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "samples": [asdict(s) for s in samples],
                                "trends": trends(samples), "problems": problems}, indent=2, default=str))
    print(f"wrote {path}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
