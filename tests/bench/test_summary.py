"""The benchmark's arithmetic: medians of per-prompt ratios, per setting and per prompt kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from bench.run import (
    Run,
    best_bound,
    by_kind,
    leviathan_bound,
    markdown,
    measure_verify_ratio,
    summarize,
)
from bench.tiny import make_model


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
    kinds = by_kind(RUNS)
    assert set(kinds) == {"code", "prose"}
    code, prose = kinds["code"]["greedy"]["tandem-lookup"], kinds["prose"]["greedy"]["tandem-lookup"]
    assert code["speedup_vs_tandem_k0"] == pytest.approx(3.0)  # median of 2x and 4x
    assert prose["speedup_vs_tandem_k0"] == pytest.approx(0.8)
    assert code["mean_accepted_per_target_pass"] == pytest.approx(13 / 7)  # decode passes: 5 + 2
    assert prose["mean_accepted_per_target_pass"] == 0
    overall = summarize(RUNS)["greedy"]["tandem-lookup"]
    assert overall["speedup_vs_tandem_k0"] == pytest.approx(2.0)  # median of 2, 4, 0.8


def test_markdown_has_a_table_per_kind() -> None:
    meta = {"started": "now", "command": "tandem bench", "num_prompts": 3, "max_new_tokens": 10,
            "k": 4, "target_dtype": "float32", "cheap_draft": "float32", "threads": 1,
            "matches": {}, "peak_rss_mb": {}}
    text = markdown(summarize(RUNS), meta, by_kind(RUNS))
    assert "## greedy, code prompts only" in text and "## greedy, prose prompts only" in text
    assert "| tandem-lookup | 15.00 | 3.00 | – | 3.00 |" in text  # code: median tok/s 15, 3x


def test_the_bound_uses_the_k_the_policy_drafted_not_the_configured_most() -> None:
    # 8 tokens drafted over 4 decode passes (the first pass is the prefill): k = 2 per pass;
    # each pass accepted one and rejected the next.
    spec = Run(mode="tandem", setting="greedy", prompt="code/0", kind="code", tokens=10, wall_s=1.0,
               ttft_s=0.0, token_ids=list(range(10)), drafted=8, accepted=4, passes=5,
               draft_ms=40.0, target_ms=400.0, total_ms=1000.0, rejected=4)
    row = summarize([*RUNS[:2], spec])["greedy"]["tandem"]
    assert row["k_mean"] == pytest.approx(2.0)
    assert row["alpha"] == pytest.approx(0.5)
    c = (40.0 / 8) / (1800.0 / 10)  # against tandem-k0's one-token pass
    assert row["c"] == pytest.approx(c)
    assert row["leviathan_bound"] == pytest.approx((1 - 0.5 ** 3) / 0.5 / (2 * c + 1))
    assert row["fraction_of_bound"] == pytest.approx(row["decode_speedup_vs_tandem_k0"] / row["leviathan_bound"])


@pytest.mark.parametrize("alpha", [0.2, 0.6, 0.9])
def test_the_bound_at_the_mean_k_is_at_least_any_mix_with_that_mean(alpha: float) -> None:
    c = 0.1
    half_plain_half_k4 = ((1.0 + (1 - alpha ** 5) / (1 - alpha)) / 2) / (2 * c + 1)
    assert leviathan_bound(alpha, 2, c) >= half_plain_half_k4
    assert leviathan_bound(alpha, 0, c) == pytest.approx(1.0)


def test_best_bound_is_leviathans_at_the_best_k_when_verification_is_free() -> None:
    free = {n: 1.0 for n in range(1, 6)}
    assert best_bound(0.8, 0.1, free) == pytest.approx(max(leviathan_bound(0.8, k, 0.1) for k in range(5)))


def test_best_bound_falls_to_plain_decoding_when_wide_passes_cost_linearly() -> None:
    linear = {n: float(n) for n in range(1, 6)}  # a pass over n tokens costs n one-token passes
    assert best_bound(0.6, 0.1, linear) == pytest.approx(1.0)  # k = 0 is best: no speculation pays
    assert best_bound(0.6, 0.1, {1: 1.0, 2: 1.2, 3: 1.4}) == pytest.approx(
        max(1.0, 1.6 / 1.3, (1 + 0.6 + 0.36) / 1.6))


def test_summary_reports_the_best_bound_from_measured_verify_costs() -> None:
    spec = Run(mode="tandem", setting="greedy", prompt="code/0", kind="code", tokens=10, wall_s=1.0,
               ttft_s=0.0, token_ids=list(range(10)), drafted=8, accepted=4, passes=5,
               draft_ms=40.0, target_ms=400.0, total_ms=1000.0, rejected=4)
    ratio = {1: 1.0, 2: 1.5, 3: 2.0}
    row = summarize([*RUNS[:2], spec], ratio)["greedy"]["tandem"]
    assert row["best_bound_measured_verify"] == pytest.approx(best_bound(0.5, row["c"], ratio))
    assert "best_bound_measured_verify" not in summarize([*RUNS[:2], spec])["greedy"]["tandem"]


def test_verify_ratio_is_measured_per_block_size_against_one_token(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "m", seed=0)).eval()
    ratio = measure_verify_ratio(model, list(range(2, 20)), range(1, 4), reps=2)
    assert list(ratio) == [1, 2, 3]
    assert ratio[1] == 1.0 and all(r > 0 for r in ratio.values())


def test_alpha_is_per_tested_token_and_c_is_against_a_plain_pass() -> None:
    """Found in review: alpha was accepted / drafted, which counts the drafts after a
    rejection that were never tested; c divided by this mode's wide verify pass."""
    # 5 decode passes of k=4 at a per-token acceptance of 0.8 (tokens 3.4 per pass): 12
    # accepted, 3 rejections; drafting 24 ms per token; verify 900 ms per wide pass.
    spec = Run(mode="tandem", setting="greedy", prompt="code/0", kind="code", tokens=18, wall_s=1.0,
               ttft_s=0.0, token_ids=list(range(18)), drafted=20, accepted=12, passes=6,
               draft_ms=480.0, target_ms=4500.0, total_ms=5000.0, rejected=3)
    plain = Run(mode="tandem-k0", setting="greedy", prompt="code/0", kind="code", tokens=10, wall_s=2.0,
                ttft_s=0.0, token_ids=list(range(10)), passes=11, target_ms=2400.0, total_ms=2400.0)
    row = summarize([plain, spec])["greedy"]["tandem"]
    assert row["alpha"] == pytest.approx(0.8)
    assert row["c"] == pytest.approx(24.0 / 240.0)


def test_a_zero_rate_baseline_does_not_lose_the_summary() -> None:
    one = [Run(mode=m, setting="greedy", prompt="code/0", kind="code", tokens=1, wall_s=1.0, ttft_s=1.0,
               token_ids=[1], passes=1) for m in ("hf-target", "tandem-k0")]
    row = summarize(one)["greedy"]["tandem-k0"]
    assert row["decode_speedup_vs_hf_target"] is None and row["speedup_vs_hf_target"] == 1.0


def test_decode_rate_excludes_every_token_that_arrived_at_ttft() -> None:
    # HF assisted generation delivers its whole first step (here 4 tokens) at TTFT.
    run = Run(mode="hf-assisted", setting="greedy", prompt="code/0", kind="code", tokens=10, wall_s=4.0,
              ttft_s=1.0, token_ids=list(range(10)), first_tokens=4)
    assert run.decode_tok_s == pytest.approx(6 / 3.0)


def test_hf_runs_note_how_many_tokens_came_first_and_ignore_model_generation_defaults(tmp_path: Path) -> None:
    """Found in review: the first streamer put of assisted generation is a whole speculative
    step, and a model's own generation_config (say a repetition penalty) leaked into the HF
    modes, which Tandem does not apply."""
    from bench.run import SETTINGS, hf_run, neutral_generation_defaults

    target = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "t", seed=0)).eval()
    ids, greedy = [3, 4, 5], SETTINGS[0]
    plain, _, _, _ = hf_run("hf-target", target, None, ids, greedy, 12, seed=0)
    target.generation_config.repetition_penalty = 5.0  # what a hub config may carry
    neutral_generation_defaults(target)
    assert hf_run("hf-target", target, None, ids, greedy, 12, seed=0)[0] == plain
    _, _, _, first = hf_run("hf-assisted", target, target, ids, greedy, 12, seed=0)
    assert first > 1  # the assistant is the target itself: its whole first block is accepted


def test_overlap_is_compared_with_the_sequential_loop_at_the_same_k() -> None:
    """tandem-overlap against tandem-sequential: hit rate, draft wait per step, and the bound
    with the draft hidden, E(k) / (v(k+1)/v(1)), v as the target service reported it."""
    plain = Run(mode="tandem-k0", setting="greedy", prompt="code/0", kind="code", tokens=10, wall_s=2.0,
                ttft_s=0.0, token_ids=list(range(10)), passes=11, target_ms=2000.0, total_ms=2000.0)

    def spec(mode: str, wall_s: float, wait_ms: float, hits: int, misses: int) -> Run:
        # 5 decode passes of k=4, 12 accepted and 3 rejected (alpha 0.8); each pass 400 ms.
        return Run(mode=mode, setting="greedy", prompt="code/0", kind="code", tokens=18, wall_s=wall_s,
                   ttft_s=0.0, token_ids=list(range(18)), drafted=20, accepted=12, passes=6,
                   draft_ms=500.0, target_ms=2000.0, total_ms=wall_s * 1000, rejected=3,
                   draft_wait_ms=wait_ms, draft_hits=hits, draft_misses=misses)

    runs = [plain, spec("tandem-sequential", 3.0, 600.0, 0, 0), spec("tandem-overlap", 2.0, 150.0, 3, 1)]
    table = summarize(runs)["greedy"]
    overlap = table["tandem-overlap"]
    assert overlap["hit_rate"] == pytest.approx(0.75)
    assert table["tandem-sequential"]["hit_rate"] is None  # no drafting ahead, no hits counted
    assert overlap["per_step"]["draft_wait_ms"] == pytest.approx(30.0)
    assert overlap["verify_vs_k0"] == pytest.approx(400.0 / 200.0)
    assert overlap["overlapped_bound"] == pytest.approx((1 - 0.8 ** 5) / 0.2 / 2.0)
    meta = {"started": "now", "command": "tandem bench", "num_prompts": 1, "max_new_tokens": 18,
            "k": 4, "target_dtype": "float32", "cheap_draft": "float32", "threads": 1,
            "matches": {}, "peak_rss_mb": {}}
    text = markdown(summarize(runs), meta)
    assert "## greedy: overlap" in text
    assert "| tandem-overlap | 9.00 | 1.50 |" in text  # 18 tokens in 2 s, against 6 tok/s
    assert "| 0.75 | 30.0 | 0.25 |" in text  # hit rate, wait per step, wait against sequential


def test_the_overlap_table_compares_prompt_by_prompt() -> None:
    """×sequential is the median of per-prompt ratios, as in every other table, not a ratio
    of the modes' median speeds (which pairs one prompt's speed with another's)."""
    def run(mode: str, prompt: str, wall_s: float) -> Run:
        return Run(mode=mode, setting="greedy", prompt=prompt, kind="code", tokens=12, wall_s=wall_s,
                   ttft_s=0.0, token_ids=list(range(12)), drafted=8, accepted=6, passes=3,
                   draft_ms=100.0, target_ms=300.0, total_ms=wall_s * 1000, rejected=1)

    # tok/s, sequential 6, 9, 12 and overlapped 12, 9, 12: per prompt 2x, 1x, 1x.
    runs = [run("tandem-sequential", p, 12 / s) for p, s in (("a", 6), ("b", 9), ("c", 12))]
    runs += [run("tandem-overlap", p, 12 / s) for p, s in (("a", 12), ("b", 9), ("c", 12))]
    meta = {"started": "now", "command": "tandem bench", "num_prompts": 3, "max_new_tokens": 12,
            "k": 4, "target_dtype": "float32", "cheap_draft": "float32", "threads": 1,
            "matches": {}, "peak_rss_mb": {}}
    assert summarize(runs)["greedy"]["tandem-overlap"]["speedup_vs_tandem_sequential"] == pytest.approx(1.0)
    assert "| tandem-overlap | 12.00 | 1.00 |" in markdown(summarize(runs), meta)  # not 12/9 = 1.33
