"""The rollup trigger (migration 0018) under concurrent reports for the same minute, and rows
no worker writes (by hand, a restored dump): added up, not refused."""

from __future__ import annotations

import threading

import pytest
from django.db import DatabaseError, connection, connections, transaction

from django_pgjobs.models import QueueStat, Rollup, Worker

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 6
REPORTS = 15


def test_concurrent_reports_for_the_same_minute_neither_deadlock_nor_lose_counts():
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def worker(n: int) -> None:
        try:
            start.wait()
            for _ in range(REPORTS):
                rows = [
                    QueueStat(
                        seconds=1.0,
                        worker=f"w{n}",
                        queue=queue,
                        claimed=1,
                        succeeded=1,
                        latency_buckets=[1] + [0] * 15,
                        tasks={
                            task: {
                                "succeeded": 1,
                                "retried": 0,
                                "failed": 0,
                                "durations": [1] + [0] * 14,
                            }
                            for task in ("a", "b", "c")
                        },
                    )
                    for queue in ("q1", "q2", "q3")
                ]
                if n % 2:
                    rows.reverse()  # another order of queues
                with transaction.atomic():
                    QueueStat.objects.bulk_create(rows)
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    total = THREADS * REPORTS
    per_minute = {}
    for row in Rollup.objects.filter(step=60):
        per_minute.setdefault((row.kind, row.name), 0)
        per_minute[(row.kind, row.name)] += row.succeeded
    assert per_minute == {
        **{("queue", q): total for q in ("q1", "q2", "q3")},
        **{("task", t): 3 * total for t in ("a", "b", "c")},
    }
    assert Worker.objects.count() == THREADS


@pytest.mark.parametrize(
    "row",
    [
        {"latency_buckets": {"a": 1}},
        {"latency_buckets": 5},
        {"latency_buckets": [1] * 40},
        {"claimed": -5},
    ],
)
def test_odd_rows_are_not_refused(row):
    """Not reachable from a worker's report (reporting.py always writes 16-position lists of
    ints and {task: {succeeded, retried, failed, durations}}): by hand or a foreign writer."""
    try:
        QueueStat.objects.bulk_create([QueueStat(seconds=1, worker="w", queue="q", **row)])
    except DatabaseError as error:
        pytest.fail(f"refused: {error}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
