"""End to end on the real default pair (Qwen2.5-Coder 0.5B draft, 1.5B target), through the README's commands.

`tandem up` starts three processes; `tandem generate --json` asks the orchestrator;
the tokens must equal the target's own greedy generate() in float32.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from fakes import Output, stop
from tiny import greedy_reference, speculated

from tandem import models
from tandem.client import TandemClient

# Loading the 1.5B target (here and in `tandem up`) takes minutes on a CPU: more than the
# suite's per-test timeout allows the first test, whose setup does both.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPTS = ["def fibonacci(n):", "The three primary colours are"]
LENGTH = 24


@pytest.fixture(scope="module")
def references() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    path = models.resolve(models.DEFAULT_TARGET, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    refs = {p: greedy_reference(path, tokenizer.encode(p), LENGTH, matmul_path="onednn")
            for p in PROMPTS}
    gc.collect()
    return refs


@pytest.fixture(scope="module")
def tandem_up(references: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tandem up` on port 0; the address is read back from its ready line. float32 on
    oneDNN's packed kernels, as the references are (auto would pick bfloat16 on a CPU with
    bf16 instructions, and the matmul path by timing)."""
    logs = tmp_path_factory.mktemp("logs")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "up", "--port", "0", "--http-port", "0",
                             "--dtype", "float32", "--matmul", "onednn",
                             "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: killed with its services below
    assert proc.stdout is not None
    try:
        ready = Output(proc.stdout).wait_for("Tandem is ready", timeout=1800)
        yield ready.rsplit(" ", 1)[1].strip()
        stop(proc, timeout=120)  # SIGTERM: it stops its services; killed if it hangs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def generate(address: str, prompt: str, *flags: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "generate", prompt, "--address", address,
         "--max-new-tokens", str(LENGTH), "--json", *flags],
        capture_output=True, text=True, timeout=600, check=True)
    reply: dict = json.loads(out.stdout)  # type: ignore[type-arg]
    return reply


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_equals_target_generate(tandem_up: str, references: dict[str, list[int]],
                                                 prompt: str) -> None:
    """As the README runs it: the server's own speculation policy, which may choose k = 0."""
    reply = generate(tandem_up, prompt)
    assert reply["token_ids"] == references[prompt]
    assert reply["usage"]["completion_tokens"] == LENGTH


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_speculation_saves_target_passes(tandem_up: str, references: dict[str, list[int]],
                                                   prompt: str) -> None:
    """With k fixed at 4, every step drafts; that the 0.5B draft matches the 1.5B target's
    greedy choice at least once in 24 tokens is a property of this pair, not of a policy."""
    with TandemClient(tandem_up) as client:
        tokens, usage = speculated(client, prompt, LENGTH, 4)  # every step drafted 4, no fallback
    assert tokens == references[prompt]
    assert usage.accepted_tokens > 0
    assert usage.target_forward_passes < LENGTH  # speculation saved target passes
