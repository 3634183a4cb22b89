"""Drafting a block of tokens with exactly the information exact rejection sampling needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem import sampling
from tandem.batching import Forward, Pass
from tandem.kv import KVSession
from tandem.model_service import Step


@dataclass(frozen=True)
class ProposedBlock:
    token_ids: tuple[int, ...]  # [k]
    distributions: tuple[sampling.SparseDistribution, ...]  # [k], the q each token was drawn from
    cache_length: int


async def propose_block(
    forward: Forward,
    session: KVSession,
    step: Step,
    num_speculative_tokens: int,
    params: sampling.SamplingParams,
    max_support_size: int,
    seed: int,
) -> ProposedBlock:
    """Append the step's tokens, then draft k tokens autoregressively.

    Each token is drawn from the draft's distribution under the request's parameters,
    truncated to its `max_support_size` most likely tokens and renormalised; that
    truncated distribution is what is reported, so q is exact (FIELD_NOTES: sparse q).
    The last drafted token is not fed back: the cache ends at n + k - 1 tokens. Each token's
    pass goes through `forward`, so the j-th tokens of all drafting sessions share a pass.
    """
    generator = torch.Generator().manual_seed(seed)
    logits = (await forward(Pass(session, step.cache_position, tuple(step.new_token_ids)))).logits  # [1, vocab]
    token_ids: list[int] = []
    distributions: list[sampling.SparseDistribution] = []
    for i in range(num_speculative_tokens):
        support, probs = sampling.truncate(sampling.probabilities(logits, params)[0], max_support_size)
        token = int(support[sampling.sample(probs[None], generator)[0]])
        token_ids.append(token)
        distributions.append(sampling.SparseDistribution(tuple(support.tolist()), tuple(probs.tolist())))
        if i + 1 < num_speculative_tokens:
            logits = (await forward(Pass(session, session.length, (token,)))).logits
    return ProposedBlock(tuple(token_ids), tuple(distributions), session.length)
