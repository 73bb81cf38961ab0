"""The runtime: claim into free slots, run handlers on threads, settle outcomes in batches,
heartbeat, reap, prune, and stop gracefully. It decides *when*; the manager decides *how*."""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from uuid import UUID

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
    router,
)
from django.db.models.functions import Now

from django_pgjobs import execute, notify, periodic, registry, signals
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import UnknownTask
from django_pgjobs.execute import Outcome, Result
from django_pgjobs.manager import FailedAttempt, Failure
from django_pgjobs.models import Job, Queue, QueueStat
from django_pgjobs.observability.activity import ActivityTally as Activity

logger = logging.getLogger(__name__)

#: Longest a finished job's outcome waits for others to share its statement (see _settle_due).
SETTLE_DELAY = 0.002

#: A worker claims more jobs than it has threads only as many as those threads are expected to
#: start within this many seconds (from the handlers' recent mean duration): fast jobs then never
#: wait for a round trip to the database, and slow ones are never hoarded from other workers.
PREFETCH_HORIZON = 0.05


def _extra(job: Job, duration: float) -> dict[str, object]:
    """The fields of a job's log records, for structured (e.g. JSON) log handlers."""
    return {
        "job_id": str(job.pk),
        "task": job.task,
        "queue": job.queue,
        "attempt": job.attempts,
        "duration": round(duration, 6),
    }


def worker_id() -> str:
    """Unique per process: host, pid and a random suffix (pids are reused, hosts are cloned)."""
    return f"{socket.gethostname()[:150]}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class Options:
    queues: Sequence[str] = ("default",)
    concurrency: int = 10
    batch_size: int = 100
    lease: float | None = None  # default PGJOBS["LEASE"]
    grace: float = 30.0
    poll_interval: float = 2.0
    listen: bool = True
    once: bool = False
    reap_interval: float = 5.0
    prune_interval: float = 60.0
    stats_interval: float = 10.0
    controls_interval: float = 1.0  # how often the Queue controls (pause, limits) are read


@dataclass
class _Timers:
    """When each periodic chore is next due (time.monotonic())."""

    heartbeat: float = 0.0
    reap: float = 0.0
    prune: float = 0.0
    controls: float = 0.0
    stats: float = field(default_factory=time.monotonic)
    periodic: float = 0.0


class Worker:
    """One worker process's runtime. ``run()`` returns when stopped (or, with once, drained)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.id = worker_id()
        self.lease = options.lease or get_settings().LEASE
        self.db = router.db_for_write(Job)
        self.jobs = Job.objects.db_manager(self.db)
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._done: list[tuple[Job, Outcome]] = []
        self._first_done_at = 0.0  # when the oldest unsettled outcome came in
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._in_flight: dict[UUID, Job] = {}  # claimed and not yet settled; main thread only
        self._stopping = False
        self._deadline = float("inf")
        self._poll_now = True  # set by wake-ups: claim at the next turn of the loop
        self._next_poll = 0.0
        self._poll_delay = 0.0
        self._mean_duration: float | None = None  # of recent handlers, for the prefetch
        self._last_claim_empty = False
        self._activity = Activity()
        # From the Queue controls: queues claimed freely, and those claimed under their limit.
        self._open_queues: list[str] = list(options.queues)
        self._limited_queues: list[str] = []
        self._timers = _Timers()
        self._periodic = periodic.Scheduler(self.db)
        self._threads: list[threading.Thread] = []

    # ---- control ---------------------------------------------------------------------------

    def stop(self, immediately: bool = False) -> None:
        """Stop claiming; finish in-flight jobs within the grace period (or release them now)."""
        now = time.monotonic()
        if self._stopping or immediately:
            self._deadline = now
        else:
            self._deadline = now + self.options.grace
        self._stopping = True
        self._wake.set()

    def run(self) -> None:
        options = self.options
        logger.info(
            "worker %s started: queues=%s concurrency=%d batch=%d lease=%gs listen=%s",
            self.id, ",".join(options.queues), options.concurrency, options.batch_size,
            self.lease, "yes" if options.listen and not options.once else "no",
        )  # fmt: skip
        self._start_threads()
        failures = 0
        while True:
            try:
                if time.monotonic() >= self._timers.controls:
                    self._read_controls()  # before claiming: never claim from a paused queue
                    self._timers.controls = time.monotonic() + options.controls_interval
                self._settle_and_fetch()
                if self._stopping:
                    self._release_unstarted()
                    if not self._in_flight or time.monotonic() >= self._deadline:
                        break
                self._chores()
                failures = 0
            except DatabaseError as error:
                failures += 1
                pause = min(5.0, 0.05 * 2**failures)
                # A lost connection is expected now and then; any other database error in the
                # worker's own statements is a bug or a broken schema, worth an operator's eye.
                lost = isinstance(error, OperationalError | InterfaceError)
                (logger.warning if lost else logger.error)(
                    "database error in the worker loop; reconnecting in %.2fs", pause, exc_info=True
                )
                connections[self.db].close()
                self._poll_now = True  # after a reconnect, look at once
                time.sleep(pause)
                continue
            if options.once and self._last_claim_empty and not self._in_flight:
                break
            self._wake.wait(self._wait_time())
            self._wake.clear()
        self._shutdown()

    # ---- the loop's steps ------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.options.concurrency + self._prefetch() - len(self._in_flight)

    def _prefetch(self) -> int:
        """How many jobs beyond the threads to hold: what they start within PREFETCH_HORIZON."""
        if self._mean_duration is None:
            return 0
        expected = self.options.concurrency * PREFETCH_HORIZON / max(self._mean_duration, 1e-6)
        return min(self.options.batch_size, int(expected))

    def _settle_and_fetch(self) -> None:
        """Record finished handlers' outcomes and claim into the free slots, in one statement
        (one round trip and one commit per turn); a Retry asked by a handler is recorded on
        its own, and so is each claim from a queue with a limit."""
        with self._lock:
            if not self._settle_due():
                return
            done, self._done = self._done, []
        succeeded: list[Job] = []
        results: dict[UUID, str] = {}
        failed: list[FailedAttempt] = []
        durations = {job.pk: outcome.duration for job, outcome in done}
        if durations:
            mean = sum(durations.values()) / len(durations)
            previous = self._mean_duration
            self._mean_duration = mean if previous is None else 0.8 * previous + 0.2 * mean
        try:
            for job, outcome in done:
                if outcome.result is Result.SUCCEEDED:
                    succeeded.append(job)
                    if outcome.result_json is not None:
                        results[job.pk] = outcome.result_json
                elif outcome.result is Result.ERROR:
                    assert outcome.failure is not None
                    failed.append((job, outcome.failure, outcome.permanent, outcome.delay))
                else:  # the handler asked to run again later
                    owned = self.jobs.retry_later(job, outcome.delay)
                    self._in_flight.pop(job.pk, None)
                    self._finished(
                        job, "retried" if owned else "lost", outcome.duration, delay=outcome.delay
                    )
            # The slots of the jobs recorded below are free for this claim.
            free = self._free_slots() + len(succeeded) + len(failed)
            claim = (
                not self._stopping
                and free > 0
                and (self._poll_now or time.monotonic() >= self._next_poll)
            )
            wanted = min(free, self.options.batch_size) if claim else 0
            if not (claim or succeeded or failed):
                return
            if claim:
                self._poll_now = False
            owned_ids, statuses, jobs = self.jobs.finish_and_claim(
                succeeded, failed, self._open_queues if claim else [], worker=self.id,
                limit=wanted, lease=self.lease, results=results,
            )  # fmt: skip
        except DatabaseError:
            # Keep what was not recorded; it is tried again after the reconnect. Recording
            # twice is harmless: the guard refuses the second write.
            with self._lock:
                self._done[:0] = [item for item in done if item[0].pk in self._in_flight]
            raise
        for job in succeeded:
            self._in_flight.pop(job.pk, None)
            self._finished(job, "succeeded" if job.pk in owned_ids else "lost", durations[job.pk])
        for job, failure, _, delay in failed:
            self._in_flight.pop(job.pk, None)
            self._failed(job, failure, statuses.get(job.pk), durations[job.pk], delay)
        if claim:
            try:
                for queue_name in self._limited_queues:
                    if len(jobs) < wanted:
                        jobs += self.jobs.claim_limited(
                            queue_name, worker=self.id, limit=wanted - len(jobs), lease=self.lease
                        )
            finally:  # what was claimed runs, even if a limited queue's claim failed
                self._take(jobs, wanted)

    def _take(self, jobs: list[Job], wanted: int) -> None:
        """Hand claimed jobs to the handler threads, then schedule the next poll: at once after
        a full batch, backing off towards the poll interval while the queue is empty."""
        longer = [job for job in jobs if self._lease_of(job) > self.lease]
        if longer:
            self.jobs.heartbeat(longer, self._lease_of(longer[0]))
        self._activity.claimed(jobs)
        for job in jobs:
            self._in_flight[job.pk] = job
            self._todo.put(job)
        self._last_claim_empty = not jobs
        if len(jobs) == wanted:
            self._poll_delay = 0.0
        elif jobs:
            self._poll_delay = 0.05  # the queue just ran dry: look again soon
        else:
            self._poll_delay = min(self.options.poll_interval, max(0.05, self._poll_delay * 2))
        self._next_poll = time.monotonic() + self._poll_delay

    def _finished(
        self, job: Job, outcome: str, duration: float, error: Failure | None = None,
        delay: float | None = None,
    ) -> None:  # fmt: skip
        """Count and announce one recorded outcome (nothing is announced for a lost job)."""
        self._activity.finished(job, outcome)
        if job.queue in self._limited_queues:
            self._poll_now = True  # a slot under the queue's limit is free again
        signals.announce(job, outcome, duration=duration, error=error, delay=delay)
        if outcome == "succeeded" and logger.isEnabledFor(logging.DEBUG):
            logger.debug("job %s (%s) succeeded", job.pk, job.task, extra=_extra(job, duration))

    def _failed(
        self, job: Job, failure: Failure, status: str | None, duration: float, delay: float
    ) -> None:
        outcome = signals.OUTCOME_OF_STATUS.get(status or "", "lost")
        self._finished(job, outcome, duration, failure, delay)
        if outcome == "lost":
            return
        extra = _extra(job, duration) | {"error": failure.summary, "status": status}
        if outcome == "cancelled":
            logger.info("job %s (%s) cancelled", job.pk, job.task, extra=extra)
            return
        dead = outcome == "failed"
        (logger.error if dead else logger.info)(
            "job %s (%s) attempt %d failed: %s%s", job.pk, job.task, job.attempts,
            failure.summary, "; dead-lettered" if dead else "", extra=extra,
        )  # fmt: skip

    def _chores(self) -> None:
        now, timers, options = time.monotonic(), self._timers, self.options
        if now >= timers.heartbeat:
            self._heartbeat()
            timers.heartbeat = now + self._heartbeat_interval()
        if now >= timers.reap:
            returned, failed = self.jobs.reap()
            if returned or failed:
                logger.warning(
                    "reaped %d jobs with expired leases (%d failed)", returned + failed, failed
                )
                self._poll_now = True
            timers.reap = now + options.reap_interval
        if now >= timers.prune and not options.once:
            # One bounded batch per turn of the loop while there is a backlog to prune.
            full = self.jobs.prune(max_batches=1) == get_settings().PRUNE_BATCH
            timers.prune = now if full else now + options.prune_interval
            QueueStat.objects.using(self.db).filter(
                at__lt=Now() - get_settings().STATS_RETENTION
            ).delete()
        if now >= timers.periodic and not options.once:
            # Returns when a tick may next be due: the worker wakes for it (_wait_time).
            timers.periodic = now + self._periodic.enqueue_due()
        if now >= timers.stats + options.stats_interval:
            self._report(now - timers.stats)
            timers.stats = now

    def _read_controls(self) -> None:
        """Which of our queues are paused or limited, as every worker sees it within a second."""
        controls = Queue.objects.using(self.db).filter(name__in=self.options.queues)
        paused = {queue.name for queue in controls if queue.paused}
        limited = {queue.name for queue in controls if queue.max_running is not None}
        before = set(self._open_queues)
        self._open_queues = [q for q in self.options.queues if q not in paused | limited]
        self._limited_queues = [q for q in self.options.queues if q in limited - paused]
        if set(self._open_queues) - before:
            self._poll_now = True  # a queue was resumed: look at once
        if paused:
            logger.debug("paused queues: %s", ", ".join(sorted(paused)))

    def _heartbeat(self) -> None:
        by_lease: dict[float, list[Job]] = {}
        for job in self._in_flight.values():
            by_lease.setdefault(self._lease_of(job), []).append(job)
        for lease, jobs in by_lease.items():
            owned = self.jobs.heartbeat(jobs, lease)
            for job in jobs:
                if job.pk not in owned:
                    logger.warning(
                        "lost the lease of job %s (%s); its outcome will not be recorded",
                        job.pk,
                        job.task,
                    )

    def _heartbeat_interval(self) -> float:
        return min([self.lease, *map(self._lease_of, self._in_flight.values())]) / 3

    def _lease_of(self, job: Job) -> float:
        try:
            return registry.get_task(job.task).lease or self.lease
        except UnknownTask:
            return self.lease

    def _report(self, seconds: float) -> None:
        """Write what this worker did per queue since the last report (QueueStat rows), and
        log it in one line."""
        activity, self._activity = self._activity, Activity()
        QueueStat.objects.using(self.db).bulk_create(
            activity.rows(self.id, seconds, self.options.queues)
        )
        self._log_stats(activity, seconds)

    def _log_stats(self, activity: Activity, seconds: float) -> None:
        if activity.queues or self._in_flight:
            done, dead = activity.total("succeeded"), activity.total("failed")
            logger.info(
                "last %.0fs: done=%d retried=%d dead=%d cancelled=%d lost=%d in_flight=%d "
                "(%.0f jobs/s)", seconds, done, activity.total("retried"), dead,
                activity.total("cancelled"), activity.total("lost"), len(self._in_flight),
                (done + dead) / seconds,
            )  # fmt: skip

    def _settle_due(self) -> bool:
        """Whether to record the finished outcomes now, or let a few more handlers finish first
        so that one statement covers them all (held with self._lock).

        Handlers finish one by one; settling each as it comes would split the worker's batches
        into ever smaller claims. So while other handlers still run, wait up to SETTLE_DELAY
        for them (a full batch is settled at once).
        """
        pending = len(self._done)
        if self._stopping or not pending or pending == len(self._in_flight):
            return True
        if pending >= min(self.options.concurrency, self.options.batch_size):
            return True
        return time.monotonic() >= self._first_done_at + SETTLE_DELAY

    def _wait_time(self) -> float:
        """Until the next chore or poll; finishing handlers and wake-ups interrupt the wait."""
        deadlines = [self._timers.heartbeat, self._timers.reap]
        if not self.options.once:
            deadlines.append(self._timers.periodic)
        if self._done:
            deadlines.append(self._first_done_at + SETTLE_DELAY)
        if self._stopping:
            deadlines.append(self._deadline)
        elif self._free_slots():
            deadlines.append(self._next_poll)
        return max(0.0, min(deadlines) - time.monotonic())

    # ---- threads ---------------------------------------------------------------------------

    def _start_threads(self) -> None:
        for n in range(self.options.concurrency):
            thread = threading.Thread(target=self._handle, name=f"pgjobs-handler-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.options.listen and not self.options.once:
            listener = threading.Thread(
                target=notify.listen,
                args=(self.db, self._on_notify, self._on_listen, lambda: self._stopping),
                name="pgjobs-listener",
                daemon=True,
            )
            listener.start()
            self._threads.append(listener)

    def _handle(self) -> None:
        """A handler thread: run jobs outside any transaction, connections handled per job the way
        Django handles them per request."""
        while (job := self._todo.get()) is not None:
            close_old_connections()
            signals.send(signals.job_started, job=job)
            outcome = execute.run(job)  # its duration is the handler's own
            close_old_connections()
            with self._lock:
                first = not self._done
                if first:
                    self._first_done_at = time.monotonic()
                self._done.append((job, outcome))
                # Wake the main thread for the first outcome (it then waits at most
                # SETTLE_DELAY) and when the outcomes are due, not for every one of them.
                wake = first or self._settle_due()
            if wake:
                self._wake.set()
        connections.close_all()

    def _on_notify(self, queue_name: str) -> None:
        if queue_name in self.options.queues:
            self._poll_now = True
            self._wake.set()

    def _on_listen(self) -> None:
        self._poll_now = True  # whatever was announced while we were disconnected
        self._wake.set()

    # ---- shutdown --------------------------------------------------------------------------

    def _release_unstarted(self) -> None:
        """Jobs claimed but not yet handed to a thread go back at once."""
        unstarted = []
        while True:
            try:
                job = self._todo.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                unstarted.append(job)
        if unstarted:
            self.jobs.release(unstarted)
            for job in unstarted:
                self._in_flight.pop(job.pk, None)

    def _shutdown(self) -> None:
        left = list(self._in_flight.values())
        for _ in self._threads:
            self._todo.put(None)
        try:
            if left:
                released = self.jobs.release(left)
                logger.warning(
                    "released %d unfinished jobs back to ready: %s",
                    len(released), ", ".join(str(pk) for pk in released),
                )  # fmt: skip
        except DatabaseError:
            logger.exception(
                "could not release %d jobs; they return when their lease expires", len(left)
            )
        seconds = max(1e-3, time.monotonic() - self._timers.stats)
        try:
            self._report(seconds)
        except DatabaseError:
            self._log_stats(self._activity, seconds)
        connections.close_all()
        logger.info("worker %s stopped", self.id)
