"""--cpu-affinity: a service pinned to CPUs, so one machine can emulate separate hardware."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.errors import InvalidRequest
from tandem.launch import spawn
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
