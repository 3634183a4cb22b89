"""`python -m bench.batch_cost`: v(T), the time of one batched forward pass by its tokens.

In process, on the step scheduler's own batched pass (tandem.batching): N sessions, each
holding a cached prefix, each adding t new tokens, for N in 1..32 and t in {1, 5}; medians
of a few repeats. The curve is what the adaptive policy learns at run time from replica
reports; this measures it once, to document and to size --max-batch-sessions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from tandem import batching, models
from tandem.kv import KVSession


def measure(model: models.CausalLM, sessions: int, tokens: int, context: int, repeats: int) -> float:
    vocab = models.logits_width(model)
    generator = torch.Generator().manual_seed(0)
    held = [KVSession(f"s{i}", vocab) for i in range(sessions)]
    for s in held:
        s.forward(model, torch.randint(2, 1000, (context,), generator=generator).tolist(), 1)
    times = []
    for _ in range(repeats):
        passes = [batching.Pass(s, context, tuple(torch.randint(2, 1000, (tokens,), generator=generator).tolist()),
                                logits_to_keep=tokens) for s in held]
        started = time.perf_counter()
        if sessions == 1:
            batching.single(model, passes[0])
        else:
            batching.batched(model, passes, models.sliding_window(model))
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_cost", description=__doc__)
    parser.add_argument("--model", default=models.DEFAULT_TARGET)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="cached tokens per session")
    parser.add_argument("--sessions", default="1,2,4,8,16,32")
    parser.add_argument("--tokens", default="1,5", help="new tokens per session")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = models.auto_dtype(args.model, "cpu") if args.dtype == "auto" else args.dtype
    model = models.load_model(args.model, models.Placement("cpu", dtype))
    base = None
    print(f"{args.model} ({dtype}, {args.threads} threads), {args.context} cached tokens per session\n")
    print("| sessions | tokens each | T | pass ms | vs 1 x 1 | ms per token |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for sessions in (int(n) for n in args.sessions.split(",")):
            ms = measure(model, sessions, tokens, args.context, args.repeats)
            base = base or ms
            total = sessions * tokens
            print(f"| {sessions} | {tokens} | {total} | {ms:.0f} | {ms / base:.2f}x | {ms / total:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
