"""Tensor parallelism: one model sharded over N ranks with torch.distributed, served by rank 0.

transformers shards a model that declares a plan (`base_model_tp_plan`) when it is loaded
inside a process group (`DistributedConfig(tp_plan="auto")`): attention heads and MLP
columns split over the ranks, and every layer ends in an all-reduce, so the hidden states
and the logits are whole on every rank. The collectives inside a forward only meet if
every rank makes the same forward call at the same time, in the same order.

Rank 0 is the service: gRPC, health, metrics, sessions, sampling and scoring. Its model is
wrapped in a `Lockstep`, which sends each forward call's inputs to the other ranks before
making it: the ids and positions, which session caches the call extends (one, or a batched
pass's several) with the length each had before it, and a batched pass's layout (each
session's lengths and tree, `lm.Layout`), from which every rank builds its own masks. Every other rank runs `follow`: it receives each call and makes the
same one on its shard, against its own mirror of that cache, cut back to the same length
first. That is the whole protocol: rollbacks need no message of their own, since the next
call names the length, and a mirror dies with rank 0's cache (a weakref finalizer queues
its key, sent with the next message). A copy of a cache's prefix (a session started from the
prefix cache, `Lockstep.fork`) is queued the same way, and every rank makes the same copy of
its mirror before the next call, which is the first that can name the copy. Control messages
travel on a gloo group of their own (on CUDA the model's collectives run on NCCL), and rank 0
sends a heartbeat when idle.

Failure: every collective is bounded by `tp_timeout_s`. A rank that dies breaks its
connections at once; one that stalls times out. Rank 0 then refuses every later step
(UNAVAILABLE), turns NOT_SERVING and exits non-zero (`ModelHost.failure`), so that
Kubernetes restarts the group; a follower that loses rank 0 exits non-zero too. A follower
also answers gRPC health for a liveness probe (`Pulse`): NOT_SERVING once rank 0 has not
reached it within `tp_timeout_s`, so a hung rank is found even where no collective times out.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache

from tandem.errors import Unavailable
from tandem.kv import fork_cache
from tandem.lm import BATCH_KWARGS, BatchCache, Layout
from tandem.topology import ParallelError, Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheUse:
    """One session cache a forward call extends."""

    key: int  # rank 0's cache
    length: int  # what it held before the call


@dataclass(frozen=True)
class Call:
    """One forward call of rank 0, as the other ranks repeat it."""

    kwargs: dict[str, Any]  # every argument but the cache (and a batched call's own); tensors on the CPU
    caches: tuple[CacheUse, ...]  # none, one session's, or a batched pass's in order
    layout: Layout | None = None  # a batched pass's: each rank builds its masks from it


@dataclass(frozen=True)
class Fork:
    """A cache rank 0 made from the first `length` tokens of another (tandem.kv.fork_cache)."""

    key: int  # the copy's
    source: int  # the cache it copies
    length: int


@dataclass(frozen=True)
class Message:
    frees: tuple[int, ...]  # cache keys rank 0 has dropped since the last message
    forks: tuple[Fork, ...] = ()  # copies rank 0 made since the last message, made before the frees
    call: Call | None = None  # None: a heartbeat
    stop: bool = False  # rank 0 is stopping: exit cleanly


class Group:
    """The process group of one replica: rendezvous, the control channel, and its bounds."""

    def __init__(self, top: Topology, device: str, timeout_s: float, start_timeout_s: float,
                 identity: str) -> None:
        """Join the group. `identity` names what every rank must load alike (model, dtype,
        size): a rank that disagrees with rank 0 (say, half a rolling update) is refused."""
        self.top = top
        self.timeout_s = timeout_s
        self.device = device
        backend = "nccl" if device.startswith("cuda") else "gloo"
        # Rendezvous on a store with the long start-up bound: ranks on other machines may
        # start minutes apart (image pulls, scheduling). Collectives get the short one.
        # Under torchrun its agent already serves the store at MASTER_PORT: every rank is a client.
        serves_store = top.is_leader and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        started = time.monotonic()
        self.store: Any = dist.TCPStore(  # type: ignore[attr-defined]
            top.master_addr, top.master_port, top.size, serves_store,
            timeout=datetime.timedelta(seconds=start_timeout_s))
        # torchrun's store outlives a restart of the group: keys are per attempt.
        self.prefix = f"tandem/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        if top.is_leader:
            self.store.set(self.prefix + "identity", identity)
        elif (leader := self.store.get(self.prefix + "identity").decode()) != identity:
            raise ParallelError(f"rank {top.rank} loads {identity} but rank 0 loads {leader}: every "
                                "rank of a group needs the same model, dtype and group size")
        dist.init_process_group(backend, store=self.store, rank=top.rank, world_size=top.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        log.info("tensor-parallel rank %d of %d joined (%s, rendezvous %s:%d) in %.1fs", top.rank,
                 top.size, backend, top.master_addr, top.master_port, time.monotonic() - started)

    def loaded(self, start_timeout_s: float) -> None:
        """Announce this rank's shard loaded, and wait until every rank has said so."""
        self.store.set(f"{self.prefix}loaded/{self.top.rank}", "1")
        self.store.wait([f"{self.prefix}loaded/{r}" for r in range(self.top.size)],
                        datetime.timedelta(seconds=start_timeout_s))

    def send(self, message: Message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> Message:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        message = box[0]
        assert isinstance(message, Message)
        return message

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # The store's server threads are C++ threads: stopped here, not during interpreter exit.
        self.store = None


class Pulse:
    """When rank 0 last reached this follower: a message received or a call made. It is alive
    while that is within `timeout_s`, and before the first (the rendezvous and the load have
    their own bound, `tp_start_timeout_s`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last: float | None = None

    def beat(self) -> None:
        self.last = time.monotonic()

    def alive(self) -> bool:
        return self.last is None or time.monotonic() - self.last <= self.timeout_s


def on_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


class Lockstep:
    """Rank 0's model: each forward call goes to the other ranks first, then runs here.

    Attribute access passes through to the model (config, embeddings, devices). Once a rank
    has failed, every call raises Unavailable without touching the group.
    """

    def __init__(self, model: Any, group: Group, on_failure: Callable[[BaseException], None]) -> None:
        self.model = model
        self.group = group
        self.on_failure = on_failure
        self.failure: BaseException | None = None
        self._lock = threading.Lock()  # one message, then its call, at a time
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._keys_lock = threading.Lock()  # the worker names caches, the event loop forks them
        self._next_key = 0
        self._frees: collections.deque[int] = collections.deque()  # finalizers append, any thread
        self._forks: collections.deque[Fork] = collections.deque()
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def _key(self, cache: Any) -> int:
        with self._keys_lock:
            key = self._keys.get(cache)
            if key is None:
                self._next_key += 1
                key = self._keys[cache] = self._next_key
                weakref.finalize(cache, self._frees.append, key)
            return key

    def fork(self, cache: Any, length: int) -> Any:
        """`kv.fork_cache` on every rank: a copy of `cache`'s first `length` tokens here, and
        the same copy of each follower's mirror, made before the next call."""
        copy = fork_cache(cache, length)
        self._forks.append(Fork(self._key(copy), self._key(cache), length))
        return copy

    def _message(self, call: Call | None = None, stop: bool = False) -> Message:
        forks = []
        while self._forks:  # before the frees: a copy's source may be dropped right after it
            forks.append(self._forks.popleft())
        frees = []
        while self._frees:
            frees.append(self._frees.popleft())
        return Message(tuple(frees), tuple(forks), call, stop)

    def __call__(self, **kwargs: Any) -> Any:
        cache = kwargs.get("cache")
        if isinstance(cache, BatchCache):  # the layout goes, not the cache or the placeholder mask
            sent = {k: v for k, v in kwargs.items() if k not in BATCH_KWARGS}
            uses = tuple(CacheUse(self._key(c), rows.cached)
                         for c, rows in zip(cache.caches, cache.layout.rows, strict=True))
            call = Call({k: on_cpu(v) for k, v in sent.items()}, uses, cache.layout)
        else:
            sent = {k: v for k, v in kwargs.items() if k != "cache"}
            uses = () if cache is None else (CacheUse(self._key(cache), int(cache.get_seq_length())),)
            call = Call({k: on_cpu(v) for k, v in sent.items()}, uses)
        with self._lock:
            self._check()
            try:
                self.group.send(self._message(call))
                self._last_sent = time.monotonic()
                return self.model(**kwargs)
            except Exception as exc:
                self._fail(exc)
                raise self._refusal() from exc

    def _check(self) -> None:
        if self.failure is not None:
            raise self._refusal()

    def _refusal(self) -> Unavailable:
        return Unavailable(f"a tensor-parallel rank failed ({self.failure}); this replica is "
                           "stopping, retry on another")

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            log.error("tensor-parallel group failed (%s): NOT_SERVING, stopping the replica", exc)
            self.on_failure(exc)

    def _beat(self) -> None:
        """Keep idle followers inside their timeout, and notice a dead rank while idle."""
        interval = self.group.timeout_s / 4
        while not self._stopped.wait(interval / 2):
            if time.monotonic() - self._last_sent < interval or not self._lock.acquire(timeout=0):
                continue
            try:
                if self.failure is None and not self._stopped.is_set():
                    self.group.send(self._message())
                    self._last_sent = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - see __call__
                self._fail(exc)
            finally:
                self._lock.release()

    def stop(self) -> None:
        """Tell the followers to exit cleanly (they would otherwise take the end for a failure)."""
        self._stopped.set()
        self._heartbeat.join()
        with self._lock:
            if self.failure is None:
                try:
                    self.group.send(self._message(stop=True))
                except Exception as exc:  # noqa: BLE001 - stopping anyway
                    log.warning("could not tell the tensor-parallel ranks to stop: %s", exc)


def follow(model: Any, group: Group, device: torch.device | str, pulse: Pulse) -> None:
    """A follower's life: repeat rank 0's forward calls on this shard until it stops, beating
    `pulse` on every message and call.

    Raises when rank 0 is gone or stalls past the timeout (the process exits non-zero).
    """
    caches: dict[int, Any] = {}
    pulse.beat()
    while True:
        message = group.receive()
        pulse.beat()
        for fork in message.forks:
            if fork.source in caches:  # else the copy's first call finds no mirror, and fails
                caches[fork.key] = fork_cache(caches[fork.source], fork.length)
        for key in message.frees:
            caches.pop(key, None)
        if message.stop:
            return
        call = message.call
        if call is None:
            continue
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in call.kwargs.items()}
        mirrors = []
        for use in call.caches:
            cache = caches.get(use.key)
            held = -1 if cache is None else int(cache.get_seq_length())
            if cache is None and use.length > 0:
                raise ParallelError(f"rank {group.top.rank}: no mirror of cache {use.key}, which "
                                    f"held {use.length} tokens on rank 0")
            if cache is None or use.length == 0:
                cache = caches[use.key] = DynamicCache()
            elif held > use.length:
                cache.crop(use.length - held)
            elif held < use.length:
                raise ParallelError(f"rank {group.top.rank}: cache {use.key} holds {held} tokens, "
                                    f"rank 0's held {use.length}")
            mirrors.append(cache)
        if call.layout is not None:
            kwargs.update(BatchCache(mirrors, call.layout).call_kwargs(device))
        elif mirrors:
            kwargs["cache"] = mirrors[0]
        with torch.inference_mode():
            model(**kwargs)
        pulse.beat()
