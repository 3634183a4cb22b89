"""The soak's arithmetic, and a short soak counted in requests: no descriptor, thread or
memory growth over a few hundred requests on the tiny stack."""

from __future__ import annotations

import pytest

from bench.soak import Sample, growth, run_soak, slope, trends
from tandem.launch import Stack


def _samples(fds: list[float]) -> list[Sample]:
    return [Sample(at_s=60.0 * i, requests=10 * i,
                   figures={"p": {"rss_mib": 100.0, "fds": f, "threads": 10.0, "streams": 0.0,
                                  "prefix_tokens": 0.0}})
            for i, f in enumerate(fds)]


def test_slope_is_least_squares() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(0, 1)]) == 0.0
    assert slope([(1, 1), (1, 5)]) == 0.0


def test_growth_after_warm_up_beyond_the_slack_is_reported() -> None:
    steady = _samples([10, 40, 40, 41, 40, 40, 41, 40, 40, 40])  # warm-up growth does not count
    assert growth(steady) == []
    assert trends(steady)["p"]["fds"]["first"] == 40
    leaking = _samples([10, 40, 45, 50, 55, 60, 65, 70, 75, 80])
    [problem] = growth(leaking)
    assert problem.startswith("p: fds grew by")
    assert trends(leaking)["p"]["fds"]["per_hour"] == pytest.approx(300.0)


@pytest.mark.slow  # a few hundred requests
def test_a_few_hundred_requests_leave_no_growth(tiny_stack: Stack) -> None:
    samples: list[Sample] = []
    report = run_soak(tiny_stack, samples, clients=8, requests=8, seed=5, every_requests=30, count=10)
    assert len(samples) == 10 and samples[-1].requests >= 300
    assert report.errors == [] and report.mismatches == []
    assert growth(samples) == []
    assert report.problems() == []
