"""The local launcher (`tandem up`, the tests' stacks)."""

from __future__ import annotations

from pathlib import Path

from tandem.launch import start_stack


def test_the_orchestrator_binds_the_host_asked_for_and_the_replicas_stay_local(tiny_target: Path) -> None:
    # `tandem up --host 0.0.0.0` used to parse the flag and bind 127.0.0.1 anyway.
    stack = start_stack(None, str(tiny_target), host="0.0.0.0")
    try:
        assert stack.orchestrator.address.startswith("0.0.0.0:")
        assert all(t.address.startswith("127.0.0.1:") for t in stack.targets)
        with stack.client() as client:
            assert client.generate("ab", max_new_tokens=2).usage.completion_tokens == 2
    finally:
        stack.stop()
