"""Reading one labelled sample off a process's Prometheus endpoint (Process.metrics() sums labels)."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tandem.launch import Process


def sample(process: Process, name: str, timeout: float = 10.0, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there are none)."""
    deadline = time.monotonic() + timeout
    while (url := process.metrics_url) is None:  # the line can lag behind the log reader
        assert time.monotonic() < deadline, f"{process.address} serves no metrics (--metrics-port)"
        time.sleep(0.05)
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())
