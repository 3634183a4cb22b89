"""Property-based fuzzing of the public GenerateRequest against a real running tiny stack.

Whatever the fields hold (ids out of range, NaN and infinite temperatures, huge lengths,
empty or unicode stop strings, both prompts at once), the answer is OK or a precise
client-error status, never UNKNOWN or INTERNAL, and the stack keeps serving. Valid requests
generate a token or three (the fuzzing orchestrator's default and cap are small), so a
thousand cases stay quick.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.launch import Process, Stack, spawn, wait_serving
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.slow  # a thousand requests through real processes (CI runs it)

CAP = 8  # --max-new-tokens-cap of the fuzzed orchestrator
DEFAULT = 2  # its --default-max-new-tokens
ACCEPTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}

UINT32, UINT64, INT32 = 2**32 - 1, 2**64 - 1, 2**31 - 1
float32s = st.floats(width=32)  # NaN, +-inf, subnormals, -0.0 included

# Wild values: anything each field's wire type can carry.
wild_prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=40)}),
    st.fixed_dictionaries({"prompt": st.text(min_size=500, max_size=700)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-INT32 - 1, INT32), max_size=8)}),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=8),
                           "prompt_token_ids": st.lists(st.integers(0, 30), min_size=1, max_size=4)}),
)
wild = st.fixed_dictionaries(
    {"max_new_tokens": st.one_of(st.integers(1, 3), st.just(0), st.integers(0, UINT32))},
    optional={
        "sampling": st.builds(common_pb2.SamplingParams, temperature=float32s, top_p=float32s,
                              top_k=st.integers(0, UINT32)),
        "seed": st.integers(0, UINT64),
        "num_speculative_tokens": st.integers(0, UINT32),
        "stop_strings": st.lists(st.text(max_size=300), max_size=20),
        "ignore_eos": st.booleans(),
    },
)
# Valid values, so that as many cases generate as fail: short runs, every sampling mode.
valid_prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 35), min_size=1, max_size=40)}),
)
valid = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 3)},
    optional={
        "sampling": st.builds(common_pb2.SamplingParams,
                              temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                              top_p=st.one_of(st.just(0.0), st.floats(0.0625, 1.0, width=32)),
                              top_k=st.one_of(st.integers(0, 40), st.integers(0, UINT32))),
        "seed": st.integers(0, UINT64),
        "num_speculative_tokens": st.integers(0, 6),
        "stop_strings": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "ignore_eos": st.booleans(),
    },
)
fields_strategy = st.one_of(
    st.tuples(valid_prompts, valid), st.tuples(valid_prompts, wild), st.tuples(wild_prompts, valid),
    st.tuples(wild_prompts, wild),
).map(lambda pair: {**pair[0], **pair[1]})


@pytest.fixture(scope="module")
def fuzzed(tiny_stack: Stack, tiny_target: Path) -> Iterator[Process]:
    process = spawn(["orchestrator", "--draft", tiny_stack.drafts[0].address,
                     "--target", tiny_stack.targets[0].address, "--tokenizer", str(tiny_target),
                     "--max-new-tokens-cap", str(CAP), "--default-max-new-tokens", str(DEFAULT)])
    try:
        wait_serving(process)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def stub(fuzzed: Process) -> Iterator[Any]:
    with grpc.insecure_channel(fuzzed.address, options=CHANNEL_OPTIONS) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


def answer(stub: Any, fields: dict[str, Any], streaming: bool) -> tuple[grpc.StatusCode, int]:
    """The status and the number of tokens generated."""
    fields = {k: v for k, v in fields.items() if v is not None}
    try:
        if streaming:
            messages = list(stub.Generate(orchestrator_pb2.GenerateRequest(**fields), timeout=60))
            assert messages[-1].HasField("summary")
            tokens = sum(len(m.delta.token_ids) for m in messages[:-1])
            assert tokens == messages[-1].summary.usage.completion_tokens
        else:
            reply = stub.GenerateUnary(orchestrator_pb2.GenerateUnaryRequest(**fields), timeout=60)
            tokens = len(reply.token_ids)
    except grpc.RpcError as exc:
        return exc.code(), 0
    return grpc.StatusCode.OK, tokens


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(fields=fields_strategy, streaming=st.booleans())
def test_any_generate_request_gets_ok_or_a_client_error(stub: Any, fields: dict[str, Any],
                                                         streaming: bool) -> None:
    code, tokens = answer(stub, fields, streaming)
    event(code.name)  # pytest --hypothesis-show-statistics: the mix of outcomes
    assert code in ACCEPTED, f"{code} for {fields}"
    if code == grpc.StatusCode.OK:
        assert tokens <= (fields["max_new_tokens"] or DEFAULT)


def test_still_serving_after_the_fuzzing(stub: Any, tiny_stack: Stack) -> None:
    assert answer(stub, {"prompt": "hello", "max_new_tokens": 3, "ignore_eos": True}, True) == \
        (grpc.StatusCode.OK, 3)
    # A replica closes its session after the summary is sent: poll, as the other tests do.
    deadline = time.monotonic() + 60
    for replica in (*tiny_stack.drafts, *tiny_stack.targets):
        while (active := replica.metrics()["tandem_sessions_active"]) != 0:
            assert time.monotonic() < deadline, f"{replica.address} still has {active} sessions open"
            time.sleep(0.1)


def test_zero_max_new_tokens_means_the_default(stub: Any) -> None:
    """proto3 cannot tell an unset uint32 from 0: both mean --default-max-new-tokens."""
    assert answer(stub, {"prompt": "hello", "max_new_tokens": 0, "ignore_eos": True}, False) == \
        (grpc.StatusCode.OK, DEFAULT)
