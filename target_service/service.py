"""gRPC servicer for TargetService: proto to domain, a core call, domain to proto."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tandem import models, sampling
from tandem.config import MAX_BLOCK_TOKENS, MAX_STOP_TOKENS, MAX_TOP_LOGPROBS
from tandem.errors import InvalidRequest, Unavailable
from tandem.grammar import GrammarState
from tandem.kv import KVSession
from tandem.model_service import ModelHost, ModelServicer, sampling_from, step_from
from tandem.server import handle_errors
from tandem.split import split_to_proto
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.candidates import TargetProposer
from target_service.proposers import build_proposers
from target_service.scorer import decode_run, propose_and_verify, score_block


def draft_from(proposal: target_pb2.DraftProposal, session: KVSession
               ) -> tuple[list[int], list[sampling.SparseDistribution]]:
    ids = list(proposal.token_ids)
    if len(ids) > MAX_BLOCK_TOKENS:
        raise InvalidRequest(f"draft_proposal.token_ids holds {len(ids)} tokens; at most {MAX_BLOCK_TOKENS}")
    if len(proposal.distributions) != len(ids):
        raise InvalidRequest(
            f"draft_proposal.distributions has {len(proposal.distributions)} entries but "
            f"draft_proposal.token_ids has {len(ids)}; send one distribution per drafted token")
    session.check_tokens("draft_proposal.token_ids", ids)
    dists = []
    for i, (token, d) in enumerate(zip(ids, proposal.distributions)):
        where = f"draft_proposal.distributions[{i}]"
        if len(d.token_ids) != len(d.probs) or not d.token_ids:
            raise InvalidRequest(f"{where} needs equal, non-zero numbers of token_ids and probs")
        session.check_tokens(f"{where}.token_ids", list(d.token_ids))
        total = math.fsum(d.probs)
        if any(not 0.0 <= p <= 1.0 for p in d.probs) or abs(total - 1.0) > 1e-3:
            raise InvalidRequest(f"{where}.probs must lie in [0, 1] and sum to 1 (got {total:.6f})")
        if len(set(d.token_ids)) != len(d.token_ids):
            raise InvalidRequest(f"{where}.token_ids must be distinct")
        if token not in d.token_ids:
            raise InvalidRequest(f"draft_proposal.token_ids[{i}]={token} is not in the support of {where}")
        if d.probs[list(d.token_ids).index(token)] <= 0.0:
            raise InvalidRequest(f"draft_proposal.token_ids[{i}]={token} has probability 0 in {where}; "
                                 "a draft samples only tokens its distribution gives mass")
        dists.append(sampling.SparseDistribution(tuple(d.token_ids), tuple(d.probs)))
    return ids, dists


def scores_to(scored: sampling.ScoredBlock) -> target_pb2.BlockScores:
    return target_pb2.BlockScores(
        target_probs=scored.target_probs, recovered_token_ids=scored.recovered_token_ids,
        bonus_token_id=scored.bonus_token_id,
        logprobs=[target_pb2.RowLogprobs(drafted_logprob=r.drafted, drawn_logprob=r.drawn,
                                         top_token_ids=r.top_token_ids, top_logprobs=r.top_logprobs)
                  for r in scored.logprobs])


class TargetService(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    name = "tandem.v1.TargetService"

    def __init__(self, host: ModelHost) -> None:
        super().__init__(host)
        host.serves_decode_runs = True
        self.proposers: dict[int, TargetProposer] = {}
        self.tokenizer: target_pb2.GetTokenizerResponse | None = None

    def add_to(self, server: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, server)

    def load(self) -> None:
        super().load()
        self.proposers = build_proposers(self.host.config, self.host.ready_model(), self.host.capabilities)
        assert self.host.info is not None
        self.host.info.proposers.extend(sorted(self.proposers))
        self.tokenizer = target_pb2.GetTokenizerResponse(files=[
            target_pb2.TokenizerFile(name=f.name, content=f.content)
            for f in models.tokenizer_files(self.host.tokenizer)])

    @handle_errors
    async def GetTokenizer(self, request: target_pb2.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> target_pb2.GetTokenizerResponse:
        if self.tokenizer is None:
            raise Unavailable("the model is still loading; wait for health SERVING")
        return self.tokenizer

    def _proposer(self, proposal: target_pb2.TargetProposal) -> TargetProposer:
        if proposal.proposer not in self.proposers:
            runs = ", ".join(common_pb2.Proposer.Name(k) for k in sorted(self.proposers)) or "none"
            raise InvalidRequest(f"target_proposal.proposer {proposal.proposer} is not run by this "
                                 f"replica (it runs: {runs})")
        return self.proposers[proposal.proposer]

    def _load(self, session: KVSession) -> dict[str, Any]:
        """The pass that served the step and the queue behind it: what the policy sees of load."""
        stats = session.last_pass
        return {"batch_session_count": stats.sessions, "batch_token_count": stats.tokens,
                "pass_ms": stats.ms, "queue_depth_count": self.host.scheduler.depth,
                "kv_cache_usage": self.host.sessions.usage(),
                "pass_split": split_to_proto(session.take_split())}

    @handle_errors
    async def ScoreBlocks(
        self, request_iterator: AsyncIterator[target_pb2.ScoreBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[target_pb2.ScoreBlocksResponse]:
        self.host.ready_model()
        exact_positions = self.host.capabilities.exact_positions
        async for session, request in self.host.session_stream(request_iterator):
            step = step_from(request, session)
            params = sampling_from(request.sampling)
            history = step.cache_position + len(step.new_token_ids)
            kind = request.WhichOneof("proposal")
            top_logprobs = self._top_logprobs(request, kind)
            if session.states.get(GrammarState) is not None:
                await session.still()  # a closed decode run's last draw may still take its token in
            grammar = await self.host.grammar_for(request, session, [*session.held_tokens[:step.cache_position],
                                                                *step.new_token_ids])
            if grammar is not None and kind == "target_proposal":
                raise InvalidRequest("grammar: a target_proposal (Lookahead, Medusa) verifies token trees, "
                                     "which are not masked; send a draft_proposal or a decode_run")
            step, cached = await self.host.start_step(session, step)
            if kind == "target_proposal":
                proposer = self._proposer(request.target_proposal)
                # The proposer's segment is cached during the pass, and cropped after it.
                verified, ms = await self.host.run_step(
                    session, history + proposer.max_segment_tokens, propose_and_verify, session,
                    step, proposer, params, request.seed, exact_positions)
                yield target_pb2.ScoreBlocksResponse(
                    cache_length=verified.cache_length, compute_ms=ms, **self._load(session),
                    cached_token_count=cached,
                    verified_tree=target_pb2.VerifiedTree(
                        committed_token_ids=verified.committed_token_ids,
                        proposed_token_count=verified.proposed_count))
            elif kind == "draft_proposal":
                ids, dists = draft_from(request.draft_proposal, session)
                scored, ms = await self.host.run_step(session, history + len(ids), score_block,
                                                      session, step, ids, dists, params, request.seed,
                                                      grammar, top_logprobs)
                yield target_pb2.ScoreBlocksResponse(
                    cache_length=scored.cache_length, compute_ms=ms, **self._load(session),
                    cached_token_count=cached, block_scores=scores_to(scored.scored))
            elif kind == "decode_run":
                stops = self._run_checks(request.decode_run, session, history)
                # Closed with this stream's handler: the pass queued ahead is cancelled with it.
                async with contextlib.aclosing(decode_run(self.host.run_step, session, step, params, request.seed,
                                                          request.decode_run.max_tokens, stops, grammar,
                                                          top_logprobs)) as tokens:
                    async for scored, ms in tokens:
                        scores = scores_to(scored.scored)
                        scores.grammar_forced = scored.forced
                        yield target_pb2.ScoreBlocksResponse(
                            cache_length=scored.cache_length, compute_ms=ms, **self._load(session),
                            cached_token_count=cached, block_scores=scores)
                        cached = 0  # told once, on the run's first token
            else:
                raise InvalidRequest("the step sets no proposal: send draft_proposal (with no "
                                     "tokens for a plain target step), target_proposal or decode_run")

    @staticmethod
    def _top_logprobs(request: target_pb2.ScoreBlocksRequest, kind: str | None) -> int | None:
        if not request.HasField("top_logprobs"):
            return None
        if request.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        if kind == "target_proposal":
            raise InvalidRequest("top_logprobs: a target_proposal's tree is verified in the target, "
                                 "which returns no log-probabilities for it")
        return int(request.top_logprobs)

    def _run_checks(self, run: target_pb2.DecodeRun, session: KVSession, history: int) -> frozenset[int]:
        """A decode run's stop tokens, once its fields are known to be valid."""
        if run.max_tokens < 1:
            raise InvalidRequest("decode_run.max_tokens must be at least 1")
        assert self.host.info is not None
        context = self.host.info.max_context_tokens
        if context and history + run.max_tokens > context:
            raise InvalidRequest(f"decode_run.max_tokens {run.max_tokens} after a history of {history} tokens "
                                 f"passes the model's context of {context} tokens")
        stops = list(run.stop_token_ids)
        if len(stops) > MAX_STOP_TOKENS:
            raise InvalidRequest(f"decode_run.stop_token_ids holds {len(stops)} ids; at most {MAX_STOP_TOKENS}")
        session.check_tokens("decode_run.stop_token_ids", stops)
        return frozenset(stops)
