"""TargetService on its own: bad steps get precise statuses, the stream stays usable."""

from __future__ import annotations

import grpc
import pytest

from tandem.launch import Stack
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc


def one_step(stub_method, request):  # type: ignore[no-untyped-def]
    return list(stub_method(iter([request]), timeout=30))


def test_target_scores_a_block(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        [reply] = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            session_id="t", new_token_ids=[5, 6, 7], draft_token_ids=[3, 4],
            draft_distributions=[common_pb2.SparseDistribution(token_ids=[3], probs=[1.0]),
                                 common_pb2.SparseDistribution(token_ids=[4, 5], probs=[0.5, 0.5])]))
    assert len(reply.target_probs) == len(reply.recovered_token_ids) == 2
    assert reply.cache_length == 5


@pytest.mark.parametrize("fields, code, needle", [
    ({"new_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "new_token_ids"),
    ({"new_token_ids": [10_000]}, grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    ({"cache_position": 7}, grpc.StatusCode.OUT_OF_RANGE, "beyond the session's cache length"),
    ({"draft_token_ids": [3, 4]}, grpc.StatusCode.INVALID_ARGUMENT, "one distribution per drafted token"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[4], probs=[1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT, "not in the support"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3], probs=[0.2])]},
     grpc.StatusCode.INVALID_ARGUMENT, "sum to 1"),
    ({"sampling": common_pb2.SamplingParams(top_p=2.0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    # A drafted block whose length disagrees with its probabilities, either way.
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3], probs=[1.0])] * 2},
     grpc.StatusCode.INVALID_ARGUMENT, "one distribution per drafted token"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3, 4], probs=[1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT, "equal, non-zero numbers of token_ids and probs"),
    ({"draft_token_ids": [3] * 65, "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3], probs=[1.0])] * 65},
     grpc.StatusCode.INVALID_ARGUMENT, "at most 64"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3], probs=[float("nan")])]},
     grpc.StatusCode.INVALID_ARGUMENT, "sum to 1"),
    ({"sampling": common_pb2.SamplingParams(temperature=float("nan"))}, grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3, 3], probs=[0.5, 0.5])]},
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids must be distinct"),
    ({"draft_token_ids": [3], "draft_distributions": [common_pb2.SparseDistribution(token_ids=[3, 4], probs=[0.0, 1.0])]},
     grpc.StatusCode.INVALID_ARGUMENT, "has probability 0"),
])
def test_target_rejects_bad_steps(tiny_stack: Stack, fields: dict, code: grpc.StatusCode, needle: str) -> None:  # type: ignore[type-arg]
    request = target_pb2.ScoreBlocksRequest(**{"session_id": "bad", "new_token_ids": [5], **fields})
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            one_step(stub.ScoreBlocks, request)
        assert err.value.code() == code
        assert needle in err.value.details()
        # The replica keeps serving.
        assert one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(new_token_ids=[5]))[0].cache_length == 1


def test_rollback_beyond_the_cache_is_out_of_range(tiny_stack: Stack) -> None:
    """Mid-stream, a step may cut the cache back but never forward past what it holds."""
    steps = [target_pb2.ScoreBlocksRequest(new_token_ids=[5, 6, 7]),
             target_pb2.ScoreBlocksRequest(cache_position=10, new_token_ids=[8])]
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        replies: list[target_pb2.ScoreBlocksResponse] = []
        with pytest.raises(grpc.RpcError) as err:
            replies.extend(stub.ScoreBlocks(iter(steps), timeout=30))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        held = replies[0].cache_length
        assert f"cache_position 10 is beyond the session's cache length {held}" in err.value.details()
        assert one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(new_token_ids=[5]))[0].cache_length >= 1


def test_rollback_then_continue_in_one_stream(tiny_stack: Stack) -> None:
    """Cutting the cache back and re-feeding gives the same scores as a fresh session."""
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        steps = [target_pb2.ScoreBlocksRequest(new_token_ids=[5, 6, 7, 8, 9]),
                 target_pb2.ScoreBlocksRequest(cache_position=2, new_token_ids=[7, 8])]
        _, rolled = list(stub.ScoreBlocks(iter(steps), timeout=30))
        fresh = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(new_token_ids=[5, 6, 7, 8]))[0]
    assert rolled.cache_length == 4
    assert rolled.bonus_token_id == fresh.bonus_token_id
