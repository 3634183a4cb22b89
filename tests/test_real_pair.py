"""End to end on the real default pair (Qwen2.5-Coder 0.5B draft, 1.5B target), through the README's commands.

`tandem up` starts three processes; `tandem generate --json` asks the orchestrator;
the tokens must equal the target's own greedy generate() in float32.
"""

from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys

import pytest
from tiny import greedy_reference

from tandem import models

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "The three primary colours are"]
LENGTH = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def references() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    path = models.resolve(models.DEFAULT_TARGET, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    refs = {p: greedy_reference(path, tokenizer.encode(p), LENGTH) for p in PROMPTS}
    gc.collect()
    return refs


@pytest.fixture(scope="module")
def tandem_up(references: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    log = []
    for line in proc.stdout:
        log.append(line)
        if "Tandem is ready" in line:
            break
    else:
        pytest.fail(f"tandem up exited with {proc.wait()}:\n{''.join(log)}")
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=120)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_equals_target_generate(tandem_up: str, references: dict[str, list[int]],
                                                 prompt: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", prompt, "--address", tandem_up,
         "--max-new-tokens", str(LENGTH), "--json"],
        capture_output=True, text=True, timeout=600, check=True)
    reply = json.loads(out.stdout)
    assert reply["token_ids"] == references[prompt]
    usage = reply["usage"]
    assert usage["completion_tokens"] == LENGTH
    assert usage["drafted_tokens"] > 0 and usage["accepted_tokens"] > 0
    assert usage["target_forward_passes"] < LENGTH  # speculation saved target passes
