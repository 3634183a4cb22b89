"""TargetService and DraftService on their own: bad steps get precise statuses, the stream stays usable."""

from __future__ import annotations

import functools

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.launch import Stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


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


@pytest.mark.parametrize("service", ["draft", "target"])
def test_rollback_beyond_the_cache_is_out_of_range(tiny_stack: Stack, service: str) -> None:
    """Mid-stream, a step may cut the cache back but never forward past what it holds."""
    if service == "draft":
        address, stub_class, method = tiny_stack.drafts[0].address, draft_pb2_grpc.DraftServiceStub, "ProposeBlocks"
        make = functools.partial(draft_pb2.ProposeBlocksRequest, num_speculative_tokens=1, max_support_size=2)
    else:
        address, stub_class, method = tiny_stack.targets[0].address, target_pb2_grpc.TargetServiceStub, "ScoreBlocks"
        make = target_pb2.ScoreBlocksRequest
    steps = [make(new_token_ids=[5, 6, 7]), make(cache_position=10, new_token_ids=[8])]
    with grpc.insecure_channel(address) as channel:
        call = getattr(stub_class(channel), method)
        replies: list = []  # type: ignore[type-arg]
        with pytest.raises(grpc.RpcError) as err:
            replies.extend(call(iter(steps), timeout=30))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        held = replies[0].cache_length
        assert f"cache_position 10 is beyond the session's cache length {held}" in err.value.details()
        assert one_step(call, make(new_token_ids=[5]))[0].cache_length >= 1


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


@pytest.mark.parametrize("role", ["drafts", "targets", "orchestrator"])
def test_health_and_reflection(tiny_stack: Stack, role: str) -> None:
    process = tiny_stack.orchestrator if role == "orchestrator" else getattr(tiny_stack, role)[0]
    with grpc.insecure_channel(process.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    expected = {"drafts": "tandem.v1.DraftService", "targets": "tandem.v1.TargetService",
                "orchestrator": "tandem.v1.OrchestratorService"}[role]
    assert {expected, "grpc.health.v1.Health"} <= names
