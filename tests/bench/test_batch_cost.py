"""`python -m bench.batch_cost --engines`: each engine measured in turn on one model, a row per
sessions x tokens point."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny import make_gguf

from bench.batch_cost import main
from tandem import llama


@pytest.mark.skipif(not llama.available(), reason="llama-cpp-python is not installed")
def test_every_engine_is_measured_at_every_point(tiny_draft: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "draft"
    shutil.copytree(tiny_draft, model)
    make_gguf(tiny_draft, model)  # the same weights as a GGUF file beside them
    main(["--model", str(model), "--engines", "transformers,transformers-int8,llama.cpp",
          "--sessions", "1,3", "--tokens", "1,2", "--context", "8", "--repeats", "1",
          "--threads", "1"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and line[2].isalpha() and not line.startswith("| engine")]
    engines = [row[0].removeprefix("| ") for row in rows]
    assert [e.split(",")[0] for e in engines] == ["transformers"] * 8 + ["llama.cpp"] * 4
    assert sum("int8-dynamic" in e for e in engines) == 4
    assert [(row[1], row[2]) for row in rows] == [("1", "1"), ("3", "1"), ("1", "2"), ("3", "2")] * 3
    assert all(float(row[4]) >= 0 for row in rows)
