"""The worker's handler threads: each runs claimed jobs one at a time, outside any transaction,
and hands how each ended to the worker; an attempt past its time limit is abandoned."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

from django.db import close_old_connections, connections

from django_pgjobs import signals
from django_pgjobs.errors import JobCancelled
from django_pgjobs.models import Job
from django_pgjobs.outcomes import Handled
from django_pgjobs.runtime import execute

#: A job that waited longer than this for a thread (claimed beyond the threads, or behind slow
#: jobs) is looked up once before it starts: cancelled meanwhile, it is not started.
CANCEL_CHECK_AFTER = 0.1


class HandlerPool:
    """`size` threads running jobs; `finished(job, handled)` is called from the thread that ran
    the job; `timeout_of(job)` is its attempt's time limit in seconds (None: none), and
    `deadline_set()` is called when an attempt with one begins (its deadline is then known)."""

    def __init__(
        self,
        size: int,
        finished: Callable[[Job, Handled], None],
        timeout_of: Callable[[Job], float | None],
        deadline_set: Callable[[], None] = lambda: None,
    ) -> None:
        self.size = size
        self.finished, self.timeout_of = finished, timeout_of
        self.deadline_set = deadline_set
        self.deadlines = Deadlines()
        self._closing, self._closed = threading.Lock(), False
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._count = 0
        self._since: dict[int, float] = {}  # id(job) → when its handler started (perf_counter)
        self._submitted: dict[int, float] = {}  # id(job) → when it was handed over (perf_counter)

    def start(self) -> None:
        for _ in range(self.size):
            self._start_thread()

    def submit(self, job: Job) -> None:
        self._submitted[id(job)] = time.perf_counter()
        self._todo.put(job)

    def unstarted(self) -> list[Job]:
        """Take back the jobs no thread has started yet."""
        jobs: list[Job] = []
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                return jobs
            if job is not None:
                self._submitted.pop(id(job), None)
                jobs.append(job)

    def _cancelled_before(self, job: Job, started: float) -> bool:
        """Whether `job`, about to start, was cancelled while it waited for this thread: the
        heartbeats bring the news; one that waited longer than CANCEL_CHECK_AFTER asks too."""
        waited = started - self._submitted.pop(id(job), started)
        if job.cancel_requested:
            return True
        if waited > CANCEL_CHECK_AFTER and execute.cancel_asked(job):
            job.cancel_requested = True
            return True
        return False

    def busy(self, longer_than: float) -> int:
        """How many threads have been running their current job for more than `longer_than`
        seconds (abandoned ones aside)."""
        since = time.perf_counter() - longer_than
        return sum(1 for started in list(self._since.values()) if started < since)

    def time_out(self) -> list[tuple[Job, Handled | None]]:
        """The attempts past their time limit: abandoned, each thread replaced by a new one;
        each with the outcome its runner kept before it passed the limit, or None."""
        late = self.deadlines.overdue()
        for job, _ in late:
            job.cancel_requested = True  # what cancel_requested() tells the handler
            # An async one's coroutine can be stopped, at its next await.
            execute.cancel_coroutine(job)
            self._since.pop(id(job), None)
            self._start_thread()
        return late

    def _hand_in(self, job: Job, handled: Handled) -> None:
        if kept_outcome(job) is None:  # most jobs: no runner decides before it tells
            self.finished(job, handled)
            return
        with self._closing:
            if not self._closed:
                self.finished(job, handled)

    def stop_hand_ins(self) -> None:
        """From now on, the outcomes runners kept before their hooks ran are the caller's to
        record (a stopping worker, once its grace is over: kept_outcome); a thread whose hook
        still runs (task_finished's receivers) hands in nothing more."""
        with self._closing:
            self._closed = True

    def stop(self) -> None:
        """Let every thread that is not abandoned end after its current job."""
        for _ in range(self.size):
            self._todo.put(None)

    def _start_thread(self) -> None:
        name = f"pgjobs-handler-{self._count}"
        self._count += 1
        threading.Thread(target=self._handle, name=name, daemon=True).start()

    def _handle(self) -> None:
        """Run jobs, connections handled per job the way Django handles them per request.
        Whatever happens, each job gets an outcome."""
        aged = True  # this thread's connections may have aged since they were last looked at
        pid = os.getpid()
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                job, aged = self._todo.get(), True
            if job is None:
                break
            started = self._since[id(job)] = time.perf_counter()
            timeout = self.timeout_of(job)
            if timeout is not None:
                self.deadlines.begin(job, timeout)
                self.deadline_set()  # the caller's wait must now end by this deadline
            try:
                # Django closes obsolete connections before and after each request. After one
                # job and before the next one taken at once, they are the same look: it is
                # taken again only when the thread waited for its job.
                if aged:
                    close_old_connections()
                if self._cancelled_before(job, started):
                    handled = execute.refused(JobCancelled("cancelled before its handler started"))
                else:
                    signals.send(signals.job_started, Job, job=job)
                    handled = execute.run(job)  # never raises; its duration is the handler's own
                    close_old_connections()
                    aged = False
            except BaseException as error:
                handled = execute.raised(job, error, None, (), started)
                aged = True
            if os.getpid() != pid:
                # A fork the handler made and returned in: it must not run the worker's code,
                # nor keep its sockets (the LISTEN session's among them) open for good.
                os._exit(0)
            self._since.pop(id(job), None)
            if timeout is not None and not self.deadlines.end(job):
                break  # timed out: recorded already, and this thread was replaced
            self._hand_in(job, handled)
        execute.release_awaiter()
        connections.close_all()


# ---- time limits --------------------------------------------------------------------------------

#: Seconds a thread left at a time limit must still run to count as left behind (towards a
#: worker's recycle): a handler or receiver that ends a moment after the limit is not.
LEFT_AFTER = 1.0

#: The attempt with a time limit begun last on this thread, and its pool's Deadlines.
_thread = threading.local()


def keep_outcome(job: Job, handled: Handled) -> bool:
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
        setattr(job, KEPT, handled)
        return True
    return begun[0].keep_outcome(job, handled)


#: The attribute of a claimed Job that holds the outcome its runner kept (keep_outcome).
KEPT = "_pgjobs_kept_outcome"


def kept_outcome(job: Job) -> Handled | None:
    """The outcome the runner of `job`'s attempt kept and told, if it did (keep_outcome): a
    worker that stops while its hook still runs records it, rather than release a job
    whose outcome was told (it would run again)."""
    handled: Handled | None = getattr(job, KEPT, None)
    return handled


#: Hooks run aside for attempts timed out (an integration's: Django's task_finished receivers).
_hooks_aside: list[tuple[threading.Thread, float]] = []
_hooks_aside_lock = threading.Lock()


def run_hook_aside(target: Callable[[], None], name: str) -> None:
    """Run `target` on a thread of its own, for an integration's time-out hook (registry's
    TimedOut, called on the worker's main thread), so that slow receivers do not hold the
    worker up. Not a daemon: a worker that exits now (a recycle, a stop) waits for it, as long
    as it waits for what handlers left (runtime/processes.py). Counted while it runs (hooks_aside):
    a worker recycles when these and its abandoned threads add up to its concurrency.
    RuntimeError when no thread can be started."""
    thread = threading.Thread(target=target, name=name)
    thread.start()
    with _hooks_aside_lock:
        _hooks_aside.append((thread, time.monotonic()))


def hooks_aside() -> int:
    """Threads started by run_hook_aside that still run LEFT_AFTER seconds after they started."""
    with _hooks_aside_lock:
        return _still_running(_hooks_aside)


def _still_running(threads: list[tuple[threading.Thread, float]]) -> int:
    """How many of `threads` (each with when it was left) still run LEFT_AFTER seconds after; those
    that ended are taken off the list."""
    now = time.monotonic()
    threads[:] = [(thread, at) for thread, at in threads if thread.is_alive()]
    return sum(1 for _, at in threads if now - at >= LEFT_AFTER)


class Deadlines:
    """The attempts running on handler threads, each with its deadline (time.monotonic()).

    Python cannot stop a thread. So when an attempt passes its time limit, the worker records it
    as failed (JobTimeout: retried or dead-lettered by the task's policy) at once, tells the
    handler through cancel_requested(), starts a new handler thread in its place so capacity
    recovers, and forgets the old thread: whatever that thread does later is not recorded.
    Abandoned threads that never return still hold what they hold (memory, a connection); when
    as many have piled up as the worker has threads, the worker stops gracefully and exits for
    recycling (see Exit), and its supervisor (runjobs --processes) or process manager starts a
    fresh one.
    """

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

    def keep_outcome(self, job: Job, handled: Handled) -> bool:
        """The handler of `job` returned with `handled` as its outcome (see keep_outcome): False
        when it was timed out already."""
        with self._lock:
            if id(job) not in self._running:
                return False
            setattr(job, KEPT, handled)  # under the lock: overdue reads it as it pops
            return True

    def end(self, job: Job) -> bool:
        """The handler of `job` returned; False when its attempt was timed out meanwhile (its
        outcome is not ours to record, and this thread was replaced)."""
        with self._lock:
            return self._running.pop(id(job), None) is not None

    def overdue(self) -> list[tuple[Job, Handled | None]]:
        """The attempts past their deadline, now abandoned with their threads; each with the
        outcome its runner kept before (keep_outcome), or None: timed out."""
        now = time.monotonic()
        with self._lock:
            late = [key for key, (_, deadline, _) in self._running.items() if deadline <= now]
            abandoned = [self._running.pop(key) for key in late]
            self._abandoned += [(thread, now) for _, _, thread in abandoned]
            return [(job, kept_outcome(job)) for job, _, _ in abandoned]

    def next_in(self) -> float:
        """Seconds until the next deadline, or until an abandoned thread still running counts
        as left behind (abandoned_alive): the worker looks then (inf: neither)."""
        now = time.monotonic()
        with self._lock:
            deadlines = [deadline for _, deadline, _ in self._running.values()]
            deadlines += [
                at + LEFT_AFTER for thread, at in self._abandoned if at + LEFT_AFTER > now
            ]
        return min(deadlines, default=float("inf")) - now

    def abandoned_alive(self) -> int:
        """Abandoned handler threads still running LEFT_AFTER seconds after they were abandoned
        (those that returned are gone; one that returns a moment late is not counted)."""
        with self._lock:
            return _still_running(self._abandoned)
