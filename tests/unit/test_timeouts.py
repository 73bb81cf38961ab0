"""The handler threads' time limits (runtime/handlers.py): a returned attempt and its time-out
cannot both end it, and what a runner told is what is recorded."""

from __future__ import annotations

import threading
import time

from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled, Verdict
from django_pgjobs.runtime import handlers
from django_pgjobs.runtime.handlers import Deadlines, keep_outcome

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
