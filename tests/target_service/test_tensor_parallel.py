"""A target sharded over 2 ranks (torch.distributed, gloo on this CPU), behind the orchestrator.

Exactness: greedy output equals the target's own generate() on two families, at k = 0, 1
and 4, through rollbacks (rejected drafts), Lookahead's tree passes and evictions, all of
which the followers must mirror from rank 0's forward calls alone. Sampling: the chi-square
law test. Faults: a follower killed or stalled mid-request stops its replica (non-zero exit)
and the request moves to another replica or ends UNAVAILABLE before its deadline; rank 0
killed takes its followers with it. Start-up: health stays NOT_SERVING until every rank has
loaded, with ranks started as a launcher would, on an explicit rendezvous. Liveness: a
follower's health turns unhealthy within the timeout once it or its rank 0 is frozen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from laws import ALPHA, PARAMS_ID, T1, TRUNCATED, exact_law, p_value, rows, sample_cells, small_pair
from replicas import FAULT_LENGTH, alive, children, stream_with_fault, wait_for
from tiny import PROMPTS, greedy_reference, make_tokenizer, noisy_copy, save_family, speculated
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.launch import Process, Stack, spawn, start_stack, wait_serving
from tandem.topology import free_port
from tandem.v1 import common_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow  # stacks with two-rank targets: minutes (CI runs it)

TP = ["--tensor-parallel-size", "2"]
LENGTH = 40


def prompt_ids(prompt: str) -> list[int]:
    # Token ids, not text: AutoTokenizer gives a qwen2 model its own tokenizer class, which
    # pre-tokenizes text its way (tests/orchestrator/test_families_through_services.py).
    return list(make_tokenizer().encode(prompt))


def followers(process: Process) -> set[int]:
    """The ranks a local rank 0 started: its child processes."""
    return children(process.proc.pid)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.TargetService"), timeout=5)
    return int(reply.status)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[tuple[Path, Stack]]:
    """(target, a stack whose target is sharded over two ranks) for one model family."""
    classes = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}
    name = request.param
    target = save_family(tiny_dir / f"tp-{name}-target", *classes[name], seed=51)
    draft = noisy_copy(target, tiny_dir / f"tp-{name}-draft", seed=52)
    stack = start_stack(str(draft), str(target), target_args=TP)
    yield target, stack
    stack.stop()


def test_the_target_really_runs_on_two_ranks(family: tuple[Path, Stack]) -> None:
    _, stack = family
    target = stack.targets[0]
    assert len(followers(target)) == 1
    with grpc.insecure_channel(target.address) as ch:
        info = target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(common_pb2.GetModelInfoRequest()).info
    assert "tensor-parallel over 2 ranks" in info.device


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_output_equals_the_target_alone(family: tuple[Path, Stack], k: int) -> None:
    target, stack = family
    prompts = [prompt_ids(p) for p in PROMPTS]
    with stack.client() as client, ThreadPoolExecutor(max_workers=4) as pool:
        if k:  # every step drafted k (no fallback)
            replies = list(pool.map(lambda p: speculated(client, p, LENGTH, k), prompts))
        else:
            replies = [(list(r.token_ids), r.usage) for r in pool.map(
                lambda p: client.generate(p, max_new_tokens=LENGTH, num_speculative_tokens=0,
                                          ignore_eos=True), prompts)]
    for prompt, (tokens, _) in zip(prompts, replies, strict=True):
        assert tokens == greedy_reference(target, prompt, LENGTH)
    if k:
        drafted = sum(usage.drafted_tokens for _, usage in replies)
        accepted = sum(usage.accepted_tokens for _, usage in replies)
        assert 0 < accepted < drafted  # blocks were kept and rolled back


def test_a_later_turn_starts_from_a_kept_prefix_on_every_rank(family: tuple[Path, Stack]) -> None:
    """Rank 0 keeps a finished session's cache and every follower its mirror; the next turn
    starts from a copy of both (Lockstep.fork) and decodes the target's own greedy tokens."""
    target, stack = family
    first = [2 + (5 * i) % 31 for i in range(30)]
    with stack.client() as client:
        reply = client.generate(first, max_new_tokens=8, num_speculative_tokens=2, ignore_eos=True)
        second = [*first, *reply.token_ids, 4]
        for _ in range(50):  # the first turn's session closes just after its reply
            again = client.generate(second, max_new_tokens=8, num_speculative_tokens=2, ignore_eos=True)
            if again.usage.target_cached_tokens:
                break
            time.sleep(0.1)
    assert again.usage.target_cached_tokens >= len(first) + 7
    assert list(again.token_ids) == greedy_reference(target, second, 8)


def test_evicted_sessions_are_rebuilt_on_every_rank(tiny_draft: Path, tiny_target: Path) -> None:
    # Four concurrent sessions of ~50 tokens against a 120-token budget:
    # rank 0 evicts caches, and the followers must drop and rebuild their mirrors with it.
    stack = start_stack(str(tiny_draft), str(tiny_target), target_args=[*TP, "--kv-budget-tokens", "120"])
    try:
        prompts = [prompt_ids(p) for p in PROMPTS]
        with stack.client() as client, ThreadPoolExecutor(max_workers=4) as pool:
            replies = list(pool.map(lambda p: client.generate(
                p, max_new_tokens=LENGTH, num_speculative_tokens=4, ignore_eos=True), prompts))
        for prompt, reply in zip(prompts, replies, strict=True):
            assert list(reply.token_ids) == greedy_reference(tiny_target, prompt, LENGTH)
        assert any("NOT_FOUND" in line and "evicted" in line for line in stack.orchestrator.lines)
    finally:
        stack.stop()


def test_lookahead_on_two_ranks_equals_the_target_alone(family: tuple[Path, Stack]) -> None:
    target, stack = family
    with stack.client() as client:
        for prompt in map(prompt_ids, PROMPTS[:2]):
            reply = client.generate(prompt, max_new_tokens=LENGTH, proposer="lookahead", ignore_eos=True)
            assert list(reply.token_ids) == greedy_reference(target, prompt, LENGTH)


@pytest.fixture(scope="module")
def sharded_small_vocab(tiny_dir: Path) -> Iterator[tuple[Path, Stack]]:
    target, draft = small_pair(tiny_dir / "tp-v6")
    stack = start_stack(str(draft), str(target), target_args=TP)
    yield target, stack
    stack.stop()


@pytest.mark.parametrize("params", [T1, TRUNCATED], ids=PARAMS_ID.get)
def test_sampled_output_follows_the_target_law(sharded_small_vocab: tuple[Path, Stack], params) -> None:  # type: ignore[no-untyped-def]
    target, stack = sharded_small_vocab
    counts, accepted, drafted = sample_cells(stack, params, "draft-model")
    assert 0 < accepted < drafted
    assert p_value(counts, exact_law(rows(target, params))) > ALPHA


# --- Faults -----------------------------------------------------------------------------------


def test_a_follower_killed_mid_request_stops_its_replica_and_the_request_moves(
        tiny_draft: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(str(tiny_draft), str(tiny_target), num_targets=2, target_args=TP)
    try:
        first = stack.targets[0]  # the first session goes to the first replica (least loaded, in order)
        [follower] = followers(first)
        tokens, summary = stream_with_fault(stack, lambda: os.kill(follower, signal.SIGKILL),
                                            num_speculative_tokens=4)
        assert tokens == reference(PROMPTS[0], FAULT_LENGTH)
        assert summary.usage.completion_tokens == FAULT_LENGTH  # type: ignore[attr-defined]
        assert any("lost on target replica" in line for line in stack.orchestrator.lines)
        # The broken replica went NOT_SERVING and exited non-zero (Kubernetes restarts it).
        assert first.proc.wait(timeout=60) != 0
        assert any("tensor-parallel group failed" in line for line in first.lines)
        assert any("draining" in line for line in first.lines)
        with stack.client() as client:
            again = client.generate(PROMPTS[1], max_new_tokens=20, ignore_eos=True)
        assert list(again.token_ids) == reference(PROMPTS[1], 20)
    finally:
        stack.stop()


def test_a_stalled_follower_ends_the_request_unavailable_before_its_deadline(
        tiny_draft: Path, tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(str(tiny_draft), str(tiny_target), target_args=[*TP, "--tp-timeout-s", "4"],
                        orchestrator_args=["--replica-retry-s", "1"])
    target = stack.targets[0]
    [follower] = followers(target)
    try:
        started = time.monotonic()
        tokens, error = stream_with_fault(stack, lambda: os.kill(follower, signal.SIGSTOP),
                                          num_speculative_tokens=4, timeout=60)
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert time.monotonic() - started < 60  # the collective timed out; nothing hung
        assert 0 < len(tokens) < FAULT_LENGTH
        assert tokens == reference(PROMPTS[0], FAULT_LENGTH)[:len(tokens)]
        assert target.proc.wait(timeout=60) != 0
    finally:
        stack.stop()
        if alive(follower):
            os.kill(follower, signal.SIGKILL)


def test_rank_0_killed_takes_its_followers_with_it(tiny_target: Path) -> None:
    target = spawn(["target-service", "--model", str(tiny_target), "--threads", "1", *TP,
                    "--tp-timeout-s", "10"])
    try:
        wait_serving(target)
        [follower] = followers(target)
        target.proc.send_signal(signal.SIGKILL)
        wait_for(lambda: not alive(follower), "the follower exited", timeout=30)
    finally:
        target.stop()


def test_a_clean_stop_stops_every_rank(tiny_target: Path) -> None:
    target = spawn(["target-service", "--model", str(tiny_target), "--threads", "1", *TP])
    wait_serving(target)
    [follower] = followers(target)
    assert target.stop() == 0
    wait_for(lambda: not alive(follower), "the follower exited", timeout=30)


# --- Start-up, with ranks placed as a launcher (torchrun, a StatefulSet) places them ----------


def test_health_stays_not_serving_until_every_rank_has_loaded(tiny_target: Path) -> None:
    master = f"127.0.0.1:{free_port()}"
    ranked = [*TP, "--tp-master", master, "--tp-rank"]
    leader = spawn(["target-service", "--model", str(tiny_target), "--threads", "1", *ranked, "0"])
    follower = None
    try:
        for _ in range(10):  # rank 1 has not started: rank 0 waits for it, NOT_SERVING
            assert health(leader.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.3)
        follower = subprocess.Popen([sys.executable, "-m", "tandem.cli", "target-service", "--model",
                                     str(tiny_target), "--threads", "1", *ranked, "1"])
        wait_serving(leader, timeout=120)
        assert not followers(leader)  # nothing started locally: the launcher placed the ranks
        assert leader.stop() == 0
        assert follower.wait(timeout=30) == 0
    finally:
        leader.stop()
        if follower is not None and follower.poll() is None:
            follower.kill()


def test_ranks_started_by_torchrun_form_one_replica(tiny_target: Path, reference) -> None:  # type: ignore[no-untyped-def]
    # torchrun's agent serves the rendezvous store itself (TORCHELASTIC_USE_AGENT_STORE): every
    # rank joins it as a client. A SIGTERM to the agent reaches both ranks: rank 0 drains, then
    # tells its follower to exit. (The agent itself exits 1 on a signal, by its own design.)
    agent = subprocess.Popen(
        [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port",
         str(free_port()), "-m", "tandem.cli", "target-service", "--model", str(tiny_target),
         "--threads", "1", *TP, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert agent.stdout is not None
        address = next(line.rsplit(" ", 1)[1].strip() for line in agent.stdout if " listening on " in line)
        threading.Thread(target=lambda: lines.extend(agent.stdout or []), daemon=True).start()
        wait_serving(Process(agent, address), timeout=120)  # type: ignore[arg-type]
        stack = start_stack(None, str(tiny_target), num_targets=0, orchestrator_args=["--target", address])
        try:
            with stack.client() as client:
                reply = client.generate(PROMPTS[0], max_new_tokens=20, num_speculative_tokens=0,
                                        ignore_eos=True)
            assert list(reply.token_ids) == reference(PROMPTS[0], 20)
        finally:
            stack.stop()
        ranks = children(agent.pid)
        assert len(ranks) == 2
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        wait_for(lambda: not any(map(alive, ranks)), "both ranks exited", timeout=30)
        assert any("target-service: stopped" in line for line in lines)  # rank 0 drained and stopped
    finally:
        if agent.poll() is None:
            agent.kill()


# --- A follower's liveness, as a kubelet probes it ---------------------------------------------


def liveness(address: str) -> int | None:
    """A follower's health as a liveness probe reads it: its status, or None where it does not
    answer within the probe's timeout."""
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError:
        return None
    return int(reply.status)


@pytest.mark.parametrize("frozen", ["follower", "rank 0"])
def test_a_frozen_rank_turns_the_followers_liveness_unhealthy_within_the_timeout(
        tiny_target: Path, frozen: str) -> None:
    timeout_s = 5
    master, port = f"127.0.0.1:{free_port()}", free_port()
    ranked = [*TP, "--tp-master", master, "--tp-timeout-s", str(timeout_s), "--tp-rank"]
    leader = spawn(["target-service", "--model", str(tiny_target), "--threads", "1", *ranked, "0"])
    follower = subprocess.Popen([sys.executable, "-m", "tandem.cli", "target-service", "--model",
                                 str(tiny_target), "--threads", "1", *ranked, "1", "--port", str(port)])
    address = f"127.0.0.1:{port}"
    SERVING = health_pb2.HealthCheckResponse.SERVING
    try:
        wait_serving(leader, timeout=120)
        # Idle, rank 0's heartbeats keep the follower alive past its timeout.
        deadline = time.monotonic() + 2 * timeout_s
        while time.monotonic() < deadline:
            assert liveness(address) == SERVING
            time.sleep(0.5)
        os.kill(follower.pid if frozen == "follower" else leader.proc.pid, signal.SIGSTOP)
        wait_for(lambda: liveness(address) != SERVING, "the follower's liveness turned unhealthy",
                 timeout=timeout_s + 10)
    finally:
        for pid in (follower.pid, leader.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        follower.kill()
        follower.wait()
        leader.proc.kill()
        leader.stop()
