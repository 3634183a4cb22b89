"""gRPC servicer for DraftService: proto to domain, a core call, domain to proto."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from draft_service.proposer import propose_block
from tandem.config import MAX_BLOCK_TOKENS, MAX_SUPPORT_SIZE
from tandem.errors import InvalidRequest
from tandem.model_service import ModelServicer, sampling_from, step_from
from tandem.server import handle_errors
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

# Bounds on a step's request, so one request cannot monopolise the replica.
MAX_SPECULATIVE_TOKENS = MAX_BLOCK_TOKENS


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
        async for session, request in self.host.session_stream(request_iterator):
            step = step_from(request, session)
            k = request.num_speculative_tokens
            if k > MAX_SPECULATIVE_TOKENS:
                raise InvalidRequest(f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k}")
            if not 1 <= request.max_support_size <= MAX_SUPPORT_SIZE:
                raise InvalidRequest(
                    f"max_support_size must be in [1, {MAX_SUPPORT_SIZE}], got {request.max_support_size}")
            params = sampling_from(request.sampling)
            block, ms = await self.host.run_step(
                session, step.cache_position + len(step.new_token_ids) + k, propose_block, session,
                step, k, params, request.max_support_size, request.seed)
            yield draft_pb2.ProposeBlocksResponse(
                token_ids=block.token_ids,
                distributions=[common_pb2.SparseDistribution(token_ids=d.token_ids, probs=d.probs)
                               for d in block.distributions],
                cache_length=block.cache_length,
                compute_ms=ms,
            )
