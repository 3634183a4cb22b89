"""The C allocator of a model service (tandem.host.keep_freed_memory): a pass's transient
megabyte-sized tensors reuse freed memory instead of faulting fresh pages in, pass after
pass. Counted in page faults of a fresh process, not in time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# A sampled 5-row score over a 152k vocabulary (the target's residuals and draws for 4
# drafted tokens), 20 times after 3 to warm up, on a thread as on a service's forward worker;
# prints the minor page faults of the 20.
PASSES = """
import resource, sys, threading, torch
from tandem import host, sampling
torch.set_num_threads(1)
if sys.argv[1] == "keep":
    print(host.keep_freed_memory(), file=sys.stderr)
drafts = [sampling.SparseDistribution(tuple(range(64 * i, 64 * i + 64)), (1 / 64,) * 64) for i in range(4)]
def step():
    logits = torch.randn(5, 151_936)
    sampling.score_logits(logits, sampling.SamplingParams(temperature=0.7), [0, 64, 128, 192], drafts, 1)
def work():
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=work)
worker.start()
worker.join()
"""

PAGES_PER_STEP = 4 * 5 * 151_936 // 4096  # one float32 tensor of the 5 rows


def faults(mode: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-c", PASSES, mode], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})})
    return int(done.stdout.strip()), done.stderr.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_a_model_services_allocator_reuses_a_passs_freed_tensors() -> None:
    default, _ = faults("default")
    kept, said = faults("keep")
    assert said == "freed blocks under 32 MiB kept for reuse"
    # glibc's defaults fault the pages of the pass's tensors in again, pass after pass
    assert default > 20 * PAGES_PER_STEP
    assert kept < 4 * PAGES_PER_STEP, f"{kept} page faults over 20 passes with freed memory kept"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_glibcs_own_environment_settings_win() -> None:
    _, said = faults("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert said == "left as the environment sets it"
