"""Time limits of attempts running on a worker's handler threads.

Python cannot stop a thread. So when an attempt passes its time limit, the worker records it
as failed (JobTimeout: retried or dead-lettered by the task's policy) at once, tells the handler
through cancel_requested(), starts a new handler thread in its place so capacity recovers, and
forgets the old thread: whatever that thread does later is not recorded. Abandoned threads that
never return still hold what they hold (memory, a connection); when as many have piled up as
the worker has threads, the worker stops gracefully and exits for recycling (see Exit), and its
supervisor (runjobs --processes) or process manager starts a fresh one.
"""

from __future__ import annotations

import threading
import time
from weakref import WeakValueDictionary

from django_pgjobs.models import Job

#: The attempt with a time limit begun last on this thread, and its pool's Deadlines.
_thread = threading.local()
#: The attempts whose runner has told how they ended (in_time), by id(job) while the job lives.
_told: WeakValueDictionary[int, Job] = WeakValueDictionary()


def in_time(job: Job) -> bool:
    """Whether the attempt of `job` running on this thread ended before its time limit, asked
    by a runner when the handler has returned, before it tells anyone how it ended (Django's
    task_finished, backend.py). False: it was timed out meanwhile, its outcome recorded as
    JobTimeout. True: the runner tells, and a time-out that comes while it does (the telling
    is part of the attempt, within its limit) is not to be told again (told). An attempt
    without a time limit, or outside a worker's handler thread (testing.run_jobs), is in
    time."""
    begun: tuple[Deadlines, Job] | None = getattr(_thread, "begun", None)
    if begun is None or begun[1] is not job:
        return True
    return begun[0].returned(job)


def told(job: Job) -> bool:
    """Whether the runner of `job`'s attempt has told how it ended (in_time): asked of an
    attempt timed out, so that it is not told twice."""
    return _told.get(id(job)) is job


class Deadlines:
    """The attempts running on handler threads, each with its deadline (time.monotonic())."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, tuple[Job, float, threading.Thread]] = {}
        self._abandoned: list[threading.Thread] = []

    def begin(self, job: Job, timeout: float | None) -> None:
        """The handler of `job` starts now on this thread."""
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._running[id(job)] = (job, deadline, threading.current_thread())
        _thread.begun = (self, job)

    def returned(self, job: Job) -> bool:
        """The handler of `job` returned, and its runner tells how the attempt ended: False
        when it was timed out already (see in_time)."""
        with self._lock:
            if id(job) not in self._running:
                return False
            _told[id(job)] = job
            return True

    def end(self, job: Job) -> bool:
        """The handler of `job` returned; False when its attempt was timed out meanwhile (its
        outcome is not ours to record, and this thread was replaced)."""
        with self._lock:
            return self._running.pop(id(job), None) is not None

    def overdue(self) -> list[Job]:
        """The attempts past their deadline, now abandoned with their threads."""
        now = time.monotonic()
        with self._lock:
            late = [key for key, (_, deadline, _) in self._running.items() if deadline <= now]
            abandoned = [self._running.pop(key) for key in late]
            self._abandoned += [thread for _, _, thread in abandoned]
            return [job for job, _, _ in abandoned]

    def next_in(self) -> float:
        """Seconds until the next deadline (inf without one)."""
        with self._lock:
            deadlines = [deadline for _, deadline, _ in self._running.values()]
        return min(deadlines, default=float("inf")) - time.monotonic()

    def abandoned_alive(self) -> int:
        """Abandoned handler threads still running (those that returned are gone)."""
        with self._lock:
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)
