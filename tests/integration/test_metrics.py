"""The Prometheus metrics: outcome counters from the lifecycle signals, the report's figures."""

from __future__ import annotations

import socket

import pytest
from django.db import connection
from django.test import RequestFactory
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from django_pgjobs import metrics, signals
from django_pgjobs.models import Job, QueueStat
from tests.conftest import statistics_count
from tests.factories import JobFactory


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_outcome_signals_count_per_queue_task_and_outcome_with_durations():
    metrics.connect()
    metrics.connect()  # idempotent: one count per signal
    job = Job(queue="emails", task="tests.tasks.send_email")
    labels = {"queue": "emails", "task": "tests.tasks.send_email"}
    before = {
        outcome: sample("pgjobs_jobs_total", **labels, outcome=outcome)
        for outcome in ("succeeded", "retried", "failed")
    }
    seconds = sample("pgjobs_job_duration_seconds_sum", **labels)
    fast = sample("pgjobs_job_duration_seconds_bucket", **labels, le="0.25")
    started = sample("pgjobs_jobs_started_total", **labels)
    signals.job_started.send(sender=Job, job=job)
    signals.job_succeeded.send(sender=Job, job=job, duration=0.2)
    signals.job_succeeded.send(sender=Job, job=job, duration=3.0)
    signals.job_retried.send(sender=Job, job=job, duration=0.1, error=None, delay=5)
    signals.job_failed.send(sender=Job, job=job, duration=0.1, error=None)
    assert sample("pgjobs_jobs_started_total", **labels) == started + 1
    assert sample("pgjobs_jobs_total", **labels, outcome="succeeded") == before["succeeded"] + 2
    assert sample("pgjobs_jobs_total", **labels, outcome="retried") == before["retried"] + 1
    assert sample("pgjobs_jobs_total", **labels, outcome="failed") == before["failed"] + 1
    assert sample("pgjobs_job_duration_seconds_sum", **labels) == pytest.approx(seconds + 3.4)
    assert sample("pgjobs_job_duration_seconds_bucket", **labels, le="0.25") == fast + 3


@pytest.mark.django_db(transaction=True)
def test_the_report_view_exposes_the_report_and_its_verdict():
    JobFactory.create_batch(4)
    JobFactory(dead=True)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET run_at = now() - interval '10 minutes'")
    QueueStat.objects.create(
        seconds=10, worker="host:1:aa", queue="default", claimed=60, succeeded=60,
        latency_buckets=[0] * 9 + [60],  # every claim between 0.5 s and 1 s
    )  # fmt: skip
    statistics_count(live=5)
    response = metrics.report_view(RequestFactory().get("/metrics"))
    assert response["Content-Type"].startswith("text/plain")
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return found[name, tuple(sorted(labels.items()))]

    assert value("pgjobs_queue_jobs", queue="default", state="due") == 4
    assert value("pgjobs_queue_jobs", queue="default", state="failed") == 1
    assert value("pgjobs_queue_oldest_due_seconds", queue="default") >= 600
    assert value("pgjobs_queue_workers", queue="default") == 1
    # 60 jobs in the 10 s the row covers.
    assert value("pgjobs_queue_throughput", queue="default", window="1m") == pytest.approx(6, 0.1)
    p95 = value("pgjobs_claim_latency_seconds", queue="default", window="5m", quantile="0.95")
    assert 0.5 < p95 <= 1.0
    assert value("pgjobs_table_tuples", kind="live") >= 5  # the jobs this test wrote
    assert value("pgjobs_connections", kind="max") > value("pgjobs_connections", kind="used") > 0
    assert value("pgjobs_health") == 1
    assert value("pgjobs_health_reason", code="workers_behind") == 1


def test_runjobs_says_clearly_when_the_metrics_port_is_taken():
    from django.core.management import CommandError, call_command

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"--metrics-port {port}: cannot listen on"):
            call_command("runjobs", "--once", "--metrics-port", str(port),
                         "--metrics-addr", "127.0.0.1")  # fmt: skip
