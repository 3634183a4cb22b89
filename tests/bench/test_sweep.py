"""`tandem bench-load --sweep` end to end on the tiny pair: every mode and point, and its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep import main

pytestmark = pytest.mark.slow  # three stacks of real processes


def test_the_sweep_measures_every_mode_at_every_concurrency(tiny_draft: Path, tiny_target: Path,
                                                          tmp_path: Path) -> None:
    main(["--draft", str(tiny_draft), "--target", str(tiny_target), "--draft-args", "",
          "--target-args", "", "--concurrency", "1,4", "--max-new-tokens", "6",
          "--prompt-chars", "40", "--out", str(tmp_path)])
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert [(p["mode"], p["clients"]) for p in points] == [
        (mode, clients) for mode in ("per-session k=0", "batched k=0", "batched speculation")
        for clients in (1, 4)]
    for p in points:
        assert p["tokens"] == 6 * p["requests"] and p["tokens_per_s"] > 0
    by = {(p["mode"], p["clients"]): p for p in points}
    assert by[("per-session k=0", 4)]["mean_batch_sessions"] == 1.0  # the unbatched baseline
    assert by[("batched k=0", 4)]["mean_batch_sessions"] > 1.0
    assert "| batched k=0 | 4 |" in (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep.png").stat().st_size > 0
