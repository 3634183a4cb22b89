"""Scoring a draft block, or a target proposer's token tree, with one forward pass of the target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem import models, sampling
from tandem.kv import KVSession
from tandem.model_service import Step
from tandem.models import CausalLM
from target_service.proposers import NO_CANDIDATES, TargetProposer


@dataclass(frozen=True)
class ScoredStep:
    scored: sampling.ScoredBlock
    cache_length: int


@dataclass(frozen=True)
class VerifiedStep:
    committed_token_ids: tuple[int, ...]  # the accepted path, then a recovered or bonus token
    proposed_count: int  # tokens in the verified tree
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


def propose_and_verify(
    model: CausalLM,
    session: KVSession,
    step: Step,
    proposer: TargetProposer,
    params: sampling.SamplingParams,
    seed: int,
) -> VerifiedStep:
    """Append the step's tokens, score the proposer's segment in the same pass, verify its tree.

    Unlike a draft block, the tree's tokens are not kept in the cache (they sit at tree
    positions); the committed ones come back as the next step's new tokens.
    """
    session.rollback(step.cache_position)
    # The segment's hand-built mask and positions match the model's own pass only inside the
    # positions it serves exactly and inside a sliding window; past them, a plain step.
    reach = step.cache_position + len(step.new_token_ids) + proposer.max_segment_tokens
    proposing = reach <= models.exact_positions(model)
    candidates = proposer.get_candidates(session, step.new_token_ids) if proposing else NO_CANDIDATES
    logits, hidden = session.forward_segment(model, step.new_token_ids, candidates.segment,
                                             proposer.with_hidden)
    rows = [0, *(1 + i for i in candidates.tree_nodes)]
    probs = sampling.probabilities(logits[rows], params)  # [1 + m, vocab]
    generator = torch.Generator().manual_seed(seed)
    verdict = sampling.verify_tree(probs, candidates.tree_token_ids, candidates.tree_parents,
                                   generator)
    if proposing:
        proposer.update_candidate_strategy(session, candidates, logits, hidden, verdict)
    path = tuple(candidates.tree_token_ids[i] for i in verdict.accepted_nodes)
    return VerifiedStep((*path, verdict.next_token_id), len(candidates.tree_nodes), session.length)
