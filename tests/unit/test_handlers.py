"""The handler threads: when they look at their connections (Django's close_old_connections)."""

from __future__ import annotations

import queue
import threading

import pytest

from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled
from django_pgjobs.runtime import handlers
from django_pgjobs.runtime.handlers import HandlerPool
from tests.conftest import wait_until
from tests.factories import JobFactory


class Todo:
    """The pool's queue, telling when a thread waits on it."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.waiting = threading.Event()

    def put(self, job: Job | None) -> None:
        self.jobs.put(job)

    def get_nowait(self) -> Job | None:
        return self.jobs.get_nowait()

    def get(self) -> Job | None:
        self.waiting.set()
        return self.jobs.get()


@pytest.fixture
def events(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(handlers, "close_old_connections", lambda: seen.append("look"))
    return seen


def test_a_handler_thread_looks_at_its_connections_after_each_job_and_before_one_it_waited_for(
    events,
):
    jobs = JobFactory.build_batch(4)
    names = {id(job): f"job {n}" for n, job in enumerate(jobs, 1)}

    def finished(job: Job, handled: Handled) -> None:
        events.append(f"{names[id(job)]} done")
        if job in (jobs[0], jobs[2]):  # the next one is there when the thread looks for it
            pool.submit(jobs[jobs.index(job) + 1])

    pool = HandlerPool(1, finished, lambda job: None)
    pool._todo = todo = Todo()  # type: ignore[assignment]
    pool.submit(jobs[0])
    pool.start()
    wait_until(lambda: "job 2 done" in events and todo.waiting.is_set(), 5)
    todo.waiting.clear()
    pool.submit(jobs[2])
    wait_until(lambda: "job 4 done" in events, 5)
    pool.stop()

    assert events == [
        "look", "look", "job 1 done",  # a new thread: its first job is looked at before too
        "look", "job 2 done",  # taken at once
        "look", "look", "job 3 done",  # the thread waited for it
        "look", "job 4 done",  # taken at once
    ]  # fmt: skip


def test_an_attempt_with_a_time_limit_says_when_it_begins_so_that_the_wait_ends_by_its_deadline():
    # The worker's loop reckoned its wait before the thread began the attempt, without its
    # deadline: a worker with nothing else due slept on long past the limit.
    done = threading.Event()
    began: list[float] = []
    pool = HandlerPool(
        1,
        lambda job, handled: done.set(),
        lambda job: 5.0 if job.task == "tests.tasks.noop" else None,
        deadline_set=lambda: began.append(pool.deadlines.next_in()),
    )
    pool.start()
    pool.submit(JobFactory.build(task="tests.tasks.noop"))
    assert done.wait(5)
    pool.stop()
    assert len(began) == 1 and 4 < began[0] <= 5  # the deadline was known when it said so
