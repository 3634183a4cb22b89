"""The benchmark's arithmetic: medians of per-prompt ratios, per setting and per prompt kind."""

from __future__ import annotations

import pytest

from bench.run import Run, by_kind, markdown, summarize


def run(mode: str, prompt: str, wall_s: float, accepted: int = 0, passes: int = 0) -> Run:
    kind = prompt.split("/")[0]
    return Run(mode=mode, setting="greedy", prompt=prompt, kind=kind, tokens=10, wall_s=wall_s,
               ttft_s=0.0, token_ids=list(range(10)), accepted=accepted, passes=passes,
               drafted=accepted, total_ms=wall_s * 1000, target_ms=wall_s * 900)


RUNS = [
    run("hf-target", "code/0", 2.0), run("tandem-k0", "code/0", 2.0, passes=11),
    run("tandem-lookup", "code/0", 1.0, accepted=5, passes=6),
    run("hf-target", "code/1", 2.0), run("tandem-k0", "code/1", 2.0, passes=11),
    run("tandem-lookup", "code/1", 0.5, accepted=8, passes=3),
    run("hf-target", "prose/0", 2.0), run("tandem-k0", "prose/0", 2.0, passes=11),
    run("tandem-lookup", "prose/0", 2.5, accepted=0, passes=11),
]


def test_each_kind_is_summarized_on_its_own_prompts() -> None:
    kinds = by_kind(RUNS, k=4)
    assert set(kinds) == {"code", "prose"}
    code, prose = kinds["code"]["greedy"]["tandem-lookup"], kinds["prose"]["greedy"]["tandem-lookup"]
    assert code["speedup_vs_tandem_k0"] == pytest.approx(3.0)  # median of 2x and 4x
    assert prose["speedup_vs_tandem_k0"] == pytest.approx(0.8)
    assert code["mean_accepted_per_target_pass"] == pytest.approx(13 / 7)  # decode passes: 5 + 2
    assert prose["mean_accepted_per_target_pass"] == 0
    overall = summarize(RUNS, k=4)["greedy"]["tandem-lookup"]
    assert overall["speedup_vs_tandem_k0"] == pytest.approx(2.0)  # median of 2, 4, 0.8


def test_markdown_has_a_table_per_kind() -> None:
    meta = {"started": "now", "command": "tandem bench", "num_prompts": 3, "max_new_tokens": 10,
            "k": 4, "target_dtype": "float32", "cheap_draft": "float32", "threads": 1,
            "matches": {}, "peak_rss_mb": {}}
    text = markdown(summarize(RUNS, 4), meta, by_kind(RUNS, 4))
    assert "## greedy, code prompts only" in text and "## greedy, prose prompts only" in text
    assert "| tandem-lookup | 15.00 | 3.00 | – | 3.00 |" in text  # code: median tok/s 15, 3x
