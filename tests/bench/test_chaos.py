"""`tandem bench-load --chaos`, small: faults land while 8 clients load two drafts and two targets.

Every fault of the schedule (a draft and a target killed and restarted, a target frozen, a
draft and a target drained and restarted) lands mid-load. Nothing may be lost: no request
fails, every deterministic output equals the request run alone, and every replica is back to
no session and no cached token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import SCHEDULE, run_chaos, summary

pytestmark = pytest.mark.slow  # five processes, four restarts


def test_faults_under_load_lose_nothing(tiny_draft: Path, tiny_target: Path) -> None:
    report = run_chaos(str(tiny_draft), str(tiny_target), clients=8, requests=60, seed=3,
                       threads=1, every=6)
    print(summary(report))
    assert len(report.events) == len(SCHEDULE), report.events
    assert report.errors == []
    assert report.mismatches == []
    assert report.deterministic_checked > 0
    assert all(v == 0 for gauges in report.gauges_after.values() for v in gauges.values())
    # Killed and drained replicas held sessions: the orchestrator rebuilt them elsewhere.
    assert report.counters["tandem_session_rebuilds_total"] >= 1
    assert report.counters["tandem_draft_cache_steps_total"] > 0  # drafting ahead ran
    assert report.problems() == []
