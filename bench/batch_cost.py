"""`python -m bench.batch_cost`: v(T), the time of one batched forward pass by its tokens.

In process, on the runners the services drive (tandem.batching's Runner): N sessions, each
holding a cached prefix, each adding t new tokens, for N in 1..32 and t in {1, 5}; medians
of a few repeats. The curve is what the adaptive policy learns at run time from replica
reports; this measures it once, to document and to size --max-batch-sessions.

`--engines` runs several ways of running one model side by side, on the same cores, in
turn: `transformers` (with `--dtype`, `--matmul` and `--quantize` as a service takes them),
`transformers-int8` (int8-dynamic), and `llama.cpp` (the model's GGUF file; a built-in
model's is the one it was assembled from). Each engine is loaded, measured and dropped
before the next, so they do not share the cores.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem import batching, llama, matmul, models
from tandem.kv import KVSession

ENGINES = ("transformers", "transformers-int8", "llama.cpp")


def load(engine: str, args: argparse.Namespace) -> tuple[batching.Runner, Callable[[str], KVSession], str]:
    """The engine's runner, how to open a session on it, and a line naming what runs."""
    if engine == "llama.cpp":
        gguf = models.find_gguf(args.model, "")
        if gguf is None:
            raise SystemExit(f"{args.model} has no GGUF file for llama.cpp")
        e = llama.LlamaEngine(str(gguf), context_tokens=max(args.sessions_list) * (args.context + 8),
                              max_batch_tokens=256, threads=args.threads)
        return e, lambda name: KVSession(name, e.vocab_size, new_cache=e.new_cache), \
            f"llama.cpp, {e.describe()}, {e.threads} threads"
    dtype = "float32" if engine == "transformers-int8" else (  # int8-dynamic quantizes float32
        models.auto_dtype(args.model, "cpu") if args.dtype == "auto" else args.dtype)
    model: Any = models.load_model(args.model, models.Placement("cpu", dtype))
    batching.use_batched_attention(model)
    if engine == "transformers-int8":
        model = models.quantize(model, models.Placement("cpu", "float32", quantize=matmul.INT8))
        path = matmul.INT8
    else:
        path, _ = matmul.apply(model, args.matmul, matmul.TIMED_ROWS)
    vocab = models.logits_width(model)
    return batching.TorchRunner(model), lambda name: KVSession(name, vocab), \
        f"transformers, {dtype}, matmul path {path}, {args.threads} threads"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.batch_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_TARGET)
    parser.add_argument("--engines", default="transformers",
                        help=f"comma-separated, measured in turn: {', '.join(ENGINES)}")
    parser.add_argument("--dtype", default="auto", help="the transformers engines' dtype")
    parser.add_argument("--matmul", default="auto", choices=matmul.CHOICES,
                        help="the transformers engine's matmul path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200, help="cached tokens per session")
    parser.add_argument("--sessions", default="1,2,4,8,16,32")
    parser.add_argument("--tokens", default="1,5", help="new tokens per session")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    args.sessions_list = [int(n) for n in args.sessions.split(",")]
    torch.set_num_threads(args.threads)
    print(f"{args.model}, {args.context} cached tokens per session\n")
    print("| engine | sessions | tokens each | T | pass ms | vs 1 x 1 | ms per token |")
    print("|---|---|---|---|---|---|---|")
    for engine in engines:
        runner, new_session, what = load(engine, args)
        token_counts = [int(t) for t in args.tokens.split(",")]
        times = {n: batching.pass_times(runner, new_session, token_counts, n, args.context, args.repeats)
                 for n in args.sessions_list}
        base = times[args.sessions_list[0]][token_counts[0]]
        for tokens in token_counts:
            for sessions in args.sessions_list:
                ms, total = times[sessions][tokens], sessions * tokens
                print(f"| {what} | {sessions} | {tokens} | {total} | {ms:.0f} | {ms / base:.2f}x | "
                      f"{ms / total:.1f} |", flush=True)
        if isinstance(runner, llama.LlamaEngine):
            runner.close()
        del runner, new_session
        gc.collect()


if __name__ == "__main__":
    main()
