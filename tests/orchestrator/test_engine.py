"""The engine's seams: no wire in the domain, and one registry the wire agrees with."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestrator import wire
from orchestrator.domain import REGISTRY
from tandem.errors import InvalidRequest
from tandem.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("module", ["engine", "domain", "speculation", "proposers", "text",
                                    "policy", "admission"])
def test_the_engine_and_its_domain_import_no_wire(module: str) -> None:
    imported = _imports(ROOT / "orchestrator" / f"{module}.py")
    wire_modules = {m for m in imported if m == "grpc" or m.startswith(("grpc.", "tandem.v1"))
                    or m == "orchestrator.wire"}
    assert not wire_modules, f"orchestrator/{module}.py imports {wire_modules}"


def test_every_registered_proposer_has_a_wire_value_and_back() -> None:
    for name in REGISTRY:
        assert wire.proposer_from_proto(wire.proposer_to_proto(name)) == name
    values = {v for v in common_pb2.Proposer.values() if v != common_pb2.PROPOSER_UNSPECIFIED}
    assert {wire.proposer_from_proto(v) for v in values} == set(REGISTRY)
    assert wire.proposer_from_proto(common_pb2.PROPOSER_UNSPECIFIED) == ""


def test_an_unknown_proposer_value_is_an_invalid_request_naming_the_choices() -> None:
    with pytest.raises(InvalidRequest) as err:
        wire.proposer_from_proto(99)
    assert "PROPOSER_PROMPT_LOOKUP" in str(err.value)
