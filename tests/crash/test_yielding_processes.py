"""Workers that yield to the application, as real processes: an "application" of real sessions
whose transactions stay open longer makes them yield (they say so), and killing or stopping one
meanwhile loses no job; its leases are renewed while it yields, as ever."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import connection_kwargs, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

YIELDING = "yielding to the application"
ENV = {"PGJOBS_TEST_YIELD": json.dumps({"YIELD_BUDGET": 1.15, "YIELD_FLOOR": 20})}


class Application:
    """Sessions named "shop", each running transactions that stay open `seconds` in a loop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def run(self, sessions: int, seconds: float) -> None:
        for _ in range(sessions):
            thread = threading.Thread(target=self._loop, args=(seconds,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _loop(self, seconds: float) -> None:
        with psycopg.connect(**connection_kwargs(), application_name="shop") as conn:
            while not self.stop.is_set():
                with conn.transaction():
                    conn.execute("SELECT pg_sleep(%s)", [seconds])

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)


@pytest.fixture
def application() -> Iterator[Application]:
    app = Application()
    yield app
    app.close()


def enqueue(count: int, seconds: float) -> list[Any]:
    return [Job.objects.enqueue("tests.tasks.record", {"n": n, "seconds": seconds})
            for n in range(count)]  # fmt: skip


def all_succeeded() -> bool:
    return not Job.objects.exclude(status=Status.SUCCEEDED).exists()


def test_killed_while_yielding_a_worker_loses_nothing_and_the_other_finishes(
    start_worker: Any, application: Application
) -> None:
    application.run(2, 0.002)  # the application's normal load, there before the workers
    enqueue(4000, 0.02)  # a backlog that outlasts the seconds before the application slows
    args = ("--concurrency", "4", "--lease", "10", "-v", "2")
    first, second = start_worker(*args, env=ENV), start_worker(*args, env=ENV)
    assert wait_until(lambda: first.started() and second.started(), 30)
    time.sleep(3)  # a probe measures the application as it is
    application.run(8, 0.2)  # now its transactions stay open a hundred times as long
    assert wait_until(lambda: YIELDING in first.log() and YIELDING in second.log(), 30)
    first.kill()
    time.sleep(2)
    application.close()
    assert wait_until(all_succeeded, 90), Job.objects.exclude(status=Status.SUCCEEDED).count()
    # The killed worker's jobs ran again (claimed twice); none was lost.
    assert set(Job.objects.values_list("claims", flat=True)) <= {1, 2}


def test_a_yielding_worker_renews_its_leases_and_one_stopped_past_them_loses_nothing(
    start_worker: Any, application: Application
) -> None:
    application.run(2, 0.002)
    long = enqueue(4, 9.0)  # longer than the lease: they live on renewals
    enqueue(3000, 0.05)  # a backlog behind them
    first = start_worker("--concurrency", "8", "--lease", "6", "-v", "2", env=ENV)
    assert wait_until(first.started, 30)
    assert wait_until(lambda: {j.status for j in _fresh(long)} == {Status.RUNNING}, 30)
    second = start_worker("--concurrency", "4", "--lease", "6", "-v", "2", env=ENV)
    assert wait_until(second.started, 30)
    time.sleep(3)  # a probe measures the application as it is
    application.run(8, 0.2)
    assert wait_until(lambda: YIELDING in first.log() and YIELDING in second.log(), 30)
    # Past their lease: the yielding first worker renewed them, so the second reaped none.
    assert wait_until(lambda: {j.status for j in _fresh(long)} == {Status.SUCCEEDED}, 40)
    assert {j.claims for j in _fresh(long)} == {1}
    # Stopped past its lease while both yield: its jobs come back, and nothing is lost.
    more = [Job.objects.enqueue("tests.tasks.record", {"n": 1000 + n, "seconds": 0.5})
            for n in range(8)]  # fmt: skip
    time.sleep(1)
    first.signal(signal.SIGSTOP)
    try:
        time.sleep(10)
    finally:
        first.signal(signal.SIGCONT)
    application.close()
    assert wait_until(all_succeeded, 90), Job.objects.exclude(status=Status.SUCCEEDED).count()
    assert {j.status for j in _fresh(more)} == {Status.SUCCEEDED}


def _fresh(jobs: list[Any]) -> list[Any]:
    return list(Job.objects.filter(pk__in=[job.pk for job in jobs]))
