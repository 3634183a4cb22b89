"""The signals an endpoint picker routes on (the Gateway API Inference Extension's model-server
protocol: queued requests, running requests, KV-cache utilisation), scraped off a real
orchestrator while real clients load it, and back at rest after."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny import PROMPTS

from tandem.launch import start_stack

pytestmark = pytest.mark.slow  # a stack of its own

WAITING, RUNNING, KV = "tandem:num_requests_waiting", "tandem:num_requests_running", "tandem:kv_cache_usage_perc"


def test_the_endpoint_picker_signals_move_with_the_load(tiny_draft: Path, tiny_target: Path) -> None:
    stack = start_stack(str(tiny_draft), str(tiny_target), target_args=["--kv-budget-tokens", "2000"],
                        orchestrator_args=["--metrics-port", "0", "--http-port", "0",
                                           "--max-concurrent-requests", "2"])
    try:
        idle = stack.orchestrator.metrics()
        assert (idle[WAITING], idle[RUNNING], idle[KV]) == (0, 0, 0)

        def request(prompt: str) -> int:
            with stack.client() as client:
                return len(client.generate(prompt, max_new_tokens=120, num_speculative_tokens=2,
                                           ignore_eos=True).token_ids)

        seen = {WAITING: 0.0, RUNNING: 0.0, KV: 0.0}
        with ThreadPoolExecutor(max_workers=5) as pool:
            replies = [pool.submit(request, PROMPTS[i % len(PROMPTS)]) for i in range(5)]
            while not all(r.done() for r in replies):
                now = stack.orchestrator.metrics()
                seen = {name: max(seen[name], now[name]) for name in seen}
                time.sleep(0.05)
        assert [r.result() for r in replies] == [120] * 5
        # Two run (--max-concurrent-requests), the other three wait, and the target's caches
        # hold a share of its budget: at most 2 sessions of under 200 tokens of 2000.
        assert seen[RUNNING] == 2 and seen[WAITING] >= 1, seen
        assert 0 < seen[KV] <= 0.2, seen
        rest = stack.orchestrator.metrics()
        assert (rest[WAITING], rest[RUNNING], rest[KV]) == (0, 0, 0)
        # The same metrics on the API's port, where an endpoint picker scrapes the pool's pods.
        with urllib.request.urlopen(stack.orchestrator.wait_http_url() + "/metrics", timeout=10) as reply:
            served = {s.name for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples}
        assert {WAITING, RUNNING, KV} <= served
    finally:
        stack.stop()
