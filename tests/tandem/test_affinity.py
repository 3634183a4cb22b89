"""--cpu-affinity: a service pinned to CPUs, so one machine can emulate separate hardware; and
threads that sleep while they wait, so services sharing cores do not spin each other off them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import apply_process_defaults
from tandem.errors import InvalidRequest
from tandem.launch import spawn, wait_serving
from tandem.model_service import parse_cpus


def test_cpu_lists_parse() -> None:
    assert parse_cpus("0") == {0}
    if len(os.sched_getaffinity(0)) >= 2:
        assert parse_cpus("0-1") == parse_cpus("0,1") == {0, 1}


@pytest.mark.parametrize("spec, message", [("x", "like 0, 2-3"), ("3-1", "empty or negative"),
                                           ("9999", "cannot use")])
def test_bad_cpu_lists_are_refused(spec: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_cpus(spec)


def test_a_service_runs_on_the_cpus_it_is_given(tiny_draft: Path) -> None:
    service = spawn(["draft-service", "--model", str(tiny_draft), "--cpu-affinity", "0"])
    try:
        with open(f"/proc/{service.proc.pid}/status") as status:
            allowed = next(line for line in status if line.startswith("Cpus_allowed_list:"))
        assert allowed.split()[1] == "0"
    finally:
        service.stop()


def test_process_defaults_fill_only_what_the_user_left_unset() -> None:
    unset: dict[str, str] = {}
    apply_process_defaults(unset)
    assert unset == {"OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {"OMP_WAIT_POLICY": "ACTIVE"}
    apply_process_defaults(chosen)
    assert chosen == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_tandem_command_sets_them_before_anything_loads_torch() -> None:
    # OpenMP reads its wait policy once, when torch loads it: a torch import at the top of
    # tandem.cli (or of a module it imports) would make the default a dead letter.
    loaded = subprocess.run([sys.executable, "-c", "import sys, tandem.cli; print('torch' in sys.modules)"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "False"


@pytest.mark.parametrize("exported, seen", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_service_threads_wait_passively_unless_told_otherwise(
        tiny_draft: Path, monkeypatch: pytest.MonkeyPatch, exported: str | None, seen: str) -> None:
    if exported is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", exported)
    service = spawn(["draft-service", "--model", str(tiny_draft), "--threads", "1"])
    try:
        wait_serving(service)  # the model (and torch) loaded
        assert any(f"OMP_WAIT_POLICY={seen}" in line for line in service.lines), service.lines[-5:]
    finally:
        service.stop()
