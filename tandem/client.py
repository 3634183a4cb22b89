"""A small synchronous Python client for the orchestrator's public API."""

from __future__ import annotations

from typing import Any, Self

from tandem.security import ClientTls, bearer_metadata, channel
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc


class TandemClient:
    """Talks to an orchestrator. Use as a context manager, or call close().

    tls: connect over TLS (`tandem.security.load_client_tls` reads the CA and, for mutual TLS,
    the client certificate). token: the bearer token an orchestrator with
    --auth-token-file requires.
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, tls: ClientTls | None = None,
                 token: str | None = None) -> None:
        self._channel = channel(address, tls, CHANNEL_OPTIONS)
        self._metadata = bearer_metadata(token)
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    @staticmethod
    def _fields(prompt: str | list[int], max_new_tokens: int, temperature: float, top_p: float,
                top_k: int, seed: int | None, num_speculative_tokens: int | None,
                stop: list[str] | None, ignore_eos: bool, proposer: str | None) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "sampling": common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
            "stop_strings": stop or [],
            "ignore_eos": ignore_eos,
        }
        if isinstance(prompt, str):
            fields["prompt"] = prompt
        else:
            fields["prompt_token_ids"] = prompt
        if seed is not None:
            fields["seed"] = seed
        if num_speculative_tokens is not None:
            fields["num_speculative_tokens"] = num_speculative_tokens
        if proposer:
            # "prompt-lookup" -> PROPOSER_PROMPT_LOOKUP
            label = "PROPOSER_" + proposer.upper().replace("-", "_")
            labels = [k for k in common_pb2.Proposer.DESCRIPTOR.values_by_name if k != "PROPOSER_UNSPECIFIED"]
            if label not in labels:
                names = [k.removeprefix("PROPOSER_").lower().replace("_", "-") for k in labels]
                raise ValueError(f"unknown proposer {proposer!r}; choose one of: {', '.join(names)}")
            fields["proposer"] = label
        return fields

    def generate_stream(self, prompt: str | list[int], *, max_new_tokens: int = 256,
                        temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                        seed: int | None = None, num_speculative_tokens: int | None = None,
                        stop: list[str] | None = None, ignore_eos: bool = False,
                        proposer: str | None = None, timeout: float | None = None,
                        grammar: common_pb2.Grammar | None = None,
                        logprobs: int | None = None) -> GenerationStream:
        """Stream deltas, then one summary message. Stop early with `cancel()` or by leaving a
        `with` block: that frees the request's sessions and caches at once."""
        request = orchestrator_pb2.GenerateRequest(**self._fields(
            prompt, max_new_tokens, temperature, top_p, top_k, seed, num_speculative_tokens, stop,
            ignore_eos, proposer), grammar=grammar, logprobs=logprobs)
        return GenerationStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))

    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, num_speculative_tokens: int | None = None,
                 stop: list[str] | None = None, ignore_eos: bool = False,
                 proposer: str | None = None, timeout: float | None = None,
                 n: int = 1, grammar: common_pb2.Grammar | None = None,
                 logprobs: int | None = None) -> orchestrator_pb2.GenerateUnaryResponse:
        """The whole generation in one reply (with n > 1, every choice in `choices`); under
        `grammar` (structured output), with `logprobs` (each token's, and the top N)."""
        request = orchestrator_pb2.GenerateUnaryRequest(**self._fields(
            prompt, max_new_tokens, temperature, top_p, top_k, seed, num_speculative_tokens, stop,
            ignore_eos, proposer), n=n, grammar=grammar, logprobs=logprobs)
        reply: orchestrator_pb2.GenerateUnaryResponse = self._stub.GenerateUnary(
            request, timeout=timeout, metadata=self._metadata)
        return reply


class GenerationStream:
    """The messages of one Generate call. A `break` alone does not end the call while the
    stream is still referenced: `cancel()` does, and so does leaving a `with` block."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> orchestrator_pb2.GenerateResponse:
        message: orchestrator_pb2.GenerateResponse = next(self._call)
        return message

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()
