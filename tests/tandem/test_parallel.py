"""Where a process sits in a tensor-parallel group, and which models can be sharded.

The group itself runs in real processes: tests/target_service/test_tensor_parallel.py. Here:
the rule a follower's liveness follows, and the health server that answers with it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny import make_model, make_tokenizer
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, Qwen2Config

from tandem.parallel import Pulse
from tandem.server import serve_liveness
from tandem.topology import ParallelError, check_shardable, topology

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.7",
            "MASTER_PORT": "29400"}


def test_one_rank_is_no_group() -> None:
    assert topology(1, -1, "", {}) is None


def test_without_a_rank_rank_0_starts_the_others_locally() -> None:
    top = topology(2, -1, "", {})
    assert top is not None
    assert (top.rank, top.master_addr, top.spawns_followers, top.is_leader) == (0, "127.0.0.1", True, True)
    assert top.master_port > 0


def test_torchrun_variables_place_the_rank() -> None:
    top = topology(2, -1, "", TORCHRUN)
    assert top is not None
    assert (top.rank, top.local_rank, top.master_addr, top.master_port, top.spawns_followers) == \
        (1, 1, "10.0.0.7", 29400, False)


LWS = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "tandem-target-3.tandem-target.tandem"}


def test_a_leader_worker_sets_variables_place_the_rank() -> None:
    top = topology(2, -1, "", LWS)
    assert top is not None
    assert (top.rank, top.local_rank, top.master_addr, top.master_port, top.spawns_followers) == \
        (1, 0, "tandem-target-3.tandem-target.tandem", 29500, False)
    leader = topology(2, -1, "", {**LWS, "LWS_WORKER_INDEX": "0"})
    assert leader is not None and leader.is_leader and not leader.spawns_followers


def test_flags_override_the_launcher() -> None:
    top = topology(2, 0, "rank0.tandem:29500", TORCHRUN)
    assert top is not None
    assert (top.rank, top.master_addr, top.master_port, top.spawns_followers) == (0, "rank0.tandem", 29500, False)


@pytest.mark.parametrize("size, rank, master, env, message", [
    (4, -1, "", TORCHRUN, "WORLD_SIZE=2"),
    (4, -1, "", LWS, "LWS_GROUP_SIZE=2"),
    (2, 2, "h:1", {}, "outside [0, 2)"),
    (2, 1, "", {}, "--tp-master"),
    (2, 1, "no-port", {}, "HOST:PORT"),
])
def test_a_group_that_cannot_form_is_refused(size: int, rank: int, master: str, env: dict[str, str],
                                             message: str) -> None:
    with pytest.raises(ParallelError, match=message.replace("[", r"\[").replace(")", r"\)")):
        topology(size, rank, master, env)


def test_a_model_without_a_plan_is_refused_by_name() -> None:
    with pytest.raises(ParallelError, match="'gpt2' declares no tensor-parallel plan"):
        check_shardable(GPT2Config(), 2)


def test_heads_must_divide_over_the_ranks() -> None:
    check_shardable(Qwen2Config(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ParallelError, match="num_key_value_heads=2"):
        check_shardable(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 4)


def serve(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.cli", "target-service", "--model", str(model),
                           *args], check=False, capture_output=True, text=True, timeout=120)


def test_the_service_refuses_an_unshardable_model_at_start_up(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    done = serve(tmp_path, "--tensor-parallel-size", "2")
    assert done.returncode != 0
    assert "model type 'gpt2' declares no tensor-parallel plan" in done.stderr
    assert "listening on" not in done.stdout  # refused before the port is announced


def test_the_service_refuses_a_size_the_heads_do_not_divide(tmp_path: Path) -> None:
    done = serve(make_model(tmp_path / "llama", seed=0), "--tensor-parallel-size", "3")
    assert done.returncode != 0
    assert "num_attention_heads=4, which --tensor-parallel-size 3 does not divide" in done.stderr


def test_a_device_map_does_not_combine_with_tensor_parallelism(tmp_path: Path) -> None:
    done = serve(make_model(tmp_path / "llama", seed=0), "--tensor-parallel-size", "2", "--device", "auto")
    assert done.returncode != 0
    assert "does not combine with a device map" in done.stderr


def test_a_pulse_is_alive_until_the_timeout_passes_since_its_last_beat() -> None:
    pulse = Pulse(timeout_s=0.3)
    assert pulse.alive()  # forming and loading: bounded by the start-up timeout instead
    pulse.beat()
    assert pulse.alive()
    time.sleep(0.5)
    assert not pulse.alive()
    pulse.beat()
    assert pulse.alive()


def test_liveness_answers_what_alive_says_at_each_check() -> None:
    alive = [True]
    server, port = serve_liveness("test", "127.0.0.1", 0, lambda: alive[0])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for state, status in ((True, "SERVING"), (False, "NOT_SERVING"), (True, "SERVING")):
                alive[0] = state
                for service in ("", "tandem.v1.TargetService"):
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.ServingStatus.Value(status)
    finally:
        server.stop(0)
