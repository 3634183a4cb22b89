"""Overlap through real processes: the draft drafts the next block while the target verifies,
and nothing about the output changes.

Greedy output equals the target's own generate() with a draft that always agrees (its
guesses hit) and one that rarely does (they miss); the sampled law holds while blocks come
from hits; a draft killed with a branch in flight, and a request cancelled with one, lose
nothing and leave nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from laws import ALPHA, PARAMS_ID, SAMPLES, T1, exact_law, p_value, rows, sample_cells, small_pair
from replicas import replica_state, wait_for, wait_for_baseline
from tiny import PROMPTS, greedy_reference, make_draft_like, random_prompts, speculated

from tandem.launch import Stack, start_stack
from tandem.sampling import SamplingParams

pytestmark = pytest.mark.slow  # stacks of their own (CI runs it)

LENGTH = 24
METRICS = ["--metrics-port", "0"]
OVERLAP = ["--overlap", "on"]
CLOSE = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)


@pytest.fixture(scope="module", params=["agrees", "disagrees"])
def stack(request: pytest.FixtureRequest, tiny_dir: Path, tiny_target: Path) -> Iterator[Stack]:
    # A copy of the target always agrees, so its guesses of the next history come true; a
    # draft with heavy noise rarely does, so they miss.
    noise = 0.0 if request.param == "agrees" else 1.0
    draft = make_draft_like(tiny_target, tiny_dir / f"overlap-{request.param}", noise=noise, seed=5)
    stack = start_stack(str(draft), str(tiny_target), draft_args=METRICS, target_args=METRICS,
                        orchestrator_args=OVERLAP)
    stack.kind = request.param  # type: ignore[attr-defined]
    yield stack
    stack.stop()


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_with_overlap_equals_the_target_alone(stack: Stack, k: int, reference) -> None:  # type: ignore[no-untyped-def]
    hits = misses = 0
    with stack.client() as client:
        for prompt in PROMPTS[:3]:
            tokens, usage = speculated(client, prompt, LENGTH, k)
            assert tokens == reference(prompt, LENGTH), (stack.kind, k, prompt)  # type: ignore[attr-defined]
            hits += usage.draft_cache_hits
            misses += usage.draft_cache_misses
            assert usage.draft_wait_ms > 0
    if stack.kind == "agrees":  # type: ignore[attr-defined]
        # Every guess is right; a miss is a step that came before the guess was made, which
        # how busy the machine is decides, so only the hits are certain.
        assert hits > 0, (hits, misses)
    else:
        assert misses > hits, (hits, misses)


@pytest.mark.parametrize("params", [T1, CLOSE], ids=lambda p: PARAMS_ID.get(p, "t0.8-topk4-topp0.9"))
def test_sampled_law_holds_with_overlap(tiny_dir: Path, params: SamplingParams) -> None:
    target, draft = small_pair(tiny_dir / "overlap-v6")
    stack = start_stack(str(draft), str(target), orchestrator_args=OVERLAP)
    try:
        usages: list = []  # type: ignore[type-arg]
        counts, accepted, drafted = sample_cells(stack, params, "draft-model", usages=usages)
    finally:
        stack.stop()
    hits = sum(u.draft_cache_hits for u in usages)
    assert hits > SAMPLES // 10, f"only {hits} hits: the law was not tested on blocks drafted ahead"
    assert sum(u.draft_cache_misses for u in usages) > SAMPLES // 10
    assert 0 < accepted < drafted
    assert p_value(counts, exact_law(rows(target, params))) > ALPHA


def held_ahead(stack: Stack) -> float:
    """Tokens drafted ahead that the draft's caches hold now."""
    return stack.drafts[0].metrics().get("tandem_draft_ahead_cached_tokens", 0.0)


@pytest.fixture
def agreeing(tiny_dir: Path, tiny_target: Path) -> Iterator[Stack]:
    draft = make_draft_like(tiny_target, tiny_dir / "overlap-agrees-faults", noise=0.0, seed=5)
    stack = start_stack(str(draft), str(tiny_target), draft_args=METRICS, target_args=METRICS,
                        orchestrator_args=OVERLAP)
    yield stack
    stack.stop()


@contextlib.contextmanager
def branch_in_flight(stack: Stack) -> Iterator[None]:
    """The target held (SIGSTOP) until a branch is drafted ahead on the draft, then the body."""
    target = stack.targets[0].proc
    target.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: held_ahead(stack) > 0, "the draft holds a branch drafted ahead")
        yield
    finally:
        target.send_signal(signal.SIGCONT)


def test_a_draft_killed_with_a_branch_in_flight_loses_nothing(agreeing: Stack, tiny_target: Path) -> None:
    prompt, length = random_prompts(30, 1, 12, seed=3)[0], 200
    tokens: list[int] = []
    with agreeing.client() as client:
        for message in client.generate_stream(prompt, max_new_tokens=length, num_speculative_tokens=4,
                                              ignore_eos=True):
            if message.HasField("delta"):
                if not tokens:
                    with branch_in_flight(agreeing):
                        agreeing.drafts[0].proc.send_signal(signal.SIGKILL)
                tokens.extend(message.delta.token_ids)
            else:
                summary = message.summary
    assert tokens == greedy_reference(tiny_target, prompt, length)
    assert summary.usage.completion_tokens == length
    assert any("going on with the target alone" in line for line in agreeing.orchestrator.lines)


def test_a_cancelled_request_frees_its_branches(agreeing: Stack) -> None:
    baseline = replica_state(agreeing)
    with agreeing.client() as client:
        stream = client.generate_stream(random_prompts(30, 1, 12, seed=4)[0], max_new_tokens=200,
                                        num_speculative_tokens=4, ignore_eos=True)
        assert next(iter(stream)).HasField("delta")
        with branch_in_flight(agreeing):
            stream.cancel()
    wait_for_baseline(agreeing, baseline)  # sessions and cached tokens, tails included
    wait_for(lambda: held_ahead(agreeing) == 0, "no branch is held")


def _ahead_steps(stack: Stack) -> int:
    """Decode steps that drafted ahead (a hit or a miss) over a few requests."""
    steps = 0
    with stack.client() as client:
        for prompt in PROMPTS[:2]:
            usage = client.generate(prompt, max_new_tokens=LENGTH, num_speculative_tokens=4,
                                    ignore_eos=True).usage
            steps += usage.draft_cache_hits + usage.draft_cache_misses
    return steps


@pytest.mark.parametrize("pinned", [False, True])
def test_a_draft_works_beside_the_target_only_on_hardware_of_its_own(tiny_draft: Path, tiny_target: Path,
                                                             pinned: bool) -> None:
    # auto, the default: a draft on the target's CPUs takes turns (its guesses would take the
    # verify's cycles) and is not prefilled beside the target; pinned to a CPU of its own,
    # it prefills at once and drafts ahead.
    if pinned and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin the draft and the target apart")
    cpus = sorted(os.sched_getaffinity(0))
    draft_args = ["--cpu-affinity", str(cpus[0])] if pinned else []
    target_args = ["--cpu-affinity", str(cpus[1])] if pinned else []
    stack = start_stack(str(tiny_draft), str(tiny_target), draft_args=[*draft_args, *METRICS],
                        target_args=target_args)
    try:
        # Two tokens: a prefill, then a step that may draft nothing (one token left). Beside
        # the target, the draft is not prefilled with it (that would slow the first token).
        with stack.client() as client:
            client.generate(PROMPTS[0], max_new_tokens=2, ignore_eos=True)
        draft_passes = stack.drafts[0].metrics().get("tandem_batch_sessions_count", 0.0)
        assert (draft_passes > 0) is pinned, draft_passes
        ahead = _ahead_steps(stack)
        said = any("shares the target's hardware" in line for line in stack.orchestrator.lines)
        if pinned:
            assert ahead > 0 and not said
        else:
            assert ahead == 0 and said
    finally:
        stack.stop()
