"""gRPC servicer for TargetService: proto to domain, a core call, domain to proto."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from tandem import sampling
from tandem.errors import InvalidRequest
from tandem.kv import KVSession
from tandem.model_service import ModelServicer, sampling_from, step_from, timed
from tandem.server import handle_errors
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.scorer import score_block

MAX_BLOCK_TOKENS = 64


def draft_from(request: target_pb2.ScoreBlocksRequest, session: KVSession
               ) -> tuple[list[int], list[sampling.SparseDistribution]]:
    ids = list(request.draft_token_ids)
    if len(ids) > MAX_BLOCK_TOKENS:
        raise InvalidRequest(f"draft_token_ids holds {len(ids)} tokens; at most {MAX_BLOCK_TOKENS}")
    if len(request.draft_distributions) != len(ids):
        raise InvalidRequest(
            f"draft_distributions has {len(request.draft_distributions)} entries but "
            f"draft_token_ids has {len(ids)}; send one distribution per drafted token")
    session.check_tokens("draft_token_ids", ids)
    dists = []
    for i, (token, d) in enumerate(zip(ids, request.draft_distributions)):
        if len(d.token_ids) != len(d.probs) or not d.token_ids:
            raise InvalidRequest(f"draft_distributions[{i}] needs equal, non-zero numbers of token_ids and probs")
        session.check_tokens(f"draft_distributions[{i}].token_ids", list(d.token_ids))
        total = math.fsum(d.probs)
        if any(not 0.0 <= p <= 1.0 for p in d.probs) or abs(total - 1.0) > 1e-3:
            raise InvalidRequest(f"draft_distributions[{i}].probs must lie in [0, 1] and sum to 1 (got {total:.6f})")
        if token not in d.token_ids:
            raise InvalidRequest(f"draft_token_ids[{i}]={token} is not in the support of draft_distributions[{i}]")
        dists.append(sampling.SparseDistribution(tuple(d.token_ids), tuple(d.probs)))
    return ids, dists


class TargetService(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    name = "tandem.v1.TargetService"

    def add_to(self, server: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, server)

    @handle_errors
    async def ScoreBlocks(
        self, request_iterator: AsyncIterator[target_pb2.ScoreBlocksRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[target_pb2.ScoreBlocksResponse]:
        model = self.host.ready_model()
        async for session, request in self.host.session_stream(request_iterator):
            step = step_from(request, session)
            ids, dists = draft_from(request, session)
            params = sampling_from(request.sampling)
            result, ms = await self.host.run(timed, score_block, model, session, step, ids, dists,
                                             params, request.seed)
            yield target_pb2.ScoreBlocksResponse(
                target_probs=result.scored.target_probs,
                recovered_token_ids=result.scored.recovered_token_ids,
                bonus_token_id=result.scored.bonus_token_id,
                cache_length=result.cache_length,
                compute_ms=ms,
            )
