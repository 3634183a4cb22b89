"""DraftService on its own: bad steps get precise statuses, the stream stays usable."""

from __future__ import annotations

import grpc
import pytest

from tandem.launch import Stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc


def one_step(stub_method, request):  # type: ignore[no-untyped-def]
    return list(stub_method(iter([request]), timeout=30))


@pytest.mark.parametrize("fields, code, needle", [
    ({"new_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "new_token_ids"),
    ({"new_token_ids": [-1]}, grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    # A fresh stream is a fresh session: a step that assumes cached tokens names an unknown
    # session, as far as this replica can tell, and gets the cache-mismatch status.
    ({"cache_position": 3}, grpc.StatusCode.OUT_OF_RANGE, "beyond the session's cache length 0"),
    ({"num_speculative_tokens": 65}, grpc.StatusCode.INVALID_ARGUMENT, "num_speculative_tokens must be in [0, 64]"),
    ({"max_support_size": 1025}, grpc.StatusCode.INVALID_ARGUMENT, "max_support_size must be in [1, 1024]"),
    ({"sampling": common_pb2.SamplingParams(top_p=-1.0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
])
def test_draft_rejects_bad_steps(tiny_stack: Stack, fields: dict, code: grpc.StatusCode, needle: str) -> None:  # type: ignore[type-arg]
    request = draft_pb2.ProposeBlocksRequest(**{"new_token_ids": [5], "num_speculative_tokens": 2,
                                                "max_support_size": 4, **fields})
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            one_step(stub.ProposeBlocks, request)
        assert err.value.code() == code
        assert needle in err.value.details()
        [reply] = one_step(stub.ProposeBlocks, draft_pb2.ProposeBlocksRequest(
            new_token_ids=[5], num_speculative_tokens=2, max_support_size=4))
        assert len(reply.token_ids) == 2


def test_draft_reports_the_distribution_it_sampled_from(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        [reply] = one_step(stub.ProposeBlocks, draft_pb2.ProposeBlocksRequest(
            new_token_ids=[5, 6], num_speculative_tokens=3, max_support_size=4, seed=1,
            sampling=common_pb2.SamplingParams(temperature=1.0)))
        with pytest.raises(grpc.RpcError) as err:
            one_step(stub.ProposeBlocks, draft_pb2.ProposeBlocksRequest(
                new_token_ids=[5], num_speculative_tokens=3, max_support_size=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(reply.token_ids) == len(reply.distributions) == 3
    for token, dist in zip(reply.token_ids, reply.distributions):
        assert token in dist.token_ids and len(dist.token_ids) <= 4
        assert abs(sum(dist.probs) - 1.0) < 1e-5
    assert reply.cache_length == 2 + 3 - 1  # the last drafted token is not fed back


def test_rollback_beyond_the_cache_is_out_of_range(tiny_stack: Stack) -> None:
    """Mid-stream, a step may cut the cache back but never forward past what it holds."""
    def step(**fields: object) -> draft_pb2.ProposeBlocksRequest:
        return draft_pb2.ProposeBlocksRequest(num_speculative_tokens=1, max_support_size=2, **fields)

    steps = [step(new_token_ids=[5, 6, 7]), step(cache_position=10, new_token_ids=[8])]
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        replies: list[draft_pb2.ProposeBlocksResponse] = []
        with pytest.raises(grpc.RpcError) as err:
            replies.extend(stub.ProposeBlocks(iter(steps), timeout=30))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        held = replies[0].cache_length
        assert f"cache_position 10 is beyond the session's cache length {held}" in err.value.details()
        assert one_step(stub.ProposeBlocks, step(new_token_ids=[5]))[0].cache_length >= 1
