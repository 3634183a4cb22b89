"""Scoring a draft block, or a target proposer's token tree, with one forward pass of the target;
or decoding a run of tokens with the target alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandem import sampling
from tandem.batching import Forward, Pass, PassOutput, Reads
from tandem.grammar import GrammarState
from tandem.kv import KVSession
from tandem.model_service import Step
from target_service.candidates import NO_CANDIDATES, TargetProposer


@dataclass(frozen=True)
class ScoredStep:
    scored: sampling.ScoredBlock
    cache_length: int
    forced: bool = False  # a decode run's token the grammar forced: no pass drew it


@dataclass(frozen=True)
class VerifiedStep:
    committed_token_ids: tuple[int, ...]  # the accepted path, then a recovered or bonus token
    proposed_count: int  # tokens in the verified tree
    cache_length: int


def block_scores(out: PassOutput, params: sampling.SamplingParams, draft_token_ids: list[int],
                 draft_distributions: list[sampling.SparseDistribution], seed: int,
                 reads: Reads) -> sampling.ScoredBlock:
    """A scoring pass's block scores: from each row's argmax (`Reads.argmax_only`) or from its
    logits, under the grammar's masks and with the log-probabilities `reads` names."""
    if out.best is not None:
        return sampling.score_greedy(out.best, draft_token_ids)
    assert out.logits is not None
    return sampling.score_logits(out.logits, params, draft_token_ids, draft_distributions, seed,
                                 reads.masks, reads.top_logprobs)


def reads_for(params: sampling.SamplingParams, grammar: GrammarState | None, block: list[int],
              top_logprobs: int | None) -> Reads:
    """What a scoring pass of `block` reads: under a grammar, the mask of every row (the state
    after the history, then after each drafted token)."""
    masks = None
    if grammar is not None:
        masks, _ = grammar.masks(block)
        # A row that allows nothing (the grammar failed there) is read only if the step's
        # tokens before it are kept, and the orchestrator ends the reply at that point; it
        # must not make the row NaN meanwhile.
        masks[~masks.any(-1)] = True
    return Reads(argmax=params.greedy, masks=masks, top_logprobs=top_logprobs)


async def score_block(
    forward: Forward,
    session: KVSession,
    step: Step,
    draft_token_ids: list[int],  # [k]
    draft_distributions: list[sampling.SparseDistribution],  # [k]
    params: sampling.SamplingParams,
    seed: int,
    grammar: GrammarState | None = None,
    top_logprobs: int | None = None,
) -> ScoredStep:
    """Append the step's tokens and the draft block in one forward pass; score the block.

    The last k+1 positions give p for each drafted token and for the bonus position,
    under the request's own sampling parameters (and grammar, at the history `grammar`
    follows).
    """
    k = len(draft_token_ids)
    reads = reads_for(params, grammar, draft_token_ids, top_logprobs)

    def score(out: PassOutput) -> sampling.ScoredBlock:
        return block_scores(out, params, draft_token_ids, draft_distributions, seed, reads)

    out = await forward(Pass(session, step.cache_position, (*step.new_token_ids, *draft_token_ids),
                             logits_to_keep=k + 1, reads=reads, reduce=score))
    return ScoredStep(scored=out.value, cache_length=session.length)


async def propose_and_verify(
    forward: Forward,
    session: KVSession,
    step: Step,
    proposer: TargetProposer,
    params: sampling.SamplingParams,
    seed: int,
    exact_positions: float,
) -> VerifiedStep:
    """Append the step's tokens, score the proposer's segment in the same pass, verify its tree.

    Unlike a draft block, the tree's tokens are not kept in the cache (they sit at tree
    positions); the committed ones come back as the next step's new tokens.
    `exact_positions`: `models.exact_positions` of the target.
    """
    session.rollback(step.cache_position)  # before the proposer reads its state (a reset clears it)
    # The segment's hand-built mask and positions match the model's own pass only inside the
    # positions it serves exactly and inside a sliding window; past them, a plain step.
    reach = step.cache_position + len(step.new_token_ids) + proposer.max_segment_tokens
    proposing = reach <= exact_positions
    candidates = proposer.get_candidates(session, step.new_token_ids) if proposing else NO_CANDIDATES
    rows = [0, *(1 + i for i in candidates.tree_nodes)]

    def verify(out: PassOutput) -> sampling.TreeVerdict:
        assert out.logits is not None
        logits = out.logits
        probs = sampling.probabilities(logits[rows], params)  # [1 + m, vocab]
        return sampling.verify_tree(probs, candidates.tree_token_ids, candidates.tree_parents,
                                    sampling.generator(seed, logits.device))

    out = await forward(Pass(session, step.cache_position, tuple(step.new_token_ids),
                             segment=candidates.segment, with_hidden=proposer.with_hidden,
                             reduce=verify))
    verdict: sampling.TreeVerdict = out.value
    if proposing:
        assert out.logits is not None  # a tree's pass is never greedy-only
        proposer.update_candidate_strategy(session, candidates, out.logits, out.hidden, verdict)
    path = tuple(candidates.tree_token_ids[i] for i in verdict.accepted_nodes)
    return VerifiedStep((*path, verdict.next_token_id), len(candidates.tree_nodes), session.length)


#: `ModelHost.run_step`: (session, tokens it may hold, step function, its arguments) -> (result, ms).
RunStep = Callable[..., Awaitable[tuple[Any, float]]]


#: A decode run claims KV room this many tokens at a time (`ModelHost.run_step`): within a
#: stretch its passes follow each other on the forward worker; between stretches the event loop
#: claims the next.
RUN_STRETCH = 32


async def decode_run(
    run_step: RunStep,
    session: KVSession,
    step: Step,
    params: sampling.SamplingParams,
    seed: int,  # the request's: the token at position p is drawn with position_seed(seed, p)
    max_tokens: int,
    stop_token_ids: frozenset[int],
    grammar: GrammarState | None = None,
    top_logprobs: int | None = None,
) -> AsyncGenerator[tuple[ScoredStep, float], None]:
    """Decode up to `max_tokens` tokens with the target alone, yielding each as it is drawn
    (the bonus token of a block of none) with the ms since the one before; the run ends after
    a stop token. Under a grammar (following the history), each draw is masked by it, and
    the tokens it forces after a draw are told at once, with no pass of their own: the next
    pass feeds them with the draw (unless the run returns log-probabilities, which only a
    pass has).

    Each token is one pass through the scheduler, so other sessions' passes share it as they
    would a plain step's; but the next pass is named on the forward worker as soon as a token
    is drawn (`Pass.then`), so the model never waits for the event loop, which sends each
    token on the wire while the next pass runs.
    """
    loop = asyncio.get_running_loop()
    news: asyncio.Queue[tuple[ScoredStep, float] | asyncio.Future[Any]] = asyncio.Queue()
    clock = [time.perf_counter()]

    def token(position: int, new: tuple[int, ...], left: int) -> Pass:
        at = position + len(new)  # where the drawn token will sit
        reads = reads_for(params, grammar, [], top_logprobs)

        def score(out: PassOutput) -> sampling.ScoredBlock:
            return block_scores(out, params, [], [], sampling.position_seed(seed, at), reads)

        def then(out: PassOutput) -> Pass | None:  # on the forward worker (the session is in its step)
            drawn = out.value.bonus_token_id
            now = time.perf_counter()
            loop.call_soon_threadsafe(news.put_nowait, (ScoredStep(out.value, at), (now - clock[0]) * 1000.0))
            clock[0] = now
            told = [drawn]
            if grammar is not None:
                # Where the grammar fails (a parser limit), the rows go unmasked and the run on:
                # the orchestrator, which follows the grammar too, ends the reply there.
                grammar.take(drawn)
                forced = grammar.forced(left - 1) if top_logprobs is None and drawn not in stop_token_ids else []
                for forced_token in forced:
                    grammar.take(forced_token)
                    told.append(forced_token)
                    loop.call_soon_threadsafe(news.put_nowait, (ScoredStep(
                        sampling.ScoredBlock((), (), forced_token), at, forced=True), 0.0))
                    if forced_token in stop_token_ids:
                        break
            left_after = left - len(told)
            return token(at, tuple(told), left_after) if left_after > 0 and told[-1] not in stop_token_ids else None

        return Pass(session, position, new, reads=reads, reduce=score, then=then)

    async def stretch(forward: Forward, first: Pass) -> None:
        await forward(first)

    position, new, left = step.cache_position, tuple(step.new_token_ids), max_tokens
    running: asyncio.Future[Any] | None = None
    try:
        while left:
            count = min(left, RUN_STRETCH)
            # The stretch's last pass leaves its cache holding count - 1 more than the first's.
            running = asyncio.ensure_future(run_step(session, position + len(new) + count - 1, stretch,
                                                     token(position, new, count)))
            running.add_done_callback(news.put_nowait)
            drawn = None
            unfed: list[int] = []  # tokens told whose KV the cache does not hold yet
            while not isinstance(item := await news.get(), asyncio.Future):
                scored, ms = item
                if scored.cache_length != position:
                    position, new, unfed = scored.cache_length, (), []
                drawn = scored.scored.bonus_token_id
                unfed.append(drawn)
                left -= 1
                yield scored, ms
            running.result()  # a failed pass's error
            if drawn is None or drawn in stop_token_ids:
                return
            new = tuple(unfed)
    finally:
        if running is not None:
            running.cancel()
            if running.done() and not running.cancelled():
                running.exception()  # retrieved: a pass that failed after the run was closed is no error
