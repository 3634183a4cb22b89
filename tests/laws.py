"""What the statistical tests share: the goodness-of-fit test, and an independent reference
for the sampling warpers the exact laws are built with."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from scipy import stats

from tandem.sampling import SamplingParams


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
