"""Real runjobs processes as the report and the metrics see them: --metrics-port serves each
worker's outcome counters, and the QueueStat rows workers write make up the report's activity."""

from __future__ import annotations

import re
import signal
import socket
import urllib.request

from django_pgjobs.observability import report as reports
from tests.conftest import wait_until
from tests.factories import JobFactory


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


def succeeded(text: str | None) -> float:
    pattern = r'pgjobs_jobs_total\{[^}]*outcome="succeeded"[^}]*task="tests.tasks.noop"\} (\S+)'
    match = re.search(pattern, text or "")
    return float(match.group(1)) if match else 0.0


def test_a_worker_with_a_metrics_port_serves_its_job_metrics(start_worker):
    JobFactory.create_batch(20)
    port = free_port()
    worker = start_worker("--metrics-port", str(port), "--metrics-addr", "127.0.0.1")
    text = wait_until(lambda: succeeded(scrape(port)) == 20 and scrape(port), timeout=30)
    assert worker.alive()
    assert "# TYPE pgjobs_job_duration_seconds histogram" in text
    assert re.search(r'pgjobs_job_duration_seconds_count\{queue="default",'
                     r'task="tests.tasks.noop"\} 20.0', text)  # fmt: skip
    assert "process_resident_memory_bytes" in text  # the process's own metrics come along


def test_the_report_sees_a_running_worker_and_what_it_did(start_worker):
    JobFactory.create_batch(30)
    worker = start_worker("--queue", "default", "--queue", "emails")
    wait_until(lambda: worker.started(), timeout=30)

    def seen() -> reports.Report | None:
        report = reports.collect()
        minute = report.activity_of("default", 60)
        return report if minute and minute.succeeded == 30 else None

    report = wait_until(seen, timeout=40)  # the worker writes its rows every 10 s
    (alive,) = [w for w in report.workers if w.alive]
    assert alive.queues == ["default", "emails"]
    assert report.serving("emails") == [alive.worker]
    minute = report.activity_of("default", 60)
    assert minute is not None and minute.claimed == 30 and minute.latency(0.95) is not None
    assert report.verdict.status == "healthy", report.verdict.reasons
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
