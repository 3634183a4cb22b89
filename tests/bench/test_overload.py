"""`tandem bench-load --overload`, small: 2 running + 2 queued, 8 clients sending without pause.
Requests beyond the queue are refused with RESOURCE_EXHAUSTED and nothing else; every admitted
one finishes; the replicas are back to no session and no cached token."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.overload import run_overload, summary
from tandem.launch import start_stack

pytestmark = pytest.mark.slow  # a stack of its own


def test_beyond_the_queue_requests_are_refused_and_the_admitted_finish(
        tiny_draft: Path, tiny_target: Path) -> None:
    metrics = ["--metrics-port", "0"]
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=metrics, target_args=metrics,
                        orchestrator_args=["--max-concurrent-requests", "2", "--max-queued-requests", "2"])
    try:
        report = run_overload(stack, running=2, queued=2, admitted_wanted=30)
    finally:
        stack.stop()
    print(summary(report))
    assert report.clients == 8
    assert report.errors == []
    assert report.admitted >= 30 and report.refused > 0
    assert report.problems() == []
