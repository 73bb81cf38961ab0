"""Flow control across real `runjobs` processes (tests/tasks.py: rated, export, per_customer): a
rate limit and a per-key concurrency limit hold for four workers together, a small key is not
held behind a big key's backlog, and a SIGKILLed worker's slots come back with its jobs."""

from __future__ import annotations

import signal
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.status import Status
from tests import tasks
from tests.conftest import wait_until
from tests.models import LimitedRun

pytestmark = pytest.mark.django_db(transaction=True)

FOUR = (("--queue", "limited", "--processes", "2", "--concurrency", "4"),) * 2


def start_all(start_worker: Any, workers: tuple[tuple[str, ...], ...] = FOUR) -> list[Any]:
    started = [start_worker(*args) for args in workers]
    assert wait_until(lambda: all(" started: " in w.log() for w in started), 60)
    return started


def stop(workers: list[Any]) -> None:
    for worker in workers:
        worker.signal(signal.SIGTERM)
    assert [worker.wait(30) for worker in workers] == [0] * len(workers)


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most of `intervals` (start, end) that overlap at one moment."""
    events = sorted(
        [(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
        key=lambda event: (event[0], event[1]),
    )  # an end before a start at a tie
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        (now,) = cursor.fetchone()
    return now


def test_a_rate_limit_holds_for_four_workers_together(start_worker: Any) -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(1200)])
    workers = start_all(start_worker)
    assert wait_until(lambda: Job.objects.filter(started_at__isnull=False).exists(), 30)
    first = Job.objects.filter(started_at__isnull=False).order_by("started_at")[0].started_at
    assert wait_until(lambda: database_now() > first + timedelta(seconds=31), 40)
    starts = sorted(
        Job.objects.filter(started_at__isnull=False).values_list("started_at", flat=True)
    )
    stop(workers)
    in_window = [s for s in starts if s < first + timedelta(seconds=30)]
    # 20/s for 30 s, and the burst (4) at the start: 604.
    assert 570 <= len(in_window) <= 630, len(in_window)
    per_second = max(
        sum(1 for later in starts[n:] if later < start + timedelta(seconds=1))
        for n, start in enumerate(starts)
    )
    assert per_second <= 20 + tasks.rated.rate_limit.burst, per_second  # type: ignore[union-attr]
    # Each job started once: the limit is never met by starting and putting jobs back.
    assert set(Job.objects.filter(started_at__isnull=False).values_list("claims", flat=True)) == {1}


def test_a_concurrency_limit_holds_per_customer_while_customers_run_side_by_side(
    start_worker: Any,
) -> None:
    Job.objects.bulk_enqueue(
        tasks.export,
        [{"customer_id": f"c{c}", "n": n, "seconds": 0.2} for c in range(5) for n in range(10)],
    )
    workers = start_all(start_worker)
    assert wait_until(lambda: not Job.objects.exclude(status=Status.SUCCEEDED).exists(), 60)
    stop(workers)
    runs = list(LimitedRun.objects.values_list("key", "started", "ended"))
    assert len(runs) == 50
    for customer in {key for key, _, _ in runs}:
        mine = [(start, end) for key, start, end in runs if key == customer]
        assert most_at_once(mine) <= 2, customer
    # The customers ran side by side: most of the 5 × 2 slots were busy at once.
    assert most_at_once([(start, end) for _, start, end in runs]) >= 6


def test_a_small_customer_starts_within_a_turn_of_a_big_ones_backlog(start_worker: Any) -> None:
    workers = start_all(start_worker, (("--queue", "limited", "--concurrency", "8"),) * 2)
    Job.objects.bulk_enqueue(
        tasks.per_customer, [{"customer_id": "big", "n": n} for n in range(100_000)]
    )
    assert wait_until(lambda: LimitedRun.objects.filter(key="big").count() > 1000, 60)
    enqueued = database_now()
    small = Job.objects.bulk_enqueue(
        tasks.per_customer, [{"customer_id": "small", "n": n} for n in range(10)]
    )
    assert wait_until(lambda: LimitedRun.objects.filter(key="small").count() == 10, 30)
    started = Job.objects.filter(pk__in=[job.pk for job in small]).values_list(
        "started_at", flat=True
    )
    assert max(started) - enqueued < timedelta(seconds=2)
    assert Job.objects.filter(limit_key="big", status=Status.READY).count() > 10_000
    stop(workers)


def test_a_killed_worker_holds_its_slots_until_its_jobs_are_taken_back(start_worker: Any) -> None:
    Job.objects.bulk_enqueue(
        tasks.export, [{"customer_id": "k", "n": n, "seconds": 1.5} for n in range(4)]
    )
    doomed = start_worker("--queue", "limited", "--lease", "5", "--concurrency", "4")
    assert wait_until(lambda: LimitedRun.objects.filter(key="k").count() == 2, 30)
    doomed.kill()
    killed_at = database_now()
    other = start_worker("--queue", "limited", "--lease", "5", "--concurrency", "4")
    assert wait_until(lambda: not Job.objects.exclude(status=Status.SUCCEEDED).exists(), 60)
    stop([other])
    runs = list(LimitedRun.objects.filter(pid=other.pid).values_list("started", "ended"))
    assert len(runs) == 4  # the two taken back, and the two that waited
    # No slot was free while the killed worker's jobs still counted as running.
    first_two = sorted(start for start, _ in runs)[:2]
    assert all(start > killed_at + timedelta(seconds=2) for start in first_two)
    assert most_at_once(runs) <= 2


def test_a_slot_freed_on_one_worker_wakes_another_waiting_for_it(start_worker: Any) -> None:
    Job.objects.bulk_enqueue(
        tasks.export, [{"customer_id": "k", "n": n, "seconds": 4.0} for n in range(4)]
    )
    # It stops after its first job ends (--max-jobs-per-child), its other job still running.
    first = start_worker("--queue", "limited", "--concurrency", "2", "--max-jobs-per-child", "1")
    assert wait_until(lambda: LimitedRun.objects.filter(key="k").count() == 2, 30)
    # Its first claims find both slots taken, then it polls only every 30 s.
    second = start_worker("--queue", "limited", "--poll-interval", "30")
    assert wait_until(second.started, 30)
    assert wait_until(lambda: LimitedRun.objects.filter(key="k").count() == 4, 15)
    assert first.wait(30) == Exit.RECYCLE  # stopped, to be replaced
    runs = list(LimitedRun.objects.filter(key="k").order_by("started"))
    assert {run.pid for run in runs[2:]} == {second.pid}
    # Woken by the first slot's end, not by its next poll (by then seconds apart).
    freed = min(run.ended for run in runs[:2])
    assert timedelta(0) <= runs[2].started - freed < timedelta(seconds=1)
    stop([second])
