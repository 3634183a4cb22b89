"""bench/gpu_check.sh end to end on a CPU (the GPU check's smoke test): a tiny model of the
real vocabulary through HF and the services, k=0 and k=4, every figure reported; the target's
decode runs through the compiled step (on a GPU a CUDA graph; here inductor's CPU code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_gpu_check_runs_end_to_end_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    done = subprocess.run([str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--shape", "tiny",
                           "--tokens", "12", "--repeats", "1", "--out", str(out), "--logs", str(tmp_path),
                           "--decode-graph", "compile"],
                          check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["hf_tokens_per_s"] > 0
    for k in ("k0", "k4"):
        assert figures[k]["tokens_per_s"] > 0
        assert {"orchestrator_ms", "wire_ms", "target_forward_ms", "target_host_bytes"} <= set(figures[k]["machinery"])
    assert figures["k0"]["drafted_tokens"] == 0 < figures["k4"]["drafted_tokens"]
    assert "draft_forward_ms" in figures["k4"]["machinery"]
    assert (tmp_path / "target.log").exists() and (tmp_path / "orchestrator.log").exists()
    assert figures["k0"]["machinery"]["target_captured_share"] > 0.5  # the run's passes, bar its prefill
    assert "decode graph: a decode run's one-token passes alone run through a static slot of 4096 tokens, " \
        "compiled" in (tmp_path / "target.log").read_text()
    assert "k=4 / k=0" in done.stdout
