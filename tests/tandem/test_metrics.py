"""Prometheus metrics: what the helpers record, the replica's session metrics, and the
HTTP endpoint `serve()` runs on its own port from before loading until the drain is over.

Metrics live in the process-wide registry, so every assertion is on a delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from fakes import release, slow_server, stop
from prometheus_client import REGISTRY

from tandem import metrics
from tandem.errors import InvalidRequest
from tandem.launch import wait_serving
from tandem.model_service import ModelHost, ModelServiceConfig
from tandem.v1 import common_pb2


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_observe_step_counts_accepted_bonus_and_recovered_tokens() -> None:
    names = ["tandem_drafted_tokens_total", "tandem_accepted_tokens_total",
             "tandem_bonus_tokens_total", "tandem_recovered_tokens_total",
             "tandem_target_only_steps_total", "tandem_accepted_tokens_per_step_count"]
    before = {n: value(n) for n in names}
    verify_before = value("tandem_stage_duration_seconds_sum", stage="verify")
    other_before = value("tandem_stage_duration_seconds_sum", stage="other")

    metrics.observe_step(drafted=4, accepted=4, draft_s=0.01, verify_s=0.02, step_s=0.04)
    metrics.observe_step(drafted=4, accepted=1, draft_s=0.01, verify_s=0.02, step_s=0.04)
    # A prefill step runs draft and target at once: `other` must not go negative.
    metrics.observe_step(drafted=0, accepted=0, draft_s=0.3, verify_s=0.3, step_s=0.35)

    delta = {n: value(n) - before[n] for n in names}
    assert delta == {"tandem_drafted_tokens_total": 8, "tandem_accepted_tokens_total": 5,
                     "tandem_bonus_tokens_total": 1, "tandem_recovered_tokens_total": 1,
                     "tandem_target_only_steps_total": 1,
                     "tandem_accepted_tokens_per_step_count": 2}
    assert value("tandem_accepted_tokens_per_step_bucket", le="1.0") >= 1
    assert value("tandem_stage_duration_seconds_sum", stage="verify") - verify_before == \
        pytest.approx(0.34)
    assert value("tandem_stage_duration_seconds_sum", stage="other") - other_before == \
        pytest.approx(0.02)


@pytest.mark.parametrize("failure, code", [
    (None, "OK"),
    (InvalidRequest("max_new_tokens must be in [1, 4096]"), "INVALID_ARGUMENT"),
    (asyncio.CancelledError(), "CANCELLED"),
    (RuntimeError("bug"), "UNKNOWN"),
])
def test_track_request_counts_each_status(failure: BaseException | None, code: str) -> None:
    before = value("tandem_requests_total", method="Test", code=code)
    count_before = value("tandem_request_duration_seconds_count", method="Test")
    expected = pytest.raises(type(failure)) if failure else contextlib.nullcontext()
    with expected, metrics.track_request("Test"):
        assert value("tandem_requests_in_flight", method="Test") == 1
        if failure is not None:
            raise failure
    assert value("tandem_requests_total", method="Test", code=code) == before + 1
    assert value("tandem_request_duration_seconds_count", method="Test") == count_before + 1
    assert value("tandem_requests_in_flight", method="Test") == 0


def test_status_code_of_an_rpc_error_is_its_code() -> None:
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(), details="replica gone")
    assert metrics.status_code(error) == "UNAVAILABLE"


@dataclass
class FakeCache:
    tokens: int

    def get_seq_length(self) -> int:
        return self.tokens


def test_a_session_stream_keeps_sessions_queue_depth_and_kv_use() -> None:
    model = "metrics-test-model"
    host = ModelHost(ModelServiceConfig(model=model, max_sessions=7))
    host.model = object()  # loaded, as far as session_stream can tell
    host.info = common_pb2.ModelInfo(vocab_size=10)
    assert value("tandem_sessions_limit", model=model) == 7

    @dataclass
    class Request:
        session_id: str
        cache_position: int = 0
        new_token_ids: tuple[int, ...] = (1,)

    async def requests() -> AsyncIterator[Request]:
        for _ in range(3):
            yield Request("s")

    async def scenario() -> None:
        opened = value("tandem_sessions_total", model=model)
        seen = []
        async for session, _ in host.session_stream(requests()):
            # The service is answering this step now; the KV metric holds the earlier steps'.
            seen.append((value("tandem_sessions_active", model=model),
                         value("tandem_steps_in_flight", model=model),
                         value("tandem_kv_cached_tokens", model=model)))
            session.cache = FakeCache(10 * len(seen))  # type: ignore[assignment]  # the step grew it
        assert seen == [(1, 1, 0), (1, 1, 10), (1, 1, 20)]
        assert value("tandem_sessions_total", model=model) == opened + 1
        assert value("tandem_sessions_active", model=model) == 0
        assert value("tandem_steps_in_flight", model=model) == 0
        assert value("tandem_kv_cached_tokens", model=model) == 0  # freed with the session
        assert value("tandem_replica_step_duration_seconds_count", model=model) == 3

    asyncio.run(scenario())


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        text: str = response.read().decode()
        return text


def test_serve_exposes_metrics_on_its_own_port_while_loading_and_until_stopped() -> None:
    with slow_server("--metrics-port", "0") as (process, output):
        url = output.wait_for(" metrics on ").rsplit(" ", 1)[1].strip()
        grpc_port = process.address.rsplit(":", 1)[1]
        assert not url.endswith(f":{grpc_port}/metrics"), "a port of its own"
        # Still loading (NOT_SERVING), and already scrapeable.
        page = _scrape(url)
        assert "tandem_completion_tokens_total" in page
        assert "process_resident_memory_bytes" in page or "python_info" in page
        release(process)
        wait_serving(process, timeout=60)
        assert stop(process.proc) == 0, output.text
        with pytest.raises(urllib.error.URLError):
            _scrape(url)
