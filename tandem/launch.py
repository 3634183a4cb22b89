"""Start Tandem services as local processes: used by `tandem up`, the tests and the benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import TandemClient
from tandem.security import ClientTls, channel


@dataclass
class Process:
    proc: subprocess.Popen[str]
    address: str
    lines: list[str] = field(default_factory=list)
    argv: tuple[str, ...] = ()  # what `spawn` ran: `tandem <argv>`, less the address
    terminated: bool = False

    @property
    def metrics_url(self) -> str | None:
        """http://host:port/metrics, when the process serves metrics (--metrics-port)."""
        for line in list(self.lines):
            if " metrics on " in line:
                return line.rsplit(" ", 1)[1].strip()
        return None

    @property
    def http_url(self) -> str | None:
        """http://host:port of the orchestrator's HTTP API, when it serves one (--http-port)."""
        for line in list(self.lines):
            if " http on " in line:
                return "http://" + line.rsplit(" ", 1)[1].strip()
        return None

    def wait_http_url(self, timeout: float = 30.0) -> str:
        """http_url, once the log reader has seen it (it follows the "listening on" line)."""
        deadline = time.monotonic() + timeout
        while (url := self.http_url) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"{self.address} serves no HTTP API:\n{''.join(self.lines)}")
            time.sleep(0.05)
        return url

    def metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """Scrape the metrics endpoint: each sample name, summed over its labels."""
        deadline = time.monotonic() + timeout
        while (url := self.metrics_url) is None:  # the line can lag behind the log reader
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.address} serves no metrics (start it with --metrics-port)")
            time.sleep(0.05)
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode()
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        return samples

    def terminate(self) -> None:
        """SIGTERM, once: the service drains, then exits."""
        if not self.terminated and self.proc.poll() is None:
            self.proc.terminate()
            self.terminated = True

    def stop(self, sig_timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                return self.proc.wait(timeout=sig_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


# Held while a service is forked (see spawn); a service releases them as it starts.
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def spawn(argv: Sequence[str], env: dict[str, str] | None = None, port: int = 0,
          host: str = "127.0.0.1", log_file: Path | None = None) -> Process:
    """Run `tandem <argv>` on host:port (0: a free port); return once it prints its address.

    Its output is kept in `Process.lines`, and also written to `log_file` when given."""
    return Launch(argv, env, port, host, log_file).announced()


class Launch:
    """`tandem <argv>` started, not yet announced: several start at once (their imports, most
    of a start, overlap), then each is awaited with `announced`."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, port: int = 0,
                 host: str = "127.0.0.1", log_file: Path | None = None) -> None:
        # A SIGINT or SIGTERM that lands inside Popen, after the fork, would leave a child that
        # no one knows of (found by tandem up stopped while it starts its services): hold both
        # until `proc` exists and the caller can stop it. The child starts with them held too;
        # tandem.cli releases them first thing.
        self.argv = tuple(argv)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", *argv, "--host", host, "--port", str(port)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, **(env or {})},
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal held meanwhile lands here
        self.log_file = log_file

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def announced(self) -> Process:
        """The process, once it prints its address; killed if it exits or this is interrupted
        first."""
        proc = self.proc
        assert proc.stdout is not None
        lines: list[str] = []
        log: TextIO | None = None

        def keep(line: str) -> None:
            lines.append(line)
            if log is not None:
                log.write(line)

        def read_on() -> None:  # the child must never block on a full pipe
            for line in proc.stdout or []:
                keep(line)
            if log is not None:
                log.close()

        try:
            log = open(self.log_file, "w", buffering=1) if self.log_file else None  # noqa: SIM115 - the reader closes it
            for line in proc.stdout:
                keep(line)
                if " listening on " in line:
                    process = Process(proc, line.rsplit(" ", 1)[1].strip(), lines, self.argv)
                    threading.Thread(target=read_on, daemon=True).start()
                    return process
        except BaseException:  # interrupted before it announced itself: it is nobody's to stop
            self.kill()
            raise
        finally:
            if log is not None and proc.poll() is not None:
                log.close()
        raise RuntimeError(f"tandem {self.argv[0]} exited with {proc.wait()}:\n{''.join(lines)}")


def restart(process: Process, tls: ClientTls | None = None) -> Process:
    """The service `process` ran, started again on its address (once `process` has exited);
    returns when it is SERVING."""
    host, port = process.address.rsplit(":", 1)
    again = spawn(process.argv, port=int(port), host=host)
    wait_serving(again, tls=tls)
    return again


def wait_serving(process: Process, timeout: float = 600.0, tls: ClientTls | None = None) -> None:
    deadline = time.monotonic() + timeout
    with channel(process.address, tls) as health_channel:
        stub = health_pb2_grpc.HealthStub(health_channel)
        while time.monotonic() < deadline:
            if process.proc.poll() is not None:
                raise RuntimeError(f"process exited with {process.proc.returncode}:\n{''.join(process.lines)}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{process.address} not SERVING after {timeout}s:\n{''.join(process.lines)}")


@dataclass
class Stack:
    drafts: list[Process]
    targets: list[Process]
    orchestrator: Process
    tls: ClientTls | None = None
    token: str | None = None

    @property
    def address(self) -> str:
        return self.orchestrator.address

    def client(self) -> TandemClient:
        return TandemClient(self.address, tls=self.tls, token=self.token)

    def stop(self) -> None:
        """The orchestrator first (it ends its sessions on the replicas), then every replica at
        once: each drains on its own."""
        self.orchestrator.stop()
        stop_all([*self.drafts, *self.targets])


def stop_all(processes: Sequence[Process]) -> None:
    """SIGTERM to each, then wait for each (a kill after its own timeout)."""
    for p in processes:
        p.terminate()
    for p in processes:
        p.stop()


def start_stack(draft_model: str | None, target_model: str, *, num_drafts: int = 1,
                num_targets: int = 1, draft_dtype: str = "float32",
                target_dtype: str = "float32", threads: int = 1,
                draft_args: Sequence[str] = (), target_args: Sequence[str] = (),
                orchestrator_args: Sequence[str] = (), port: int = 0, host: str = "127.0.0.1",
                tls: ClientTls | None = None, token: str | None = None,
                log_dir: Path | None = None,
                on_ready: Callable[[str], None] | None = None) -> Stack:
    """Start drafts, targets and an orchestrator; return when all are SERVING.

    The orchestrator binds `host` (the public API); the replicas only ever bind 127.0.0.1.

    With TLS flags among the *_args, `tls` is how this process reaches every service (one CA,
    and a client certificate where mutual TLS is on); `token` is what `Stack.client()` sends.

    With `log_dir`, each service's output also goes to <log_dir>/<role>[-i].log; `on_ready`
    is called with each role ("draft", "target", "orchestrator") as it turns SERVING.
    """
    common = ["--threads", str(threads)]
    started: list[tuple[str, Process]] = []  # stopped if anything fails, a signal included
    pending: list[Launch] = []  # started, not yet announced: killed if anything fails
    names: list[str] = []  # every service's, in start order: role, role-1, ...

    def launch(argv: list[str], port: int = 0, host: str = "127.0.0.1") -> tuple[str, Launch]:
        role = argv[0].removesuffix("-service")
        count = sum(1 for r in names if r.split("-")[0] == role)
        name = role if count == 0 else f"{role}-{count}"
        names.append(name)
        log_file = log_dir / f"{name}.log" if log_dir else None
        pending.append(Launch(argv, port=port, host=host, log_file=log_file))
        return name, pending[-1]

    def announced(name: str, started_one: Launch) -> Process:
        process = started_one.announced()
        pending.remove(started_one)
        started.append((name, process))
        return process

    try:
        # The replicas start at once; the orchestrator, which needs their addresses, after.
        replicas = [launch(["draft-service", "--model", draft_model, "--dtype", draft_dtype,
                            *common, *draft_args]) for _ in range(num_drafts)] if draft_model else []
        replicas += [launch(["target-service", "--model", target_model, "--dtype", target_dtype,
                             *common, *target_args]) for _ in range(num_targets)]
        processes = [announced(name, one) for name, one in replicas]
        drafts, targets = processes[:len(processes) - num_targets], processes[len(processes) - num_targets:]
        # No --tokenizer: the orchestrator loads the one the target serves.
        orch = announced(*launch(["orchestrator", "--draft", ",".join(p.address for p in drafts),
                                  "--target", ",".join(p.address for p in targets),
                                  *orchestrator_args], port=port, host=host))
        for name, p in started:
            wait_serving(p, tls=tls)
            if on_ready is not None:
                on_ready(name)
    except BaseException:
        for one in pending:
            one.kill()
        stop_all([p for _, p in reversed(started)])
        raise
    return Stack(drafts, targets, orch, tls, token)
