"""Which replica a lost session is rebuilt on: the cooldown of a failed replica.

The target services are real processes; the pool and the sessions run here, on an event
loop whose clock the test moves: a replica whose session broke (it died, even between two
steps) is avoided for FAILED_COOLDOWN_S and taken again after it; a replica that answered that
it is up but full (RESOURCE_EXHAUSTED) is not avoided, and the session moves to another one.

And a target whose answer is not of the protocol the step spoke is refused, never guessed at.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
from tiny import PROMPTS, make_tokenizer

from orchestrator.domain import EMPTY_BLOCK
from orchestrator.remote import (
    FAILED_COOLDOWN_S,
    TARGET_STUB,
    ReplicaPool,
    TargetSession,
)
from tandem import sampling
from tandem.errors import Unavailable
from tandem.launch import Process, spawn, wait_serving
from tandem.v1 import target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow  # its own target processes, killed and restarted (CI runs it)


class ClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test can move forward (timers only fire earlier)."""

    offset = 0.0

    def time(self) -> float:
        return super().time() + self.offset


def spawn_target(model: Path, *args: str) -> Process:
    process = spawn(["target-service", "--model", str(model), "--threads", "1", *args])
    try:
        wait_serving(process)
    except BaseException:
        process.stop()
        raise
    return process


def test_a_dead_replica_is_avoided_for_the_cooldown_and_a_full_one_is_not(tiny_target: Path) -> None:
    history = make_tokenizer().encode(PROMPTS[0])
    greedy = sampling.SamplingParams()
    target_a = spawn_target(tiny_target, "--max-sessions", "2")
    target_b = spawn_target(tiny_target)
    a, b = target_a.address, target_b.address

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, ClockLoop)
        pool = ReplicaPool([a, b], TARGET_STUB)
        replica_a, replica_b = pool.get(a), pool.get(b)
        assert replica_a is not None and replica_b is not None
        sessions = [TargetSession(pool, name, None) for name in ("first", "second")]
        try:
            # A is full: each new session's first choice (A, listed first) refuses it, so the
            # step moves to B, and A, which is up, is not avoided.
            async with grpc.aio.insecure_channel(a) as channel:
                holders = [TARGET_STUB(channel).ScoreBlocks() for _ in range(2)]
                for holder in holders:
                    await holder.write(target_pb2.ScoreBlocksRequest(
                        new_token_ids=history, draft_proposal=target_pb2.DraftProposal()))
                    await holder.read()
                for session in sessions:
                    await session.score(history, EMPTY_BLOCK, greedy, 1)
                    assert session.replica is replica_b and session.rebuilds == 1
                    session.advance(len(history), len(history))
                assert replica_a.failed_until == 0.0
                for holder in holders:
                    holder.cancel()

            # B dies between two steps. The first session steps at once, before its channel may
            # have seen the loss (the write fails INTERNAL); the second once its stream has
            # ended (the write fails InvalidStateError). Both are rebuilt on A.
            target_b.proc.send_signal(signal.SIGKILL)
            target_b.proc.wait()
            await sessions[0].score(history + [5], EMPTY_BLOCK, greedy, 2)
            stream = sessions[1]._call
            while not stream.done():
                await asyncio.sleep(0.05)
            await sessions[1].score(history + [5], EMPTY_BLOCK, greedy, 2)
            for session in sessions:
                assert session.replica is replica_a and session.rebuilds == 2
            assert replica_b.failed_until == pytest.approx(loop.time() + FAILED_COOLDOWN_S, abs=1.0)

            # During the cooldown, new sessions avoid B though it is the least loaded...
            assert (replica_a.active_sessions, replica_b.active_sessions) == (2, 0)
            assert pool.acquire() is replica_a
            loop.offset += FAILED_COOLDOWN_S - 1.0
            assert pool.acquire() is replica_a
            # ...and after it, B is the least loaded replica again (it may have restarted).
            loop.offset += 2.0
            assert pool.acquire() is replica_b
        finally:
            for session in sessions:
                await session.close()
            await pool.close()

    try:
        with asyncio.Runner(loop_factory=ClockLoop) as runner:
            runner.run(scenario())
    finally:
        target_a.stop()
        target_b.stop()


def test_with_every_replica_cooling_down_the_one_that_failed_first_is_tried() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, ClockLoop)
        pool = ReplicaPool(["127.0.0.1:1", "127.0.0.1:2"], TARGET_STUB)  # never dialled
        first, second = pool.replicas
        pool.mark_failed(first)
        loop.offset += 1.0
        pool.mark_failed(second)
        assert not pool.healthy
        held = pool.acquire()
        assert held is first
        loop.offset += FAILED_COOLDOWN_S - 0.5
        assert pool.healthy and pool.acquire() is first  # its cooldown is over, the other's is not
        pool.release(held)
        await pool.close()

    with asyncio.Runner(loop_factory=ClockLoop) as runner:
        runner.run(scenario())



class OtherProtocolTarget(target_pb2_grpc.TargetServiceServicer):  # type: ignore[misc]
    """Answers every step with `answer`, whatever the step asked. A real target cannot be
    made to: this stands for one of another version (one older than the oneof sends neither)."""

    def __init__(self, answer: target_pb2.ScoreBlocksResponse) -> None:
        self.answer = answer

    async def ScoreBlocks(self, requests: Any, context: Any) -> Any:
        async for _ in requests:
            yield self.answer


TREE = target_pb2.ScoreBlocksResponse(cache_length=1, verified_tree=target_pb2.VerifiedTree(
    committed_token_ids=[5], proposed_token_count=3))
SCORES = target_pb2.ScoreBlocksResponse(cache_length=1, block_scores=target_pb2.BlockScores(
    bonus_token_id=5))


@pytest.mark.parametrize("proposer, answer, refusal", [
    ("", TREE, "answered a draft_proposal step with verified_tree"),
    ("", target_pb2.ScoreBlocksResponse(cache_length=1), "answered a draft_proposal step with no result"),
    ("lookahead", SCORES, "answered a target_proposal step with block_scores"),
])
def test_an_answer_of_the_other_protocol_is_refused(proposer: str, answer: target_pb2.ScoreBlocksResponse,
                                                    refusal: str) -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(OtherProtocolTarget(answer), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ReplicaPool([f"127.0.0.1:{port}"], TARGET_STUB)
        session = TargetSession(pool, "s", None, proposer=proposer)
        try:
            with pytest.raises(Unavailable, match=refusal):
                await session.score([5], EMPTY_BLOCK, sampling.SamplingParams(), 1)
        finally:
            await session.close()
            await pool.close()
            await server.stop(None)

    asyncio.run(scenario())
