"""The packages' import graph: no cycle, and no import of Tandem's own inside a function
(which is how a cycle hides), except the command line's lazy loading of its subcommands.

Read from the source with `ast`, so it sees every import whether or not it runs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tandem", "orchestrator", "draft_service", "target_service", "bench")
# The command line imports each subcommand's modules only when that subcommand runs, so a
# client command never loads torch.
LAZY = {"tandem.cli"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts:  # generated gRPC stubs
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(module of ours imported, whether inside a function), TYPE_CHECKING blocks left out."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names = [child.module] + [f"{child.module}.{alias.name}" for alias in child.names]
            out.extend((name, inner) for name in names if name in known)
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles() -> None:
    known = modules()
    graph = {name: {m for m, _ in imports(path, known) if m != name} for name, path in known.items()}
    assert cycles(graph) == []


def test_no_import_of_our_own_inside_a_function() -> None:
    known = modules()
    inside = sorted((name, m) for name, path in known.items() if name not in LAZY
                    for m, in_function in imports(path, known) if in_function)
    assert inside == []


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
