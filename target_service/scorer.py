"""Scoring a draft block with one forward pass of the target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem import sampling
from tandem.kv import KVSession
from tandem.model_service import Step
from tandem.models import CausalLM


@dataclass(frozen=True)
class ScoredStep:
    scored: sampling.ScoredBlock
    cache_length: int


def score_block(
    model: CausalLM,
    session: KVSession,
    step: Step,
    draft_token_ids: list[int],  # [k]
    draft_distributions: list[sampling.SparseDistribution],  # [k]
    params: sampling.SamplingParams,
    seed: int,
) -> ScoredStep:
    """Append the step's tokens and the draft block in one forward pass; score the block.

    The last k+1 positions give p for each drafted token and for the bonus position,
    under the request's own sampling parameters.
    """
    session.rollback(step.cache_position)
    k = len(draft_token_ids)
    logits = session.forward(model, step.new_token_ids + draft_token_ids, logits_to_keep=k + 1)
    probs = sampling.probabilities(logits, params)  # [k+1, vocab]
    generator = torch.Generator().manual_seed(seed)
    scored = sampling.score_block(probs, draft_token_ids, draft_distributions, generator)
    return ScoredStep(scored=scored, cache_length=session.length)
