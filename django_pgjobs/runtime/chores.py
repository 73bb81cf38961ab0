"""The housekeeping every worker shares, each chore an object with its own rhythm; among them
the periodic schedules' ticks, enqueued exactly once however many workers run."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from uuid import UUID

from django.db import DatabaseError, ProgrammingError, connections, transaction
from django.db.models.functions import Now

from django_pgjobs import batches, registry, retry, signals
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows, sql
from django_pgjobs.data.jobs import JobManager
from django_pgjobs.data.records import Claim, TakenBack
from django_pgjobs.errors import UnknownTask, text_of
from django_pgjobs.models import Job, QueueStat, Rollup, Schedule, Worker
from django_pgjobs.periodic import MAX_WAIT, Periodic, declared
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.reporting import log_safely

logger = logging.getLogger(__name__)

#: Scheduled jobs moved into the claim index per statement.
PROMOTE_BATCH = 1000
#: How long the batches of jobs a busy worker ended wait to be followed up (Sweeper): one
#: statement for the turns of this long, the callbacks that much later.
FOLLOW_UP_AFTER = 0.1


class Chore:
    """Something a worker does now and then: `run()` does its work and returns the seconds until
    it is due again; the worker calls `due_in()` to know how long it may wait. Chores run on the
    worker's main thread, except the lease keeper, which has a thread of its own
    (runtime/leases.py).

    One that fails is tried again after a pause of
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
                raise  # the worker's outage (reporting.Outage)
            self.failures += 1
            self.failed(error)
            wait = policy.outage_pause(self.failures)
            name, first = type(self).__name__, _first_line(error)
            if self.failures == 1:
                log_safely(
                    logger.error, "%s failed (%s); trying again in %.1fs", name, first, wait,
                    exc_info=error,
                )  # fmt: skip
            else:
                log_safely(
                    logger.warning, "%s failed again (%d times: %s); trying again in %.1fs",
                    name, self.failures, first, wait,
                )  # fmt: skip
        else:
            if self.failures:
                log_safely(logger.info, "%s works again", type(self).__name__)
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
        running: Callable[[], list[Claim]],
    ) -> None:
        super().__init__()
        self.jobs, self.interval, self.on_reaped, self.running = jobs, interval, on_reaped, running
        self._troubled = False
        self._calm_at = -math.inf  # when the worker's statements last worked again
        self._fresh = True  # it has not reaped yet

    def trouble(self, error: Exception) -> None:
        """A statement of the worker's (a turn's, this chore's) failed with `error`: trouble
        when it may have held up every worker's heartbeats too (blocks_heartbeats)."""
        if blocks_heartbeats(error):
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
            log_safely(
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


class Sweeper(Chore):
    """Follows up the batches of the jobs this worker's turns ended (batches.py): once for the
    turns of FOLLOW_UP_AFTER seconds, not a statement after each; at once when idle. And every
    `interval` seconds, sweeps what a lost follow-up left: a session killed right after the
    commit that ended a batch's last job, or released a waiting job's last dependency."""

    def __init__(self, db: str, interval: float) -> None:
        super().__init__(first_in=interval)
        self.db, self.interval, self.sweep = db, interval, batches.Sweep()
        self.sweep_at = self.next_at
        self.ending: set[UUID] = set()

    def ended(self, batch_ids: Iterable[UUID]) -> None:
        """Follow up these batches within FOLLOW_UP_AFTER seconds (their jobs' ends committed)."""
        if batch_ids and not self.ending:
            self.next_at = min(self.next_at, time.monotonic() + FOLLOW_UP_AFTER)
        self.ending.update(batch_ids)

    def follow_up_now(self) -> int:
        """Follow up the batches ended so far; returns how many batches and jobs moved."""
        moves = batches.follow_up(self.db, batches=self.ending) if self.ending else 0
        self.ending.clear()
        return moves

    def run(self) -> float:
        self.follow_up_now()
        if time.monotonic() >= self.sweep_at:
            self.sweep(self.db)
            self.sweep_at = time.monotonic() + self.interval
        return self.sweep_at - time.monotonic()


#: How long the workers' own rows are kept, rolled up as they arrived (migration 0018): long
#: enough to read one by hand, not a day of 43 million rows with a hundred workers.
RAW_STATS_KEPT = timedelta(minutes=15)


class Pruner(Chore):
    """Deletes finished jobs past their retention, workers' statistics past theirs and full
    rate-limit buckets (limits.py): one
    bounded batch a turn while there is a backlog, then again after `interval` seconds, or a
    quarter of the shortest retention when that is sooner (at least a second): a job is kept
    little longer than its retention, so a short one keeps the table small."""

    def __init__(self, jobs: JobManager, interval: float) -> None:
        super().__init__()
        self.jobs, self.interval = jobs, interval

    def run(self) -> float:
        settings = get_settings()
        full = self.jobs.prune(max_batches=1) == settings.PRUNE_BATCH
        raw = min(settings.STATS_RETENTION, RAW_STATS_KEPT)
        for stats in (
            QueueStat.objects.filter(at__lt=Now() - raw),
            Rollup.objects.filter(at__lt=Now() - settings.STATS_RETENTION),
            Worker.objects.filter(seen_at__lt=Now() - settings.STATS_RETENTION),
        ):
            stats.using(self.jobs.db).delete()
        rows.execute(self.jobs.db, sql.PRUNE_BUCKETS, {"limit": settings.PRUNE_BATCH})
        # Batches are kept as long as succeeded jobs, and then until their jobs are gone.
        kept_for = settings.retention().get("succeeded") or timedelta(0)
        batches.prune(self.jobs.db, kept_for.total_seconds(), settings.PRUNE_BATCH)
        if full:
            return 0.0
        kept = [age.total_seconds() for age in settings.retention().values() if age is not None]
        return min([self.interval, *(max(1.0, age / 4) for age in kept)])


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
                    log_safely(
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
            log_safely(logger.warning, "a reaped job of %s keeps the default backoff: %s",
                    task_name, error)  # fmt: skip
            continue
        delays.append((job_id, claims, delay))
    return delays


def blocks_heartbeats(error: Exception) -> bool:
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


# ---- periodic schedules -------------------------------------------------------------------------

#: Seconds until a schedule whose row another session held locked is looked at again.
LOCKED_RETRY = 1.0
#: Seconds until a schedule whose tick failed is tried again; doubled at each failure in a row,
#: up to MAX_WAIT.
FAILED_RETRY = 1.0


class Scheduler(Chore):
    """Enqueues the due ticks of the declared schedules on one database: a worker's chore, which
    calls `enqueue_due()` when the seconds it last returned have passed.

    Each schedule has a row in pgjobs_schedule holding its last tick. A worker that finds a tick
    due reads the row and the database's clock, works out which ticks are due, and in one
    transaction moves last_tick forward with an UPDATE guarded on the value it read (a
    compare-and-set) and inserts the ticks' jobs. Only one worker's UPDATE can match; the others
    change nothing. The jobs commit with the tick, so a tick is neither enqueued twice nor lost.
    No leader is elected.

    Each schedule's last tick is kept in memory, and the database's clock is estimated from
    its last reading, so looking costs no query until a tick is due.
    """

    def __init__(
        self,
        db: str,
        schedules: list[Periodic] | None = None,
        enqueued: Callable[[list[Job]], None] | None = None,
    ) -> None:
        """`enqueued(jobs)`: sends job_enqueued for a tick's committed jobs (a worker's: on its
        signals thread, reporting.Announcer; by default, at once)."""
        super().__init__()
        self.db = db
        self.enqueued = enqueued or _send_enqueued
        if schedules is None:
            schedules, errors = declared()
            for error in errors:
                log_safely(logger.error, "%s (not scheduled; %s)", error, error.id)
        self.schedules = {each.name: each for each in schedules}
        self._next: dict[str, datetime] = {}  # each schedule's next tick after its last one
        self._last: dict[str, datetime] = {}  # each schedule's last tick, as last read
        self._failures: dict[str, int] = {}  # each failing schedule's failures in a row
        # The database's clock minus this process's monotonic clock, in seconds: the time of
        # day is the database's, and a step of this machine's wall clock (NTP after a VM's
        # resume) changes nothing in when the schedules are looked at.
        self._offset = 0.0
        self._synced = False

    def run(self) -> float:
        return self.enqueue_due()

    def enqueue_due(self) -> float:
        """Enqueue the jobs of every tick now due; returns the seconds until one may be due."""
        if not self.schedules:
            return MAX_WAIT
        if not self._synced:
            try:
                self._sync()
            except ProgrammingError:
                # New code before its migration (a deploy that migrates after starting workers):
                # keep running jobs, and look again later.
                log_safely(
                    logger.error,
                    "periodic schedules are off until the pgjobs migrations are applied "
                    "(manage.py migrate pgjobs); looking again in %gs", MAX_WAIT, exc_info=True,
                )  # fmt: skip
                return MAX_WAIT
        for name, periodic in self.schedules.items():
            if self._next[name] <= self._now():
                self._enqueue_or_pause(periodic)
        wait = (min(self._next.values()) - self._now()).total_seconds()
        return min(MAX_WAIT, max(0.01, wait))

    def _sync(self) -> None:
        """Create the rows of new schedules; take the current last ticks of all of them."""
        names = sorted(self.schedules)
        declared = [self.schedules[name] for name in names]
        with transaction.atomic(using=self.db), connections[self.db].cursor() as cursor:
            cursor.execute(
                _UPSERT,
                [
                    names,
                    [each.task for each in declared],
                    [each.cron for each in declared],
                    [each.timezone.key for each in declared],
                ],
            )
            cursor.execute(
                "SELECT name, last_tick, statement_timestamp() FROM pgjobs_schedule "
                "WHERE name = ANY(%s)",
                [names],
            )
            rows = cursor.fetchall()
        for name, last_tick, now in rows:
            self._observe(now)
            self._last[name] = last_tick
            self._next[name] = self.schedules[name].next_tick(last_tick)
        self._synced = True
        log_safely(
            logger.info,
            "periodic schedules: %s",
            "; ".join(
                f"{each.name} ({each.cron}, {each.timezone.key}) → {each.task}" for each in declared
            ),
        )

    def _enqueue_or_pause(self, periodic: Periodic) -> None:
        """Enqueue the schedule's due ticks. If that fails for a reason of its own (a bug in its
        declaration, a statement of its that failed), log it naming the schedule and try it
        again after a pause, while the others go on: one schedule never starves the rest. A
        lost connection is every schedule's: it is raised, for the worker to reconnect."""
        name = periodic.name
        try:
            self._enqueue(periodic)
        except Exception as error:
            if isinstance(error, DatabaseError) and rows.connection_lost(error):
                raise
            self._failed(periodic, error)
        else:
            if self._failures.pop(name, 0):
                log_safely(logger.info, "periodic %s: enqueued again after failing", name)

    def _failed(self, periodic: Periodic, error: Exception) -> None:
        failures = self._failures[periodic.name] = self._failures.get(periodic.name, 0) + 1
        pause = policy.doubling(FAILED_RETRY, failures, MAX_WAIT)
        self._next[periodic.name] = self._now() + timedelta(seconds=pause)
        log_safely(
            logger.error,
            "periodic %s failed (%s: %s; %d times in a row); the other schedules go on, this "
            "one is tried again in %gs", periodic.name, type(error).__name__, error, failures,
            pause, exc_info=failures == 1,  # the traceback once, not every minute
        )  # fmt: skip

    def _enqueue(self, periodic: Periodic) -> None:
        schedule = Schedule.objects.using(self.db).filter(name=periodic.name)
        with transaction.atomic(using=self.db):
            # An enqueue is durable at its commit, also on the worker's own connection.
            with connections[self.db].cursor() as cursor:
                cursor.execute("SET LOCAL synchronous_commit = on")
            # Locked, never waited for: another worker is ticking it (and will have enqueued the
            # tick when this one looks again), or an operator's transaction holds it. The wait
            # would be on the worker's main loop, with its claims and outcomes behind it.
            locked = schedule.select_for_update(skip_locked=True).annotate(now=Now())
            row = locked.values_list("last_tick", "now").first()
            if row is None and not schedule.exists():
                # Deleted: made again from the last tick this worker knew of, so that the tick
                # due now is enqueued (made again from now, it was lost, silently).
                with connections[self.db].cursor() as cursor:
                    cursor.execute(_RECREATE, [
                        periodic.name, periodic.task, periodic.cron, periodic.timezone.key,
                        self._last[periodic.name],
                    ])  # fmt: skip
                row = locked.values_list("last_tick", "now").first()
            if row is None:
                self._next[periodic.name] = self._now() + timedelta(seconds=LOCKED_RETRY)
                return
            last, now = row
            self._observe(now)
            ticks, latest = periodic.due(last, now)
            # The compare-and-set: of the workers that read `last`, only the first to write
            # moves the tick on; the others' UPDATE finds last_tick changed and matches nothing.
            won = latest > last and bool(
                schedule.filter(last_tick=last).update(last_tick=latest, updated_at=Now())
            )
            # The ticks' jobs without their job_enqueued signal: its receivers are the
            # application's code, which must not run inside this transaction, holding the
            # schedule's row that every other worker's scheduler waits for; sent after it.
            jobs = Job.objects.db_manager(self.db)
            enqueued = [
                jobs.enqueue(
                    periodic.task, periodic.payload_for(tick), queue=periodic.queue,
                    priority=periodic.priority, announce=False,
                )
                for tick in (ticks if won else [])
            ]  # fmt: skip
            if not won and latest > last:  # another worker moved it on first: take its tick
                latest = schedule.values_list("last_tick", flat=True).first() or last
        for job in enqueued:
            self.enqueued([job])
        self._last[periodic.name] = latest
        self._next[periodic.name] = periodic.next_tick(latest)
        if not won:
            return
        if not ticks or ticks[0] != periodic.next_tick(last):  # some ticks got no job
            log_safely(
                logger.warning,
                "periodic %s: ticks after %s were missed; enqueued %d jobs, up to the tick of %s "
                "(missed=%r, grace=%gs)", periodic.name, last.isoformat(), len(ticks),
                latest.isoformat(), periodic.missed, periodic.grace,
            )  # fmt: skip
        elif len(ticks) > 1:  # late, but each tick within grace got its own job
            log_safely(
                logger.info,
                "periodic %s: enqueued %d ticks late, from %s to %s, each one's job within its "
                "grace of %gs", periodic.name, len(ticks), ticks[0].isoformat(),
                latest.isoformat(), periodic.grace,
            )  # fmt: skip

    def _observe(self, database_now: datetime) -> None:
        self._offset = database_now.timestamp() - time.monotonic()

    def _now(self) -> datetime:
        return datetime.fromtimestamp(time.monotonic() + self._offset, UTC)


# New schedules start counting from now. An existing row takes the declaration's task, cron and
# time zone; a changed cron or zone counts from now too (the old expression's ticks since the
# last one are not caught up). Rows are locked in name order, so workers starting together
# cannot deadlock.
_UPSERT = """
    INSERT INTO pgjobs_schedule AS s (name, task, cron, timezone, last_tick, updated_at)
    SELECT d.*, statement_timestamp(), statement_timestamp()
    FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS d(name, task, cron, zone)
    ORDER BY d.name
    ON CONFLICT (name) DO UPDATE SET
        task = excluded.task, cron = excluded.cron, timezone = excluded.timezone,
        last_tick = CASE
            WHEN (s.cron, s.timezone) IS DISTINCT FROM (excluded.cron, excluded.timezone)
            THEN greatest(s.last_tick, excluded.last_tick)
            ELSE s.last_tick
        END,
        updated_at = excluded.updated_at
    WHERE (s.task, s.cron, s.timezone)
        IS DISTINCT FROM (excluded.task, excluded.cron, excluded.timezone)
"""


# A schedule's row deleted while workers run, made again by one that finds a tick due, from the
# last tick it knew of.
_RECREATE = """
    INSERT INTO pgjobs_schedule (name, task, cron, timezone, last_tick, updated_at)
    VALUES (%s, %s, %s, %s, %s, statement_timestamp())
    ON CONFLICT (name) DO NOTHING
"""


def _send_enqueued(jobs: list[Job]) -> None:
    signals.send(signals.job_enqueued, Job, jobs=jobs)
