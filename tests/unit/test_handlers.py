"""The handler threads (runtime/handlers.py): when they look at their connections (Django's
close_old_connections), and their time limits: a returned attempt and its time-out cannot both
end it, and what a runner told is what is recorded."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime import handlers
from django_pgjobs.runtime.handlers import Deadlines, HandlerPool, keep_outcome
from tests.conftest import wait_until
from tests.factories import JobFactory

# ---- connections ----------------------------------------------------------------------------


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


# ---- time limits ----------------------------------------------------------------------------


SUCCEEDED = Handled(Verdict.SUCCEEDED)


def test_an_attempt_decided_in_time_is_recorded_as_decided_even_if_telling_takes_too_long():
    deadlines, job = Deadlines(), Job()
    deadlines.begin(job, 0.01)
    assert keep_outcome(job, SUCCEEDED)  # its runner tells how it ended
    assert deadlines.end(job)  # and the handler thread records it
    assert deadlines.overdue() == []

    slow = Job()
    deadlines.begin(slow, 0.01)
    assert keep_outcome(slow, SUCCEEDED)
    time.sleep(0.02)  # its runner's telling (task_finished's receivers) passes the limit
    # Its thread is abandoned (a hung receiver holds no thread of the pool), and what it told
    # is recorded: not a JobTimeout after a SUCCESSFUL task_finished (a retry ran it again).
    assert deadlines.overdue() == [(slow, SUCCEEDED)]
    assert not deadlines.end(slow)


def test_an_attempt_not_yet_returned_is_timed_out():
    deadlines, job = Deadlines(), Job()
    deadlines.begin(job, 0.0)
    assert deadlines.overdue() == [(job, None)]
    assert not keep_outcome(job, SUCCEEDED)
    assert not deadlines.end(job)


def test_outside_a_handler_thread_every_attempt_is_in_time():
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(keep_outcome(Job(), SUCCEEDED)))
    thread.start()
    thread.join()
    assert answers == [True]


def test_an_attempt_without_a_time_limit_after_one_with_a_limit_is_in_time():
    # The thread remembered the pool of its last limited attempt, and the next attempt, without
    # a limit, was taken for one timed out: a Django Task's task_finished was never sent.
    deadlines, limited, unlimited = Deadlines(), Job(), Job()
    deadlines.begin(limited, 30)
    assert deadlines.end(limited)
    assert keep_outcome(unlimited, SUCCEEDED)


def test_threads_telling_of_time_outs_are_counted_while_they_run(monkeypatch):
    release = threading.Event()
    before = handlers.hooks_aside()
    handlers.run_hook_aside(release.wait, "task_finished receivers")
    assert handlers.hooks_aside() == before  # not a moment after the limit
    monkeypatch.setattr(handlers, "LEFT_AFTER", 0.0)
    assert handlers.hooks_aside() == before + 1
    release.set()
    deadline = time.monotonic() + 5
    while handlers.hooks_aside() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handlers.hooks_aside() == before


def test_a_handler_that_ends_a_moment_after_its_time_limit_is_not_left_behind(monkeypatch):
    # Threads ending a few milliseconds late counted: a worker whose threads all met the limit
    # at once recycled though every one of them then ended.
    deadlines, job, release = Deadlines(), Job(), threading.Event()

    def handler() -> None:
        deadlines.begin(job, 0.0)
        release.wait()

    thread = threading.Thread(target=handler)
    thread.start()
    time.sleep(0.05)
    assert deadlines.overdue() == [(job, None)]
    assert deadlines.abandoned_alive() == 0  # abandoned a moment ago
    monkeypatch.setattr(handlers, "LEFT_AFTER", 0.0)
    assert deadlines.abandoned_alive() == 1
    release.set()
    thread.join()
    assert deadlines.abandoned_alive() == 0
