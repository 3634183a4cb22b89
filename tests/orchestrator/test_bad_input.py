"""Bad input that a well-behaved client cannot send: bytes hand-encoded on the wire, oversized
messages, and what proto3's unsigned fields make of negative numbers. Each gets a precise
status (never UNKNOWN), and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.launch import Process, Stack, spawn, wait_serving
from tandem.v1 import common_pb2, orchestrator_pb2, target_pb2

GENERATE = "/tandem.v1.OrchestratorService/Generate"
GENERATE_UNARY = "/tandem.v1.OrchestratorService/GenerateUnary"
SCORE_BLOCKS = "/tandem.v1.TargetService/ScoreBlocks"


def varint(value: int) -> bytes:
    """Protobuf base-128 varint; a negative value is sent as its 64-bit two's complement,
    as a client of a signed type would."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes | int) -> bytes:
    if isinstance(payload, int):
        return varint(number << 3) + varint(payload)
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def call_raw(address: str, method: str, payload: bytes, streaming: bool) -> list[bytes]:
    """Send hand-made request bytes; return the raw response messages."""
    with grpc.insecure_channel(address) as channel:
        if method == SCORE_BLOCKS:
            return list(channel.stream_stream(method)(iter([payload]), timeout=30))
        if streaming:
            return list(channel.unary_stream(method)(payload, timeout=30))
        return [channel.unary_unary(method)(payload, timeout=30)]


def still_serves(stack: Stack) -> None:
    with stack.client() as client:
        assert client.generate("hello", max_new_tokens=3).usage.completion_tokens == 3


# --- Invalid UTF-8 in a string field ---

@pytest.mark.parametrize("method", [GENERATE, GENERATE_UNARY])
@pytest.mark.parametrize("payload, name", [
    (field(1, b"hi \xff\xfe"), "prompt"),
    (field(1, b"hi") + field(7, b"ok") + field(7, b"\xc3\x28"), "stop_strings"),
])
def test_invalid_utf8_gets_invalid_argument_naming_the_field(
        tiny_stack: Stack, method: str, payload: bytes, name: str) -> None:
    payload += field(3, 2)  # max_new_tokens
    with pytest.raises(grpc.RpcError) as err:
        call_raw(tiny_stack.address, method, payload, streaming=method == GENERATE)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{name} is not valid UTF-8" in err.value.details()
    still_serves(tiny_stack)


def test_bytes_that_do_not_parse_get_invalid_argument(tiny_stack: Stack) -> None:
    truncated = field(1, b"hello")[:-2]  # the length promises more bytes than follow
    with pytest.raises(grpc.RpcError) as err:
        call_raw(tiny_stack.address, GENERATE_UNARY, truncated, streaming=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in err.value.details()
    still_serves(tiny_stack)


def test_invalid_utf8_on_an_internal_stream(tiny_stack: Stack) -> None:
    step = target_pb2.ScoreBlocksRequest(new_token_ids=[5], draft_proposal=target_pb2.DraftProposal()).SerializeToString()
    with pytest.raises(grpc.RpcError) as err:
        call_raw(tiny_stack.targets[0].address, SCORE_BLOCKS, field(1, b"\xff") + step, True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "session_id is not valid UTF-8" in err.value.details()
    [reply] = call_raw(tiny_stack.targets[0].address, SCORE_BLOCKS, step, True)
    assert target_pb2.ScoreBlocksResponse.FromString(reply).cache_length == 1


# --- Negative numbers in unsigned fields ---

def test_python_client_refuses_negative_unsigned_fields() -> None:
    with pytest.raises(ValueError):
        orchestrator_pb2.GenerateRequest(max_new_tokens=-1)
    with pytest.raises(ValueError):
        common_pb2.SamplingParams(top_k=-1)


def test_negative_max_new_tokens_on_the_wire_is_out_of_range(tiny_stack: Stack) -> None:
    """A client of a signed type sends -1 as a 10-byte varint; uint32 keeps the low 32 bits."""
    payload = field(1, b"hello") + field(3, -1)
    with pytest.raises(grpc.RpcError) as err:
        call_raw(tiny_stack.address, GENERATE_UNARY, payload, streaming=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_new_tokens must be in [1, 4096], got {2**32 - 1}" in err.value.details()
    still_serves(tiny_stack)


def test_negative_top_k_on_the_wire_means_no_top_k(tiny_stack: Stack) -> None:
    """top_k -1 arrives as 2**32 - 1: more than the vocabulary, so nothing is cut, as with 0."""
    sampling = common_pb2.SamplingParams(temperature=1.0).SerializeToString()
    base = field(1, b"hello") + field(3, 8) + field(5, 7) + field(6, 2) + field(8, 1)
    replies = [orchestrator_pb2.GenerateUnaryResponse.FromString(call_raw(
        tiny_stack.address, GENERATE_UNARY, base + field(4, sampling + top_k), streaming=False)[0])
        for top_k in (field(2, -1), b"")]
    assert len(replies[0].token_ids) == 8
    assert list(replies[0].token_ids) == list(replies[1].token_ids)


def test_prompt_and_prompt_token_ids_together(tiny_stack: Stack) -> None:
    payload = field(1, b"hello") + field(2, varint(5)) + field(3, 2)
    with pytest.raises(grpc.RpcError) as err:
        call_raw(tiny_stack.address, GENERATE_UNARY, payload, streaming=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one of prompt and prompt_token_ids" in err.value.details()
    still_serves(tiny_stack)


# --- A message larger than the configured limit ---

@pytest.fixture(scope="module")
def small_limit_orchestrator(tiny_stack: Stack, tiny_target: Path) -> Iterator[Process]:
    """An orchestrator on the shared replicas that accepts requests of at most 4 KiB."""
    process = spawn(["orchestrator", "--draft", tiny_stack.drafts[0].address,
                     "--target", tiny_stack.targets[0].address, "--tokenizer", str(tiny_target),
                     "--max-message-bytes", "4096"])
    try:
        wait_serving(process)
        yield process
    finally:
        process.stop()


def test_oversized_request_gets_resource_exhausted(small_limit_orchestrator: Process) -> None:
    stack = Stack([], [], small_limit_orchestrator)
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("a" * 5000, max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "4096" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate_stream("hello", max_new_tokens=2, stop=["x" * 200] * 30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Under the limit, a long prompt is parsed and validated as usual.
        with pytest.raises(grpc.RpcError) as err:
            client.generate("a" * 3000, max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "context" in err.value.details()
    still_serves(stack)


# --- A text prompt far longer than the context ---

def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(tiny_stack: Stack) -> None:
    # The tiny target's context is 512 tokens: 100 characters per token of it is 51,200.
    with tiny_stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate("ab" * 30_000, max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt has 60000 characters, more than 100 per token" in err.value.details()
    still_serves(tiny_stack)


def test_a_text_prompt_is_tokenized_off_the_event_loop() -> None:
    """The tokenizer waits for the event loop to run something else: on the loop it would time out."""
    import asyncio
    import threading

    from orchestrator.domain import GenerationRequest, ModelInfo
    from orchestrator.service import OrchestratorConfig, OrchestratorService

    loop_ran = threading.Event()

    class WaitsForTheLoop:
        def encode(self, text: str) -> list[int]:
            assert loop_ran.wait(timeout=20), "the event loop was blocked while tokenizing"
            return [1, 2, 3]

    engine = OrchestratorService(OrchestratorConfig(target="127.0.0.1:1")).engine
    engine.tokenizer = WaitsForTheLoop()
    engine.target_info = ModelInfo(model="m", vocab_size=10, tokenizer_fingerprint="",
                                   max_context_tokens=100, eos_token_ids=())

    async def scenario() -> None:
        asyncio.get_running_loop().call_soon(loop_ran.set)
        gen, _ = await engine.validate(GenerationRequest(prompt="abc", max_new_tokens=2))
        assert gen.prompt_token_ids == (1, 2, 3)

    asyncio.run(scenario())
