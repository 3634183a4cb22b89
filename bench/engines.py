"""`python -m bench.engines`: Tandem as `tandem up` runs it beside llama.cpp's own programs on
the same GGUF files and the same cores, in one run.

Tandem modes, each prompt running every mode before the next prompt (the order rotates):
  tandem      the defaults (`tandem up`): the policy chooses k, the backends are chosen at start-up
  tandem-k0   num_speculative_tokens=0: the target alone, through the services
  tandem-k4   k = 4 at every step: its output must equal tandem-k0's (the match column)

llama.cpp anchors, built from the sources llama-cpp-python vendors (--llama-cpp-bin DIR; building
them: docs/BENCHMARKS.md): `llama-bench` on the target file (plain decoding, tg; prefill, pp; and
v(T), ms per pass of T tokens) and `llama-speculative-simple` on the pair, per prompt.

Also the time to first token of a long chat-like prompt (--long-prompt-tokens) on the stack, and
with --float32-ttft on a second stack whose target runs on transformers in float32.

Results: a markdown table on stdout and bench/results/engines-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.prompts import prompts
from bench.run import Setting, tandem_run
from tandem import models
from tandem.launch import Stack, start_stack

GREEDY = Setting("greedy", 0.0)
MODES = {"tandem": None, "tandem-k0": 0, "tandem-k4": 4}


def up_stack(target_backend: str = "auto") -> Stack:
    """The stack `tandem up` starts on a CPU: every flag at its default."""
    device = ["--device", "cpu", "--matmul", "auto"]
    return start_stack(models.DEFAULT_DRAFT, models.DEFAULT_TARGET, draft_dtype="auto",
                       target_dtype="auto", threads=0, draft_args=[*device, "--quantize", "auto"],
                       target_args=[*device, "--backend", target_backend])


def llama_bench(binary: Path, gguf: Path, threads: int, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-o", "json", *args],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def speculative_simple(binary: Path, target: Path, draft: Path, text: str, n: int, threads: int,
                       draft_max: int) -> float:
    """llama-speculative-simple's decode rate (tokens/s) on one prompt, greedy."""
    result = subprocess.run(
        [str(binary), "-m", str(target), "-md", str(draft), "-p", text, "-n", str(n), "--temp", "0",
         "-t", str(threads), "-td", str(threads), "--spec-type", "draft-simple",
         "--spec-draft-n-max", str(draft_max), "-c", "4096"],
        capture_output=True, text=True, timeout=1800, check=False)
    found = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s",
                      result.stdout + result.stderr)
    if found is None:
        raise RuntimeError(f"llama-speculative-simple printed no speed:\n{result.stderr[-2000:]}")
    return float(found.group(1))


def long_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """A chat-like prompt of about `tokens` tokens: our prose and code prompts, repeated."""
    text = "\n\n".join(p.text for p in prompts(20, 10, "own"))
    ids: list[int] = tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-bin", default="", help="directory holding llama-bench and "
                        "llama-speculative-simple (empty: no llama.cpp anchors)")
    parser.add_argument("--num-code", type=int, default=2)
    parser.add_argument("--num-prose", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp programs' threads")
    parser.add_argument("--draft-max", type=int, default=4, help="llama-speculative-simple's")
    parser.add_argument("--long-prompt-tokens", type=int, default=700)
    parser.add_argument("--float32-ttft", action="store_true",
                        help="also time the long prompt's first token on a float32 transformers target")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)

    target_gguf, draft_gguf = models.find_gguf(models.DEFAULT_TARGET), models.find_gguf(models.DEFAULT_DRAFT)
    assert target_gguf is not None and draft_gguf is not None
    bins = Path(args.llama_cpp_bin) if args.llama_cpp_bin else None
    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    chosen = prompts(args.num_code, args.num_prose, "own")
    rates: dict[str, dict[str, list[float]]] = {}  # mode -> prompt -> decode tokens/s
    outputs: dict[tuple[str, str], list[int]] = {}
    results: dict[str, Any] = {}

    stack = up_stack()
    try:
        with stack.client() as client:
            target = stack.targets[0]
            for rep in range(args.repeats):
                for i, prompt in enumerate(chosen):
                    ids = tokenizer.encode(prompt.text)
                    modes = list(MODES)
                    shift = (i + rep) % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        tokens, wall, ttft, first, _ = tandem_run(client, ids, GREEDY, args.max_new_tokens,
                                                                  1, MODES[mode])
                        rates.setdefault(mode, {}).setdefault(prompt.id, []).append(
                            (len(tokens) - first) / (wall - ttft))
                        outputs[(mode, prompt.id)] = tokens
                    if bins is not None:
                        rates.setdefault("llama.cpp speculative", {}).setdefault(prompt.id, []).append(
                            speculative_simple(bins / "llama-speculative-simple", target_gguf, draft_gguf,
                                               prompt.text, args.max_new_tokens, args.threads,
                                               args.draft_max))
            _, wall, ttft, _, _ = tandem_run(client, long_prompt(tokenizer, args.long_prompt_tokens),
                                             GREEDY, 8, 1, None)
            results["long_prompt_ttft_s"] = ttft
            results["backend_choice"] = [line for line in target.lines if "--backend auto" in line]
    finally:
        stack.stop()
    if args.float32_ttft:
        stack = up_stack("transformers")
        try:
            with stack.client() as client:
                _, _, ttft, _, _ = tandem_run(client, long_prompt(tokenizer, args.long_prompt_tokens),
                                              GREEDY, 8, 1, None)
                results["long_prompt_ttft_float32_s"] = ttft
        finally:
            stack.stop()
    if bins is not None:
        plain = llama_bench(bins / "llama-bench", target_gguf, args.threads, "-p", "0", "-n", "64", "-r", "3")
        rates["llama.cpp plain (llama-bench tg64)"] = {"all": [plain[0]["avg_ts"]]}
        prefill = llama_bench(bins / "llama-bench", target_gguf, args.threads, "-p",
                              str(args.long_prompt_tokens), "-n", "0", "-r", "1")
        results["llama_bench_prefill_tokens_per_s"] = prefill[0]["avg_ts"]
        sizes = llama_bench(bins / "llama-bench", target_gguf, args.threads, "-p", "1,2,3,5,9", "-n", "0",
                            "-r", "3")
        results["llama_bench_v_ms"] = {r["n_prompt"]: 1000.0 / r["avg_ts"] * r["n_prompt"] for r in sizes}

    table = {mode: statistics.median(statistics.median(v) for v in per.values()) for mode, per in rates.items()}
    base = table.get("llama.cpp plain (llama-bench tg64)")
    matched = sum(outputs[("tandem-k4", p.id)] == outputs[("tandem-k0", p.id)] for p in chosen)
    lines = ["| what decoded | tokens/s (median over prompts) | × llama.cpp plain |", "|---|---|---|"]
    lines += [f"| {mode} | {rate:.2f} | {rate / base:.2f} |" if base else f"| {mode} | {rate:.2f} | - |"
              for mode, rate in table.items()]
    lines += results.get("backend_choice", [])
    lines.append(f"\nk=4 output equal to k=0 output on {matched} of {len(chosen)} prompts")
    lines.append(f"time to first token, a {args.long_prompt_tokens}-token prompt: "
                 f"{results['long_prompt_ttft_s']:.2f} s"
                 + (f" (float32 transformers target: {results['long_prompt_ttft_float32_s']:.2f} s)"
                    if "long_prompt_ttft_float32_s" in results else "")
                 + (f"; llama-bench pp{args.long_prompt_tokens}: "
                    f"{args.long_prompt_tokens / results['llama_bench_prefill_tokens_per_s']:.2f} s"
                    if "llama_bench_prefill_tokens_per_s" in results else ""))
    if "llama_bench_v_ms" in results:
        lines.append("llama-bench v(T), ms per pass: " + ", ".join(
            f"{t}: {ms:.0f}" for t, ms in results["llama_bench_v_ms"].items()))
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engines-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(
        {"rates": rates, "table": table, "matched": matched, **results}, indent=1, default=str))


if __name__ == "__main__":
    main()
