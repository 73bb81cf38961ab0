"""SIGKILL a worker every 2 s while three drain a task limited to 2 running jobs per customer
(tests/tasks.py, export): the database never shows a customer with more than 2 running, and no
slot leaks — every job finishes, the killed workers' slots coming back with their jobs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests import tasks
from tests.chaos.conftest import Workers, open_test_database, worker_args

pytestmark = pytest.mark.django_db(transaction=True)

MOST_RUNNING = """
    SELECT coalesce(max(n), 0) FROM (
        SELECT count(*) AS n FROM pgjobs_job
        WHERE status = 'running' AND task = %s GROUP BY limit_key
    ) AS per_customer
"""


def test_sigkill_every_two_seconds_never_breaks_a_per_key_limit_nor_leaks_a_slot(
    workers: Callable[..., Workers],
) -> None:
    Job.objects.bulk_enqueue(
        tasks.export,
        [{"customer_id": f"c{c}", "n": n, "seconds": 0.2} for c in range(10) for n in range(35)],
    )
    pool = workers(worker_args(4, 2, "--queue", "limited"))
    pool.start(3)
    seen, done = [0], threading.Event()

    def sample() -> None:
        with open_test_database() as db:
            while not done.is_set():
                (most,) = db.execute(MOST_RUNNING, [tasks.export.name]).fetchone()
                seen[0] = max(seen[0], most)
                time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    kills, deadline = 0, time.monotonic() + 120
    try:
        while Job.objects.exclude(status=Status.SUCCEEDED).exists():
            assert time.monotonic() < deadline, Job.objects.exclude(status=Status.SUCCEEDED).count()
            time.sleep(2)
            if Job.objects.filter(status=Status.READY).exists():
                pool.kill_random()
                kills += 1
    finally:
        done.set()
        sampler.join(5)
    assert pool.stop() == [0, 0, 0]
    assert kills >= 3
    assert seen[0] == 2  # reached, never passed
