"""Sampled output through the three services follows the target-only distribution.

A 6-token vocabulary (EOS, unk, a-d) makes the exact law of the first three generated tokens
computable (216 cells). The orchestrator's first step is the target alone (it prefills both
caches), so speculation decides tokens 2 and 3: each request asks for 4 tokens, so the second
step may draft k=2 (a block never runs past what can be committed, and with 3 tokens it would
be capped at 1); Medusa verifies the heads' 14-node tree. Chi-square test, false-alarm rate
ALPHA (tests/laws.py).

The setting is chosen for power, not only for a pass. The target is not peaked (the default
init_std), so the law spreads over many cells even truncated: temperature 1.5 then top-k 5 then
top-p 0.9 keeps about 3.5 of 6 tokens a row (46 cells with mass). The draft is far enough from
the target that a wrong acceptance or recovery rule moves that law by a total variation of
0.03-0.29. The replay tests below show the same test, on the same law and sample size,
rejecting the pipeline with a broken rule: a test that cannot fail proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from laws import (
    ALPHA,
    GRAMMAR_MASKS,
    GRAMMAR_REGEX,
    MAX_NEW_TOKENS,
    PARAMS_ID,
    PROMPT,
    SAMPLES,
    T1,
    TRUNCATED,
    VOCAB,
    K,
    Rows,
    cell,
    continuation_logits,
    exact_law,
    p_value,
    rows,
    sample_cells,
    small_pair,
    warped_by_transformers,
)
from mutants import mutant
from tiny import make_medusa_heads

from orchestrator.proposers import lookup
from tandem import sampling
from tandem.launch import Stack, start_stack
from tandem.v1 import common_pb2

pytestmark = pytest.mark.slow  # tens of thousands of sampled requests: minutes (CI runs it)

LOOKUP_NGRAMS = (1, 3)  # prompt lookup matches a single token too, so it proposes often


@pytest.fixture(scope="module")
def small_models(tiny_dir: Path) -> tuple[Path, Path]:
    return small_pair(tiny_dir)


@pytest.fixture(scope="module")
def small_vocab(tiny_dir: Path, small_models: tuple[Path, Path]) -> Iterator[tuple[Path, Stack]]:
    target, draft = small_models
    # Heads trained on the target's sampled text: the tree holds likely and unlikely tokens.
    heads = make_medusa_heads(target, tiny_dir / "v6-medusa", temperature=1.0, num_prompts=128,
                              epochs=2)
    # Lookahead N=3: its pool is first harvested after the second pass, so it verifies token 3.
    stack = start_stack(str(draft), str(target),
                        target_args=["--lookahead", "4,3,4", "--medusa-heads", str(heads)],
                        orchestrator_args=["--prompt-lookup-min-ngram", str(LOOKUP_NGRAMS[0]),
                                           "--prompt-lookup-max-ngram", str(LOOKUP_NGRAMS[1])])
    yield target, stack
    stack.stop()


def test_truncated_setting_really_truncates(small_models: tuple[Path, Path]) -> None:
    """Top-k and top-p each cut tokens in TRUNCATED, and the law still spreads over many cells."""
    target, _ = small_models
    sizes = [sum(int((row > 0).sum()) for row in rows(target, params).values())
             for params in (sampling.SamplingParams(temperature=TRUNCATED.temperature),
                            sampling.SamplingParams(temperature=TRUNCATED.temperature, top_k=TRUNCATED.top_k),
                            TRUNCATED)]
    assert sizes[0] > sizes[1] > sizes[2]
    assert int((exact_law(rows(target, TRUNCATED)) > 0).sum()) >= 40


@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
def test_exact_law_agrees_with_transformers_warpers(small_models: tuple[Path, Path],
                                                    params: sampling.SamplingParams) -> None:
    """The law is built with Tandem's own probabilities(): check it on the same logits against
    an independent reference, transformers' temperature, top-k and top-p warpers."""
    _, logits = continuation_logits(small_models[0])
    ours = sampling.probabilities(logits.reshape(-1, VOCAB), params)
    reference = warped_by_transformers(logits.reshape(-1, VOCAB), params)
    assert torch.equal(ours > 0, reference > 0), "a different set of tokens was kept"
    assert torch.allclose(ours, reference, atol=1e-6)


@pytest.mark.parametrize("params, proposer", [
    *((params, proposer) for proposer in ("draft-model", "prompt-lookup", "lookahead")
      for params in (T1, TRUNCATED)),
    # NOTE: Medusa in one setting only: each costs ~40 s of requests through real processes;
    # the tree rule itself is tested against exact laws in tests/tandem/test_sampling.py.
    (T1, "medusa"),
    # Suffix proposals are one-hot, as prompt lookup's (the same rule): one setting each for
    # suffix alone and for auto, which switches between it and the draft mid-request.
    (TRUNCATED, "suffix"),
    (T1, "auto"),
], ids=lambda v: v if isinstance(v, str) else PARAMS_ID[v])
def test_speculative_sampling_matches_target_law(small_vocab: tuple[Path, Stack],
                                                 params: sampling.SamplingParams, proposer: str) -> None:
    target, stack = small_vocab
    law = exact_law(rows(target, params))
    counts, accepted, drafted = sample_cells(stack, params, proposer)
    # Speculation really accepted and rejected tokens.
    assert 0 < accepted < drafted
    if proposer == "draft-model":
        assert drafted >= K * SAMPLES  # every request's second step verified a 2-token block
    assert p_value(counts, law) > ALPHA


def test_speculative_sampling_under_a_grammar_matches_the_masked_target_law(
        small_vocab: tuple[Path, Stack]) -> None:
    """Under a grammar the law is the target's masked and renormalised; the draft drafts under
    the same masks and its blocks are still accepted and rejected."""
    target, stack = small_vocab
    counts, accepted, drafted = sample_cells(stack, T1, "draft-model", samples=GRAMMAR_SAMPLES,
                                             grammar=common_pb2.Grammar(regex=GRAMMAR_REGEX))
    assert 0 < accepted < drafted
    assert p_value(counts, exact_law(rows(target, T1, masks=GRAMMAR_MASKS))) > ALPHA


@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
def test_the_target_decoding_alone_samples_its_law(small_vocab: tuple[Path, Stack],
                                                   params: sampling.SamplingParams) -> None:
    """k=0: one decode run a request, each token drawn on the target with its position's seed."""
    target, stack = small_vocab
    counts, _, drafted = sample_cells(stack, params, "", k=0)
    assert drafted == 0
    assert p_value(counts, exact_law(rows(target, params))) > ALPHA


# --- Power: the same test rejects the pipeline with a broken rule ---------------------------------
#
# The services run in their own processes, so a broken rule cannot be patched into them.
# Instead the orchestrator's steps are replayed in process with Tandem's own sampling
# functions over the models' exact rows (the draft samples from its rows as the draft
# service does; prompt lookup is the orchestrator's own `lookup`), at the service test's
# sample size. The exact rules must pass, so the replay is faithful; each mutant, the
# production function with one line broken (tests/mutants.py), must be rejected.

REPLAY_MUTANTS: dict[str, tuple[Callable[..., Any], str, str]] = {
    # Keep x with probability min(1, p(x)), not min(1, p(x)/q(x)).
    "accept-min1-p": (sampling.num_accepted, "u * q < p", "u < p"),
    # The recovered token drawn from p, not from norm(max(0, p - q)).
    "recovered-from-p": (sampling.score_block, "(target_probs[:k] - draft).clamp_min(0.0)",
                         "target_probs[:k]"),
}


def draft_block(draft: Rows, history: list[int], k: int, rng: torch.Generator
                ) -> tuple[list[int], list[sampling.SparseDistribution]]:
    """k tokens drafted after `history` from the draft's rows, as the draft service samples
    them; the draft's support cap (8 by default) is above the vocabulary: q is sent whole."""
    drafted: list[int] = []
    dists: list[sampling.SparseDistribution] = []
    for _ in range(k):
        ids, probs = sampling.truncate(draft[tuple(history + drafted)].float(), VOCAB)
        drafted.append(int(ids[sampling.sample(probs[None], rng)[0]]))
        dists.append(sampling.SparseDistribution(tuple(ids.tolist()), tuple(probs.tolist())))
    return drafted, dists


def replay(target: Rows, draft: Rows, proposer: str, trials: int, *,
           num_accepted: Callable[..., int] = sampling.num_accepted,
           score_block: Callable[..., sampling.ScoredBlock] = sampling.score_block) -> torch.Tensor:
    """Cell counts of the first three tokens of `trials` requests, each step as the services take it."""
    rng = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB**3, dtype=torch.long)
    for _ in range(trials):
        history: list[int] = []
        while len(history) < 3:
            # The first step is the target alone; a block never runs past what can be committed.
            k = min(K, MAX_NEW_TOKENS - len(history) - 1) if history else 0
            drafted: list[int] = []
            dists: list[sampling.SparseDistribution] = []
            if proposer == "draft-model":
                drafted, dists = draft_block(draft, history, k, rng)
            elif k:
                drafted = lookup(PROMPT + history, k, *LOOKUP_NGRAMS)
                dists = [sampling.SparseDistribution((t,), (1.0,)) for t in drafted]
            target_probs = torch.stack([target[tuple(history + drafted[:i])] for i in range(len(drafted) + 1)])
            scored = score_block(target_probs.float(), drafted, dists, rng)
            draft_probs = [d.probs[d.token_ids.index(x)] for d, x in zip(dists, drafted, strict=True)]
            uniforms = torch.rand(len(drafted), generator=rng, dtype=torch.float64).tolist()
            accepted = num_accepted(scored.target_probs, draft_probs, uniforms)
            history += sampling.commit(drafted, scored, accepted)
        counts[cell(history)] += 1
    return counts


@pytest.fixture(scope="module")
def model_rows(small_models: tuple[Path, Path]) -> dict[sampling.SamplingParams, tuple[Rows, Rows]]:
    target, draft = small_models
    return {params: (rows(target, params), rows(draft, params)) for params in (T1, TRUNCATED)}


@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
@pytest.mark.parametrize("proposer", ["draft-model", "prompt-lookup"])
def test_replay_with_the_exact_rules_matches_target_law(
        model_rows: dict[sampling.SamplingParams, tuple[Rows, Rows]],
        params: sampling.SamplingParams, proposer: str) -> None:
    target, draft = model_rows[params]
    assert p_value(replay(target, draft, proposer, SAMPLES), exact_law(target)) > ALPHA


@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
@pytest.mark.parametrize("proposer, broken", [
    ("draft-model", "accept-min1-p"),
    ("draft-model", "recovered-from-p"),
    # NOTE: not accept-min1-p: with a one-hot q, min(1, p) is the exact rule.
    ("prompt-lookup", "recovered-from-p"),
])
def test_law_test_catches_a_broken_rule(model_rows: dict[sampling.SamplingParams, tuple[Rows, Rows]],
                                        params: sampling.SamplingParams, proposer: str, broken: str) -> None:
    target, draft = model_rows[params]
    function, original, replacement = REPLAY_MUTANTS[broken]
    counts = replay(target, draft, proposer, SAMPLES,
                    **{function.__name__: mutant(function, original, replacement)})
    assert p_value(counts, exact_law(target)) < ALPHA


# --- Under a grammar: the replay with masks, and the wrong rules it must reject ---------------

# The grammar's law has 18 cells, not 216: a third of the samples gives the replay's wrong
# rules p-values under 1e-28 (and the draft-only rule draws forbidden cells at once).
GRAMMAR_SAMPLES = 1000


def masked_replay(target: Path, draft: Path, params: sampling.SamplingParams, rule: str,
                  trials: int = GRAMMAR_SAMPLES) -> torch.Tensor:
    """The replay above under GRAMMAR_MASKS: the draft drafts from its masked rows; the target
    scores with `sampling.score_logits` and the masks (rule "exact"), or with a known wrong
    rule: "draft-only" (the target's rows left unmasked), "unrenormalised" (the target's law
    masked after the softmax, its mass not restored)."""
    rng = torch.Generator().manual_seed(1)
    continuations, target_logits = continuation_logits(target)
    logits_at = {c[:n]: target_logits[i, n] for i, c in enumerate(continuations) for n in range(4)}
    draft_rows = rows(draft, params, masks=GRAMMAR_MASKS)
    counts = torch.zeros(VOCAB**3, dtype=torch.long)
    for _ in range(trials):
        history: list[int] = []
        while len(history) < 3:
            k = min(K, MAX_NEW_TOKENS - len(history) - 1) if history else 0
            drafted, dists = draft_block(draft_rows, history, k, rng)
            n = len(history)
            logits = torch.stack([logits_at[tuple(history + drafted[:i])] for i in range(k + 1)])
            masks = GRAMMAR_MASKS[n:n + k + 1]
            seed = int(torch.randint(0, 2**62, (1,), generator=rng))
            if rule == "exact":
                scored = sampling.score_logits(logits, params, drafted, dists, seed, masks)
            elif rule == "draft-only":
                scored = sampling.score_logits(logits, params, drafted, dists, seed)
            else:
                probs = sampling.probabilities(logits, params) * masks
                scored = sampling.score_block(probs, drafted, dists, sampling.generator(seed))
            draft_probs = [d.probs[d.token_ids.index(x)] for d, x in zip(dists, drafted, strict=True)]
            uniforms = torch.rand(len(drafted), generator=rng, dtype=torch.float64).tolist()
            accepted = sampling.num_accepted(scored.target_probs, draft_probs, uniforms)
            history += sampling.commit(drafted, scored, accepted)
        counts[cell(history[:3])] += 1
    return counts


@pytest.mark.parametrize("rule", ["exact", "draft-only", "unrenormalised"])
def test_the_law_test_under_a_grammar_passes_the_exact_rule_and_rejects_wrong_ones(
        small_models: tuple[Path, Path], rule: str) -> None:
    target, draft = small_models
    law = exact_law(rows(target, TRUNCATED, masks=GRAMMAR_MASKS))
    counts = masked_replay(target, draft, TRUNCATED, rule)
    if rule == "exact":
        assert p_value(counts, law) > ALPHA
    elif rule == "draft-only":  # the unmasked target emits tokens the grammar forbids
        assert int(counts[law == 0].sum()) > 0
    else:
        assert p_value(counts, law) < ALPHA
