"""runjobs as real processes: several at once, killed, terminated, cut off from the database."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter

import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def statuses() -> Counter[str]:
    return Counter(Job.objects.values_list("status", flat=True))


def has_run(n: int):
    return lambda: Execution.objects.filter(n=n).exists()


def all_succeeded(count: int):
    return lambda: statuses()[Status.SUCCEEDED] == count


def test_three_workers_with_four_threads_run_2000_jobs_exactly_once(start_worker):
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n} for n in range(2000)))
    workers = [start_worker("--concurrency", "4", "--batch-size", "4") for _ in range(3)]
    wait_until(all_succeeded(2000), timeout=90)
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert [worker.wait(15) for worker in workers] == [0, 0, 0]
    runs = Counter(Execution.objects.values_list("n", flat=True))
    assert len(runs) == 2000
    assert set(runs.values()) == {1}
    assert len(set(Execution.objects.values_list("pid", flat=True))) == 3  # all took part


def test_sigkill_mid_job_runs_it_again_after_the_lease(start_worker):
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 2})
    doomed = start_worker("--lease", "1")
    wait_until(has_run(1), timeout=20)
    doomed.signal(signal.SIGKILL)
    doomed.wait(5)
    start_worker("--lease", "1")
    wait_until(all_succeeded(1), timeout=30)
    row = Job.objects.get(pk=job.pk)
    assert row.attempts == 2
    assert row.errors[0]["type"] == "WorkerLost"
    assert Execution.objects.filter(n=1).count() == 2


def test_sigterm_lets_the_in_flight_job_finish_and_exits_zero(start_worker):
    Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 1.5})
    worker = start_worker("--grace", "30")
    wait_until(has_run(1), timeout=20)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert statuses() == {Status.SUCCEEDED: 1}
    assert "worker" in worker.log() and "stopped" in worker.log()


def test_a_second_sigterm_releases_the_running_job_at_once(start_worker):
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 60})
    worker = start_worker("--grace", "60")
    wait_until(has_run(1), timeout=20)
    wait_until(_listening, timeout=20)
    worker.signal(signal.SIGTERM)
    wait_until(lambda: not _listening(), timeout=10)  # it is stopping: its listener hung up
    # It must not exit while its job runs inside the grace period: give it half a second to
    # do what it must not.
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.5)
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    assert time.monotonic() - started < 5
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempts, row.leased_until) == (Status.READY, 0, None)


def test_sighup_stops_a_worker_as_sigterm_does_and_each_signal_is_logged(start_worker):
    # SIGHUP (a closed terminal, an orchestrator's hang-up) killed the worker at once, silently,
    # its job left running until its lease expired; no line said which signal stopped it.
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 60})
    worker = start_worker("--grace", "60")
    wait_until(has_run(1), timeout=20)
    worker.signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        worker.wait(0.5)  # in its grace, its job running
    worker.signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    assert Job.objects.values_list("status", flat=True).get(pk=job.pk) == Status.READY
    log = worker.log()
    assert "SIGHUP: stopping; running jobs get 60s to finish" in log
    assert "SIGTERM again: releasing the running jobs now" in log


def test_jobs_claimed_but_not_started_are_released_on_sigterm(start_worker):
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n, "seconds": 3} for n in range(3)))
    worker = start_worker("--concurrency", "1", "--grace", "30")
    wait_until(lambda: Execution.objects.exists(), timeout=20)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert statuses() == {Status.SUCCEEDED: 1, Status.READY: 2}
    assert not Job.objects.filter(status=Status.RUNNING).exists()


def test_the_worker_survives_pg_terminate_backend_on_all_its_connections(start_worker):
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n, "seconds": 0.01} for n in range(400)))
    worker = start_worker("--concurrency", "4", "--batch-size", "4")
    wait_until(lambda: Execution.objects.count() > 50, timeout=30)
    for _ in range(3):
        # Its listener and its main loop (or lease keeper) are (back) on their connections,
        # which carry the worker's name; handler threads' connections come and go (one counted
        # here could close before the terminate, which then found only the listener).
        wait_until(lambda: _listening() and _named_worker_sessions() >= 2, timeout=10)
        with connection.cursor() as cursor:
            # With a timeout, each call returns once its backend has gone: a terminated session
            # must not linger in pg_stat_activity into the next round's wait (it did under
            # load, and that round then found only one session to terminate).
            cursor.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
                "FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            (terminated,) = cursor.fetchone()
        assert terminated >= 2  # the main loop, the listener and handler threads
    wait_until(all_succeeded(400), timeout=60)
    assert worker.alive()
    # Both its main loop and its listener lost their connections, said so, and reconnected.
    log = worker.log()
    assert "the database is back after" in log and "listener lost its connection" in log, log


def test_a_job_running_three_times_longer_than_its_lease_is_never_reaped_while_its_worker_lives(
    start_worker,
):
    job = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4.5})
    start_worker("--lease", "1.5")
    wait_until(has_run(1), timeout=20)
    reaped = []
    while Job.objects.get(pk=job.pk).status == Status.RUNNING:
        reaped.append(Job.objects.reap()[:2])  # an eager reaper running beside the live worker
        time.sleep(0.1)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempts) == (Status.SUCCEEDED, 1)
    assert set(reaped) == {(0, 0)}
    assert Execution.objects.filter(n=1).count() == 1


def _named_worker_sessions() -> int:
    """Sessions named after a worker: its main loop, lease keeper and listener."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'pgjobs worker %%'"
        )
        return int(cursor.fetchone()[0])


def _listening() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND query = 'LISTEN pgjobs'"
        )
        return cursor.fetchone() is not None


def test_with_listen_a_job_enqueued_to_an_idle_worker_starts_promptly(start_worker):
    worker = start_worker("--poll-interval", "30")
    wait_until(_listening, timeout=20)
    # Nothing to wait for: let the worker idle on purpose, so that its polls back off (0.05 s,
    # doubling) until the next is more than 2 s away (past 3.15 s the gap is 3.2 s). A job
    # then starting within 2 s was woken by its NOTIFY, not found by a poll.
    time.sleep(3.5)
    assert worker.alive() and _listening() and not Execution.objects.exists()
    enqueued = time.monotonic()
    Job.objects.enqueue("tests.tasks.record", {"n": 1})
    wait_until(has_run(1), timeout=20, interval=0.01)
    assert time.monotonic() - enqueued < 2  # far below the 30 s poll ceiling


def test_without_listen_a_job_starts_within_the_poll_ceiling(start_worker):
    worker = start_worker("--no-listen", "--poll-interval", "1")
    wait_until(lambda: "started" in worker.log(), timeout=20)
    # Nothing to wait for: let the worker idle on purpose until its polls have backed off to
    # the ceiling (0.05 s doubling reaches 1 s after 1.55 s), and past the moment (3.15 s) when
    # a worker without the ceiling would next poll only at 6.35 s.
    time.sleep(3.5)
    assert worker.alive() and not _listening() and not Execution.objects.exists()
    assert "listen=no" in worker.log()
    enqueued = time.monotonic()
    Job.objects.enqueue("tests.tasks.record", {"n": 1})
    wait_until(has_run(1), timeout=20, interval=0.01)
    assert time.monotonic() - enqueued < 1 + 0.5


def test_nothing_a_handler_raises_stops_the_worker(start_worker):
    for name in ("exits", "interrupts", "always_fails", "fails_permanently"):
        Job.objects.enqueue(f"tests.tasks.{name}", max_attempts=1)
    Job.objects.enqueue("tests.tasks.async_noop", {"value": 1})
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n} for n in range(20)))
    worker = start_worker("--once")
    assert worker.wait(60) == 0
    assert statuses() == {Status.SUCCEEDED: 21, Status.FAILED: 4}
