from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from stack import Stack, start_stack  # noqa: E402
from tiny import make_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir: Path) -> Path:
    return make_model(tiny_dir / "target", seed=1)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir: Path) -> Path:
    # Different random weights from the target: many rejections.
    return make_model(tiny_dir / "draft", seed=2)


@pytest.fixture(scope="session")
def tiny_stack(tiny_draft: Path, tiny_target: Path) -> Iterator[Stack]:
    stack = start_stack(str(tiny_draft), str(tiny_target))
    yield stack
    stack.stop()
