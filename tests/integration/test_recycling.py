"""A worker replaced at a limit (--max-jobs-per-child, --max-memory-per-child): its running
jobs finish, for so long; a stop meanwhile gives the usual grace; a memory limit below a fresh
worker's size runs jobs all the same; and nothing it logs keeps it from being replaced."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from django_pgjobs.models import Job
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.conftest import wait_until


@pytest.mark.django_db(transaction=True)
def test_a_recycled_worker_lets_its_running_jobs_finish_past_its_grace():
    # A recycle released the running jobs after the grace, without spending an attempt: the
    # next worker started the job again, and again at each recycle (a job whose memory made
    # its worker pass --max-memory-per-child ran for ever, never finishing).
    long = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 1.5}, priority=10)
    for _ in range(6):
        Job.objects.enqueue("tests.tasks.noop")
    options = Options(
        queues=["default"], concurrency=2, listen=False, once=True, max_jobs=3, grace=0.1
    )
    assert Worker(options).run() == Exit.RECYCLE
    rows = dict(Job.objects.values_list("pk", "status"))
    assert rows.pop(long.pk) == Status.SUCCEEDED
    assert Status.RUNNING not in rows.values()
    assert Job.objects.get(pk=long.pk).attempts == 1


@pytest.mark.django_db(transaction=True)
def test_a_recycle_waits_for_a_job_that_never_ends_only_so_long(monkeypatch, caplog):
    # Waiting for every running job to end, a recycle held the whole worker up for good behind
    # one that never returned (no time limit): no claims, no exit, its supervisor none the wiser.
    from django_pgjobs.runtime import lifecycle as stopping

    monkeypatch.setattr(stopping, "RECYCLE_PATIENCE", 1.0)
    monkeypatch.setattr(stopping, "RECYCLE_NOTE_EVERY", 0.3)
    never = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4}, priority=10)
    for _ in range(4):
        Job.objects.enqueue("tests.tasks.noop")
    options = Options(
        queues=["default"], concurrency=2, listen=False, once=True, max_jobs=2, grace=0.1
    )
    began = time.monotonic()
    assert Worker(options).run() == Exit.RECYCLE
    assert time.monotonic() - began < 3.5  # before the job would have ended
    row = Job.objects.get(pk=never.pk)
    assert (row.status, row.attempts) == (Status.READY, 0)  # released: no attempt spent
    assert "waits for 1 running jobs before it is replaced" in caplog.text
    # The released job's handler runs on, with its connection, until it returns.
    wait_until(
        lambda: not any(t.name.startswith("pgjobs-handler") for t in threading.enumerate()), 10
    )


@pytest.mark.django_db(transaction=True)
def test_a_stop_signal_during_a_recycle_gives_the_usual_grace():
    long = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 4})
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, grace=0.5))
    ended: list[Exit] = []
    thread = threading.Thread(target=lambda: ended.append(worker.run()))
    thread.start()
    try:
        wait_until(lambda: Job.objects.filter(status=Status.RUNNING).exists(), 10)
        worker._recycle("a test")
        time.sleep(1.0)  # past the grace: a recycle waits for the job
        assert thread.is_alive()
        worker.stop()  # SIGTERM: the grace, then released
        thread.join(5)
        assert not thread.is_alive()
    finally:
        worker.stop(immediately=True)
        thread.join(10)
    assert Job.objects.values_list("status", flat=True).get(pk=long.pk) == Status.READY
    assert ended == [Exit.OK]  # stopped, not recycled
    # The released job's handler runs on, with its connection, until it returns.
    wait_until(
        lambda: not any(t.name.startswith("pgjobs-handler") for t in threading.enumerate()), 10
    )


@pytest.mark.django_db(transaction=True)
def test_a_memory_limit_below_a_fresh_workers_size_runs_jobs_and_says_so(caplog):
    # Recycled before its first claim, every replacement exited at once: a supervisor
    # restarted children for ever at full CPU and ran none of the jobs, saying nothing.
    for _ in range(3):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(
        Options(queues=["default"], concurrency=1, listen=False, once=True, max_memory_mb=1)
    )
    assert worker.run() == Exit.RECYCLE  # once it has recorded an outcome
    assert Job.objects.filter(status=Status.SUCCEEDED).count() >= 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("before its first job ended, over --max-memory-per-child 1" in s for s in said) == 1


@pytest.mark.django_db(transaction=True)
def test_a_memory_limit_is_looked_at_after_each_turn_that_recorded_outcomes():
    # Looked at once a second, fast jobs grew a worker to 660 MB against a 400 MB limit.
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 500)
    options = Options(queues=["default"], concurrency=2, batch_size=20, listen=False)
    options.max_memory_mb = 1
    assert Worker(options).run() == Exit.RECYCLE
    # The first turn that recorded outcomes (its first two) recycled it: it ran what that
    # turn's statement claimed too, and no more.
    assert Job.objects.filter(status=Status.SUCCEEDED).count() <= 2 + 20


class Discarding(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        pass


@pytest.fixture(params=["RequestUser", "Exits"])
def every_line_raises(request):
    """An application's logging filter that raises on every worker line (tests.logfilters), on a
    handler that sees all of them."""
    from tests import logfilters

    handler = Discarding()  # not logging.NullHandler, whose handle() looks at no filter
    handler.addFilter(getattr(logfilters, request.param)())
    pgjobs = logging.getLogger("django_pgjobs")
    level = pgjobs.level
    pgjobs.addHandler(handler)
    pgjobs.setLevel(logging.DEBUG)
    yield
    pgjobs.removeHandler(handler)
    pgjobs.setLevel(level)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("every_line_raises")
def test_a_logging_filter_that_raises_on_every_line_stops_nothing_a_worker_does():
    # The line saying the worker stops to be replaced raised after its turn had committed: it
    # never recycled, and the jobs that turn claimed were never run (reaped later, an attempt
    # spent on nothing).
    for _ in range(8):
        Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True, max_jobs=3))
    assert worker.run() == Exit.RECYCLE
    rows = list(Job.objects.values_list("status", "attempts"))
    assert Status.RUNNING not in {status for status, _ in rows}
    assert {attempts for status, attempts in rows if status == Status.READY} <= {0}
    assert sum(1 for status, _ in rows if status == Status.SUCCEEDED) >= 3
