"""A KV-budgeted replica: a refused request costs no other session its cache.

Each case holds a victim session open on a replica whose budget the victim nearly fills,
sends one bad request on another stream, and then steps the victim again: it must
continue from its cache (an evicted one would get NOT_FOUND).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.launch import Process, spawn, wait_serving
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

BUDGET, VICTIM = 100, 80


@pytest.fixture(scope="module")
def budgeted(tiny_target: Path) -> Iterator[dict[str, Process]]:
    common = ["--model", str(tiny_target), "--dtype", "float32", "--threads", "1",
              "--kv-budget-tokens", str(BUDGET), "--lookahead", "5,3,5"]
    procs = {"draft": spawn(["draft-service", *common]), "target": spawn(["target-service", *common])}
    try:
        for p in procs.values():
            wait_serving(p)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _draft(**fields: Any) -> draft_pb2.ProposeBlocksRequest:
    return draft_pb2.ProposeBlocksRequest(**{"num_speculative_tokens": 1, "max_support_size": 4, **fields})


def _target(**fields: Any) -> target_pb2.ScoreBlocksRequest:
    return target_pb2.ScoreBlocksRequest(**{"draft_proposal": target_pb2.DraftProposal(), **fields})


CASES = {
    "draft": (draft_pb2_grpc.DraftServiceStub, "ProposeBlocks", _draft, [
        (_draft(new_token_ids=[5], num_speculative_tokens=65), grpc.StatusCode.INVALID_ARGUMENT,
         "num_speculative_tokens must be in [0, 64]"),
        (_draft(new_token_ids=[5], num_speculative_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT,
         "num_speculative_tokens must be in [0, 64]"),
        (_draft(new_token_ids=[5], max_support_size=0, num_speculative_tokens=30),
         grpc.StatusCode.INVALID_ARGUMENT, "max_support_size"),
        (_draft(cache_position=5000, new_token_ids=[5]), grpc.StatusCode.OUT_OF_RANGE,
         "beyond the session's cache length 0"),
    ]),
    "target": (target_pb2_grpc.TargetServiceStub, "ScoreBlocks", _target, [
        (_target(new_token_ids=[5], draft_proposal=target_pb2.DraftProposal(
            token_ids=[3] * 40,
            distributions=[common_pb2.SparseDistribution(token_ids=[4], probs=[1.0])] * 40)),
         grpc.StatusCode.INVALID_ARGUMENT, "not in the support"),
        (_target(cache_position=5000, new_token_ids=[5]),
         grpc.StatusCode.OUT_OF_RANGE, "beyond the session's cache length 0"),
        (_target(new_token_ids=[5], sampling=common_pb2.SamplingParams(top_p=2.0),
                 draft_proposal=target_pb2.DraftProposal(
                     token_ids=[3] * 30,
                     distributions=[common_pb2.SparseDistribution(token_ids=[3], probs=[1.0])] * 30)),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ]),
}


@pytest.mark.parametrize("case", [(service, i) for service, (_, _, _, bad) in CASES.items()
                                  for i in range(len(bad))], ids=str)
def test_a_bad_request_evicts_no_other_session(budgeted: dict[str, Process], case: tuple[str, int]) -> None:
    service, i = case
    stub_class, method, make, bad = CASES[service]
    request, code, needle = bad[i]
    with grpc.insecure_channel(budgeted[service].address) as channel:
        call = getattr(stub_class(channel), method)
        victim: queue.Queue[Any] = queue.Queue()
        replies = call(iter(victim.get, None), timeout=60)
        victim.put(make(new_token_ids=[3 + i % 30 for i in range(VICTIM)]))
        assert next(replies).cache_length >= VICTIM
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([request]), timeout=30))
        assert err.value.code() == code
        assert needle in err.value.details()
        victim.put(make(cache_position=VICTIM, new_token_ids=[5]))
        assert next(replies).cache_length >= VICTIM + 1  # its cache is still there
        victim.put(None)
        list(replies)


def test_a_target_proposer_reserves_its_segment_not_a_fixed_block(budgeted: dict[str, Process]) -> None:
    """Lookahead W,N,G = 5,3,5 scores at most 4 + 5 + 5 * 2 = 19 tokens after the history, so a
    78-token history fits a 100-token budget (the old fixed 64-token reservation refused it)."""
    with grpc.insecure_channel(budgeted["target"].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        [reply] = list(stub.ScoreBlocks(iter([target_pb2.ScoreBlocksRequest(
            new_token_ids=[3 + i % 30 for i in range(78)], target_proposal=target_pb2.TargetProposal(
                proposer=common_pb2.PROPOSER_LOOKAHEAD))]),
            timeout=60))
    assert reply.cache_length == 78 and len(reply.verified_tree.committed_token_ids) >= 1
