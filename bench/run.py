"""`tandem bench`: every mode in one invocation, on the same prompts, interleaved.

Modes (each prompt runs every mode before the next prompt; the order rotates):
  hf-target         Hugging Face target-only generate(), in process (the reference)
  hf-assisted       HF assisted generation, draft in the same dtype as the target (HF defaults)
  hf-assisted-cheap HF assisted generation with the same cheap draft Tandem uses
  tandem-k0         Tandem with num_speculative_tokens=0: plain target decoding via the services
  tandem            Tandem speculative, default policy, cheap draft
  tandem-plain-draft  Tandem speculative with the draft in the target's dtype (acceptance before quantization)
  tandem-llama      Tandem speculative, default policy, the draft's GGUF file on llama.cpp
                    (--backend llama.cpp; the other draft modes run --backend transformers)
  tandem-lookup     Tandem with proposer=prompt-lookup: n-gram matches in the history, no model
  tandem-lookahead  Tandem with proposer=lookahead: no draft model; the target proposes n-grams from a
                    Jacobi window scored in its own pass (--lookahead W,N,G, the target's default if unset)
  tandem-medusa     Tandem with Medusa heads on the target (only with --medusa-heads): no draft;
                    the target proposes a token tree and verifies it in the same pass
  tandem-sequential Tandem with the cheap draft at fixed k, --overlap off: draft and target take turns
  tandem-overlap    the same with --overlap on: the draft drafts the next block while the target
                    verifies this one (the `tandem` mode overlaps too, under the adaptive policy)

--placement split pins the target service to core 0 and the draft service to core 1, one
thread each, for every Tandem mode: one machine emulating separate hardware.

Results go to bench/results/<time>/: results.json, results.md and plot.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import tiny
from bench.prompts import Prompt, prompts
from orchestrator.config import OrchestratorConfig
from orchestrator.policy import expected_tokens
from tandem import batching, llama, matmul, models
from tandem.client import TandemClient
from tandem.kv import KVSession
from tandem.launch import Process, spawn, wait_serving

HF_MODES = ("hf-target", "hf-assisted", "hf-assisted-cheap")
TANDEM_MODES = ("tandem-k0", "tandem", "tandem-plain-draft", "tandem-llama", "tandem-lookup",
                "tandem-lookahead",
                "tandem-medusa", "tandem-sequential", "tandem-overlap")
# Modes at a fixed k on an orchestrator of their own: --overlap off and on.
OVERLAP_MODES = {"tandem-sequential": "off", "tandem-overlap": "on"}
# Modes that ask for a proposer other than the deployment's default (the draft model).
MODE_PROPOSERS = {"tandem-lookup": "prompt-lookup", "tandem-lookahead": "lookahead",
                  "tandem-medusa": "medusa"}
MODES = HF_MODES + TANDEM_MODES
# Accepted tokens come from no drafted chain: no draft at all, or a token tree verified in
# the target's own pass (the chain formulas for alpha, c and the bounds do not apply).
DRAFTLESS_MODES = ("tandem-k0", "tandem-lookahead", "tandem-medusa")
TINY_VOCAB = 151_936  # the Qwen2.5 family's: --tiny's logits are as wide as the real pair's


@dataclass(frozen=True)
class Setting:
    name: str
    temperature: float


SETTINGS = (Setting("greedy", 0.0), Setting("t0.7", 0.7))


@dataclass
class Run:
    mode: str
    setting: str
    prompt: str
    kind: str
    tokens: int
    wall_s: float
    ttft_s: float
    token_ids: list[int] = field(repr=False)
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    total_ms: float = 0.0
    wire_bytes: int = 0
    prefill_ms: float = 0.0
    rejected: int = 0  # drafted tokens tested and rejected (at most one per pass)
    first_tokens: int = 1  # tokens that arrived at TTFT (HF assisted: a whole first step)
    draft_wait_ms: float = 0.0  # decode steps' waits for the draft
    draft_hits: int = 0  # drafting steps whose history the draft had guessed (overlap on)
    draft_misses: int = 0
    # Per decode step: the orchestrator's own time and the wire's; per replica pass: its
    # stages (ms) and bytes read to the host (`machinery`).
    machinery: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first arrival, per second after it: prefill excluded."""
        return (self.tokens - self.first_tokens) / max(1e-9, self.wall_s - self.ttft_s)

    @property
    def decode_passes(self) -> int:
        return max(1, self.passes - 1)


class FirstTokenTimer:
    """A generate() streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None
        self.first_tokens = 1

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put() is the prompt
            self.first = time.perf_counter()
            self.first_tokens = int(value.numel())  # assisted generation puts a whole step

    def end(self) -> None:
        pass


def hf_run(mode: str, target: Any, assistant: Any, ids: list[int], setting: Setting, n: int,
           seed: int) -> tuple[list[int], float, float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=setting.temperature > 0, temperature=setting.temperature or None, top_k=0, top_p=1.0,
        max_new_tokens=n, min_new_tokens=0, pad_token_id=0)
    torch.manual_seed(seed)
    timer = FirstTokenTimer()
    started = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), generation_config=config, streamer=timer,
                              assistant_model=assistant)
    wall = time.perf_counter() - started
    return out[0, len(ids):].tolist(), wall, (timer.first or started + wall) - started, timer.first_tokens


def neutral_generation_defaults(model: Any) -> None:
    """Make generate() do what Tandem does: exactly the tokens asked for (no EOS stop), and no
    logits processing a hub model's generation_config may carry (unset fields of the
    GenerationConfig passed to generate() are filled from it)."""
    config = model.generation_config
    config.eos_token_id = None
    config.repetition_penalty = 1.0
    config.no_repeat_ngram_size = 0
    config.encoder_no_repeat_ngram_size = 0
    config.bad_words_ids = None
    config.suppress_tokens = None
    config.begin_suppress_tokens = None
    config.min_p = None
    config.typical_p = 1.0
    config.epsilon_cutoff = 0.0
    config.eta_cutoff = 0.0


def tandem_run(client: Any, ids: list[int], setting: Setting, n: int, seed: int, k: int | None,
               proposer: str | None = None) -> tuple[list[int], float, float, int, Any]:
    started = time.perf_counter()
    first, first_tokens = None, 1
    token_ids: list[int] = []
    summary = None
    for message in client.generate_stream(ids, max_new_tokens=n, temperature=setting.temperature,
                                          seed=seed, num_speculative_tokens=k, ignore_eos=True,
                                          proposer=proposer):
        if message.HasField("delta"):
            if first is None:
                first, first_tokens = time.perf_counter(), len(message.delta.token_ids)
            token_ids.extend(message.delta.token_ids)
        else:
            summary = message.summary
    wall = time.perf_counter() - started
    assert summary is not None, "the stream ended without a summary"
    return token_ids, wall, (first or started) - started, first_tokens, summary.usage


#: The machinery split's columns: per decode step, then per replica pass.
MACHINERY = ("orchestrator_ms", "wire_ms", "target_before_ms", "target_forward_ms", "target_after_ms",
             "target_host_bytes", "draft_before_ms", "draft_forward_ms", "draft_after_ms",
             "draft_host_bytes")


def machinery(usage: Any) -> dict[str, float]:
    """A request's machinery (its Usage): the orchestrator's own time and the wire's per
    decode step, and each replica's pass by stage, per pass."""
    steps = max(1, usage.target_forward_passes - 1)  # the first step prefills
    out = {"orchestrator_ms": usage.orchestrator_ms / steps, "wire_ms": usage.replica_wire_ms / steps}
    for name, split in (("target", usage.target_passes), ("draft", usage.draft_passes)):
        if split.pass_count:
            n = split.pass_count
            out |= {f"{name}_before_ms": split.host_before_ms / n, f"{name}_forward_ms": split.forward_ms / n,
                    f"{name}_after_ms": split.host_after_ms / n, f"{name}_host_bytes": split.host_bytes / n,
                    f"{name}_captured_share": split.captured_count / n}
    return out


def machinery_table(setting: str, table: dict[str, Any], f: Any) -> list[str]:
    """Where a step's time goes besides the forwards: medians over the mode's runs."""
    lines = [f"## {setting}: machinery", "",
             ("| mode | orchestrator ms/step | wire ms/step | target pass: before / forward / after ms "
              "| target bytes to host/pass | draft pass: before / forward / after ms "
              "| draft bytes to host/pass |"), "|" + "---|" * 7]
    for mode, r in table.items():
        m = r.get("machinery")
        if not m:
            continue

        def stages(name: str, m: dict[str, float] = m) -> str:
            parts = [m.get(f"{name}_{s}_ms") for s in ("before", "forward", "after")]
            return " / ".join(f(v, "{:.2f}") for v in parts) if parts[0] is not None else "-"

        lines.append(f"| {mode} | {f(m.get('orchestrator_ms'), '{:.2f}')} | {f(m.get('wire_ms'), '{:.2f}')} "
                     f"| {stages('target')} | {f(m.get('target_host_bytes'), '{:.0f}')} | {stages('draft')} "
                     f"| {f(m.get('draft_host_bytes'), '{:.0f}')} |")
    return [*lines, ""]


def peak_rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def leviathan_bound(alpha: float, k: float, c: float) -> float:
    """Expected speedup of speculative decoding: E / (k c + 1), E = (1 - alpha^(k+1)) / (1 - alpha).

    k may be fractional: the mean number of tokens drafted per target pass under an
    adaptive policy. E is concave in k and the cost k c + 1 is linear, so by Jensen the
    bound at the mean k is at least the bound of any mix of block sizes with that mean:
    achieved / bound(mean k) never flatters the policy.
    """
    return expected_tokens(alpha, k) / (k * c + 1)


def best_bound(alpha: float, c: float, verify_ratio: dict[int, float]) -> float:
    """The best speedup any fixed k can reach with these measured costs: max over k of
    E(k) / (k c + v(k+1) / v(1)), where verify_ratio[n] = v(n) / v(1) is what a target pass
    over n tokens costs against one token. With verification free in block size
    (verify_ratio all 1) it is Leviathan's bound at the best k; where wider passes cost
    more (a CPU without matrix units) it is lower, and it is never below 1 (k = 0).
    """
    return max(expected_tokens(alpha, n - 1) / ((n - 1) * c + ratio) for n, ratio in verify_ratio.items())


def measure_verify_ratio(model: Any, prompt_ids: list[int], sizes: range, reps: int = 5) -> dict[int, float]:
    """v(n) / v(1) for n in sizes: the target's cost to append n tokens to a warm cache,
    against one token; medians of `reps` interleaved passes, in this process."""
    session = KVSession("verify-cost", models.logits_width(model))
    batching.forward(session, model, prompt_ids, logits_to_keep=1)
    start, times = session.length, defaultdict(list)
    for _ in range(reps):
        for n in sizes:
            session.rollback(start)
            began = time.perf_counter()
            batching.forward(session, model, prompt_ids[:n], logits_to_keep=n)
            times[n].append(time.perf_counter() - began)
    one = statistics.median(times[1])
    return {n: statistics.median(times[n]) / one for n in sizes}


def summarize(runs: list[Run], verify_ratio: dict[int, float] | None = None) -> dict[str, Any]:
    by: dict[tuple[str, str], dict[str, Run]] = defaultdict(dict)
    for r in runs:
        by[(r.setting, r.prompt)][r.mode] = r
    out: dict[str, Any] = {}
    for setting in sorted({r.setting for r in runs}):
        groups = [g for (s, _), g in by.items() if s == setting]
        table: dict[str, Any] = {}
        for mode in MODES:
            mine = [g[mode] for g in groups if mode in g]
            if not mine:
                continue

            def ratio(base: str, mode: str = mode, groups: list[dict[str, Run]] = groups,
                      decode: bool = False) -> float | None:
                pairs = [(g[mode].decode_tok_s / g[base].decode_tok_s) if decode
                         else (g[mode].tok_s / g[base].tok_s)
                         for g in groups if mode in g and base in g
                         and (g[base].decode_tok_s if decode else g[base].tok_s) > 0]
                return statistics.median(pairs) if pairs else None

            row: dict[str, Any] = {
                "tok_s": statistics.median(r.tok_s for r in mine),
                "ttft_s": statistics.median(r.ttft_s for r in mine),
                "speedup_vs_hf_target": ratio("hf-target"),
                "speedup_vs_hf_assisted": ratio("hf-assisted"),
                "speedup_vs_hf_assisted_cheap": ratio("hf-assisted-cheap"),
                "speedup_vs_tandem_k0": ratio("tandem-k0"),
                "speedup_vs_tandem_sequential": ratio("tandem-sequential"),
                "decode_tok_s": statistics.median(r.decode_tok_s for r in mine),
                "decode_speedup_vs_hf_target": ratio("hf-target", decode=True),
                "decode_speedup_vs_hf_assisted": ratio("hf-assisted", decode=True),
                "decode_speedup_vs_tandem_k0": ratio("tandem-k0", decode=True),
            }
            if mode in TANDEM_MODES:
                drafted, accepted = sum(r.drafted for r in mine), sum(r.accepted for r in mine)
                passes = sum(r.decode_passes for r in mine)
                row["bytes_per_token"] = statistics.median(r.wire_bytes / r.tokens for r in mine)
                # Decode steps only: the first step prefills both models and is reported as TTFT.
                row["mean_tokens_per_target_pass"] = sum(r.tokens - 1 for r in mine) / passes
                row["mean_accepted_per_target_pass"] = accepted / passes
                step = {
                    "draft_ms": statistics.median(r.draft_ms / r.decode_passes for r in mine),
                    "verify_ms": statistics.median(r.target_ms / r.decode_passes for r in mine),
                    "other_ms": statistics.median(
                        (r.total_ms - r.prefill_ms - r.draft_ms - r.target_ms) / r.decode_passes
                        for r in mine),
                }
                row["per_step"] = step
                row["machinery"] = {key: statistics.median(r.machinery[key] for r in mine)
                                    for key in MACHINERY if all(key in r.machinery for r in mine)}
                tested = accepted + sum(r.rejected for r in mine)
                if drafted and tested and mode not in DRAFTLESS_MODES:
                    # Per tested token: a block stops at its first rejection, and the drafts
                    # after it are never tested (accepted / drafted would understate alpha).
                    alpha = accepted / tested
                    # c against a one-token target pass (tandem-k0's, where it ran), as the
                    # achieved speedup is against tandem-k0; else this mode's mean pass.
                    plain = [g["tandem-k0"] for g in groups if "tandem-k0" in g]
                    one_pass = (sum(r.target_ms for r in plain) / sum(r.decode_passes for r in plain)
                                if plain else sum(r.target_ms for r in mine) / passes)
                    c = (sum(r.draft_ms for r in mine) / drafted) / one_pass
                    # The k the policy actually drafted, per pass: the configured k is only its most.
                    k_mean = drafted / passes
                    bound = leviathan_bound(alpha, k_mean, c)
                    row.update(alpha=alpha, c=c, k_mean=k_mean, leviathan_bound=bound)
                    achieved = row["decode_speedup_vs_tandem_k0"]
                    row["fraction_of_bound"] = achieved / bound if achieved else None
                    if verify_ratio:
                        best = best_bound(alpha, c, verify_ratio)
                        row["best_bound_measured_verify"] = best
                        row["fraction_of_best_bound"] = achieved / best if achieved else None
                    # With the draft hidden behind verification, a step costs one pass of k+1
                    # tokens: E(k) / (v(k+1)/v(1)), v as the target service measured it here.
                    plain_verify = [r.target_ms / r.decode_passes for r in plain]
                    if plain_verify:
                        ratio_v = (sum(r.target_ms for r in mine) / passes) / statistics.median(plain_verify)
                        row["verify_vs_k0"] = ratio_v
                        row["overlapped_bound"] = expected_tokens(alpha, k_mean) / max(ratio_v, 1e-9)
                hits, misses = sum(r.draft_hits for r in mine), sum(r.draft_misses for r in mine)
                row["hit_rate"] = hits / (hits + misses) if hits + misses else None
                step["draft_wait_ms"] = statistics.median(r.draft_wait_ms / r.decode_passes for r in mine)
            table[mode] = row
        out[setting] = table
    return out


def by_kind(runs: list[Run], verify_ratio: dict[int, float] | None = None) -> dict[str, dict[str, Any]]:
    """The summary again over each kind of prompt alone: {kind: {setting: {mode: row}}}.

    Proposers differ most here: prompt lookup and Lookahead pay on code that repeats
    itself and barely on prose."""
    return {kind: summarize([r for r in runs if r.kind == kind], verify_ratio)
            for kind in sorted({r.kind for r in runs})}


def matches(runs: list[Run]) -> dict[str, str]:
    """Greedy outputs of each mode that equal hf-target's, per mode (bf16 near-ties may flip)."""
    ref = {r.prompt: r.token_ids for r in runs if r.mode == "hf-target" and r.setting == "greedy"}
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode and r.setting == "greedy" and r.prompt in ref]
        if mine:
            out[mode] = f"{sum(r.token_ids == ref[r.prompt] for r in mine)}/{len(mine)}"
    return out


def markdown(summary: dict[str, Any], meta: dict[str, Any],
             kinds: dict[str, dict[str, Any]] | None = None) -> str:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    header = (f"`{meta['command']}`: {meta['num_prompts']} prompts, {meta['max_new_tokens']} new tokens, "
              f"k={meta['k']}, target {meta['target_dtype']}, cheap draft {meta['cheap_draft']}, "
              f"threads {meta['threads']}"
              + (f", Medusa heads {meta['medusa_heads']}" if meta.get("medusa_heads") else ""))
    lines = [f"# tandem bench ({meta['started']})", "", header, ""]
    if meta.get("pass_times"):
        lines += [pass_table({name: {int(t): ms for t, ms in times.items()}
                              for name, times in meta["pass_times"].items()}), ""]
    if meta.get("verify_ratio"):
        lines += ["Target pass over n tokens against one token, measured in process (v(n)/v(1)): "
                  + ", ".join(f"{n}: {r:.2f}" for n, r in meta["verify_ratio"].items())
                  + ". Bound: Leviathan's E/(k̄c+1), which takes verification as free in block size; "
                  "best bound: max over k of E(k)/(kc + v(k+1)/v(1)), with the costs measured here.", ""]
    for setting, table in summary.items():
        if set(OVERLAP_MODES) & set(table):
            lines += overlap_table(setting, table, f)
        if any(r.get("machinery") for r in table.values()):
            lines += machinery_table(setting, table, f)
        lines += [f"## {setting}", "",
                  ("| mode | tok/s | ×hf-target | ×hf-assisted | ×hf-assisted-cheap | ×tandem-k0 | TTFT s "
                   "| decode tok/s | decode ×hf-target | decode ×hf-assisted | decode ×tandem-k0 "
                   "| α | tokens/pass | accepted/pass | c | k̄ | bound | achieved/bound | best bound "
                   "| achieved/best | draft ms/step | verify ms/step | other ms/step | bytes/token |"),
                  "|" + "---|" * 24]
        for mode, r in table.items():
            step = r.get("per_step", {})
            lines.append(
                f"| {mode} | {f(r['tok_s'])} | {f(r['speedup_vs_hf_target'])} | "
                f"{f(r['speedup_vs_hf_assisted'])} | {f(r['speedup_vs_hf_assisted_cheap'])} | "
                f"{f(r['speedup_vs_tandem_k0'])} | {f(r['ttft_s'])} | {f(r['decode_tok_s'])} | "
                f"{f(r['decode_speedup_vs_hf_target'])} | {f(r['decode_speedup_vs_hf_assisted'])} | "
                f"{f(r['decode_speedup_vs_tandem_k0'])} | {f(r.get('alpha'))} | "
                f"{f(r.get('mean_tokens_per_target_pass'))} | "
                f"{f(r.get('mean_accepted_per_target_pass'))} | {f(r.get('c'))} | "
                f"{f(r.get('k_mean'))} | {f(r.get('leviathan_bound'))} | {f(r.get('fraction_of_bound'))} | "
                f"{f(r.get('best_bound_measured_verify'))} | {f(r.get('fraction_of_best_bound'))} | "
                f"{f(step.get('draft_ms'), '{:.1f}')} | {f(step.get('verify_ms'), '{:.1f}')} | "
                f"{f(step.get('other_ms'), '{:.2f}')} | {f(r.get('bytes_per_token'), '{:.0f}')} |")
        lines.append("")
    for kind, by_setting in (kinds or {}).items():
        for setting, table in by_setting.items():
            lines += [f"## {setting}, {kind} prompts only", "",
                      ("| mode | tok/s | ×hf-target | ×hf-assisted | ×tandem-k0 | decode ×tandem-k0 "
                       "| tokens/pass | accepted/pass |"), "|" + "---|" * 8]
            for mode, r in table.items():
                lines.append(
                    f"| {mode} | {f(r['tok_s'])} | {f(r['speedup_vs_hf_target'])} | "
                    f"{f(r['speedup_vs_hf_assisted'])} | {f(r['speedup_vs_tandem_k0'])} | "
                    f"{f(r['decode_speedup_vs_tandem_k0'])} | "
                    f"{f(r.get('mean_tokens_per_target_pass'))} | "
                    f"{f(r.get('mean_accepted_per_target_pass'))} |")
            lines.append("")
    lines += ["Greedy outputs equal to hf-target: " + ", ".join(f"{m} {v}" for m, v in meta["matches"].items()),
              "", "Peak RSS (MB): " + ", ".join(f"{k} {v:.0f}" for k, v in meta["peak_rss_mb"].items()), ""]
    return "\n".join(lines)


def overlap_table(setting: str, table: dict[str, Any], f: Any) -> list[str]:
    """Sequential against overlapped drafting (and the adaptive policy's `tandem`), side by side.

    Speed ratios are medians of per-prompt ratios, as in every other table."""
    base = table.get("tandem-sequential")
    lines = [f"## {setting}: overlap", "",
             ("| mode | tok/s | ×sequential | ×tandem-k0 | α | k̄ | hit rate | draft wait ms/step "
              "| draft wait ×sequential | verify ms/step | v(k̄+1)/v(1) | Leviathan bound "
              "| overlapped bound |"),
             "|" + "---|" * 13]
    for mode in ("tandem-sequential", "tandem-overlap", "tandem"):
        r = table.get(mode)
        if r is None:
            continue
        step = r.get("per_step", {})
        wait, base_wait = step.get("draft_wait_ms"), (base or {}).get("per_step", {}).get("draft_wait_ms")
        lines.append(
            f"| {mode} | {f(r['tok_s'])} | {f(r.get('speedup_vs_tandem_sequential'))} | "
            f"{f(r['speedup_vs_tandem_k0'])} | {f(r.get('alpha'))} | {f(r.get('k_mean'))} | "
            f"{f(r.get('hit_rate'))} | {f(wait, '{:.1f}')} | "
            f"{f(wait / base_wait if wait is not None and base_wait else None)} | "
            f"{f(step.get('verify_ms'), '{:.1f}')} | {f(r.get('verify_vs_k0'))} | "
            f"{f(r.get('leviathan_bound'))} | {f(r.get('overlapped_bound'))} |")
    return [*lines, ""]


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(summary))
    for i, (setting, table) in enumerate(summary.items()):
        modes = list(table)
        left.bar([j + i * width for j in range(len(modes))],
                 [table[m]["speedup_vs_hf_target"] or 0 for m in modes], width, label=setting)
        left.set_xticks([j + width / 2 for j in range(len(modes))], modes, rotation=25, ha="right")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_ylabel("speedup vs HF target-only generate()")
    left.legend()
    rows = [(f"{m}\n{s}", t[m]["per_step"]) for s, t in summary.items() for m in t if "per_step" in t[m]]
    bottom = [0.0] * len(rows)
    for part in ("draft_ms", "verify_ms", "other_ms"):
        values = [step[part] for _, step in rows]
        right.bar(range(len(rows)), values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values)]
    right.set_xticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
    right.set_ylabel("ms per target pass (step)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="2 code + 1 prose prompt, 32 tokens, greedy only (minutes on a 2-core CPU)")
    parser.add_argument("--draft", default=models.DEFAULT_DRAFT)
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--target-dtype", default="bfloat16")
    parser.add_argument("--cheap-draft", default="int8-dynamic",
                        help="how Tandem's draft is made cheap: int8-dynamic, or a dtype")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="k (default: server's)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--num-code", type=int, default=20)
    parser.add_argument("--num-prose", type=int, default=10)
    parser.add_argument("--code-prompts", choices=("humaneval", "own"), default="humaneval",
                        help="code prompts: HumanEval's first ones, or bench/prompts.py's own")
    parser.add_argument("--matmul", default="auto",
                        help="the services' --matmul (HF in process runs torch's default kernels)")
    parser.add_argument("--settings", default="greedy,t0.7")
    parser.add_argument("--modes", default=None,
                        help="comma-separated (default: every mode; tandem-medusa only with --medusa-heads)")
    parser.add_argument("--medusa-heads", default="",
                        help="Medusa heads for the target (tandem train-medusa): adds tandem-medusa")
    parser.add_argument("--medusa-choices", default="", help="the Medusa tree (default: the server's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--placement", choices=("shared", "split"), default="shared",
                        help="split: target service on core 0, draft service on core 1, one thread "
                        "each, for every Tandem mode (shared: both on every core, --threads each)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lookahead", default=None, help="target's W,N,G for tandem-lookahead "
                        "(default: the target service's)")
    parser.add_argument("--tiny", action="store_true",
                        help="the machinery alone: a tiny random model with a 152k-token vocabulary "
                        "as target and (identical: every token accepted) draft, float32, one thread "
                        "per process; modes hf-target, tandem-k0 and tandem at k=4, 4 code and 2 "
                        "prose prompts, 64 tokens (unless given)")
    args = parser.parse_args(argv)
    if args.tiny:
        tiny_dir = Path(tempfile.mkdtemp(prefix="tandem-tiny-"))
        target = tiny.make_model(tiny_dir / "target", seed=1, vocab_size=TINY_VOCAB, hidden=64, layers=2)
        args.target = str(target)
        args.draft = str(tiny.make_draft_like(target, tiny_dir / "draft", noise=0.0, seed=2))
        args.target_dtype = args.cheap_draft = "float32"
        # Both sides on torch's own kernels: the same forward as HF's, so what differs is machinery.
        args.threads, args.code_prompts, args.matmul = 1, "own", "default"
        args.modes = args.modes or "hf-target,tandem-k0,tandem"
        args.num_speculative_tokens = args.num_speculative_tokens or 4
        if not args.quick and (args.num_code, args.num_prose) == (20, 10):  # the defaults
            args.num_code, args.num_prose = 4, 2
        args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 64)
    if args.quick:
        args.num_code, args.num_prose, args.settings = 2, 1, "greedy"
    n = args.max_new_tokens or (32 if args.quick else 128)
    modes = ([m for m in args.modes.split(",") if m] if args.modes is not None else
             [m for m in MODES if (m != "tandem-medusa" or args.medusa_heads)
              and (m != "tandem-llama" or llama.available())])
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    if "tandem-medusa" in modes and not args.medusa_heads:
        parser.error("mode tandem-medusa needs --medusa-heads (train them with tandem train-medusa)")
    settings = [s for s in SETTINGS if s.name in args.settings.split(",")]
    torch.set_num_threads(args.threads)

    k = args.num_speculative_tokens or OrchestratorConfig.num_speculative_tokens
    quantized = args.cheap_draft == "int8-dynamic"
    cheap = models.Placement(args.device, "float32" if quantized else args.cheap_draft,
                             quantize="int8-dynamic" if quantized else "")
    draft_path, target_path = models.resolve(args.draft), models.resolve(args.target)
    tokenizer = models.load_tokenizer(args.target)
    items: list[Prompt] = prompts(args.num_code, args.num_prose, args.code_prompts)

    procs: dict[str, Process] = {}
    threads = ["--threads", str(args.threads), "--device", args.device, "--matmul", args.matmul]
    target_threads, draft_threads = threads, threads
    if args.placement == "split":
        target_threads = ["--threads", "1", "--cpu-affinity", "0", *threads[2:]]
        draft_threads = ["--threads", "1", "--cpu-affinity", "1", *threads[2:]]
    try:
        if set(modes) & set(TANDEM_MODES):
            lookahead = ["--lookahead", args.lookahead] if args.lookahead else []
            medusa = ["--medusa-heads", args.medusa_heads] if "tandem-medusa" in modes else []
            if medusa and args.medusa_choices:
                medusa += ["--medusa-choices", args.medusa_choices]
            procs["target-service"] = spawn(["target-service", "--model", args.target, "--dtype",
                                             args.target_dtype, *target_threads, *lookahead, *medusa])
            # Alone while it times its passes at start-up: they are the table below.
            wait_serving(procs["target-service"])
            cheap_args = ["--backend", "transformers", "--dtype", cheap.dtype] + (
                ["--quantize", cheap.quantize] if cheap.quantize else [])
            procs["draft-service(cheap)"] = spawn(["draft-service", "--model", args.draft, *cheap_args,
                                                   *draft_threads])
            if "tandem-plain-draft" in modes:
                procs["draft-service(plain)"] = spawn(["draft-service", "--model", args.draft,
                                                       "--backend", "transformers", "--dtype",
                                                       args.target_dtype, *draft_threads])
            if "tandem-llama" in modes:
                procs["draft-service(llama)"] = spawn(["draft-service", "--model", args.draft,
                                                       "--backend", "llama.cpp", *draft_threads])
            orch_args = ["--target", procs["target-service"].address, "--tokenizer", args.target]
            if args.num_speculative_tokens is not None:
                orch_args += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
            procs["orchestrator(cheap)"] = spawn(["orchestrator", "--draft",
                                                  procs["draft-service(cheap)"].address, *orch_args])
            if "tandem-plain-draft" in modes:
                procs["orchestrator(plain)"] = spawn(["orchestrator", "--draft",
                                                      procs["draft-service(plain)"].address, *orch_args])
            if "tandem-llama" in modes:
                procs["orchestrator(llama)"] = spawn(["orchestrator", "--draft",
                                                      procs["draft-service(llama)"].address, *orch_args])
            for mode, overlap in OVERLAP_MODES.items():
                if mode in modes:
                    procs[f"orchestrator({mode})"] = spawn([
                        "orchestrator", "--draft", procs["draft-service(cheap)"].address, *orch_args,
                        "--overlap", overlap])
        hf: dict[str, Any] = {}
        dtype = models.torch_dtype(args.target_dtype)
        if "hf-target" in modes or "hf-assisted" in modes or "hf-assisted-cheap" in modes:
            hf["target"] = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(args.device).eval()
        if "hf-assisted" in modes:
            hf["draft"] = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).to(args.device).eval()
        if "hf-assisted-cheap" in modes:
            hf["cheap"] = models.load_model(args.draft, cheap)
        for model in hf.values():
            neutral_generation_defaults(model)
        for p in procs.values():
            wait_serving(p)
        clients = {name: TandemClient(p.address) for name, p in procs.items() if name.startswith("orchestrator")}
        verify_ratio = None
        pass_times: dict[str, dict[int, float]] = {}
        if "target-service" in procs:
            info = target_info(procs["target-service"].address)
            pass_times[f"target service ({info.matmul_path})"] = {
                p.token_count: p.pass_ms for p in info.pass_times}
        if "target" in hf:  # what wider passes cost on this machine: the bounds' premise, measured
            probe = (tokenizer.encode(items[0].text) * (k + 2))[: max(k + 1, 16)]
            verify_ratio = measure_verify_ratio(hf["target"], probe, range(1, k + 2))
            pass_times["HF in process (default)"] = matmul.time_passes(hf["target"],
                                                                       matmul.PASS_TOKENS)
        if pass_times:
            print(pass_table(pass_times), flush=True)

        runs: list[Run] = []
        jobs = [(s, p) for s in settings for p in items]
        bar = tqdm(total=len(jobs) * len(modes), desc="bench", unit="run")
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        # Warm up every mode once (first-call allocations, thread pools).
        warm = tokenizer.encode("def f(x):")
        for mode in modes:
            _one(mode, hf, clients, warm, settings[0], 8, args.seed, args.num_speculative_tokens)
        for j, (setting, prompt) in enumerate(jobs):
            ids = tokenizer.encode(prompt.text)
            order = modes[j % len(modes):] + modes[: j % len(modes)]  # rotate so drift hits all modes alike
            for mode in order:
                runs.append(_one(mode, hf, clients, ids, setting, n, args.seed, args.num_speculative_tokens,
                                 prompt))
                bar.update(1)
        bar.close()

        out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        # The raw runs first: an hour of measurements survives a failure in what follows.
        (out / "results.json").write_text(json.dumps({"runs": [asdict(r) for r in runs]}, indent=1))
        summary, kinds = summarize(runs, verify_ratio), by_kind(runs, verify_ratio)
        rss = {"bench (HF in-process)": peak_rss_mb()} | {name: peak_rss_mb(p.proc.pid) for name, p in procs.items()}
        meta = {
            "started": started, "command": "tandem bench " + " ".join(argv or []),
            "target": args.target, "draft": args.draft,
            "num_prompts": len(items), "max_new_tokens": n, "k": k, "target_dtype": args.target_dtype,
            "cheap_draft": args.cheap_draft,
            "threads": (f"{args.threads} per process" if args.placement == "shared" else
                        "split: target on core 0, draft on core 1, 1 thread each"),
            "medusa_heads": args.medusa_heads or None,
            "device": args.device, "matches": matches(runs), "peak_rss_mb": rss,
            "verify_ratio": verify_ratio, "pass_times": pass_times, "matmul": args.matmul,
            "code_prompts": args.code_prompts,
        }
        (out / "results.json").write_text(json.dumps(
            {"meta": meta, "summary": summary, "by_kind": kinds, "runs": [asdict(r) for r in runs]},
            indent=1))
        (out / "results.md").write_text(markdown(summary, meta, kinds))
        plot(summary, out / "plot.png")
        print(markdown(summary, meta, kinds))
        print(f"results: {out}/results.json, results.md, plot.png")
    finally:
        for p in procs.values():
            p.stop()


def target_info(address: str) -> Any:
    """The target service's ModelInfo (its matmul path and the passes it timed)."""
    import grpc

    from tandem.v1 import common_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
            common_pb2.GetModelInfoRequest(), timeout=60).info


def pass_table(pass_times: dict[str, dict[int, float]]) -> str:
    """v(T) per path: ms per pass by its tokens, and v(T)/v(1)."""
    widths = sorted({t for times in pass_times.values() for t in times})
    lines = ["| target pass, ms (v(T)/v(1)) | " + " | ".join(f"T={t}" for t in widths) + " |",
             "|---|" + "---|" * len(widths)]
    for name, times in pass_times.items():
        one = times.get(1)
        cells = [f"{times[t]:.0f} ({times[t] / one:.2f})" if t in times and one else "-"
                 for t in widths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _one(mode: str, hf: dict[str, Any], clients: dict[str, Any], ids: list[int], setting: Setting, n: int,
         seed: int, k: int | None, prompt: Prompt | None = None) -> Run:
    name, kind = (prompt.id, prompt.kind) if prompt else ("warmup", "warmup")
    if mode in HF_MODES:
        assistant = {"hf-target": None, "hf-assisted": hf.get("draft"), "hf-assisted-cheap": hf.get("cheap")}[mode]
        tokens, wall, ttft, first = hf_run(mode, hf["target"], assistant, ids, setting, n, seed)
        return Run(mode, setting.name, name, kind, len(tokens), wall, ttft, tokens, first_tokens=first)
    client = clients[f"orchestrator({mode})" if mode in OVERLAP_MODES else
                     "orchestrator(plain)" if mode == "tandem-plain-draft" else
                     "orchestrator(llama)" if mode == "tandem-llama" else "orchestrator(cheap)"]
    proposer = MODE_PROPOSERS.get(mode)
    # The overlap modes compare the two loops at one fixed k (the server's default when unset).
    fixed = k if k is not None else OrchestratorConfig.num_speculative_tokens
    tokens, wall, ttft, first, usage = tandem_run(
        client, ids, setting, n, seed,
        0 if mode == "tandem-k0" else fixed if mode in OVERLAP_MODES else k, proposer)
    return Run(mode, setting.name, name, kind, len(tokens), wall, ttft, tokens, usage.drafted_tokens,
               usage.accepted_tokens, usage.target_forward_passes, usage.draft_ms, usage.target_ms,
               usage.total_ms, usage.wire_bytes, usage.prefill_ms, usage.rejected_tokens, first,
               usage.draft_wait_ms, usage.draft_cache_hits, usage.draft_cache_misses, machinery(usage))


if __name__ == "__main__":
    main()
