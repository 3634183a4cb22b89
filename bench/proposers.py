"""`python -m bench.proposers`: the proposers side by side on `tandem up`'s stack, on code,
prose and an agent-like workload, in one run.

Modes (the policy chooses k in each; every mode runs a whole pass over the workloads before the
next, in an order that rotates with each repeat):
  k0             the target alone (num_speculative_tokens=0)
  draft-model    the draft model's blocks
  prompt-lookup  n-grams of the request's own history
  suffix         suffix decoding: the request's own tokens and recent outputs of every request
  auto           per step, a suffix proposal where it pays, else the draft's block (the default)

The agent-like workload is sequences of requests, each reading what came before: a file edited
over several requests (each reply rewrites the file with one more change), a tool-call loop
(each reply the next call, in the shape of the last ones), and questions asked again with a
small change. Suffix decoding learns from earlier outputs, so each mode's pass runs on an
orchestrator of its own, started afresh (its index and its measured costs empty): no mode
profits from another's replies, nor a repeat from the one before. The replicas stay up (their
prefix caches shorten every pass's prefills; decode rates exclude the first token).

Results: a markdown table on stdout and bench/results/proposers-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engines import GREEDY, up_stack
from bench.prompts import CODE, PROSE
from bench.run import tandem_run
from tandem import models
from tandem.launch import restart

MODES = {"k0": ("", 0), "draft-model": ("draft-model", None), "prompt-lookup": ("prompt-lookup", None),
         "suffix": ("suffix", None), "auto": ("auto", None)}

SOURCE = '''def load_orders(path):
    orders = []
    with open(path) as f:
        for line in f:
            order_id, customer, amount = line.strip().split(",")
            orders.append({"id": order_id, "customer": customer, "amount": float(amount)})
    return orders


def total_by_customer(orders):
    totals = {}
    for order in orders:
        totals[order["customer"]] = totals.get(order["customer"], 0.0) + order["amount"]
    return totals


def top_customers(totals, n):
    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)
    return [customer for customer, _ in ranked[:n]]


def main(path, n=3):
    orders = load_orders(path)
    totals = total_by_customer(orders)
    for customer in top_customers(totals, n):
        print(customer, totals[customer])
'''
EDITS = ["Rename the function load_orders to read_orders everywhere.",
         "Add a docstring to total_by_customer.",
         "Make main print the totals rounded to two decimals."]
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Dublin"]
QUESTIONS = [("Write a Python function is_palindrome(s) that checks whether a string reads the same "
              "backwards. Reply with the code only."),
             ("Write a Python function is_palindrome(s) that checks whether a string reads the same "
              "backwards, ignoring case and spaces. Reply with the code only.")]


@dataclass(frozen=True)
class Task:
    """A sequence of requests: each one's messages, given the replies before it."""

    id: str
    kind: str  # "agent", "code" or "prose"
    turns: int

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, str]]:
        if self.id == "agent/edit":  # the file as the last reply left it, and the next change
            current = replies[-1] if replies else f"```python\n{SOURCE}```"
            return [{"role": "system", "content": "You are a coding agent. Reply with the whole file only."},
                    {"role": "user", "content": f"Here is the file:\n{current}\n\n{EDITS[turn]}"}]
        if self.id == "agent/tools":  # every call so far and its result, then the next call
            messages = [{"role": "system", "content": (
                'You call tools. Reply with one JSON call only, like {"tool": "get_weather", '
                '"arguments": {"city": "..."}}.')},
                {"role": "user", "content": "Get the weather for each of: " + ", ".join(CITIES) + "."}]
            for city, reply in zip(CITIES, replies, strict=False):
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": f'{{"city": "{city}", "temp_c": {10 + len(city)}}}'}]
            return messages
        if self.id == "agent/again":
            return [{"role": "user", "content": QUESTIONS[turn]}]
        text = dict(ALONE)[self.id]
        return [{"role": "user", "content": text}]


ALONE = [(f"code/{i}", f"Complete this function:\n{text}") for i, text in enumerate(CODE[:2])] + \
    [(f"prose/{i}", text) for i, text in enumerate(PROSE[:2])]
TASKS = [Task("agent/edit", "agent", len(EDITS)), Task("agent/tools", "agent", 4),
         Task("agent/again", "agent", len(QUESTIONS))] + \
    [Task(name, name.split("/")[0], 1) for name, _ in ALONE]


def run_pass(client: Any, tokenizer: Any, mode: str, max_new_tokens: int) -> dict[str, Any]:
    """Every task once in `mode`: per request, decode tokens/s, tokens and usage."""
    proposer, k = MODES[mode]
    out: dict[str, Any] = {}
    for task in TASKS:
        replies: list[str] = []
        for turn in range(task.turns):
            ids = tokenizer.apply_chat_template(task.messages(turn, replies), add_generation_prompt=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
            tokens, wall, ttft, first, usage = tandem_run(client, ids, GREEDY, max_new_tokens, 1, k,
                                                          proposer or None)
            replies.append(tokenizer.decode(tokens, skip_special_tokens=True))
            out[f"{task.id}/{turn}"] = {
                "kind": task.kind, "tokens_per_s": (len(tokens) - first) / max(1e-9, wall - ttft),
                "tokens": tokens, "drafted": usage.drafted_tokens, "accepted": usage.accepted_tokens,
                "suffix_drafted": usage.suffix_drafted_tokens, "suffix_accepted": usage.suffix_accepted_tokens}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.proposers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="passes of every mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    tokenizer = models.load_tokenizer(models.DEFAULT_TARGET)
    passes: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    stack = up_stack()
    try:
        for rep in range(args.repeats):
            shift = rep % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                stack.orchestrator.stop()  # a fresh orchestrator: an empty index, costs unmeasured
                stack.orchestrator = restart(stack.orchestrator)
                with stack.client() as client:
                    passes[mode].append(run_pass(client, tokenizer, mode, args.max_new_tokens))
    finally:
        stack.stop()

    def median_rate(mode: str, kind: str) -> float:
        return float(statistics.median(r["tokens_per_s"] for p in passes[mode] for r in p.values()
                                       if r["kind"] == kind))

    kinds = ("agent", "code", "prose")
    table = {m: {kind: median_rate(m, kind) for kind in kinds} for m in modes}
    base = table.get("draft-model")
    lines = ["| mode | " + " | ".join(f"{k} tokens/s" + (" (× draft-model)" if base else "") for k in kinds)
             + " | drafted / accepted (suffix's) |", "|---" * (len(kinds) + 2) + "|"]
    for m in modes:
        cells = [f"{table[m][k]:.2f}" + (f" ({table[m][k] / base[k]:.2f})" if base else "") for k in kinds]
        totals = {f: sum(r[f] for p in passes[m] for r in p.values())
                  for f in ("drafted", "accepted", "suffix_drafted", "suffix_accepted")}
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {totals['drafted']} / {totals['accepted']} "
                     f"({totals['suffix_drafted']} / {totals['suffix_accepted']}) |")
    first = passes[modes[0]][0]
    same = all(p[key]["tokens"] == first[key]["tokens"] for m in modes for p in passes[m] for key in first)
    lines.append(f"\nreplies: {'the same in every mode and repeat' if same else 'DIFFERENT between modes'}")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"proposers-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(
        {"argv": argv, "table": table, "passes": passes, "same_replies": same}, indent=1))


if __name__ == "__main__":
    main()
