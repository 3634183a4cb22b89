"""`python -m bench.tensor_parallel`: a target on one rank against the same target on N ranks.

Both run on the same cores: one rank with N threads, against N ranks (tensor parallel,
torch.distributed) with one thread each. Each serves the target alone (k=0, greedy) behind an
orchestrator, on the same prompts, in alternating rounds. Reported per mode, as medians over
rounds: the target's step time (from its own step histogram, so the orchestrator and the
wire are not in it), the time to the first token, and tokens/s; and whether the two modes
produced the same tokens.

On a CPU, tensor parallelism is not expected to win: the all-reduces cost more than the
split saves at these sizes. It pays on GPUs, and when one device cannot hold the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.prompts import prompts as bench_prompts
from tandem import models
from tandem.launch import start_stack


def run_mode(target: str, dtype: str, args: Sequence[str], prompts: Sequence[str],
             max_new_tokens: int) -> dict[str, Any]:
    stack = start_stack(None, target, target_dtype=dtype, threads=1,
                        target_args=[*args, "--metrics-port", "0"])
    try:
        with stack.client() as client:
            client.generate(prompts[0], max_new_tokens=4, num_speculative_tokens=0)  # warm-up
            before = stack.targets[0].metrics()
            started, outputs, ttfts = time.perf_counter(), [], []
            for prompt in prompts:
                sent = time.perf_counter()
                tokens: list[int] = []
                for message in client.generate_stream(prompt, max_new_tokens=max_new_tokens,
                                                      num_speculative_tokens=0, ignore_eos=True):
                    if message.HasField("delta"):
                        if not tokens:
                            ttfts.append(time.perf_counter() - sent)
                        tokens.extend(message.delta.token_ids)
                outputs.append(tokens)
            wall = time.perf_counter() - started
            after = stack.targets[0].metrics()
    finally:
        stack.stop()
    name = "tandem_replica_step_duration_seconds"
    steps = after[f"{name}_count"] - before[f"{name}_count"]
    return {
        "step_ms": 1000 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / steps,
        "ttft_ms": 1000 * statistics.median(ttfts),
        "tokens_per_s": sum(map(len, outputs)) / wall,
        "outputs": outputs,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=models.DEFAULT_TARGET)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (and cores) compared with one rank")
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval prompts per round")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="", help="write the figures here")
    args = parser.parse_args(argv)
    dtype = models.auto_dtype(args.target, "cpu") if args.dtype == "auto" else args.dtype
    prompts = [p.text for p in bench_prompts(num_code=args.prompts, num_prose=0)]
    modes = {f"1 rank x {args.ranks} threads": ["--threads", str(args.ranks)],
             f"{args.ranks} ranks x 1 thread": ["--tensor-parallel-size", str(args.ranks)]}
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_ in range(args.rounds):
        for mode, mode_args in modes.items():
            runs[mode].append(run_mode(args.target, dtype, mode_args, prompts, args.max_new_tokens))
            print(f"round {round_ + 1}/{args.rounds} {mode}: "
                  f"{runs[mode][-1]['step_ms']:.1f} ms per step", flush=True)
    first, second = modes
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs[first], runs[second], strict=True))
    summary = {mode: {key: statistics.median(r[key] for r in rs)
                      for key in ("step_ms", "ttft_ms", "tokens_per_s")} for mode, rs in runs.items()}
    print(f"\n{args.target} ({dtype}), {args.prompts} prompts x {args.max_new_tokens} tokens, "
          f"k=0, medians of {args.rounds} rounds; outputs identical: {same}\n")
    print("| mode | step ms | TTFT ms | tokens/s | step time vs 1 rank |")
    print("|---|---|---|---|---|")
    for mode, figures in summary.items():
        print(f"| {mode} | {figures['step_ms']:.1f} | {figures['ttft_ms']:.0f} | "
              f"{figures['tokens_per_s']:.2f} | {figures['step_ms'] / summary[first]['step_ms']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "dtype": dtype,
                                               "identical": same, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
