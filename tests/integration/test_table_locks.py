"""A lock on the whole job table (VACUUM FULL, CLUSTER, a table-rewriting ALTER TABLE) held
past the lease: every worker's heartbeats wait behind it, so leases run out under live
handlers; the first reaper through when it goes must not take them back from live workers."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from django_pgjobs.models import Job, Queue
from django_pgjobs.runtime import policy, sessions
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import connection_kwargs, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

#: Shortened for the test: the worker's lock_timeout, and how long it reaps nothing after its
#: statements work again.
LOCK_TIMEOUT = "300ms"
RECOVERY = 4.0
#: When the live worker's lease keeper, in its retry pause as the lock went, renews.
KEEPER_BACK_AFTER = 2.5


def waiting_on_the_lock() -> bool:
    """Whether one of the worker's own sessions waits for the lock (read from a session of its
    own: pg_stat_activity holds still within a transaction)."""
    with psycopg.connect(**connection_kwargs(), autocommit=True) as session:
        return session.execute(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND application_name LIKE 'pgjobs worker%%')"
        ).fetchone()[0]


@pytest.mark.parametrize(
    ("lock_timeout", "lock_left"),
    [
        # A worker whose turns and reaps fail on the lock, as long as it lasts.
        (LOCK_TIMEOUT, 1.5),
        # A worker started in the lock's last second: its first statements wait less than their
        # lock_timeout, so it meets no failure; its first reap came the moment the lock went.
        ("5s", 1.0),
    ],
    ids=["failing on the lock", "started as it ends"],
)
def test_after_a_table_lock_a_worker_lets_live_workers_renew_before_it_reaps(
    other_connection, monkeypatch, lock_timeout, lock_left
):
    monkeypatch.setattr(sessions, "LOCK_TIMEOUT", lock_timeout)
    monkeypatch.setattr(policy, "REAP_RECOVERY", RECOVERY, raising=False)
    for _ in range(2):
        Job.objects.enqueue("tests.tasks.noop")
    (live,) = Job.objects.claim(["default"], worker="live-worker", limit=1, lease=30)
    (dead,) = Job.objects.claim(["default"], worker="dead-worker", limit=1, lease=30)
    # Both leases ran out while the table was locked: no keeper could renew.
    other_connection.execute("UPDATE pgjobs_job SET leased_until = now() - interval '1 second'")
    other_connection.execute("BEGIN")
    other_connection.execute("LOCK TABLE pgjobs_job IN ACCESS EXCLUSIVE MODE")
    worker = Worker(
        Options(
            queues=["default"], concurrency=1, listen=False, poll_interval=0.1, reap_interval=0.1
        )
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(waiting_on_the_lock, timeout=20)
        time.sleep(lock_left)  # what is left of the lock
        other_connection.execute("ROLLBACK")  # the lock goes
        time.sleep(KEEPER_BACK_AFTER)  # the live worker's keeper ends its retry pause...
        assert Job.objects.heartbeat([live], lease=30) == {live.pk}  # ...and renews
        # The dead worker's job is taken back once the others had time to renew theirs (and
        # may be claimed and run at once: its history says it was taken back).
        wait_until(lambda: Job.objects.get(pk=dead.pk).errors, timeout=20)
    finally:
        worker.stop()
        thread.join(10)
    row = Job.objects.get(pk=live.pk)
    assert (row.status, row.worker, row.attempts) == (Status.RUNNING, "live-worker", 1)


def test_a_lock_on_the_queue_controls_stops_only_the_limited_queues(other_connection, caplog):
    # Every turn read the controls and failed on the lock (a migration altering the table, an
    # operator's LOCK TABLE): no queue ran while it lasted (attack 12).
    Queue.objects.create(name="limited", max_running=5)
    worker = Worker(
        Options(queues=["default", "limited"], concurrency=2, listen=False, poll_interval=0.1)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    wait_until(lambda: worker.controls.limited == ["limited"], timeout=20)  # read once
    other_connection.execute("BEGIN")
    other_connection.execute("LOCK TABLE pgjobs_queue IN ACCESS EXCLUSIVE MODE")
    open_jobs = [Job.objects.enqueue("tests.tasks.noop") for _ in range(3)]
    limited = Job.objects.enqueue("tests.tasks.noop", queue="limited")
    try:
        done = lambda *jobs: all(  # noqa: E731
            Job.objects.get(pk=job.pk).status == Status.SUCCEEDED for job in jobs
        )
        wait_until(lambda: done(*open_jobs), timeout=20)
        wait_until(lambda: "the queue controls cannot be read" in caplog.text, timeout=10)
        assert Job.objects.get(pk=limited.pk).status == Status.READY  # its limit is unknown
        other_connection.execute("ROLLBACK")
        wait_until(lambda: done(limited), timeout=20)
    finally:
        worker.stop()
        thread.join(10)
