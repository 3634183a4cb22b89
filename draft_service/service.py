"""gRPC servicer for DraftService: proto to domain, a core call, domain to proto.

After answering a step that asks for it (draft_ahead_tokens), a session drafts ahead on its
own task while the target verifies: see draft_service/proposer.py. The next step stops that
task before it starts, at once when its history left the guessed branch (a queued pass is
skipped; a running one stops at its next layer), or after the pass under way when it matches.
Its passes are optional until then: they yield to steps' passes (tandem/batching.py), so
guesses take the draft's spare time, not the time of other sessions' blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace

import grpc

from draft_service.proposer import Guesses, ProposedBlock, draft_ahead, propose_block
from tandem.batching import Pass, PassOutput
from tandem.config import MAX_BLOCK_TOKENS, MAX_SUPPORT_SIZE
from tandem.errors import InvalidRequest, TandemError
from tandem.kv import KVSession
from tandem.metrics import AHEAD_CACHED_TOKENS, AHEAD_TOKENS
from tandem.model_service import ModelServicer, sampling_from, step_from
from tandem.sampling import SamplingParams
from tandem.server import handle_errors
from tandem.split import split_to_proto
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

# Bounds on a step's request, so one request cannot monopolise the replica.
MAX_SPECULATIVE_TOKENS = MAX_BLOCK_TOKENS


@dataclass
class Ahead:
    """A session's drafting ahead: its task, what it guessed, and its stop."""

    task: asyncio.Task[None]
    guesses: Guesses
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def end(self, session: KVSession, history: list[int]) -> tuple[int, bool]:
        """Stop it before the next step; `history` is that step's. Returns the tokens it
        drafted, and whether `history` is one it guessed (a hit)."""
        self.stop.set()
        hit = self.guesses.hit(history)
        if not hit:
            self.task.cancel()  # off the branch: a queued pass is skipped
        await asyncio.wait([self.task])
        await session.still()  # a running pass finishes, or stops at its next layer
        await self.guesses.still()
        session.ahead = False
        return self.guesses.drafted, hit


class DraftService(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    name = "tandem.v1.DraftService"

    def add_to(self, server: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self, server)

    @handle_errors
    async def ProposeBlocks(
        self, request_iterator: AsyncIterator[draft_pb2.ProposeBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[draft_pb2.ProposeBlocksResponse]:
        self.host.ready_model()
        ahead: Ahead | None = None
        session: KVSession | None = None
        # What the last reply said the cache holds: the history and the block's first k - 1
        # tokens. The cache itself may hold more (drafted ahead) or other tokens (a block
        # that came from a branch: the cache catches up on the next pass).
        told: list[int] | None = None
        try:
            async for session, request in self.host.session_stream(request_iterator):
                drafted, hit = 0, False
                step = step_from(request, session, None if told is None else len(told))
                history = (told or [])[:step.cache_position] + step.new_token_ids
                # A fresh session's first step: its cache starts from the longest kept prefix of
                # the history, and its first pass feeds only the rest (the drafter feeds what its
                # cache does not hold).
                cached = await self.host.reuse_prefix(session, history) if told is None else 0
                if ahead is not None:
                    drafted, hit = await ahead.end(session, history)
                    ahead = None
                session.tail_from = None  # what is left of a tail is this step's to use or cut
                self._gauges()
                k, depth = request.num_speculative_tokens, request.draft_ahead_tokens
                for name, value in (("num_speculative_tokens", k), ("draft_ahead_tokens", depth)):
                    if value > MAX_SPECULATIVE_TOKENS:
                        raise InvalidRequest(f"{name} must be in [0, {MAX_SPECULATIVE_TOKENS}], got {value}")
                if not 1 <= request.max_support_size <= MAX_SUPPORT_SIZE:
                    raise InvalidRequest(
                        f"max_support_size must be in [1, {MAX_SUPPORT_SIZE}], got {request.max_support_size}")
                params = sampling_from(request.sampling)
                grammar = await self.host.grammar_for(request, session, history)
                block, ms = await self.host.run_step(
                    session, len(history) + k, propose_block, session, history, k, params,
                    request.max_support_size, request.seed, grammar)
                if drafted:
                    used = min(block.reused, drafted)
                    AHEAD_TOKENS.labels(self.host.config.model, "used").inc(used)
                    AHEAD_TOKENS.labels(self.host.config.model, "wasted").inc(drafted - used)
                yield draft_pb2.ProposeBlocksResponse(
                    token_ids=block.token_ids,
                    distributions=[common_pb2.SparseDistribution(token_ids=d.token_ids, probs=d.probs)
                                   for d in block.distributions],
                    cache_length=block.cache_length,
                    compute_ms=ms,
                    pass_split=split_to_proto(session.take_split()),
                    prebuilt_tokens=block.reused,
                    ahead_hit=hit,
                    cached_token_count=cached,
                )
                told = history + list(block.token_ids[:-1])
                if depth:
                    ahead = self._start_ahead(session, history, block, depth, params,
                                              request.max_support_size, request.seed)
        finally:
            # No await here: a cancelled stream's handler may be cancelled again meanwhile.
            if ahead is not None and session is not None:
                session.tail_from = None
                ahead.task.cancel()
            self._gauges()

    def _gauges(self) -> None:
        AHEAD_CACHED_TOKENS.labels(self.host.config.model).set(self.host.sessions.tail_tokens)
        self.host.metrics.kv_total(self.host.sessions.cached_tokens)

    def _start_ahead(self, session: KVSession, history: list[int], block: ProposedBlock, depth: int,
                     params: SamplingParams, max_support_size: int, seed: int) -> Ahead | None:
        """Draft the step after `block` on a task of its own, in free KV room only."""
        k = len(block.token_ids)
        # Its own cache: the block, the bonus token and depth drafted tokens (the last not fed);
        # each copy for a rejection at i: the history, i drafted tokens, the guess and depth
        # (only the guess and depth where a copy shares its source's storage).
        own = len(history) + k + depth
        shared = 0 if self.host.sessions.shares_copies else 1
        copies = sum(shared * (len(history) + i) + 1 + depth for i in range(k))
        try:
            self.host.sessions.reserve(session, own + copies, evict=False)
            with_copies = True
        except TandemError:
            try:
                self.host.sessions.reserve(session, own, evict=False)
                with_copies = False
            except TandemError:
                return None  # no free room: drafting ahead must never cost another session its cache
        session.tail_from, session.ahead = block.cache_length, True
        guesses, stop = Guesses(), asyncio.Event()

        def optional(p: Pass) -> Awaitable[PassOutput]:  # yields to steps' passes until a step needs it
            return self.host.scheduler(replace(p, optional_until=stop))

        async def run() -> None:
            try:
                await draft_ahead(optional, session, history, block.token_ids,
                                  depth, params, max_support_size, seed, stop, guesses, with_copies)
            except TandemError as exc:  # evicted, trimmed: the next step finds out, and says so
                log.debug("session %s: drafting ahead stopped: %s", session.session_id, exc)
            finally:
                session.reserved = session.length + session.tail_extra  # the copies hold room too
                self._gauges()

        return Ahead(asyncio.get_running_loop().create_task(run()), guesses, stop)
