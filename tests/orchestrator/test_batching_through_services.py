"""Many sessions share each forward pass on the draft and the target, through real processes.

Sixteen concurrent requests with mixed k (0, 1, 4, 8), mixed prompt lengths and every
proposer: each one's greedy output equals the target's own generate() and the same request
run alone. The replicas' batch histograms prove the passes were shared, and sessions and
cached tokens return to zero. The sampled law holds while other sessions share the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from laws import ALPHA, LONG_PROMPT, T1, exact_law, p_value, rows, sample_cells, small_pair
from replicas import GAUGES, wait_for_baseline
from tiny import greedy_reference, random_prompts, speculated

from tandem.launch import Process, Stack, start_stack

pytestmark = pytest.mark.slow  # stacks of their own and thousands of requests (CI runs it)

LENGTH = 24
METRICS = ["--metrics-port", "0"]


def mean_batch(replica: Process, before: dict[str, float] | None = None) -> float:
    """Sessions per forward pass on a replica (since `before`, its earlier metrics)."""
    now, before = replica.metrics(), before or {}
    name = "tandem_batch_sessions"
    return (now[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / \
        (now[f"{name}_count"] - before.get(f"{name}_count", 0.0))


@pytest.fixture(scope="module")
def stack(tiny_draft: Path, tiny_target: Path, tiny_medusa: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=METRICS,
                        target_args=[*METRICS, "--medusa-heads", str(tiny_medusa)])
    yield stack
    stack.stop()


def test_sixteen_mixed_sessions_sharing_passes_each_equal_the_target_alone(
        stack: Stack, tiny_target: Path) -> None:
    lengths = itertools.cycle([1, 3, 8, 17, 30])
    prompts = [random_prompts(30, 1, next(lengths), seed=i)[0] for i in range(16)]  # no EOS, no unk
    settings = [{"num_speculative_tokens": k, "proposer": proposer} for k, proposer in zip(
        itertools.cycle([0, 1, 4, 8]),
        itertools.chain.from_iterable(itertools.repeat(p, 4) for p in
                                      ("draft-model", "prompt-lookup", "lookahead", "medusa")))]
    before = {role: r.metrics() for role, r in (("draft", stack.drafts[0]), ("target", stack.targets[0]))}

    def request(i: int) -> list[int]:
        with stack.client() as client:
            k = settings[i]["num_speculative_tokens"]
            if settings[i]["proposer"] == "draft-model" and k:  # every step drafted k, shared or not
                return speculated(client, prompts[i], LENGTH, k)[0]  # type: ignore[arg-type]
            return list(client.generate(prompts[i], max_new_tokens=LENGTH, ignore_eos=True,
                                        **settings[i]).token_ids)  # type: ignore[arg-type]

    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(request, range(16)))
    shared = {role: mean_batch(r, before[role]) for role, r in
              (("draft", stack.drafts[0]), ("target", stack.targets[0]))}
    alone = [request(i) for i in range(16)]
    for i, prompt in enumerate(prompts):
        expected = greedy_reference(tiny_target, prompt, LENGTH)
        assert together[i] == expected, f"request {i} ({settings[i]}) changed when batched"
        assert alone[i] == expected
    # The passes really were shared, on both services (only the draft-model quarter of the
    # requests drafts, so the draft shares less).
    assert shared["target"] > 1.5, shared
    assert shared["draft"] > 1.0, shared
    wait_for_baseline(stack, dict.fromkeys((f"{role} {gauge}" for role in ("draft", "target")
                                            for gauge in GAUGES), 0.0))


def test_sampled_law_holds_while_sessions_share_the_batch(tiny_dir: Path) -> None:
    """8 requests at a time share passes; each after the first few starts from the prompt the
    replicas kept (the prefix cache): the law holds through both."""
    target, draft = small_pair(tiny_dir / "batched-v6")
    stack = start_stack(str(draft), str(target), draft_args=METRICS, target_args=METRICS)
    try:
        usages: list[Any] = []
        counts, accepted, drafted = sample_cells(stack, T1, "draft-model", usages=usages, prompt=LONG_PROMPT)
        assert 0 < accepted < drafted
        assert p_value(counts, exact_law(rows(target, T1, tuple(LONG_PROMPT)))) > ALPHA
        assert sum(u.target_cached_tokens > 0 for u in usages) > len(usages) // 2
        assert sum(u.draft_cached_tokens > 0 for u in usages) > len(usages) // 2
        assert mean_batch(stack.targets[0]) > 1.5
        assert mean_batch(stack.drafts[0]) > 1.5
    finally:
        stack.stop()


def test_k_changing_with_the_load_changes_no_token(tiny_draft: Path, tiny_target: Path) -> None:
    """The load rule: while four or more requests run, this table drafts nothing, and as the
    shorter ones finish the rest draft again; every request's greedy output stays the
    target's own (the choice itself: tests/orchestrator/test_policy.py)."""
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=METRICS, target_args=METRICS,
                        orchestrator_args=["--speculation-by-batch", "1-3:4,4-:0"])
    try:
        prompts = [random_prompts(30, 1, 5 + i, seed=100 + i)[0] for i in range(6)]
        lengths = [20 + 12 * i for i in range(6)]

        def request(i: int) -> tuple[list[int], int]:
            with stack.client() as client:
                reply = client.generate(prompts[i], max_new_tokens=lengths[i], ignore_eos=True)
                return list(reply.token_ids), reply.usage.drafted_tokens

        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(request, range(6)))
        for prompt, length, (tokens, _) in zip(prompts, lengths, results, strict=True):
            assert tokens == greedy_reference(tiny_target, prompt, length)
        assert results[-1][1] > 0  # the longest drafted once it ran with fewer than four
        assert results[0][1] == 0  # the shortest ran only beside five others: it drafted nothing
    finally:
        stack.stop()
