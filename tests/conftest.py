from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent))

# Hypothesis' "ci" profile, on every machine and not only where a CI variable is set: the
# fuzz tries the same cases each run (derandomized), so a failure replays by running again,
# and print_blob prints a @reproduce_failure line that pins the failing case. To look for
# new cases instead: HYPOTHESIS_PROFILE=default (random; add --hypothesis-seed=N to repeat).
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
# Services started by the tests multiply on torch's default kernels, as the in-process
# references do (a path timed at start-up could differ from run to run); the tests of the
# matmul paths start services on each path and compare with references on the same one.
os.environ.setdefault("TANDEM_MATMUL", "default")
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header() -> str:
    how = ("derandomized: a failure replays by running again" if settings().derandomize
           else "random: replay a run with --hypothesis-seed=N")
    return f"fuzz: hypothesis profile {HYPOTHESIS_PROFILE!r} ({how}; HYPOTHESIS_PROFILE to change)"

from tiny import greedy_reference, make_draft_like, make_model, make_tokenizer

from tandem.launch import Stack, start_stack


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir: Path) -> Path:
    return make_model(tiny_dir / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir: Path, tiny_target: Path) -> Path:
    # The target plus weight noise: some drafted tokens are accepted, many are not.
    return make_draft_like(tiny_target, tiny_dir / "draft", noise=0.05, seed=2)


@pytest.fixture(scope="session")
def tiny_stack(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    # Metrics endpoints on every service: tests read the replicas' session and KV gauges, and
    # how the orchestrator ended its session streams.
    metrics = ["--metrics-port", "0"]
    # The target runs its decode runs through the static slot (tandem.decode_graph), uncompiled:
    # every test of a decode run through this stack tests it (--decode-graph auto: off on a CPU);
    # and reads greedy argmaxes through its head in slices (tandem.head) of 64 bytes of logits
    # (16 rows for a one-row pass), where the default slice is wider than the whole vocabulary.
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=metrics, orchestrator_args=metrics,
                        target_args=[*metrics, "--decode-graph", "eager", "--vocab-slice-bytes", "64"])
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def reference(tiny_target: Path):  # type: ignore[no-untyped-def]
    """Greedy generate() of the tiny target, cached per (prompt, length)."""
    tokenizer = make_tokenizer()
    cache: dict[tuple[str, int], list[int]] = {}

    def ref(prompt: str, max_new_tokens: int) -> list[int]:
        key = (prompt, max_new_tokens)
        if key not in cache:
            cache[key] = greedy_reference(tiny_target, tokenizer.encode(prompt), max_new_tokens)
        return cache[key]

    return ref


@pytest.fixture(scope="session")
def tiny_medusa(tiny_dir: Path, tiny_target: Path) -> Path:
    """Medusa heads for tiny_target, trained on its own greedy text."""
    from tiny import make_medusa_heads

    return make_medusa_heads(tiny_target, tiny_dir / "medusa")
