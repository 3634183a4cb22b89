"""What the statistical tests share: the goodness-of-fit test, an independent reference for
the sampling warpers the exact laws are built with, and the setting the service-level tests
sample in (a 6-token vocabulary, whose three-token law is computed exactly: see
tests/orchestrator/test_distribution.py for why it has power)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from scipy import stats
from tiny import make_draft_like, make_model
from transformers import AutoModelForCausalLM

from tandem import sampling
from tandem.launch import Stack
from tandem.sampling import SamplingParams

ALPHA = 1e-3  # false-alarm rate of each law test
SAMPLES = 3000
PROMPT = [2, 3, 2]
# A prompt long enough for the prefix cache (tandem.prefix.BLOCK_TOKENS and one more): every
# request after the first starts from a kept prefix of it.
LONG_PROMPT = [2, 3, 2, 4, 5, 3, 2, 2, 4, 3, 5, 5, 2, 3, 4, 2, 3, 2]
VOCAB = 6
MAX_NEW_TOKENS, K = 4, 2  # each request; k of its blocks
T1 = SamplingParams(temperature=1.0)
TRUNCATED = SamplingParams(temperature=1.5, top_k=5, top_p=0.9)
PARAMS_ID = {T1: "t1", TRUNCATED: "t1.5-topk5-topp0.9"}

Rows = dict[tuple[int, ...], torch.Tensor]  # continuation of PROMPT -> the next token's probs [vocab]


def small_pair(directory: Path) -> tuple[Path, Path]:
    """(target, draft) over the 6-token vocabulary (EOS, unk, a-d), saved under `directory`."""
    target = make_model(directory / "v6-target", seed=11, chars="abcd")
    return target, make_draft_like(target, directory / "v6-draft", noise=0.5, seed=12)


@functools.cache
def continuation_logits(model_path: Path, prompt: tuple[int, ...] = tuple(PROMPT)
                        ) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """Every continuation of `prompt` by 3 tokens, and the logits after each of its prefixes
    (lengths 0-3): [VOCAB**3, 4, vocab], from one plain forward pass of the model."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    continuations = list(itertools.product(range(VOCAB), repeat=3))
    ids = torch.tensor([[*prompt, *c] for c in continuations])
    with torch.inference_mode():
        return continuations, model(ids).logits[:, -4:]


def rows(model_path: Path, params: SamplingParams, prompt: tuple[int, ...] = tuple(PROMPT),
         masks: torch.Tensor | None = None) -> Rows:
    """The model's next-token distribution under `params` after every continuation of `prompt`
    by up to 3 tokens; with `masks` [4, vocab] (a grammar's allowed tokens by position), its
    logits masked first: the masked, renormalised law a grammar samples."""
    continuations, logits = continuation_logits(model_path, prompt)
    if masks is not None:
        logits = logits.masked_fill(~masks, -torch.inf)
    probs = sampling.probabilities(logits.reshape(-1, VOCAB), params).reshape(logits.shape).double()
    return {c[:n]: probs[i, n] for i, c in enumerate(continuations) for n in range(4)}


# A grammar over the 6-token vocabulary (EOS, unk, a-d) whose masks depend on the position
# alone: a or b, then a-c, then b-d, then only EOS. As a regex, and as masks [4, vocab].
GRAMMAR_REGEX = "[ab][a-c][b-d]"
GRAMMAR_MASKS = torch.tensor([[t in allowed for t in range(VOCAB)]
                              for allowed in ({2, 3}, {2, 3, 4}, {3, 4, 5}, {0})])


def exact_law(target: Rows) -> torch.Tensor:
    """The target-only law of the first three tokens, flat [VOCAB**3]."""
    law = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        law[t1, t2] = target[()][t1] * target[(t1,)][t2] * target[(t1, t2)]
    return law.reshape(-1)


def cell(tokens: list[int]) -> int:
    return (tokens[0] * VOCAB + tokens[1]) * VOCAB + tokens[2]


def sample_cells(stack: Stack, params: SamplingParams, proposer: str, samples: int = SAMPLES,
                 usages: list[Any] | None = None, k: int = K, prompt: list[int] = PROMPT,
                 grammar: Any = None) -> tuple[torch.Tensor, int, int]:
    """Cell counts of the first three tokens of `samples` seeded requests through the stack
    (8 at a time), each drafting up to `k` a step (0: the target alone), and the drafted
    tokens accepted and drafted over all of them; `usages` gathers each request's usage.
    `grammar` (a common_pb2.Grammar) must end the reply after three tokens: it ends with EOS."""
    with stack.client() as client:
        def draw(seed: int) -> tuple[int, int, int]:
            reply = client.generate(prompt, max_new_tokens=MAX_NEW_TOKENS, temperature=params.temperature,
                                    top_k=params.top_k, top_p=params.top_p, seed=seed,
                                    num_speculative_tokens=k, proposer=proposer, ignore_eos=grammar is None,
                                    grammar=grammar)
            usage = reply.usage
            if usages is not None:
                usages.append(usage)
            return cell(list(reply.token_ids)), usage.accepted_tokens, usage.drafted_tokens

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(draw, range(samples)))
    counts = torch.bincount(torch.tensor([r[0] for r in results]), minlength=VOCAB**3)
    return counts, sum(r[1] for r in results), sum(r[2] for r in results)


def p_value(counts: Sequence[int] | torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square goodness of fit of cell counts to an exact law (both flat, one entry a cell).

    Cells expected fewer than 5 times are pooled into one: the test's approximation needs
    it (one draw in a cell expected 0.01 times is no evidence). A draw in a cell of zero
    mass fails at once: no sample size makes it likely.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    law = law.double() / law.double().sum()
    assert counts[law == 0].sum() == 0, "a sequence outside the target's support was sampled"
    expected = law * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    wanted = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = wanted > 0  # the pooled cell, when nothing was pooled
    return float(stats.chisquare(observed[keep].tolist(), wanted[keep].tolist()).pvalue)


def warped_by_transformers(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' own logits warpers, in the order generate() applies them (temperature,
    top-k, top-p), then softmax: logits [n, vocab] -> probs [n, vocab]."""
    from transformers import (
        LogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    scores, no_ids = logits.float(), torch.zeros(logits.shape[0], 0, dtype=torch.long)
    for warper in warpers:
        scores = warper(no_ids, scores)
    return torch.softmax(scores, -1)


def assert_law_through(stack: Stack, target: Path, params: SamplingParams,
                       proposer: str = "draft-model", long_prompt: bool = False,
                       usages: list[Any] | None = None) -> None:
    """Sample through `stack` (stopped afterwards): some drafted tokens were accepted and some
    rejected, and the first three tokens follow the target's own law (chi-square). With
    `long_prompt`, after LONG_PROMPT (the prefix cache's case) rather than PROMPT."""
    prompt = LONG_PROMPT if long_prompt else PROMPT
    try:
        counts, accepted, drafted = sample_cells(stack, params, proposer, usages=usages, prompt=prompt)
    finally:
        stack.stop()
    assert 0 < accepted < drafted
    assert p_value(counts, exact_law(rows(target, params, tuple(prompt)))) > ALPHA
