"""TargetService on its own: each proposal gets its kind of result, bad steps get precise
statuses, the stream stays usable."""

from __future__ import annotations

import queue
from pathlib import Path

import grpc
import pytest
from tiny import greedy_reference

from tandem.launch import Stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service.scorer import RUN_STRETCH

PLAIN = target_pb2.DraftProposal()  # a plain target step: nothing proposed


def one_step(stub_method, request):  # type: ignore[no-untyped-def]
    return list(stub_method(iter([request]), timeout=30))


def dist(token_ids: list[int], probs: list[float]) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=token_ids, probs=probs)


def drafted(token_ids: list[int], *dists: common_pb2.SparseDistribution) -> dict[str, object]:
    return {"draft_proposal": target_pb2.DraftProposal(token_ids=token_ids, distributions=dists)}


def test_target_scores_a_block(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        [reply] = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            session_id="t", new_token_ids=[5, 6, 7],
            **drafted([3, 4], dist([3], [1.0]), dist([4, 5], [0.5, 0.5]))))  # type: ignore[arg-type]
    assert reply.WhichOneof("result") == "block_scores"
    assert len(reply.block_scores.target_probs) == len(reply.block_scores.recovered_token_ids) == 2
    assert reply.cache_length == 5


def test_each_proposal_gets_its_own_kind_of_result(tiny_stack: Stack) -> None:
    """A plain step is a draft proposal with no tokens: block scores with only a bonus token.
    A proposer the target runs (Lookahead, on by default) gets the tree it verified."""
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        [plain] = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            new_token_ids=[5, 6, 7], draft_proposal=PLAIN))
        [tree] = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            new_token_ids=[5, 6, 7], target_proposal=target_pb2.TargetProposal(
                proposer=common_pb2.PROPOSER_LOOKAHEAD)))
    assert plain.WhichOneof("result") == "block_scores"
    assert list(plain.block_scores.target_probs) == list(plain.block_scores.recovered_token_ids) == []
    assert tree.WhichOneof("result") == "verified_tree"
    # The first Lookahead step only fills its window: a plain step, one token committed.
    assert [plain.block_scores.bonus_token_id] == list(tree.verified_tree.committed_token_ids)


@pytest.mark.parametrize("fields, code, needle", [
    ({"new_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "new_token_ids"),
    ({"new_token_ids": [10_000]}, grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    ({"cache_position": 7}, grpc.StatusCode.OUT_OF_RANGE, "beyond the session's cache length"),
    (drafted([3, 4]), grpc.StatusCode.INVALID_ARGUMENT, "one distribution per drafted token"),
    (drafted([3], dist([4], [1.0])), grpc.StatusCode.INVALID_ARGUMENT, "not in the support"),
    (drafted([3], dist([3], [0.2])), grpc.StatusCode.INVALID_ARGUMENT, "sum to 1"),
    ({"sampling": common_pb2.SamplingParams(top_p=2.0)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    # A drafted block whose length disagrees with its probabilities, either way.
    (drafted([3], dist([3], [1.0]), dist([3], [1.0])), grpc.StatusCode.INVALID_ARGUMENT,
     "one distribution per drafted token"),
    (drafted([3], dist([3, 4], [1.0])), grpc.StatusCode.INVALID_ARGUMENT,
     "equal, non-zero numbers of token_ids and probs"),
    (drafted([3] * 65, *[dist([3], [1.0])] * 65), grpc.StatusCode.INVALID_ARGUMENT, "at most 64"),
    (drafted([3], dist([3], [float("nan")])), grpc.StatusCode.INVALID_ARGUMENT, "sum to 1"),
    ({"sampling": common_pb2.SamplingParams(temperature=float("nan"))}, grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    (drafted([3], dist([3, 3], [0.5, 0.5])), grpc.StatusCode.INVALID_ARGUMENT, "token_ids must be distinct"),
    (drafted([3], dist([3, 4], [0.0, 1.0])), grpc.StatusCode.INVALID_ARGUMENT, "has probability 0"),
    # A decode run that cannot be run as asked.
    ({"decode_run": target_pb2.DecodeRun(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT,
     "decode_run.max_tokens must be at least 1"),
    ({"decode_run": target_pb2.DecodeRun(max_tokens=1_000_000)}, grpc.StatusCode.INVALID_ARGUMENT,
     "passes the model's context"),
    ({"decode_run": target_pb2.DecodeRun(max_tokens=2, stop_token_ids=[10_000])},
     grpc.StatusCode.INVALID_ARGUMENT, "decode_run.stop_token_ids"),
    ({"decode_run": target_pb2.DecodeRun(max_tokens=2, stop_token_ids=[3] * 65)},
     grpc.StatusCode.INVALID_ARGUMENT, "at most 64"),
    # Neither protocol: refused, never read as a plain step.
    ({"draft_proposal": None}, grpc.StatusCode.INVALID_ARGUMENT, "sets no proposal"),
    ({"target_proposal": target_pb2.TargetProposal()}, grpc.StatusCode.INVALID_ARGUMENT,
     "is not run by this replica"),
    ({"target_proposal": target_pb2.TargetProposal(proposer=common_pb2.PROPOSER_MEDUSA)},
     grpc.StatusCode.INVALID_ARGUMENT, "is not run by this replica (it runs: PROPOSER_LOOKAHEAD)"),
])
def test_target_rejects_bad_steps(tiny_stack: Stack, fields: dict, code: grpc.StatusCode, needle: str) -> None:  # type: ignore[type-arg]
    proposal = {} if {"draft_proposal", "target_proposal", "decode_run"} & fields.keys() else {"draft_proposal": PLAIN}
    request = target_pb2.ScoreBlocksRequest(**{"session_id": "bad", "new_token_ids": [5], **proposal, **fields})
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            one_step(stub.ScoreBlocks, request)
        assert err.value.code() == code
        assert needle in err.value.details()
        # The replica keeps serving.
        assert one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            new_token_ids=[5], draft_proposal=PLAIN))[0].cache_length == 1


def test_rollback_beyond_the_cache_is_out_of_range(tiny_stack: Stack) -> None:
    """Mid-stream, a step may cut the cache back but never forward past what it holds."""
    steps = [target_pb2.ScoreBlocksRequest(new_token_ids=[5, 6, 7], draft_proposal=PLAIN),
             target_pb2.ScoreBlocksRequest(cache_position=10, new_token_ids=[8], draft_proposal=PLAIN)]
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        replies: list[target_pb2.ScoreBlocksResponse] = []
        with pytest.raises(grpc.RpcError) as err:
            replies.extend(stub.ScoreBlocks(iter(steps), timeout=30))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        held = replies[0].cache_length
        assert f"cache_position 10 is beyond the session's cache length {held}" in err.value.details()
        assert one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            new_token_ids=[5], draft_proposal=PLAIN))[0].cache_length >= 1


def test_rollback_then_continue_in_one_stream(tiny_stack: Stack) -> None:
    """Cutting the cache back and re-feeding gives the same scores as a fresh session."""
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        steps = [target_pb2.ScoreBlocksRequest(new_token_ids=[5, 6, 7, 8, 9], draft_proposal=PLAIN),
                 target_pb2.ScoreBlocksRequest(cache_position=2, new_token_ids=[7, 8],
                                               draft_proposal=PLAIN)]
        _, rolled = list(stub.ScoreBlocks(iter(steps), timeout=30))
        fresh = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
            new_token_ids=[5, 6, 7, 8], draft_proposal=PLAIN))[0]
    assert rolled.cache_length == 4
    assert rolled.block_scores.bonus_token_id == fresh.block_scores.bonus_token_id


def run(new_token_ids: list[int], max_tokens: int, *, cache_position: int = 0, seed: int = 0,
        temperature: float = 0.0, stops: tuple[int, ...] = ()) -> target_pb2.ScoreBlocksRequest:
    return target_pb2.ScoreBlocksRequest(
        session_id="run", cache_position=cache_position, new_token_ids=new_token_ids, seed=seed,
        sampling=common_pb2.SamplingParams(temperature=temperature),
        decode_run=target_pb2.DecodeRun(max_tokens=max_tokens, stop_token_ids=stops))


@pytest.mark.parametrize("length", [6, 2 * RUN_STRETCH + 5])
def test_a_decode_run_answers_each_token_as_a_plain_step_would(tiny_stack: Stack, length: int) -> None:
    """Greedy: a run of n tokens is n plain steps' bonus tokens, one response each, each with
    the cache as that step would leave it, across the stretches it claims KV room in."""
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        history = [5, 6, 7]
        for _ in range(length):
            [step] = one_step(stub.ScoreBlocks, target_pb2.ScoreBlocksRequest(
                new_token_ids=history, draft_proposal=PLAIN))
            history.append(step.block_scores.bonus_token_id)
        answers = one_step(stub.ScoreBlocks, run([5, 6, 7], length))
        stop = history[3 + min(length - 2, RUN_STRETCH + 2)]  # in the second stretch, if any
        stopped = one_step(stub.ScoreBlocks, run([5, 6, 7], length, stops=(stop,)))
    assert [a.block_scores.bonus_token_id for a in answers] == history[3:]
    assert [a.cache_length for a in answers] == list(range(3, 3 + length))
    assert [a.block_scores.bonus_token_id for a in stopped] == history[3:history.index(stop, 3) + 1]


def test_a_resent_run_draws_the_same_tokens(tiny_stack: Stack) -> None:
    """Each token is drawn with randomness keyed by (seed, position): a run resent from part
    way, in the same stream or on a fresh one (a rebuilt session), draws what the first did."""
    prompt = [5, 6, 7]
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)

        def tokens(answers: list[target_pb2.ScoreBlocksResponse]) -> list[int]:
            return [a.block_scores.bonus_token_id for a in answers]

        first = tokens(one_step(stub.ScoreBlocks, run(prompt, 8, seed=11, temperature=1.0)))
        fresh = tokens(one_step(stub.ScoreBlocks, run(prompt + first[:3], 5, seed=11, temperature=1.0)))
        again = list(stub.ScoreBlocks(iter([
            run(prompt, 4, seed=11, temperature=1.0),
            run(first[1:2], 5, cache_position=len(prompt) + 1, seed=11, temperature=1.0)]), timeout=30))
        other = tokens(one_step(stub.ScoreBlocks, run(prompt, 8, seed=12, temperature=1.0)))
    assert fresh == first[3:]
    assert tokens(again) == first[:4] + first[2:7]
    assert other != first  # the seed matters


def test_a_run_ends_after_its_first_stop_token(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.targets[0].address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        free = [a.block_scores.bonus_token_id for a in one_step(stub.ScoreBlocks, run([5, 6, 7], 8))]
        stop = free[3]
        stopped = [a.block_scores.bonus_token_id
                   for a in one_step(stub.ScoreBlocks, run([5, 6, 7], 8, stops=(stop,)))]
        # The stream goes on after a run: the next step continues the session.
        after = list(stub.ScoreBlocks(iter([run([5, 6, 7], 2), run([free[1]], 1, cache_position=4)]), timeout=30))
    assert stopped == free[:free.index(stop) + 1]
    assert [a.block_scores.bonus_token_id for a in after] == free[:3]


def test_a_session_starts_from_what_a_live_session_holds(tiny_stack: Stack, tiny_target: Path,
                                                       tiny_draft: Path) -> None:
    """While one stream's session is open between steps, another whose history starts with it
    is copied from it, on both tiers (nothing is kept yet: the first is still live), and
    computes what a cold session computes."""
    history = [2 + (11 * i) % 31 for i in range(24)]  # a history no other test sends
    longer = [*history, 9, 8, 7]
    steps = {"target": lambda ids: target_pb2.ScoreBlocksRequest(new_token_ids=ids, draft_proposal=PLAIN),
             "draft": lambda ids: draft_pb2.ProposeBlocksRequest(new_token_ids=ids, num_speculative_tokens=2,
                                                                 max_support_size=4)}
    with grpc.insecure_channel(tiny_stack.targets[0].address) as target, \
            grpc.insecure_channel(tiny_stack.drafts[0].address) as draft:
        calls = {"target": target_pb2_grpc.TargetServiceStub(target).ScoreBlocks,
                 "draft": draft_pb2_grpc.DraftServiceStub(draft).ProposeBlocks}
        copied = {}
        for tier, call in calls.items():
            opened: queue.Queue[object] = queue.Queue()
            live = call(iter(opened.get, None), timeout=30)
            opened.put(steps[tier](history))
            next(live)  # its session holds the history now, and stays open
            [copied[tier]] = one_step(call, steps[tier](longer))
            opened.put(None)
            assert list(live) == []
    assert copied["target"].cached_token_count == len(history)
    assert copied["target"].block_scores.bonus_token_id == greedy_reference(tiny_target, longer, 1)[0]
    assert copied["draft"].cached_token_count >= len(history)  # and the token it drafted, if 9
    assert list(copied["draft"].token_ids) == greedy_reference(tiny_draft, longer, 2)
