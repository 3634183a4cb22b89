"""The Dockerfile, checked without a Docker engine: its stages, the non-root user, that every
COPY source exists and survives .dockerignore, the CPU/CUDA switch, and that no weights are
baked in. The image itself is built where Docker runs (k8s/README.md has the command)."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field

import pytest
from k8s_manifests import K8S, ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "EXPOSE",
                "ENTRYPOINT", "CMD", "LABEL", "HEALTHCHECK", "SHELL", "STOPSIGNAL", "VOLUME",
                "ONBUILD"}


@dataclass
class Instruction:
    keyword: str
    arguments: str
    line: int


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Instructions (continuations joined, comments dropped) and the stages they form."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment line inside a continued instruction
        if not pending:
            start = number
        pending += (" " if pending else "") + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            keyword, _, arguments = pending.partition(" ")
            instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
            pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            parts = instruction.arguments.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(parts[0], name))
        elif stages:
            stages[-1].instructions.append(instruction)
    return instructions, stages


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` out of the build context (last match wins; a
    pattern also matches everything under a directory it matches)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        candidates = [pattern, pattern.removeprefix("**/")] if pattern.startswith("**/") else [pattern]
        for candidate in candidates:
            anywhere = candidate != pattern
            if any(fnmatch.fnmatchcase(p.rsplit("/", 1)[-1] if anywhere else p, candidate)
                   for p in prefixes):
                ignored = not negated
                break
    return ignored


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[Instruction], list[Stage]]:
    return parse(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def ignore_patterns() -> list[str]:
    return [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_every_line_is_an_instruction(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    instructions, _ = dockerfile
    unknown = [(i.line, i.keyword) for i in instructions if i.keyword not in INSTRUCTIONS]
    assert not unknown, f"not Dockerfile instructions: {unknown}"
    assert DOCKERFILE.read_text().startswith("# syntax=docker/dockerfile:1")


def test_multi_stage_slim_build(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    _, stages = dockerfile
    assert len(stages) >= 2, "build tools and caches stay in a build stage"
    assert all(s.name for s in stages), "name every stage"
    runtime = stages[-1]
    assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim|python:[\d.]+-slim", runtime.base)
    assert not runtime.all("ADD"), "COPY, not ADD (no remote fetches or auto-extraction)"
    for copy in runtime.all("COPY"):
        assert copy.arguments.startswith("--from="), "the runtime stage takes only build outputs"


def test_copy_sources_exist_and_reach_the_build_context(
        dockerfile: tuple[list[Instruction], list[Stage]], ignore_patterns: list[str]) -> None:
    _, stages = dockerfile
    names = [s.name for s in stages]
    for index, stage in enumerate(stages):
        for copy in stage.all("COPY"):
            words = shlex.split(copy.arguments)
            flags = [w for w in words if w.startswith("--")]
            sources = [w for w in words if not w.startswith("--")][:-1]
            source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if source_stage is not None:
                assert source_stage in names[:index], f"line {copy.line}: unknown stage {source_stage}"
                continue
            for source in sources:
                assert (ROOT / source).exists(), f"line {copy.line}: {source} does not exist"
                assert not dockerignored(source, ignore_patterns), \
                    f"line {copy.line}: {source} is excluded by .dockerignore"


def test_dockerignore_keeps_out_what_the_image_must_not_hold(ignore_patterns: list[str]) -> None:
    for path in (".git", "tests/conftest.py", "k8s/base/draft.yaml", ".mypy_cache",
                 "tandem/__pycache__/cli.cpython-311.pyc", "bench/results/run.json",
                 ".benchmarks/x.json", "models/model.safetensors"):
        assert dockerignored(path, ignore_patterns), path
    for path in ("tandem/cli.py", "orchestrator/discovery.py", "pyproject.toml", "README.md"):
        assert not dockerignored(path, ignore_patterns), path


def test_the_runtime_user_is_not_root(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    _, stages = dockerfile
    users = stages[-1].all("USER")
    assert users, "the runtime stage must set a USER"
    user = users[-1].arguments.split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd, and the
    # one the manifests run as.
    assert user.isdigit()
    for workload in ("draft", "target", "orchestrator"):
        assert f"runAsUser: {user}" in (K8S / "base" / f"{workload}.yaml").read_text()


def test_variant_build_argument_selects_cpu_or_cuda_torch(
        dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    _, stages = dockerfile
    build = stages[0]
    args = dict(a.arguments.partition("=")[::2] for a in build.all("ARG"))
    assert args.get("VARIANT") == "cpu", "the default build is the CPU image"
    torch_install = [r.arguments for r in build.all("RUN") if "torch==" in r.arguments]
    assert len(torch_install) == 1
    for variant in ("cpu)", "cuda)", "$TORCH_INDEX_CPU", "$TORCH_INDEX_CUDA", "exit 1"):
        assert variant in torch_install[0], f"the torch install does not handle {variant}"
    assert "download.pytorch.org/whl/cpu" in args["TORCH_INDEX_CPU"]
    assert "download.pytorch.org/whl/cu" in args["TORCH_INDEX_CUDA"]


def test_no_model_weights_are_baked_in(dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    from tandem import models

    instructions, _ = dockerfile
    text = " ".join(i.arguments for i in instructions if i.keyword in ("RUN", "COPY", "ADD"))
    for model in models.BUILTIN_MODELS.values():
        assert model.pip_requirement.split("{")[0] not in text, f"{model.name}'s chunks"
    for marker in ("prepare-models", "snapshot_download", "huggingface-cli", ".safetensors", ".gguf"):
        assert marker not in text


def test_entrypoint_gets_sigterm_and_ports_match_the_manifests(
        dockerfile: tuple[list[Instruction], list[Stage]]) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    [entrypoint] = runtime.all("ENTRYPOINT")
    assert entrypoint.arguments == '["tandem"]', "exec form, so SIGTERM reaches tandem (PID 1)"
    exposed = {int(p.split("/")[0]) for e in runtime.all("EXPOSE") for p in e.arguments.split()}
    assert exposed == {50051, 9090}
    env = " ".join(e.arguments for e in runtime.all("ENV"))
    assert "TANDEM_CACHE_DIR=/cache" in env and "HF_HOME=/cache/" in env


def test_the_parser_reads_continuations_and_stages() -> None:
    instructions, stages = parse("# syntax=docker/dockerfile:1\nFROM a AS one\nRUN x \\\n"
                                 "  # note\n  && y\nFROM b AS two\nCOPY --from=one /a /a\n")
    assert [i.keyword for i in instructions] == ["FROM", "RUN", "FROM", "COPY"]
    assert instructions[1].arguments == "x && y"
    assert [(s.base, s.name) for s in stages] == [("a", "one"), ("b", "two")]


def test_the_ignore_matcher() -> None:
    patterns = ["*", "!tandem/", "**/__pycache__", "bench/results"]
    assert dockerignored("tests/x.py", patterns)
    assert not dockerignored("tandem/cli.py", patterns)
    assert dockerignored("tandem/__pycache__/a.pyc", patterns)
    assert dockerignored("bench/results/a", patterns)
