"""`tandem bench-load --sweep`: its arithmetic, and end to end on the tiny pair: every mode and
point, interleaved, and its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep import (
    MODES,
    Point,
    main,
    median_point,
    orchestrator_argv,
    ratio,
    rotated,
    split_cpus,
)


def _point(mode: str, tokens_per_s: float, runs: list[float] | None = None) -> Point:
    return Point(mode, 4, 4, 24, 1.0, tokens_per_s, 10.0, 20.0, 1.0, 2.0, 3.0, 0.5, 0.0, 0.0, runs or [])


def test_every_mode_takes_each_place_in_turn() -> None:
    modes = ["a", "b", "c"]
    orders = [rotated(modes, repeat) for repeat in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotated(modes, 3) == modes
    for place in range(3):  # so a slow first (or last) place falls on each mode once
        assert sorted(order[place] for order in orders) == modes


def test_a_point_keeps_the_median_of_its_repeats_and_every_run() -> None:
    runs = [_point("m", t) for t in (3.0, 1.0, 2.0)]
    runs[1].ttft_p50_ms = 99.0
    merged = median_point(runs)
    assert merged.tokens_per_s == 2.0 and merged.ttft_p50_ms == 10.0
    assert merged.runs_tokens_per_s == [3.0, 1.0, 2.0]


def test_ratios_pair_runs_made_side_by_side() -> None:
    # A slow spell in the second repeat slows both modes: the paired ratios stay 2.
    fast = _point("spec", 4.0, [4.0, 2.0, 4.0])
    base = _point("k=0", 2.0, [2.0, 1.0, 2.0])
    assert ratio(fast, base) == 2.0
    assert ratio(_point("x", 3.0), _point("y", 2.0)) == 1.5  # no runs: the medians


@pytest.mark.slow  # three stacks of real processes
def test_the_sweep_measures_every_mode_at_every_concurrency(tiny_draft: Path, tiny_target: Path,
                                                          tmp_path: Path) -> None:
    main(["--draft", str(tiny_draft), "--target", str(tiny_target), "--draft-args", "",
          "--target-args", "", "--concurrency", "1,2,4", "--max-new-tokens", "6",
          "--prompt-chars", "40", "--repeats", "2", "--per-session-up-to", "2", "--placement", "split",
          "--out", str(tmp_path)])
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert [(p["mode"], p["clients"]) for p in points] == [  # the per-session baseline up to 2 clients
        ("per-session k=0", 1), ("per-session k=0", 2),
        *((mode, clients) for mode in ("batched k=0", "batched speculation") for clients in (1, 2, 4))]
    for p in points:
        assert p["tokens"] == 6 * p["requests"] and p["tokens_per_s"] > 0
        assert len(p["runs_tokens_per_s"]) == 2
        assert 0.0 < p["target_busy"] <= 1.0
    by = {(p["mode"], p["clients"]): p for p in points}
    assert by[("per-session k=0", 2)]["mean_batch_sessions"] == 1.0  # the unbatched baseline
    assert by[("batched k=0", 4)]["mean_batch_sessions"] > 1.0
    for p in points:  # what the policy drafted: nothing at k=0
        assert p["drafted_per_token"] >= p["accepted_per_token"] >= 0.0
        assert p["mode"] == "batched speculation" or p["drafted_per_token"] == 0.0
    table = (tmp_path / "sweep.md").read_text()
    assert "| batched k=0 | 4 |" in table and "| batched k=0 | 4 | " + f"{by[('batched k=0', 4)]['tokens_per_s']:.2f} | - |" in table
    assert (tmp_path / "sweep.png").stat().st_size > 0
    # Modes whose services run alike share them: one target for both batched modes, one for
    # the per-session baseline, one draft; an orchestrator per mode.
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert [n for n in logs if n.startswith("target")] == ["target-0.log", "target-1.log"]
    assert len([n for n in logs if n.startswith("draft")]) == 1
    assert len([n for n in logs if n.startswith("orchestrator")]) == 3
    # Every mode prefills the same prompts as the first did: no prefix cache hands them over.
    assert all("prefix cache: up to" not in (tmp_path / "logs" / n).read_text() for n in logs)


def test_the_split_placement_gives_the_target_and_the_draft_disjoint_cpus() -> None:
    assert split_cpus([1, 0]) == ("0", "1")
    assert split_cpus(range(5)) == ("0,1,2", "3,4")
    with pytest.raises(SystemExit, match="at least two CPUs"):
        split_cpus([3])


def test_speculation_modes_measure_the_draft_model_alone() -> None:
    """Found by the split sweep: under `auto`, the default proposer, later points proposed the
    replies earlier points had given the same prompts (suffix decoding) and accepted them all."""
    argv = orchestrator_argv(MODES["batched speculation llama.cpp"], ["d:1"], "t:2")
    assert argv[argv.index("--proposer") + 1] == "draft-model"
    assert "--proposer" not in orchestrator_argv(MODES["batched k=0"], [], "t:2")
