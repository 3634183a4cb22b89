"""Where a process sits in a tensor-parallel group, and whether a model can be sharded:
what the command line needs before anything loads torch (tandem.parallel runs the group)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


class ParallelError(Exception):
    """A tensor-parallel group cannot be formed as configured, or a model cannot be sharded."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits in its tensor-parallel group."""

    size: int  # ranks in the group
    rank: int
    master_addr: str  # rank 0's rendezvous (a TCPStore)
    master_port: int
    local_rank: int  # which of this machine's GPUs (CUDA)
    spawns_followers: bool  # rank 0 starts ranks 1..size-1 on this machine

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


# Where rank 0's rendezvous store listens when only its host is given (torchrun's default).
DEFAULT_MASTER_PORT = 29500


def topology(size: int, rank: int, master: str, env: Mapping[str, str] = os.environ) -> Topology | None:
    """This process's place, from the flags, else torchrun's variables, else a LeaderWorkerSet's
    (each of its pods one rank: LWS_WORKER_INDEX, the leader's LWS_LEADER_ADDRESS, and
    LWS_GROUP_SIZE, which must be the group size); None: one rank.

    Without a rank from either, this is rank 0 of a group on this machine: it picks a free
    local port and starts the other ranks itself (`spawn_followers`).
    """
    for variable in ("WORLD_SIZE", "LWS_GROUP_SIZE"):
        if variable in env and size > 1 and int(env[variable]) != size:
            raise ParallelError(f"--tensor-parallel-size {size} but the launcher started "
                                f"{variable}={env[variable]} ranks")
    if size <= 1:
        return None
    if rank < 0 and "RANK" in env:
        rank = int(env["RANK"])
    if not master and "MASTER_ADDR" in env:
        master = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', DEFAULT_MASTER_PORT)}"
    in_lws = "LWS_WORKER_INDEX" in env
    if rank < 0 and in_lws:
        rank = int(env["LWS_WORKER_INDEX"])
    if not master and "LWS_LEADER_ADDRESS" in env:
        master = f"{env['LWS_LEADER_ADDRESS']}:{env.get('MASTER_PORT', DEFAULT_MASTER_PORT)}"
    spawns = rank < 0
    if spawns:
        rank, master = 0, f"127.0.0.1:{free_port()}"
    if not 0 <= rank < size:
        raise ParallelError(f"--tp-rank {rank} is outside [0, {size}) for --tensor-parallel-size {size}")
    if not master:
        raise ParallelError(f"rank {rank} of {size} needs rank 0's rendezvous address: "
                            "--tp-master HOST:PORT (or MASTER_ADDR and MASTER_PORT, as torchrun sets)")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise ParallelError(f"--tp-master must be HOST:PORT, got {master!r}")
    # A LeaderWorkerSet's pod holds its own GPU (cuda:0), whatever its rank.
    local_rank = int(env.get("LOCAL_RANK", 0 if in_lws else rank))
    return Topology(size, rank, host, int(port), local_rank, spawns)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_followers(top: Topology, config: Any, label: str) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1..size-1 of a local group: this command again, each with its rank.

    The configuration travels as TANDEM_* variables (every flag has one), so a follower
    loads exactly what rank 0 loads, but on ports of its own; its output goes where rank 0's goes.
    """
    env = dict(os.environ)
    for f in fields(config):
        env[f"TANDEM_{f.name.upper()}"] = str(getattr(config, f.name))
    env["TANDEM_TP_MASTER"] = f"{top.master_addr}:{top.master_port}"
    # Rank 0 holds the service's ports, and watches its own followers: theirs are any free one.
    env["TANDEM_PORT"], env["TANDEM_HEALTH_PORT"] = "0", "-1"
    children = []
    for rank in range(1, top.size):
        env["TANDEM_TP_RANK"] = str(rank)
        env["LOCAL_RANK"] = str(rank)
        children.append(subprocess.Popen([sys.executable, "-m", "tandem.cli", label], env=env))
    return children


def check_shardable(config: Any, size: int) -> None:
    """Refuse, naming the model type, a model that transformers cannot shard `size` ways."""
    text = config.get_text_config()
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    if not getattr(text, "base_model_tp_plan", None):
        raise ParallelError(f"model type {model_type!r} declares no tensor-parallel plan "
                            "(base_model_tp_plan) in transformers; serve it with "
                            "--tensor-parallel-size 1, or split it over devices with --device auto")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads and heads % size:
            raise ParallelError(f"model type {model_type!r} has {name}={heads}, which "
                                f"--tensor-parallel-size {size} does not divide")
