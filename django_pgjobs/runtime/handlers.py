"""The worker's handler threads: each runs claimed jobs one at a time, outside any transaction,
and hands how each ended to the worker; attempts past their time limit are abandoned and their
threads replaced (see runtime/timeouts.py)."""

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
from django_pgjobs.runtime import execute, timeouts
from django_pgjobs.runtime.timeouts import Deadlines

#: A job that waited longer than this for a thread (claimed beyond the threads, or behind slow
#: jobs) is looked up once before it starts: cancelled meanwhile, it is not started.
CANCEL_CHECK_AFTER = 0.1


class HandlerPool:
    """`size` threads running jobs; `finished(job, handled)` is called from the thread that ran
    the job; `timeout_of(job)` is its attempt's time limit in seconds (None: none)."""

    def __init__(
        self,
        size: int,
        finished: Callable[[Job, Handled], None],
        timeout_of: Callable[[Job], float | None],
    ) -> None:
        self.size = size
        self.finished, self.timeout_of = finished, timeout_of
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

    def held_up(self, longer_than: float) -> int:
        """How many threads have been running their current job for more than `longer_than`
        seconds (abandoned ones aside)."""
        since = time.perf_counter() - longer_than
        return sum(1 for started in list(self._since.values()) if started < since)

    def time_out(self) -> list[tuple[Job, Handled | None]]:
        """The attempts past their time limit: abandoned, each thread replaced by a new one;
        each with the outcome its runner had decided before it passed the limit, or None."""
        late = self.deadlines.overdue()
        for job, _ in late:
            job.cancel_requested = True  # what cancel_requested() tells the handler
            # An async one's coroutine can be stopped, at its next await.
            execute.cancel_coroutine(job)
            self._since.pop(id(job), None)
            self._start_thread()
        return late

    def _hand_in(self, job: Job, handled: Handled) -> None:
        if timeouts.decided_of(job) is None:  # most jobs: no runner decides before it tells
            self.finished(job, handled)
            return
        with self._closing:
            if not self._closed:
                self.finished(job, handled)

    def close_decided(self) -> None:
        """From now on, the outcomes runners decided before telling them are the caller's to
        record (a stopping worker, once its grace is over: timeouts.decided_of); a thread still
        telling (task_finished's receivers) hands in nothing more."""
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
