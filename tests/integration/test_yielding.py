"""Yielding to the application, against real PostgreSQL: what the gauge reads of other sessions
(and what it leaves out), each queue's room in the claim, a worker held to its rate, and what
jobstats and the Prometheus gauges say of the workers' reports."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from django_pgjobs.models import Job, QueueStat
from django_pgjobs.runtime.controls import Gauge, Yielding
from django_pgjobs.runtime.lifecycle import Options
from django_pgjobs.runtime.worker import Worker
from django_pgjobs.status import Status
from tests.conftest import connection_kwargs, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def session(name: str) -> psycopg.Connection[Any]:
    return psycopg.connect(**connection_kwargs(), application_name=name, autocommit=True)


def test_the_gauge_reads_the_applications_open_transactions_and_not_the_queues():
    gauge = Gauge("default", [Yielding(1.1, 10, ["default"])])
    shop, idle, worker, queue_statement = (
        session("shop"), session("shop"), session("pgjobs worker w1"), session("shop")
    )  # fmt: skip
    try:
        shop.execute("BEGIN")
        shop.execute("SELECT 1")  # idle in a transaction: open, and counted
        worker.execute("BEGIN")
        worker.execute("SELECT 1")  # the queue's own, by its name
        queue_statement.execute("BEGIN")
        queue_statement.execute("SELECT count(*) FROM pgjobs_job")  # the queue's, by its statement
        time.sleep(0.2)
        seen: list[tuple[float, list[float]]] = []
        gauge.seen = lambda epoch, ages: seen.append((epoch, list(ages)))  # type: ignore[method-assign]
        gauge.sample()
    finally:
        for conn in (shop, idle, worker, queue_statement):
            conn.close()
    ((epoch, ages),) = seen
    assert len(ages) == 1 and 0.2 <= ages[0] < 5
    assert abs(epoch - time.time()) < 60  # the database's clock, as epoch seconds
    assert gauge.hidden == 0


def test_each_queue_takes_at_most_its_room_in_one_claim():
    for queue in ("a", "b", "c"):
        Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 5, queue=queue)
    settled = Job.objects.settle_and_claim(
        [], [], ["a", "b", "c"], worker="w1", limit=8, rooms={"a": 2, "b": 0}
    )
    taken: dict[str, int] = {}
    for job in settled.claimed:
        taken[job.queue] = taken.get(job.queue, 0) + 1
    assert taken == {"a": 2, "c": 5}  # c had no room given: the turn's limit, less a's


def test_a_yielding_worker_claims_at_its_rate_and_a_never_yield_queue_beside_it_at_full_speed():
    Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 400, queue="slow")
    Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 400, queue="urgent")
    settings = {"YIELD_BUDGET": 1.15, "QUEUES": {"urgent": {"YIELD_BUDGET": None}}}
    with override_settings(PGJOBS=settings):
        worker = Worker(Options(queues=["slow", "urgent"], concurrency=4, listen=False))
    group = worker.controls.yielding["slow"]
    assert "urgent" not in worker.controls.yielding
    group.rate = 40.0  # as if the application had been slow: 40 jobs a second
    group.judge = lambda signal, baseline: None  # type: ignore[method-assign]  # held there
    thread = threading.Thread(target=worker.run)
    started = time.monotonic()
    thread.start()
    try:
        urgent = Job.objects.filter(queue="urgent").exclude(status=Status.SUCCEEDED)
        assert wait_until(lambda: not urgent.exists(), timeout=60)
        urgent_seconds = time.monotonic() - started
        time.sleep(max(0.0, started + 3.0 - time.monotonic()))
        seconds = time.monotonic() - started
        slow = Job.objects.filter(queue="slow", status=Status.SUCCEEDED).count()
    finally:
        worker.stop()
        thread.join(15)
    assert urgent_seconds < 5  # 400 jobs: not held to 40 a second (10 s)
    # 40 a second, give or take a burst (a tenth of a second's) and the turn's last claim; and
    # it moves.
    assert 10 <= slow <= 40 * seconds + 4 + 4


def test_jobstats_and_the_gauges_say_how_each_queue_yields():
    QueueStat.objects.create(
        seconds=10, worker="w1", queue="default", claimed=20_000, yielded=6.0, allowed=2500.0,
        open_ms=4.1, baseline_ms=2.0,
    )  # fmt: skip
    QueueStat.objects.create(seconds=10, worker="w2", queue="default", claimed=10_000)
    QueueStat.objects.create(seconds=10, worker="w1", queue="emails", claimed=10)
    settings = {"YIELD_BUDGET": 1.15, "QUEUES": {"emails": {"YIELD_BUDGET": None}}}
    with override_settings(PGJOBS=settings):
        text, report = _jobstats(), json.loads(_jobstats("--json"))
    assert "yielding to the application" in text
    line = next(x for x in text.splitlines() if x.startswith("default ") and "yielding" in x)
    assert "1 of 2 workers" in line and "30% of their last reports' time" in line
    assert "allowed 2,500 jobs/s, claiming 3,000 jobs/s" in line
    assert "4.1 ms against a baseline of 2.0 ms" in line
    assert "emails               never yields" in text
    yielding = {y["queue"]: y for y in report["yielding"]}
    assert yielding["default"]["allowed"] == 2500.0 and yielding["default"]["yielding"] == 1

    from prometheus_client.core import GaugeMetricFamily

    from django_pgjobs import metrics
    from django_pgjobs.observability import report as reports

    families = {f.name: f for f in metrics.families(reports.collect())}
    allowed = families["pgjobs_queue_allowed_rate"]
    assert isinstance(allowed, GaugeMetricFamily)
    assert [(s.labels["queue"], s.value) for s in allowed.samples] == [("default", 2500.0)]
    signal = {
        (s.labels["queue"], s.labels["kind"]): s.value
        for s in families["pgjobs_app_open_transaction_seconds"].samples
    }
    assert signal[("default", "value")] == pytest.approx(0.0041)


def _jobstats(*args: str) -> str:
    out = StringIO()
    with contextlib.suppress(SystemExit):  # a verdict other than healthy exits non-zero
        call_command("jobstats", *args, stdout=out)
    return out.getvalue()


def test_a_row_from_a_worker_of_the_previous_release_reads_as_not_yielding():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO pgjobs_queuestat (at, seconds, worker, queue, claimed, succeeded, "
            "retried, failed, latency_buckets) VALUES (now(), 10, 'old', 'default', 1, 1, 0, 0, "
            "'[]')"
        )  # a worker of the previous release: no yielding columns
    stat = QueueStat.objects.get(worker="old")
    assert stat.yielded == 0.0 and stat.allowed is None
