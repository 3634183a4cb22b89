"""The speculation loop: draft a block, score it in one target pass, keep the exact prefix.

The orchestrator owns `history` (prompt + committed tokens), the source of truth.
Service caches follow it through `RemoteSession.synced`: after a step that kept m
of k drafted tokens, only the first n + m cached tokens are history, so the next
step rolls both caches back to that (see remote.py). The maths is in tandem.sampling.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import torch

from orchestrator.constraint import NO_CONSTRAINT, Constraint, step_logprobs
from orchestrator.domain import (
    EMPTY_BLOCK,
    DraftBlock,
    Generation,
    Step,
    TargetResult,
    TargetScores,
    TreeCommit,
    one_hot_block,
)
from orchestrator.policy import CostModel, Speculation
from orchestrator.proposers import Proposer
from orchestrator.remote import TargetSession
from orchestrator.suffix import NO_PROPOSAL, Proposal
from tandem import sampling


async def speculate(gen: Generation, proposer: Proposer | None, target: TargetSession,
                    costs: CostModel, constraint: Constraint = NO_CONSTRAINT) -> AsyncIterator[Step]:
    """Yield what each step committed until max_new_tokens or EOS.

    `proposer` drafts blocks here (a draft model, prompt lookup); with None the target
    decodes alone (one run for the whole generation, each token a step here), or proposes and
    verifies a tree itself when `target.proposer` is set. Where the policy drafts nothing
    after the prefill, the target decodes alone too, in a run as long as the policy would go
    before looking again (`Speculation.plain_run`): no round trip per token either. A
    proposer with free proposals (suffix, auto) offers one before each step; the step takes
    it when its expected tokens per millisecond beat the model's k (`Speculation.free_length`).
    Under a grammar (`constraint`), what it forces is committed with no model call (or, where
    the request wants log-probabilities, verified as a free proposal), and proposals are cut
    where it forbids them (orchestrator/constraint.py).
    """
    history = list(gen.prompt_token_ids)
    run = (target.decode(history, gen.sampling, gen.seed, len(history) + gen.max_new_tokens, gen.eos_token_ids)
           if proposer is None and not target.proposer else None)
    run_left = gen.max_new_tokens  # tokens the run in progress still decodes
    rng = torch.Generator().manual_seed(gen.seed)
    policy = Speculation(gen.policy, gen.num_speculative_tokens if proposer and proposer.drafts else 0, costs)
    # A proposer with free proposals (suffix decoding) finds them between runs only: a run is
    # at most `free_run` tokens, which doubles with each run and is 1 again after a free step.
    free_run = 1
    # The draft's prefill runs beside the target's and never holds the first token back (a
    # draft on slower hardware than the target's would otherwise set the time to it); the
    # next step, the first that drafts, waits for it.
    warming: asyncio.Future[DraftBlock] | None = None
    warm_length = 0
    generated = 0
    mark = time.perf_counter()  # the end of the last step; the consumer's turn follows it
    try:
        while generated < gen.max_new_tokens:
            remaining = gen.max_new_tokens - generated
            forced = constraint.forced(history, remaining) if run is None else []
            if run is None and constraint.dead_end(history):
                yield Step([], False, dead_end=True)
                return
            if forced and gen.top_logprobs is None:  # known without a model: no call at all
                eos_at = next((i for i, t in enumerate(forced) if t in gen.eos_token_ids), None)
                forced = forced[:len(forced) if eos_at is None else eos_at + 1]
                history += forced
                generated += len(forced)
                yield Step(forced, eos_at is not None, accepted=len(forced), drafted=len(forced),
                           proposer="grammar", target_passes=0)
                if eos_at is not None:
                    return
                continue
            target_seed = int(torch.randint(0, 2**62, (1,), generator=rng)) if run is None else 0  # a run keys its own
            started = time.perf_counter()
            prefill, target_synced = target.synced == 0, target.synced
            if warming is not None:
                assert proposer is not None
                proposer.update_candidate_strategy(await warming, 0, warm_length)  # or its error
                warming = None
            lag = proposer.lag(len(history)) if proposer is not None else 0
            k = policy.choose(remaining, prefill, lag) if run is None else 0  # a run goes on to its end
            free, free_kind = NO_PROPOSAL, ""
            if forced:  # the request wants log-probabilities: a pass verifies what is forced
                free, free_kind, k = Proposal(one_hot_block(forced, 0.0)), "grammar", 0
            elif run is None and proposer is not None and proposer.free_proposals and not prefill:
                free = constraint.cut_free(history, proposer.free(history, min(gen.max_free_tokens, remaining - 1)))
                free = free.cut(policy.free_length(free.probabilities, k, lag, remaining))
                if free.block.token_ids:
                    k, free_run, free_kind = 0, 1, "suffix"
                else:
                    free = NO_PROPOSAL
            if run is None and proposer is not None and k == 0 and not prefill and remaining > 1 \
                    and not free.block.token_ids:
                run_left = policy.plain_run(remaining)
                if proposer.free_proposals:
                    run_left, free_run = min(run_left, free_run), 2 * free_run
                run = target.decode(history, gen.sampling, gen.seed, len(history) + run_left,
                                    gen.eos_token_ids)
            wait_ms = 0.0
            # The draft keys its draws by (request seed, position), so a block drafted ahead is
            # the block drafted now; with overlap it drafts the next k while the target verifies.
            beside = costs.deployment.draft_shares_target and not costs.deployment.overlap
            if run is not None:  # the target decoding alone: its run's next token
                block = EMPTY_BLOCK
                called = time.perf_counter()
                result: TargetResult = await anext(run)
                answered = time.perf_counter()
                run_left -= 1
                if run_left == 0 and proposer is not None:  # the policy looks again next step
                    await run.aclose()
                    run = None
            elif free.block.token_ids:  # a free proposal (suffix decoding): no draft call
                block = free.block
                called = time.perf_counter()
                result = await target.score(history, block, gen.sampling, target_seed)
                answered = time.perf_counter()
            elif proposer is None or k == 0 or (prefill and beside):
                # A draft the policy does not mean to use is not prefilled: it catches up when used.
                # Nor is one that takes turns on the target's hardware: prefilling both at once there
                # only slows the target's prefill (the first token), and is wasted if the load rule
                # keeps it plain. (With --overlap on it is, and drafts the first block meanwhile.)
                block = EMPTY_BLOCK
                called = time.perf_counter()
                result = await target.score(history, block, gen.sampling, target_seed)
                answered = time.perf_counter()
            elif prefill:
                # Prefill both caches at once; the target alone yields the first token (TTFT).
                called = started
                warming = asyncio.ensure_future(proposer.get_candidates(history, 0, gen.sampling, gen.seed, ahead=k))
                warm_length, block = len(history), EMPTY_BLOCK
                result = await target.score(history, EMPTY_BLOCK, gen.sampling, target_seed)
                answered = time.perf_counter()
            else:
                block = constraint.cut_block(history, await proposer.get_candidates(
                    history, k, gen.sampling, gen.seed, ahead=k))
                called = time.perf_counter()
                wait_ms = (called - started) * 1000.0
                result = await target.score(history, block, gen.sampling, target_seed)
                answered = time.perf_counter()

            if isinstance(result, TreeCommit):  # the target proposed and verified a tree itself
                new, drafted = list(result.committed_token_ids), result.proposed_count
                accepted, rejected = len(new) - 1, 0
            else:  # TargetScores of `block`: the acceptance is drawn here
                uniforms = (torch.rand(len(block.token_ids), generator=rng, dtype=torch.float64).tolist()
                            if block.token_ids else [])
                accepted = sampling.num_accepted(result.scored.target_probs, block.draft_probs, uniforms)
                new, drafted = sampling.commit(block.token_ids, result.scored, accepted), len(block.token_ids)
                rejected = int(accepted < drafted)
            no_pass = isinstance(result, TargetScores) and result.forced  # a run's token its grammar forced
            if no_pass:
                accepted, drafted, free_kind = 1, 1, "grammar"

            if free_kind == "suffix":
                policy.observe_free(free.expected, accepted)
            elif proposer is not None and not free_kind:
                proposer.update_candidate_strategy(block, accepted, len(history))
            target.advance(result.cache_length, len(history) + accepted)
            ended = time.perf_counter()
            step_ms, cycle_ms, mark = (ended - started) * 1000.0, (ended - mark) * 1000.0, ended
            # Not a target's own tree pass: it scores a segment of a width not known here, and its
            # cost would be filed under its 1-2 new tokens, where the draft policy reads.
            # A free step is the model's k = 0 (the draft sat it out); its pass is still measured.
            if not prefill and not isinstance(result, TreeCommit) and not no_pass:
                policy.observe(0 if free.block.token_ids else len(block.token_ids),
                               0 if free.block.token_ids else accepted, block.compute_ms, result.compute_ms,
                               step_ms, len(history) - target_synced + len(block.token_ids), result.load,
                               fed=lag)

            allowed = constraint.allowed(history, new)
            dead_end = allowed < len(new)  # the grammar failed on the way
            new = new[:allowed]
            eos_at = next((i for i, t in enumerate(new) if t in gen.eos_token_ids), None)
            new = new[: remaining if eos_at is None else min(eos_at + 1, remaining)]
            logprobs = step_logprobs(result, accepted, new)
            history += new
            generated += len(new)
            finished_by_eos = eos_at is not None and eos_at < len(new)
            yield Step(new, finished_by_eos, accepted=min(accepted, len(new)),  # a tree may pass the end
                       drafted=drafted, rejected=rejected, prefill=prefill,
                       draft_ms=block.compute_ms, target_ms=result.compute_ms, wall_ms=step_ms,
                       draft_wait_ms=wait_ms,
                       draft_hit=None if block.prebuilt < 0 or not block.token_ids else block.ahead_hit,
                       target_call_ms=(answered - called) * 1000.0, cycle_ms=cycle_ms, draft_split=block.split,
                       target_split=result.split, draft_cached=block.cached, target_cached=result.cached,
                       proposer=free_kind, logprobs=logprobs, dead_end=dead_end,
                       target_passes=0 if no_pass else 1)
            if finished_by_eos or dead_end:
                return
    finally:
        if warming is not None:
            warming.cancel()
            if warming.done() and not warming.cancelled():
                warming.exception()  # retrieved: the request ended before it needed the draft
        if run is not None:
            await run.aclose()
