"""OrchestratorService: the public gRPC API, a thin adapter over the engine (proto -> domain ->
proto). Generation itself lives in orchestrator/engine.py; conversions in orchestrator/wire.py."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc

from orchestrator import wire
from orchestrator.config import OrchestratorConfig
from orchestrator.domain import Delta, Event
from orchestrator.engine import Engine
from tandem import metrics
from tandem.server import handle_errors
from tandem.v1 import orchestrator_pb2, orchestrator_pb2_grpc

__all__ = ["OrchestratorConfig", "OrchestratorService"]


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    name = "tandem.v1.OrchestratorService"

    def __init__(self, config: OrchestratorConfig, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config)

    def add_to(self, server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(self, server)

    def load(self) -> None:
        self.engine.load()

    async def close(self) -> None:
        await self.engine.close()

    def _events(self, request: orchestrator_pb2.GenerateRequest
                | orchestrator_pb2.GenerateUnaryRequest,
                context: grpc.aio.ServicerContext) -> AsyncIterator[Event]:
        remaining = context.time_remaining()
        deadline_s = remaining if remaining is not None and math.isfinite(remaining) else None
        return self.engine.generate(wire.request_from_proto(request), deadline_s)

    @handle_errors
    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        with metrics.track_request("Generate"):
            async for event in self._events(request, context):
                if isinstance(event, Delta):
                    if event.token_ids or event.text:
                        yield wire.delta_to_proto(event)
                else:
                    yield orchestrator_pb2.GenerateResponse(summary=wire.summary_to_proto(event))

    @handle_errors
    async def GenerateUnary(
        self, request: orchestrator_pb2.GenerateUnaryRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GenerateUnaryResponse:
        choices = [orchestrator_pb2.Choice() for _ in range(max(1, request.n))]
        with metrics.track_request("GenerateUnary"):
            async for event in self._events(request, context):
                choice = choices[event.choice]
                if isinstance(event, Delta):
                    choice.token_ids.extend(event.token_ids)
                    choice.text += event.text
                    choice.logprobs.extend(wire.logprobs_to_proto(event.logprobs))
                else:
                    summary = wire.summary_to_proto(event)
                    choice.finish_reason = summary.finish_reason
                    choice.usage.CopyFrom(summary.usage)
        first = choices[0]
        return orchestrator_pb2.GenerateUnaryResponse(
            text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason, usage=first.usage,
            choices=choices if len(choices) > 1 else (), logprobs=first.logprobs)
