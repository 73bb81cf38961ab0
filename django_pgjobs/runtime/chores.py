"""The housekeeping every worker shares, each chore an object with its own rhythm.

A chore's `run()` does its work and returns the seconds until it is due again; the worker
calls `due_in()` to know how long it may wait. Chores run on the worker's main thread, except
the lease keeper, which has a thread of its own (runtime/leases.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from uuid import UUID

from django.db import DatabaseError, connections
from django.db.models.functions import Now

from django_pgjobs import registry, retry
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows
from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.records import TakenBack
from django_pgjobs.errors import UnknownTask, text_of
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.logs import quietly
from django_pgjobs.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: Scheduled jobs moved into the claim index per statement.
PROMOTE_BATCH = 1000


class Chore:
    """Something a worker does now and then. One that fails is tried again after a pause of
    its own, doubling up to policy.OUTAGE_BACKOFF_MAX, and says so (the traceback once): a
    chore that cannot be done (the worker's role may not delete statistics, a prune outlasts
    a statement_timeout) must hold up neither the claims nor the other chores, as it would
    if it failed the worker's turn. A lost connection is the worker's outage, as ever."""

    def __init__(self, first_in: float = 0.0) -> None:
        self.next_at = time.monotonic() + first_in
        self.failures = 0

    def due_in(self) -> float:
        return self.next_at - time.monotonic()

    def run_if_due(self) -> None:
        if self.due_in() > 0:
            return
        try:
            wait = self.run()
        except Exception as error:
            if _connection_lost(error):
                raise  # the worker's outage (runtime/outages.py)
            self.failures += 1
            self.failed(error)
            wait = policy.outage_pause(self.failures)
            name, first = type(self).__name__, _first_line(error)
            if self.failures == 1:
                quietly(
                    logger.error, "%s failed (%s); trying again in %.1fs", name, first, wait,
                    exc_info=error,
                )  # fmt: skip
            else:
                quietly(
                    logger.warning, "%s failed again (%d times: %s); trying again in %.1fs",
                    name, self.failures, first, wait,
                )  # fmt: skip
        else:
            if self.failures:
                quietly(logger.info, "%s works again", type(self).__name__)
                self.failures = 0
        self.next_at = time.monotonic() + wait

    def run(self) -> float:
        raise NotImplementedError

    def failed(self, error: Exception) -> None:
        """`run()` raised `error` (and was logged)."""


class Reaper(Chore):
    """Returns jobs whose lease expired (any worker's but those of `running()`, this worker's
    own running claims) to ready, or to the dead letters.

    Not while the worker's own statements are held up (trouble(), its own failures), nor for
    policy.REAP_RECOVERY seconds after they work again (calm()): whatever held them up (an
    outage, a lock on the job table) held up every worker's heartbeats too, and the leases that
    ran out meanwhile are those of live workers until their keepers have had time to renew."""

    def __init__(
        self,
        jobs: JobManager,
        interval: float,
        on_reaped: Callable[[], None],
        running: Callable[[], list[Job]],
    ) -> None:
        super().__init__()
        self.jobs, self.interval, self.on_reaped, self.running = jobs, interval, on_reaped, running
        self._troubled = False
        self._calm_at = -math.inf  # when the worker's statements last worked again
        self._fresh = True  # it has not reaped yet

    def trouble(self, error: Exception) -> None:
        """A statement of the worker's (a turn's, this chore's) failed with `error`: trouble
        when it may have held up every worker's heartbeats too (held_up)."""
        if held_up(error):
            self._troubled = True

    def calm(self) -> None:
        """The worker's statements work (a turn that reached the database)."""
        if self._troubled:
            self._troubled = False
            self._calm_at = time.monotonic()

    def stalled(self) -> None:
        """A statement of the worker's took longer than policy.STALLED and then worked: before
        this worker's first reap, as trouble just over. A worker started in the last seconds of
        a lock on the job table meets no failure (its first statements wait less than their
        lock_timeout), yet its first reap would come just as the lock goes, before the lease
        keepers of the live workers renew. (A worker that has run longer met the lock's
        failures: the lock lasted past a lease, longer than the lock_timeout.)"""
        if self._fresh:
            self._calm_at = time.monotonic()

    def failed(self, error: Exception) -> None:
        self.trouble(error)

    def run(self) -> float:
        if self._troubled:
            return self.interval
        recovering = self._calm_at + policy.REAP_RECOVERY - time.monotonic()
        if recovering > 0:
            return recovering
        self._fresh = False
        taken = self.jobs.reap(sparing=self.running())
        self.jobs.delay(own_backoffs(taken))
        returned, failed = taken.returned, taken.failed
        if returned or failed:
            quietly(
                logger.warning,
                "reaped %d jobs with expired leases (%d failed)",
                returned + failed,
                failed,
            )
            self.on_reaped()
        return self.interval


class Promoter(Chore):
    """Moves scheduled jobs that have come due into the claim index (any worker's: see
    sql.PROMOTE), so that claims see them in priority order."""

    def __init__(self, jobs: JobManager, interval: float) -> None:
        super().__init__()
        self.jobs, self.interval = jobs, interval

    def run(self) -> float:
        full = self.jobs.promote(limit=PROMOTE_BATCH) == PROMOTE_BATCH
        return 0.0 if full else self.interval


class Pruner(Chore):
    """Deletes finished jobs past their retention, and workers' statistics past theirs: one
    bounded batch a turn while there is a backlog, then again after `interval` seconds, or a
    quarter of the shortest retention when that is sooner (at least a second): a job is kept
    little longer than its retention, so a short one keeps the table small (benchmark W6: with
    5 s and a prune every minute, a minute of finished jobs piled up between prunes)."""

    def __init__(self, jobs: JobManager, interval: float) -> None:
        super().__init__()
        self.jobs, self.interval = jobs, interval

    def run(self) -> float:
        settings = get_settings()
        full = self.jobs.prune(max_batches=1) == settings.PRUNE_BATCH
        QueueStat.objects.using(self.jobs.db).filter(
            at__lt=Now() - settings.STATS_RETENTION
        ).delete()
        if full:
            return 0.0
        kept = [age.total_seconds() for age in settings.retention().values() if age is not None]
        return min([self.interval, *(max(1.0, age / 4) for age in kept)])


class Ticker(Chore):
    """Enqueues the periodic schedules' due ticks (see runtime/scheduler.py)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__()
        self.scheduler = scheduler

    def run(self) -> float:
        return self.scheduler.enqueue_due()


class Reporter(Chore):
    """Writes what the worker did (QueueStat rows) every `interval` seconds: `report(seconds,
    stopping)`, which keeps what it could not write for the next report (then covering both
    spans)."""

    def __init__(self, interval: float, report: Callable[[float, bool], None]) -> None:
        super().__init__(first_in=interval)
        self.interval, self.report = interval, report
        self.since = time.monotonic()

    def run(self) -> float:
        now = time.monotonic()
        self.report(now - self.since, False)
        self.since = now
        return self.interval

    def span(self) -> float:
        """The seconds the next report covers."""
        return max(1e-3, time.monotonic() - self.since)

    def last(self, db: str, worker: str) -> bool:
        """The worker's last report, which also says it stopped; False when it could not be
        written (said, unless the database could not be reached at all: an outage the worker
        says as such). A connection found gone (a failover, a session ended while idle between
        reports) is made again once: the stopped worker would read as alive in jobstats and the
        admin until its reports were overdue, then as one that went silent. Not when the first
        try connected afresh: the database is away, and the stop is not held up by a second
        wait for it."""
        connection = connections[db]
        for again in (False, True):
            opened = connection.connection is not None
            try:
                self.report(self.span(), True)
                return True
            except DatabaseError as error:
                lost = _connection_lost(error)
                if lost and opened and not again:
                    connection.close()
                    continue
                if not lost or connection.connection is not None:  # not a failed connect
                    quietly(
                        logger.warning,
                        "worker %s could not record that it stopped (%s): it reads as alive "
                        "until its reports are overdue",
                        worker, _first_line(error),
                    )  # fmt: skip
                return False
        return False


def own_backoffs(taken: TakenBack) -> list[tuple[UUID, int, float]]:
    """The delays of the jobs taken back whose tasks have a backoff of their own (id, claim
    count, seconds); the others keep the default backoff the statement gave them. Asked within
    retry.BACKOFF_PATIENCE in all: a slow backoff, called for every job a dead worker held,
    must not hold up the caller (a worker's main thread, a supervisor's loop). A backoff that
    fails or is slow keeps the default too (its next failed attempt says why)."""
    until = time.monotonic() + retry.BACKOFF_PATIENCE
    delays = []
    for job_id, claims, task_name, attempts in taken.ready:
        left = until - time.monotonic()
        if left <= 0:
            break
        try:
            backoff = registry.get_task(task_name).backoff
        except UnknownTask:
            continue
        if backoff is None:
            continue
        try:
            delay = retry.backoff_seconds(backoff, attempts, task_name, within=left)
        except Exception as error:  # ValueError, RuntimeError or TimeoutError, naming the task
            quietly(logger.warning, "a reaped job of %s keeps the default backoff: %s",
                    task_name, error)  # fmt: skip
            continue
        delays.append((job_id, claims, delay))
    return delays


def held_up(error: Exception) -> bool:
    """Whether `error` may have held up every worker's heartbeats too: a statement that waited
    out its time (a lock on the job table), or a connection lost (an outage); not a transaction
    the database rolled back (a serialization failure: they come and go under contention), nor
    a bug."""
    return (
        isinstance(error, DatabaseError)
        and not rows.rolled_back(error)
        and (rows.timed_out(error) or rows.connection_lost(error))
    )


def _connection_lost(error: Exception) -> bool:
    """The connection at fault, not the chore's statement (one that ran out of time is)."""
    return (
        isinstance(error, DatabaseError)
        and rows.connection_lost(error)
        and not rows.timed_out(error)
    )


def _first_line(error: Exception) -> str:
    text = text_of(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
