"""The load test, small: 4 streaming clients, 24 requests. Correctness only, no timing asserts:
no errors, every deterministic output equals the request run alone, and the replicas hold no
session or cached token afterwards."""

from __future__ import annotations

from bench.load import run_load, workload
from tandem.launch import Stack


def test_small_load_is_exact_and_leaves_nothing_behind(tiny_stack: Stack) -> None:
    report = run_load(tiny_stack, workload(24, seed=1, distinct=12), clients=4)
    assert report.requests == 24
    assert report.errors == []
    assert report.mismatches == []
    assert report.deterministic_checked > 0
    assert all(v == 0 for gauges in report.gauges_after.values() for v in gauges.values())
    assert report.problems() == []  # includes RSS within a generous slack of its baseline
