"""n > 1 over gRPC: one prefill, n choices from it, each with its own seed."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from scrape import sample
from tiny import greedy_reference

from tandem.launch import Stack

PROMPT = [2 + (3 * i) % 31 for i in range(24)]


def test_greedy_choices_are_the_targets_own_and_start_from_one_prefill(tiny_stack: Stack, tiny_target: Path) -> None:
    target = tiny_stack.targets[0]

    def reused() -> float:
        return sample(target, "tandem_prefix_cache_reused_tokens_total")

    before = reused()
    with tiny_stack.client() as client:
        reply = client.generate(PROMPT, max_new_tokens=10, num_speculative_tokens=2, ignore_eos=True, n=3)
    # The prefill computed the prompt once; each choice took all of it but the last token.
    assert reused() - before == 3 * (len(PROMPT) - 1)
    assert len(reply.choices) == 3
    want = greedy_reference(tiny_target, PROMPT, 10)
    assert [list(c.token_ids) for c in reply.choices] == [want] * 3
    assert list(reply.token_ids) == want and reply.text == reply.choices[0].text
    for choice in reply.choices:
        assert choice.usage.completion_tokens == 10 and choice.usage.prompt_tokens == len(PROMPT)


def test_seeded_choices_are_reproducible_and_choice_0_is_the_single_request(tiny_stack: Stack) -> None:
    fields = {"max_new_tokens": 12, "temperature": 1.0, "seed": 7, "num_speculative_tokens": 2,
              "ignore_eos": True}
    with tiny_stack.client() as client:
        first = client.generate(PROMPT, n=4, **fields)  # type: ignore[arg-type]
        again = client.generate(PROMPT, n=4, **fields)  # type: ignore[arg-type]
        single = client.generate(PROMPT, **fields)  # type: ignore[arg-type]
    choices = [list(c.token_ids) for c in first.choices]
    assert choices == [list(c.token_ids) for c in again.choices]
    assert choices[0] == list(single.token_ids)
    assert len({tuple(c) for c in choices}) > 1  # each its own seed


def test_a_stream_tags_each_choice_and_ends_each_with_a_summary(tiny_stack: Stack) -> None:
    from tandem.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

    with grpc.insecure_channel(tiny_stack.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        messages = list(stub.Generate(orchestrator_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, max_new_tokens=6, n=2, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=1.0), seed=3), timeout=60))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    summaries = []
    for m in messages:
        if m.HasField("delta"):
            tokens[m.delta.choice_index] += m.delta.token_ids
        else:
            summaries.append(m.summary.choice_index)
    assert sorted(summaries) == [0, 1] and [len(t) for t in tokens.values()] == [6, 6]


@pytest.mark.parametrize("n", [17, 100])
def test_too_many_choices_are_refused_naming_n(tiny_stack: Stack, n: int) -> None:
    with tiny_stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPT, max_new_tokens=2, n=n)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"n must be in [1, 16] (--max-choices), got {n}" in (err.value.details() or "")
