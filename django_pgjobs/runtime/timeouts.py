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
from collections.abc import Callable

from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled

#: Seconds a thread left at a time limit must still run to count as left behind (towards a
#: worker's recycle): a handler or receiver that ends a moment after the limit is not.
LINGER = 1.0

#: The attempt with a time limit begun last on this thread, and its pool's Deadlines.
_thread = threading.local()


def decided(job: Job, handled: Handled) -> bool:
    """Whether the attempt of `job` running on this thread ended within its time limit, asked
    by a runner once the handler has returned and its outcome is `handled`, before it tells
    anyone how it ended (Django's task_finished, backend.py). False: it was timed out
    meanwhile, its outcome recorded as JobTimeout; the runner tells nothing. True: `handled`
    is the attempt's outcome, and the runner tells it; should the telling outlast the limit
    (a receiver that hangs), the thread is abandoned as at any time-out, but `handled` is what
    is recorded (Deadlines.overdue), so what was told and the job's row agree. An attempt
    without a time limit, or outside a worker's handler thread (testing.run_jobs), is within
    it."""
    begun: tuple[Deadlines, Job] | None = getattr(_thread, "begun", None)
    if begun is None or begun[1] is not job:
        setattr(job, DECIDED, handled)
        return True
    return begun[0].decided(job, handled)


#: The attribute of a claimed Job that holds the outcome its runner decided (decided).
DECIDED = "_pgjobs_decided"


def decided_of(job: Job) -> Handled | None:
    """The outcome the runner of `job`'s attempt decided and told, if it did (decided): a
    worker that stops while the telling still runs records it, rather than release a job
    whose outcome was told (it would run again)."""
    handled: Handled | None = getattr(job, DECIDED, None)
    return handled


#: Threads telling of attempts timed out (an integration's: Django's task_finished receivers).
_telling: list[tuple[threading.Thread, float]] = []
_telling_lock = threading.Lock()


def tell(target: Callable[[], None], name: str) -> None:
    """Run `target` on a thread of its own, for an integration's time-out hook (registry's
    TimedOut, called on the worker's main thread), so that slow receivers do not hold the
    worker up. Not a daemon: a worker that exits now (a recycle, a stop) waits for it, as long
    as it waits for what handlers left (runtime/exiting.py). Counted while it runs (telling):
    a worker recycles when these and its abandoned threads add up to its concurrency.
    RuntimeError when no thread can be started."""
    thread = threading.Thread(target=target, name=name)
    thread.start()
    with _telling_lock:
        _telling.append((thread, time.monotonic()))


def telling() -> int:
    """Threads started by tell that still run LINGER seconds after they started."""
    with _telling_lock:
        return _left_behind(_telling)


def _left_behind(threads: list[tuple[threading.Thread, float]]) -> int:
    """How many of `threads` (each with when it was left) still run LINGER seconds after; those
    that ended are taken off the list."""
    now = time.monotonic()
    threads[:] = [(thread, at) for thread, at in threads if thread.is_alive()]
    return sum(1 for _, at in threads if now - at >= LINGER)


class Deadlines:
    """The attempts running on handler threads, each with its deadline (time.monotonic())."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, tuple[Job, float, threading.Thread]] = {}
        self._abandoned: list[tuple[threading.Thread, float]] = []

    def begin(self, job: Job, timeout: float | None) -> None:
        """The handler of `job` starts now on this thread."""
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._running[id(job)] = (job, deadline, threading.current_thread())
        _thread.begun = (self, job)

    def decided(self, job: Job, handled: Handled) -> bool:
        """The handler of `job` returned with `handled` as its outcome (see decided): False
        when it was timed out already."""
        with self._lock:
            if id(job) not in self._running:
                return False
            setattr(job, DECIDED, handled)  # under the lock: overdue reads it as it pops
            return True

    def end(self, job: Job) -> bool:
        """The handler of `job` returned; False when its attempt was timed out meanwhile (its
        outcome is not ours to record, and this thread was replaced)."""
        with self._lock:
            return self._running.pop(id(job), None) is not None

    def overdue(self) -> list[tuple[Job, Handled | None]]:
        """The attempts past their deadline, now abandoned with their threads; each with the
        outcome its runner had decided before (decided), or None: timed out."""
        now = time.monotonic()
        with self._lock:
            late = [key for key, (_, deadline, _) in self._running.items() if deadline <= now]
            abandoned = [self._running.pop(key) for key in late]
            self._abandoned += [(thread, now) for _, _, thread in abandoned]
            return [(job, decided_of(job)) for job, _, _ in abandoned]

    def next_in(self) -> float:
        """Seconds until the next deadline (inf without one)."""
        with self._lock:
            deadlines = [deadline for _, deadline, _ in self._running.values()]
        return min(deadlines, default=float("inf")) - time.monotonic()

    def abandoned(self) -> bool:
        """Whether an abandoned handler thread may still run."""
        return bool(self._abandoned)

    def abandoned_alive(self) -> int:
        """Abandoned handler threads still running LINGER seconds after they were abandoned
        (those that returned are gone; one that returns a moment late is not counted)."""
        with self._lock:
            return _left_behind(self._abandoned)
