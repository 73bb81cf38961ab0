"""A real runjobs process serves its Prometheus metrics with --metrics-port."""

from __future__ import annotations

import socket
import urllib.request

from tests.conftest import wait_until


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def test_a_worker_with_a_metrics_port_serves_its_job_metrics(start_worker):
    port = free_port()
    worker = start_worker("--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    text = wait_until(lambda: scrape(port), timeout=30)
    assert worker.alive()
    assert "# TYPE pgjobs_jobs_total counter" in text
    assert "# TYPE pgjobs_job_duration_seconds histogram" in text
    assert "process_resident_memory_bytes" in text  # the process's own metrics come along
