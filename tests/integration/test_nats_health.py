"""The health report of queues carried by NATS: the outbox, the stream and its consumer in
jobstats and the admin, and the verdicts when the relay is behind or NATS is unreachable."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse

from django_pgjobs import transports
from django_pgjobs.jetstream import streams as figures
from django_pgjobs.models import Job, Queue, QueueStat, Rollup, Worker
from django_pgjobs.observability import report as reports
from django_pgjobs.observability import stats
from tests import tasks
from tests.chaos.nats_server import NatsServer, free_port
from tests.conftest import end_sessions_of, wait_until
from tests.integration.nats_helpers import (
    WorkerThread,
    bridge,
    make_stream,
    nats_queue,
    queue_settings,
    relay,
)
from tests.integration.test_health import codes, jobstats
from tests.models import ChaosExecution

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def queue(settings: Any) -> Iterator[str]:
    with nats_queue(settings) as name:
        yield name


def stream_of(report: reports.Report, queue: str) -> Any:
    return next(stream for stream in report.streams if stream.queue == queue)


def test_the_report_shows_the_outbox_the_stream_and_the_consumer(queue: str) -> None:
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(5)], queue=queue)
    relay().round()
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue)

    with WorkerThread(queue, concurrency=1):  # creates the consumer, runs the 5 relayed jobs
        wait_until(lambda: stream_of(reports.collect(), queue).messages == 5, timeout=30)
        wait_until(lambda: stream_of(reports.collect(), queue).pending == 0, timeout=30)
    report = reports.collect()
    depth = next(q for q in report.queues if q.queue == queue)
    assert depth.due == 3  # the outbox
    stream = stream_of(report, queue)
    assert stream.reachable and stream.messages == 5 and stream.ack_pending == 0

    out = jobstats()[1]
    assert f"{queue:<20}       3" in out
    document = json.loads(jobstats("--json")[1])
    assert [s["queue"] for s in document["streams"]] == [queue]


def test_a_relay_that_falls_behind_is_a_warning_not_workers_behind(
    queue: str, settings: Any
) -> None:
    settings.PGJOBS = {
        **settings.PGJOBS,
        "HEALTH": {"RELAY_LAG_SECONDS": 0, "OLDEST_DUE_SECONDS": 0},
    }
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": 1}], queue=queue)
    found = codes(reports.collect())
    assert "relay_behind" in found
    assert "workers_behind" not in found and "no_worker_serves_a_queue" not in found


def five_minutes_ago() -> Any:
    """By the database's clock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT now() - interval '5 minutes'")
        return cursor.fetchone()[0]


def unserved(queue: str) -> tuple[Any, str]:
    """The queue's stream figures and the detail of its 'no worker serves' reason."""
    report = reports.collect()
    [reason] = [r for r in report.verdict.reasons if r.code == "no_worker_serves_a_queue"]
    return stream_of(report, queue), reason.detail


def a_consumer_its_worker_left(queue: str) -> None:
    """The queue's consumer exists, having delivered one job, and its only worker has stopped
    (its statistics, which say it is alive for a while, deleted)."""
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": 1}], queue=queue)
    relay().round()
    with WorkerThread(queue):
        wait_until(lambda: ChaosExecution.objects.exists(), timeout=30)
    QueueStat.objects.all().delete()
    Worker.objects.all().delete()
    Rollup.objects.all().delete()


def a_stream_its_worker_left(queue: str, **waiting: Any) -> None:
    """a_consumer_its_worker_left, then a job enqueued with `waiting` (e.g. run_at) is relayed
    to the stream, where nothing takes it."""
    a_consumer_its_worker_left(queue)
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": 2}], queue=queue, **waiting)
    relay().round()


def test_messages_no_worker_takes_are_critical_once_they_have_waited(
    queue: str, settings: Any
) -> None:
    a_stream_its_worker_left(queue)
    report = reports.collect()
    stream = stream_of(report, queue)
    assert stream.pending == 1
    assert stream.oldest_pending_seconds is not None and stream.oldest_pending_seconds < 60
    # A moment without a worker, as in a deploy, is not an alarm (UNSERVED_SECONDS, 60)
    assert "no_worker_serves_a_queue" not in codes(report)

    settings.PGJOBS = {**settings.PGJOBS, "HEALTH": {"UNSERVED_SECONDS": 0}}
    assert "no_worker_serves_a_queue" in codes(reports.collect())


def ages(queue: str) -> dict[str, float]:
    """pgjobs_nats_oldest_seconds of `queue`, by state."""
    pytest.importorskip("prometheus_client")
    from django_pgjobs import metrics

    (family,) = [
        f for f in metrics.families(reports.collect()) if f.name == "pgjobs_nats_oldest_seconds"
    ]
    return {s.labels["state"]: s.value for s in family.samples if s.labels["queue"] == queue}


def test_the_age_is_the_waiting_jobs_own_by_the_databases_clock(queue: str) -> None:
    due = five_minutes_ago()
    a_stream_its_worker_left(queue, run_at=due)
    report = reports.collect()
    assert 300 <= stream_of(report, queue).oldest_pending_seconds < 400
    [reason] = [r for r in report.verdict.reasons if r.code == "no_worker_serves_a_queue"]
    assert "the oldest due 30" in reason.detail and "UNSERVED_SECONDS" in reason.threshold
    # The age itself, where operators look: jobstats' NATS table and Prometheus
    (line,) = [line for line in jobstats()[1].splitlines() if line.startswith(queue)]
    pending, age, acks_due = line.split()[4:7]
    assert (pending, age[:2], age[-1], acks_due) == ("1", "30", "s", "0"), line
    assert 300 <= ages(queue)["pending"] < 400 and ages(queue)["ack_pending"] == 0


def test_messages_a_worker_took_and_died_with_are_critical_once_they_have_waited(
    queue: str,
) -> None:
    # Delivered to a worker that was then SIGKILLed, nothing pending: they wait for a worker
    # that fetches, and the report said HEALTHY for ever.
    a_consumer_its_worker_left(queue)
    due = five_minutes_ago()
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": 2}, {"n": 3}], queue=queue, run_at=due)
    relay().round()
    taker, carried = bridge(), transports.nats_queues()[queue]
    # As a worker takes them, and then it dies: nothing is acknowledged
    subscription = taker.call(taker.js.pull_subscribe_bind(carried.consumer, stream=carried.stream))
    assert len(taker.fetch(subscription, 2, timeout=5)) == 2
    stream, detail = unserved(queue)
    assert (stream.pending, stream.ack_pending) == (0, 2)
    assert 300 <= stream.oldest_unacked_seconds < 400
    assert "2 messages delivered to workers that are gone, the oldest due 30" in detail
    (line,) = [line for line in jobstats()[1].splitlines() if line.startswith(queue)]
    pending, age, acks_due, unacked = line.split()[4:8]
    assert (pending, age, acks_due, unacked[:2], unacked[-1]) == ("0", "-", "2", "30", "s"), line
    assert ages(queue) == {"pending": 0, "ack_pending": pytest.approx(330, abs=30)}


def test_a_paused_queue_is_not_said_to_be_unserved_nor_behind(queue: str, settings: Any) -> None:
    # Paused with a backlog, it was "workers are behind" (a WARNING to add workers, which fetch
    # nothing from a paused queue); a paused PostgreSQL queue is left out.
    settings.PGJOBS = {**settings.PGJOBS, "HEALTH": {"NATS_PENDING": 1}}
    due = five_minutes_ago()
    a_stream_its_worker_left(queue, run_at=due)
    Queue.objects.create(name=queue, paused=True)
    found = codes(reports.collect())
    assert "no_worker_serves_a_queue" not in found and "workers_behind" not in found


def test_a_foreign_message_the_report_cannot_read_is_judged_old_and_said_so(
    queue: str, admin_client: Any
) -> None:
    # A deeply nested body raised RecursionError out of the report: jobstats exited 3 with a
    # traceback, the admin's report page answered 500, for every queue.
    a_consumer_its_worker_left(queue)
    publisher = bridge()
    publisher.publish(
        [(transports.nats_queues()[queue].subject, b"[" * 100_000, {"Nats-Msg-Id": "deep"})]
    )
    report = reports.collect()
    assert stream_of(report, queue).pending == 1
    assert stream_of(report, queue).oldest_pending_seconds is None
    [reason] = [r for r in report.verdict.reasons if r.code == "no_worker_serves_a_queue"]
    assert "the oldest one's age could not be read" in reason.detail
    code, out = jobstats()
    assert code == 2 and "Traceback" not in out
    assert admin_client.get(reverse("admin:pgjobs_queue_report")).status_code == 200


def test_nats_unreachable_is_critical_in_jobstats_and_the_admin(
    settings: Any, admin_client: Any
) -> None:
    queue = "pgjobstest_nowhere"  # its server listens nowhere: no stream is ever made
    settings.PGJOBS = {
        **settings.PGJOBS,
        "QUEUES": queue_settings(queue),
        "NATS": {"SERVERS": f"nats://127.0.0.1:{free_port()}"},
    }
    report = reports.collect()
    assert not stream_of(report, queue).reachable
    assert "nats_unreachable" in codes(report)
    code, out = jobstats()
    assert code == 2 and "unreachable:" in out

    page = admin_client.get(reverse("admin:pgjobs_queue_report")).content.decode()
    assert 'id="streams"' in page and "NATS unreachable" in page


def test_nats_unreachable_is_asked_once_for_every_queue_and_said_as_it_is(settings: Any) -> None:
    # Each queue connected again, 4 s each: 21 s for five queues, past a Prometheus scrape's
    # timeout (every pgjobs figure gone while NATS is down); and a refused connection was
    # said to be "TimeoutError:".
    queues = [f"pgjobstest_nowhere_{n}" for n in range(5)]
    settings.PGJOBS = {
        **settings.PGJOBS,
        "QUEUES": {k: v for queue in queues for k, v in queue_settings(queue).items()},
        "NATS": {"SERVERS": f"nats://127.0.0.1:{free_port()}"},
    }
    began = time.monotonic()
    report = reports.collect()
    assert time.monotonic() - began < 3 * figures.REPORT_TIMEOUT  # one connection's wait
    for queue in queues:
        stream = stream_of(report, queue)
        assert not stream.reachable
        assert "no connection within 4s" in stream.error
        assert "ConnectionRefusedError" in stream.error, stream.error


def test_a_queue_no_worker_ever_served_is_critical_once_its_messages_have_waited(
    queue: str, settings: Any
) -> None:
    # No worker of the queue ever started (a --queue typo): its consumer, a worker's to make,
    # did not exist, the relayed jobs counted as none pending, and the report said HEALTHY.
    due = five_minutes_ago()
    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(3)], queue=queue, run_at=due)
    relay().round()
    stream, detail = unserved(queue)
    assert (stream.messages, stream.pending) == (3, 3)
    assert 300 <= stream.oldest_pending_seconds < 400
    assert "3 messages not yet delivered" in detail


NATS_USERS = """
accounts {
  QUEUES {
    jetstream: enabled
    users: [
      {user: admin, password: admin}
      {user: monitor, password: monitor, permissions: {
        publish: [
          "$JS.API.INFO", "$JS.API.STREAM.INFO.PGJOBS_pgjobstest_guarded",
          "$JS.API.CONSUMER.INFO.PGJOBS_pgjobstest_guarded.>"
        ]
        subscribe: ["_INBOX.>"]
      }}
    ]
  }
}
"""


def test_what_the_reports_nats_user_may_not_read_is_said_queue_by_queue(
    settings: Any, tmp_path: Any
) -> None:
    # A NATS user allowed the stream's and consumer's figures (enough before the report read the
    # next message's age) got a CRITICAL saying only that the age could not be read; a queue
    # whose stream it was not allowed (a grant forgotten) made every queue after it
    # "unreachable", the refusal unsaid.
    server = NatsServer(tmp_path / "nats", config=NATS_USERS)
    server.start()
    try:
        queue = "pgjobstest_guarded"
        admin = f"nats://admin:admin@127.0.0.1:{server.port}"
        queues = {**queue_settings("pgjobstest_ungranted"), **queue_settings(queue)}
        settings.PGJOBS = {**settings.PGJOBS, "QUEUES": queues, "NATS": {"SERVERS": admin}}
        make_stream(queue)
        Job.objects.bulk_enqueue(tasks.ledger, [{"n": 1}], queue=queue)
        relay().round()
        settings.PGJOBS = {
            **settings.PGJOBS,
            "NATS": {"SERVERS": f"nats://monitor:monitor@127.0.0.1:{server.port}"},
        }
        report = reports.collect()
        stream = stream_of(report, queue)
        assert stream.reachable and stream.pending == 1
        assert "permissions violation" in stream.age_error
        assert f"$JS.API.STREAM.MSG.GET.{stream.stream}" in stream.age_error, stream
        ungranted = stream_of(report, "pgjobstest_ungranted")
        assert not ungranted.reachable and "permissions violation" in ungranted.error
        assert f"$JS.API.STREAM.INFO.{ungranted.stream}" in ungranted.error
    finally:
        server.stop()


def test_prometheus_shows_the_stream_figures(queue: str) -> None:
    pytest.importorskip("prometheus_client")
    from django_pgjobs import metrics

    Job.objects.bulk_enqueue(tasks.ledger, [{"n": n} for n in range(4)], queue=queue)
    relay().round()
    (family,) = [f for f in metrics.families(reports.collect()) if f.name == "pgjobs_nats_messages"]
    values = {tuple(s.labels.values()): s.value for s in family.samples}
    assert values[(queue, "stream")] == 4


def test_a_nats_worker_that_stopped_is_reported_stopped_not_silent(queue: str) -> None:
    with WorkerThread(queue, concurrency=1) as worker:
        wait_until(lambda: QueueStat.objects.filter(worker=worker.id).exists(), timeout=30)
    (seen,) = [w for w in stats.worker_stats() if w.worker == worker.id]
    assert (seen.alive, seen.stopped, seen.queues) == (False, True, [queue])


def test_a_nats_worker_whose_session_ended_while_idle_still_records_that_it_stopped(
    queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Its last report, the first statement on a connection the server had ended, failed
    # silently: the stopped worker read as alive, then as one that went silent.
    with WorkerThread(queue, concurrency=1, stats_interval=60.0) as worker:
        wait_until(lambda: end_sessions_of(worker.id) > 0, timeout=20)
    (seen,) = [w for w in stats.worker_stats() if w.worker == worker.id]
    assert (seen.alive, seen.stopped) == (False, True)
    assert "could not record" not in caplog.text
