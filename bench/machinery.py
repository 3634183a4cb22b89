"""`python -m bench.machinery`: a replica's host time around one pass, by the sessions in it.

In process, on the runner the services drive: N sessions, each holding a cached prefix,
each scoring a drafted block (the target's step: k + 1 new tokens, the step's scores read on
the worker as `Pass.reduce` does in the service), for N in 1..16; each pass timed by stage
as the scheduler times it (tandem.host): host work before the forward, the forward, host
work after it, and the bytes read to the host. Medians of a few repeats. Without `--model`,
a tiny random model with the real pair's 152k-token vocabulary: the forward is nearly free
and what is left is the machinery.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench import tiny
from tandem import batching, head, host, models, sampling, split
from tandem.kv import KVSession
from target_service import scorer

SETTINGS = {"greedy": sampling.SamplingParams(), "t0.7": sampling.SamplingParams(temperature=0.7),
            "t1-top-p": sampling.SamplingParams(temperature=1.0, top_p=0.9)}


def measure(runner: batching.Runner, vocab: int, sessions: int, k: int, context: int,
            params: sampling.SamplingParams, repeats: int) -> split.PassSplit:
    """The median pass split of `sessions` sessions, each scoring a k-token block."""
    generator = torch.Generator().manual_seed(0)
    high = min(1000, vocab)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(2, high, (n,), generator=generator).tolist())

    held = [KVSession(f"s{i}", vocab) for i in range(sessions)]
    for s in held:
        runner.single(batching.Pass(s, 0, ids(context)))
    splits = []
    for i in range(repeats + 1):
        passes = []
        for s in held:
            block = list(ids(k))
            dists = [sampling.SparseDistribution((t,), (1.0,)) for t in block]

            def score(out: batching.PassOutput, block: list[int] = block,
                      dists: list[sampling.SparseDistribution] = dists) -> Any:
                return scorer.block_scores(out, params, block, dists, 0, batching.ALL_ROWS)

            passes.append(batching.Pass(s, context, (*ids(1), *block), logits_to_keep=k + 1,
                                        reads=batching.Reads(argmax=params.greedy), reduce=score))
        clock = host.begin()
        if sessions == 1:
            runner.single(passes[0])
        else:
            runner.batched(passes, ())
        if i:  # the first is a warm-up
            splits.append(clock.split())
    return split.PassSplit(*(statistics.median(getattr(s, f) for s in splits)
                            for f in ("before_ms", "forward_ms", "after_ms", "host_bytes")))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.machinery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a model to load (default: the tiny wide one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=64, help="cached tokens per session")
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--k", type=int, default=4, help="drafted tokens each session scores")
    parser.add_argument("--settings", default="greedy,t0.7,t1-top-p")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--vocab-slice-bytes", type=int, default=head.SLICE_BYTES,
                        help="as the target service's option (0: through the whole head's logits)")
    parser.add_argument("--allocator-defaults", action="store_true",
                        help="leave the C allocator as it is (a service keeps freed memory: tandem.host)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or str(tiny.make_model(Path(tempfile.mkdtemp()) / "wide", seed=1, hidden=64,
                                             vocab_size=151_936))
    model: Any = models.load_model(path, models.Placement("cpu", "float32"))
    batching.use_batched_attention(model)
    allocator = "glibc's defaults" if args.allocator_defaults else host.keep_freed_memory()
    vocab = models.logits_width(model)
    runner = batching.TorchRunner(model, head=head.install(model, args.vocab_slice_bytes) if args.vocab_slice_bytes else None)
    print(f"{args.model or 'tiny random model, 152k vocabulary'}; {args.threads} thread(s); each "
          f"session scores {args.k} drafted tokens after {args.context} cached; C allocator: {allocator}\n")
    print("| setting | sessions | host before ms | forward ms | host after ms | host ms per session "
          "| bytes to host |")
    print("|---|---|---|---|---|---|---|")
    for name in args.settings.split(","):
        for n in (int(s) for s in args.sessions.split(",")):
            s = measure(runner, vocab, n, args.k, args.context, SETTINGS[name], args.repeats)
            print(f"| {name} | {n} | {s.before_ms:.2f} | {s.forward_ms:.2f} | {s.after_ms:.2f} | "
                  f"{(s.before_ms + s.after_ms) / n:.2f} | {s.host_bytes:.0f} |", flush=True)


if __name__ == "__main__":
    main()
