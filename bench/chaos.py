"""`tandem bench-load --chaos`: replicas die, freeze and drain while many sessions share passes.

Two draft replicas, two target replicas and one orchestrator (tiny random models unless
--draft/--target name others), batching on, drafting ahead on (`--overlap on`, though the
replicas share one machine: its guesses and their copies are state a fault can break too).
Streaming clients send the bench-load workload (greedy and seeded sampled requests; k = 0, 2,
4 and the adaptive policy). While it runs, faults land one at a time, each after the stack
has served some requests since the last one recovered:

- a draft killed (SIGKILL) and started again on its port;
- a target killed and started again;
- a target frozen (SIGSTOP) for a few seconds, then resumed;
- a draft, then a target, drained (SIGTERM: in-flight sessions finish or move) and started again.

Never the last replica of a kind: the next fault waits until the restarted replica serves.
Afterwards every deterministic request must equal the same request run alone on the quiet
stack, no request may have failed, every replica must be back to no session and no cached
token, and the orchestrator's rebuild and fallback counters say how the faults were absorbed.
One summary line; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.load import Outcome, Report, run_load, workload
from bench.tiny import make_pair
from tandem.launch import Stack, restart, start_stack


@dataclass(frozen=True)
class Fault:
    action: str  # "kill", "freeze" or "drain"
    role: str  # "draft" or "target"
    index: int

    def __str__(self) -> str:
        return f"{self.action} {self.role} {self.index}"


SCHEDULE = (Fault("kill", "draft", 0), Fault("kill", "target", 0), Fault("freeze", "target", 1),
            Fault("drain", "draft", 1), Fault("drain", "target", 1))
FREEZE_S = 3.0


def inject(stack: Stack, fault: Fault) -> None:
    """Apply `fault` to the stack; a killed or drained replica is serving again on return."""
    replicas = stack.drafts if fault.role == "draft" else stack.targets
    process = replicas[fault.index]
    if fault.action == "freeze":
        os.kill(process.proc.pid, signal.SIGSTOP)
        time.sleep(FREEZE_S)
        os.kill(process.proc.pid, signal.SIGCONT)
        return
    if fault.action == "kill":
        process.proc.kill()
        process.proc.wait()
    else:
        process.stop()  # SIGTERM: the replica drains, then exits
    replicas[fault.index] = restart(process)


def chaos(stack: Stack, schedule: Sequence[Fault], every: int) -> Callable[[list[Outcome]], list[str]]:
    """What runs beside the load: each fault once `every` more requests have finished."""

    def run(outcomes: list[Outcome]) -> list[str]:
        done = []
        for fault in schedule:
            mark = len(outcomes) + every
            while len(outcomes) < mark:
                time.sleep(0.05)
            started = time.monotonic()
            inject(stack, fault)
            done.append(f"{fault} after {mark} requests: serving again in "
                        f"{time.monotonic() - started:.1f}s")
        return done

    return run


def summary(report: Report) -> str:
    sessions = sum(g["tandem_sessions_active"] for g in report.gauges_after.values())
    kv = sum(g["tandem_kv_cached_tokens"] for g in report.gauges_after.values())
    counters = report.counters
    return (f"chaos: {report.requests} requests, {len(report.errors)} errors, "
            f"{len(report.mismatches)} mismatches of {report.deterministic_checked} checked, "
            f"{len(report.events)} faults, {sessions:.0f} sessions and {kv:.0f} KV tokens left; "
            f"{counters.get('tandem_session_rebuilds_total', 0):.0f} session rebuilds, "
            f"{counters.get('tandem_draft_fallbacks_total', 0):.0f} draft fallbacks, "
            f"{counters.get('tandem_draft_cache_steps_total', 0):.0f} steps drafted ahead")


def run_chaos(draft: str, target: str, *, clients: int, requests: int, seed: int, threads: int,
              every: int, schedule: Sequence[Fault] = SCHEDULE) -> Report:
    metrics = ["--metrics-port", "0"]
    stack = start_stack(draft, target, num_drafts=2, num_targets=2, threads=threads,
                        draft_args=metrics, target_args=metrics,
                        orchestrator_args=[*metrics, "--overlap", "on"])
    try:
        return run_load(stack, workload(requests, seed), clients, beside=chaos(stack, schedule, every))
    finally:
        stack.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench-load --chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=14, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=300, help="requests at least (more while "
                        "faults are still to come)")
    parser.add_argument("--every", type=int, default=20,
                        help="requests finished between one fault's recovery and the next fault")
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
        report = run_chaos(draft, target, clients=args.clients, requests=args.requests,
                           seed=args.seed, threads=args.threads, every=args.every)
    for event in report.events:
        print(f"  {event}")
    print(summary(report))
    problems = report.problems()
    for problem in problems[:20]:
        print(f"FAIL {problem}", file=sys.stderr)
    path = Path(args.json) if args.json else \
        Path("bench/results") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(report), "problems": problems}, indent=2, default=str))
    print(f"wrote {path}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
