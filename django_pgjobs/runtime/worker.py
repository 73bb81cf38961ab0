"""The worker loop: claim into free slots, run handlers on threads, settle their outcomes in
batches, and stop gracefully. It decides *when*; the data layer decides *how*."""

from __future__ import annotations

import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import DatabaseError, close_old_connections, connections, router

from django_pgjobs import registry, signals
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import UnknownTask
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.observability.activity import ActivityTally
from django_pgjobs.outcomes import Handled, Outcome
from django_pgjobs.runtime import execute, listener, policy
from django_pgjobs.runtime.chores import Chore, Promoter, Pruner, Reaper, Reporter, Ticker
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.leases import LeaseKeeper
from django_pgjobs.runtime.locks import LockWaits
from django_pgjobs.runtime.logs import log_activity, log_outcome
from django_pgjobs.runtime.outages import Outage, WorkerError
from django_pgjobs.runtime.scheduler import Scheduler
from django_pgjobs.runtime.settling import Settler

logger = logging.getLogger(__name__)


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
    promote_interval: float = 1.0  # how often due scheduled jobs join the claim index
    prune_interval: float = 60.0
    stats_interval: float = 10.0
    controls_interval: float = 1.0  # how often the Queue controls (pause, limits) are read


class Worker:
    """One worker process's runtime. ``run()`` returns True when it stopped (or, with once,
    drained) with every job it held recorded or released."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.id = worker_id()
        self.lease = options.lease or get_settings().LEASE
        self.db = router.db_for_write(Job)
        self.jobs = Job.objects.db_manager(self.db)
        self.activity = ActivityTally()
        self._todo: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Claimed and not yet settled, keyed by the claim (its Job object), never by job id: a
        # stale claim's outcome must not unregister a newer claim of the same job.
        self._in_flight: dict[int, Job] = {}
        self._lock = threading.Lock()  # guards _in_flight against the lease keeper
        self._settler = Settler(self)
        self._stopping = False
        self._deadline = float("inf")
        self._poll_now = True  # set by wake-ups: claim at the next turn of the loop
        self._next_poll = 0.0
        self._poll_delay = 0.0
        self._mean_duration: float | None = None  # of recent handlers, for the prefetch
        self._last_claim_empty = False
        self.controls = QueueControls(options.queues, options.controls_interval)
        self._chores: list[Chore] = [
            Reaper(self.jobs, options.reap_interval, self.poll_now),
            Promoter(self.jobs, options.promote_interval),
        ]
        if not options.once:
            self._chores += [
                Pruner(self.jobs, options.prune_interval),
                Ticker(Scheduler(self.db)),
            ]
        self._chores.append(Reporter(options.stats_interval, self._report))
        self._lock_waits = LockWaits(self.db)
        self._leases = LeaseKeeper(
            self.jobs, self.running_claims, self.lease_of, self.lease, self._lost,
            self._lock_waits,
        )  # fmt: skip
        self._threads: list[threading.Thread] = []

    # ---- control ---------------------------------------------------------------------------

    def stop(self, immediately: bool = False) -> None:
        """Stop claiming; finish in-flight jobs within the grace period (or release them now).
        Safe to call from a signal handler."""
        now = time.monotonic()
        self._deadline = now if self._stopping or immediately else now + self.options.grace
        self._stopping = True
        self._wake.set()

    def poll_now(self) -> None:
        self._poll_now = True
        self._wake.set()

    def run(self) -> bool:
        """Run until stopped (or, with once, drained). WorkerError, with once, when the
        database cannot be used at all."""
        options = self.options
        logger.info(
            "worker %s started: queues=%s concurrency=%d batch=%d lease=%gs listen=%s",
            self.id, ",".join(options.queues), options.concurrency, options.batch_size,
            self.lease, "yes" if options.listen and not options.once else "no",
        )  # fmt: skip
        self._lock_waits.limit_this_thread()
        self._start_threads()
        outage = Outage()
        while True:
            try:
                self._turn()
                outage.over()
            except DatabaseError as error:
                if options.once:
                    self._shutdown()
                    raise WorkerError(outage.describe(error)) from error
                pause = outage.failed(error)
                connections[self.db].close()
                self._poll_now = True  # after a reconnect, look at once
                self._wake.wait(pause)  # a stop signal ends the wait
                self._wake.clear()
                if not self._stopping:
                    continue
            if self._stopping:
                if not self._in_flight or time.monotonic() >= self._deadline:
                    break
            elif options.once and self._last_claim_empty and not self._in_flight:
                break
            self._wake.wait(self._wait_time())
            self._wake.clear()
        return self._shutdown()

    # ---- the loop's steps ------------------------------------------------------------------

    def _turn(self) -> None:
        # Before claiming: never claim from a paused queue.
        if self.controls.read_if_due(self.db):
            self._poll_now = True  # a queue was resumed: look at once
        self._settler.settle_and_fetch()
        if self._stopping:
            self._release_unstarted()
        else:
            for chore in self._chores:
                chore.run_if_due()

    def free_slots(self) -> int:
        options = self.options
        extra = policy.prefetch(options.concurrency, options.batch_size, self._mean_duration)
        return options.concurrency + extra - len(self._in_flight)

    def claim_wanted(self, freed: int) -> int:
        """How many jobs to claim this turn, `freed` slots being about to open (0: none)."""
        free = self.free_slots() + freed
        due = self._poll_now or time.monotonic() >= self._next_poll
        if self._stopping or free <= 0 or not due:
            return 0
        self._poll_now = False
        return min(free, self.options.batch_size)

    def claim_limited(self, wanted: int, into: list[Job]) -> None:
        """Claim up to `wanted` jobs from the queues with a limit, into `into` (which keeps
        what was claimed if a later queue's claim fails)."""
        start = len(into)
        for queue_name in self.controls.limited:
            room = wanted - (len(into) - start)
            if room > 0:
                into += self.jobs.claim_limited(
                    queue_name, worker=self.id, limit=room, lease=self.lease
                )

    def take(self, jobs: list[Job], wanted: int) -> None:
        """Hand claimed jobs to the handler threads, then schedule the next poll."""
        longer = [job for job in jobs if self.lease_of(job) > self.lease]
        if longer:
            self.jobs.heartbeat(longer, self.lease_of(longer[0]))
        self.activity.claimed(jobs)
        with self._lock:
            for job in jobs:
                self._in_flight[id(job)] = job
        for job in jobs:
            self._todo.put(job)
        self._last_claim_empty = not jobs
        self._poll_delay = policy.poll_delay(
            self._poll_delay, len(jobs), wanted, self.options.poll_interval
        )
        self._next_poll = time.monotonic() + self._poll_delay

    def settled(self, job: Job, handled: Handled, outcome: Outcome) -> None:
        """Forget a claim whose outcome was recorded (or refused), count and announce it."""
        with self._lock:
            self._in_flight.pop(id(job), None)
        self.activity.finished(job, outcome)
        if job.queue in self.controls.limited:
            self._poll_now = True  # a slot under the queue's limit is free again
        signals.announce(
            job, outcome, duration=handled.duration, error=handled.failure, delay=handled.delay
        )
        log_outcome(job, handled, outcome)

    def learn_durations(self, durations: list[float]) -> None:
        self._mean_duration = policy.mean_duration(self._mean_duration, durations)

    def running_claims(self) -> list[Job]:
        """The claims whose handlers have not finished (the lease keeper renews these)."""
        with self._lock:
            claims = list(self._in_flight.values())
        return self._settler.unfinished(claims)

    def lease_of(self, job: Job) -> float:
        try:
            return registry.get_task(job.task).lease or self.lease
        except UnknownTask:
            return self.lease

    def _lost(self, jobs: list[Job]) -> None:
        for job in jobs:
            logger.warning(
                "lost the lease of job %s (%s); its outcome will not be recorded", job.pk, job.task
            )

    def _report(self, seconds: float) -> None:
        """Write what this worker did per queue since the last report (QueueStat rows), and
        log it in one line."""
        activity, self.activity = self.activity, ActivityTally()
        QueueStat.objects.using(self.db).bulk_create(
            activity.rows(self.id, seconds, self.options.queues)
        )
        log_activity(activity, seconds, len(self._in_flight))

    def _wait_time(self) -> float:
        """Until the next chore or poll; finishing handlers and wake-ups interrupt the wait."""
        waits = [chore.due_in() for chore in self._chores]
        waits.append(self._settler.due_in())
        if self._stopping:
            waits.append(self._deadline - time.monotonic())
        elif self.free_slots() > 0:
            waits.append(self._next_poll - time.monotonic())
        return max(0.0, min(waits))

    # ---- threads ---------------------------------------------------------------------------

    def _start_threads(self) -> None:
        for n in range(self.options.concurrency):
            thread = threading.Thread(target=self._handle, name=f"pgjobs-handler-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.options.listen and not self.options.once:
            thread = threading.Thread(
                target=listener.listen,
                args=(self.db, self._on_notify, self.poll_now, lambda: self._stopping),
                name="pgjobs-listener",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._leases.start()

    def _handle(self) -> None:
        """A handler thread: run jobs outside any transaction, connections handled per job the
        way Django handles them per request. Whatever happens, each job gets an outcome."""
        while (job := self._todo.get()) is not None:
            started = time.perf_counter()
            try:
                close_old_connections()
                signals.send(signals.job_started, Job, job=job)
                handled = execute.run(job)  # never raises; its duration is the handler's own
                close_old_connections()
            except BaseException as error:
                handled = execute.raised(job, error, None, (), started)
            if self._settler.finished(job, handled):
                self._wake.set()
        connections.close_all()

    def _on_notify(self, queue_name: str) -> None:
        if queue_name in self.options.queues:
            self.poll_now()

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
            try:
                self.jobs.release(unstarted)
            finally:
                with self._lock:
                    for job in unstarted:
                        self._in_flight.pop(id(job), None)

    def _shutdown(self) -> bool:
        """Release what is left; True when every job this worker held was recorded or
        released."""
        self._leases.stop()
        for _ in range(self.options.concurrency):
            self._todo.put(None)
        left = list(self._in_flight.values())
        clean = True
        try:
            self._settler.settle_and_fetch()
            left = list(self._in_flight.values())
            if left:
                released = self.jobs.release(left)
                logger.warning(
                    "released %d unfinished jobs back to ready: %s",
                    len(released), ", ".join(str(pk) for pk in released),
                )  # fmt: skip
        except DatabaseError as error:
            clean = not left
            if left:
                logger.error(
                    "could not release %d jobs (%s); they return when their leases expire",
                    len(left), str(error).strip().splitlines()[0],
                )  # fmt: skip
        reporter = next(chore for chore in self._chores if isinstance(chore, Reporter))
        seconds = max(1e-3, time.monotonic() - reporter.since)
        try:
            self._report(seconds)
        except DatabaseError:
            log_activity(self.activity, seconds, len(self._in_flight))
        connections.close_all()
        self._lock_waits.stop()
        logger.info("worker %s stopped", self.id)
        return clean
