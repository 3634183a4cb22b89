"""Drafting ahead on the draft service, driven directly: a block drafted ahead (a hit) is the
block a fresh draft gives for the same history and seed, and so is a miss's.

The draft keys the draw at absolute position p by (seed, p): a block depends on the history
alone, whichever stream, step or timing produced it.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from tandem.launch import Stack
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROMPT = [5, 9, 11, 7, 4, 13]
K, SUPPORT, SEED = 4, 6, 1234
SAMPLED = common_pb2.SamplingParams(temperature=1.0)


class Stream:
    """One session on the draft: send a step, read its reply."""

    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub) -> None:
        self.requests: queue.Queue[draft_pb2.ProposeBlocksRequest | None] = queue.Queue()
        self.replies = stub.ProposeBlocks(self._iterate(), timeout=60)

    def _iterate(self) -> Iterator[draft_pb2.ProposeBlocksRequest]:
        while (request := self.requests.get()) is not None:
            yield request

    def step(self, cache_position: int, new: list[int], k: int = K, ahead: int = 0
             ) -> draft_pb2.ProposeBlocksResponse:
        self.requests.put(draft_pb2.ProposeBlocksRequest(
            cache_position=cache_position, new_token_ids=new, num_speculative_tokens=k,
            max_support_size=SUPPORT, sampling=SAMPLED, seed=SEED, draft_ahead_tokens=ahead))
        return next(self.replies)

    def close(self) -> None:
        self.requests.put(None)
        list(self.replies)


def fresh(stub: draft_pb2_grpc.DraftServiceStub, history: list[int], k: int = K) -> draft_pb2.ProposeBlocksResponse:
    stream = Stream(stub)
    try:
        return stream.step(0, history, k)
    finally:
        stream.close()


def same_block(got: draft_pb2.ProposeBlocksResponse, want: draft_pb2.ProposeBlocksResponse) -> None:
    assert list(got.token_ids) == list(want.token_ids)
    for a, b in zip(got.distributions, want.distributions, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        # Computed in other passes (a 2-token pass against two 1-token ones): float rounding.
        assert list(a.probs) == pytest.approx(list(b.probs), abs=1e-5)


def drafted_ahead(stub: draft_pb2_grpc.DraftServiceStub, accepted: int,
                  outcome: Callable[[draft_pb2.ProposeBlocksResponse], int], want_hit: bool) -> None:
    """A step, then the next one after `accepted` of its block and the target's token
    `outcome(first reply)`, as the orchestrator sends it; that block is a fresh draft's."""
    stream = Stream(stub)
    try:
        first = stream.step(0, PROMPT, ahead=K)
        assert first.prebuilt_tokens == 0 and first.cache_length == len(PROMPT) + K - 1
        history = PROMPT + list(first.token_ids[:accepted]) + [outcome(first)]
        synced = min(first.cache_length, len(PROMPT) + accepted)
        # Give the draft time to draft ahead (a tiny model: milliseconds); should it not
        # have finished, the step takes what is there and drafts the rest, the same block.
        deadline = time.monotonic() + 30
        while True:
            time.sleep(0.5)
            second = stream.step(synced, history[synced:])
            if not want_hit or second.prebuilt_tokens == K or time.monotonic() > deadline:
                break
            first = stream.step(0, PROMPT, ahead=K)  # not ready yet: again, from the start
        assert second.ahead_hit == want_hit
        assert second.prebuilt_tokens == (K if want_hit else 0)
        same_block(second, fresh(stub, history))
        assert second.cache_length == len(history) + K - 1
        # The next step, after the whole block and a bonus token: the cache caught up.
        after = history + list(second.token_ids) + [3]
        third = stream.step(second.cache_length, after[second.cache_length:], k=2)
        same_block(third, fresh(stub, after, 2))
    finally:
        stream.close()


def test_a_block_depends_on_the_history_and_seed_alone(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        long = fresh(stub, PROMPT, K + 1)
        short = fresh(stub, PROMPT, K)
        # The first K draws of a longer block are the shorter block: keyed by position.
        assert list(long.token_ids[:K]) == list(short.token_ids)


def test_a_hit_on_full_acceptance_gives_the_block_a_fresh_draft_gives(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        # The draft's guess for the bonus token: its most likely token after the block.
        guess = fresh(stub, PROMPT, K + 1).distributions[K].token_ids[0]
        drafted_ahead(stub, K, lambda first: guess, want_hit=True)


@pytest.mark.parametrize("accepted", [0, 2])
def test_a_hit_on_a_rejection_gives_the_block_a_fresh_draft_gives(tiny_stack: Stack, accepted: int) -> None:
    def recovered(first: draft_pb2.ProposeBlocksResponse) -> int:
        # The draft's guess for the target's token where it rejects x: q's most likely other token.
        q = first.distributions[accepted]
        return next(t for t in q.token_ids if t != first.token_ids[accepted])

    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        drafted_ahead(draft_pb2_grpc.DraftServiceStub(channel), accepted, recovered, want_hit=True)


def test_a_miss_gives_the_block_a_fresh_draft_gives(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        first = fresh(stub, PROMPT, K + 1)
        unguessed = next(t for t in range(3, 30) if t not in first.distributions[K].token_ids[:1])
        drafted_ahead(stub, K, lambda _: unguessed, want_hit=False)


def test_a_step_cannot_claim_tokens_it_was_never_told_of(tiny_stack: Stack) -> None:
    """The cache holds the tail drafted ahead, but the client was told of n + k - 1 tokens."""
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stream = Stream(draft_pb2_grpc.DraftServiceStub(channel))
        first = stream.step(0, PROMPT, ahead=K)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:
            stream.step(first.cache_length + 2, [3])
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert f"beyond the session's cache length {first.cache_length}" in err.value.details()


def test_draft_ahead_tokens_is_bounded(tiny_stack: Stack) -> None:
    with grpc.insecure_channel(tiny_stack.drafts[0].address) as channel:
        stream = Stream(draft_pb2_grpc.DraftServiceStub(channel))
        with pytest.raises(grpc.RpcError) as err:
            stream.step(0, PROMPT, ahead=65)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_ahead_tokens must be in [0, 64], got 65" in err.value.details()
