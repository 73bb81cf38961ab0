"""A worker whose project uses Django's connection pool (DATABASES OPTIONS "pool", Django 5.1+):
its own threads (main loop, lease keeper, listener) keep connections of their own, outside the
pool, so the handlers have all of it, and none of the worker's session settings reaches them."""

from __future__ import annotations

import json
import signal
from collections import Counter

import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

#: As many connections as the worker has handler threads; a handler that waits 3 s for one fails.
POOL = json.dumps({"min_size": 4, "max_size": 4, "timeout": 3})


def test_the_handlers_have_the_whole_pool_and_each_job_runs_once(start_worker):
    # Before: the main loop, lease keeper and listener held three of the four connections for
    # as long as the worker ran; four handlers waited for the last one, and failed their
    # attempts with "couldn't get a connection after 3.00 sec" (the lease keeper, waiting too,
    # let leases run out under healthy handlers: jobs ran twice at once).
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n, "seconds": 2} for n in range(8)))
    worker = start_worker("--concurrency", "4", "--lease", "10", env={"PGJOBS_TEST_POOL": POOL})
    wait_until(lambda: Job.objects.filter(status=Status.SUCCEEDED).count() == 8, timeout=60)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    runs = Counter(Execution.objects.values_list("n", flat=True))
    assert runs == Counter(range(8))
    assert set(Job.objects.values_list("attempts", flat=True)) == {1}
    log = worker.log()
    assert "couldn't get a connection" not in log and "connection pool" not in log


def test_a_pool_smaller_than_the_handler_threads_is_said_at_start(start_worker):
    worker = start_worker("--concurrency", "6", env={"PGJOBS_TEST_POOL": POOL})
    wait_until(worker.started, timeout=30)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert (
        "the connection pool of database 'default' (DATABASES OPTIONS 'pool') holds at most 4 "
        "connections, fewer than its 6 handler threads" in worker.log()
    )
