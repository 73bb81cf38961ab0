"""The handler threads' time limits (runtime/timeouts.py): a returned attempt and its time-out
cannot both end it."""

from __future__ import annotations

import threading
import time

from django_pgjobs.models import Job
from django_pgjobs.runtime.timeouts import Deadlines, in_time, told


def test_an_attempt_that_returned_in_time_is_told_once_even_if_telling_takes_too_long():
    deadlines, job = Deadlines(), Job()
    deadlines.begin(job, 0.01)
    assert in_time(job) and told(job)  # its runner tells how it ended
    assert deadlines.end(job)  # and the handler thread records it
    assert told(job)  # not to be told again

    slow = Job()
    deadlines.begin(slow, 0.01)
    assert in_time(slow)
    time.sleep(0.02)  # its runner's telling (task_finished's receivers) passes the limit
    assert deadlines.overdue() == [slow]  # still timed out: a hung receiver holds no thread
    assert told(slow)  # but it is not told a second time
    assert not deadlines.end(slow)


def test_an_attempt_not_yet_returned_is_not_told():
    deadlines, job = Deadlines(), Job()
    deadlines.begin(job, 0.0)
    assert not told(job)
    assert deadlines.overdue() == [job]
    assert not told(job) and not in_time(job)


def test_an_attempt_timed_out_first_is_not_in_time():
    deadlines, job = Deadlines(), Job()
    deadlines.begin(job, 0.0)
    assert deadlines.overdue() == [job]
    assert not in_time(job)
    assert not deadlines.end(job)


def test_outside_a_handler_thread_every_attempt_is_in_time():
    answers: list[bool] = []
    thread = threading.Thread(target=lambda: answers.append(in_time(Job())))
    thread.start()
    thread.join()
    assert answers == [True]


def test_an_attempt_without_a_time_limit_after_one_with_a_limit_is_in_time():
    # The thread remembered the pool of its last limited attempt, and the next attempt, without
    # a limit, was taken for one timed out: a Django Task's task_finished was never sent.
    deadlines, limited, unlimited = Deadlines(), Job(), Job()
    deadlines.begin(limited, 30)
    assert deadlines.end(limited)
    assert in_time(unlimited)
