"""Enqueueing due periodic ticks, exactly once however many workers run.

Each schedule has a row in pgjobs_schedule holding its last tick. A worker that finds a tick due
reads the row and the database's clock, works out which ticks are due, and in one transaction
moves last_tick forward with an UPDATE guarded on the value it read (a compare-and-set) and
inserts the ticks' jobs. Only one worker's UPDATE can match; the others change nothing. The
jobs commit with the tick, so a tick is neither enqueued twice nor lost. No leader is elected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from django.db import DatabaseError, ProgrammingError, connections, transaction
from django.db.models.functions import Now

from django_pgjobs import signals
from django_pgjobs.data import rows
from django_pgjobs.models import Job, Schedule
from django_pgjobs.periodic import MAX_WAIT, Periodic, declared
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.logs import quietly

logger = logging.getLogger(__name__)


#: Seconds until a schedule whose row another session held locked is looked at again.
LOCKED_RETRY = 1.0
#: Seconds until a schedule whose tick failed is tried again; doubled at each failure in a row,
#: up to MAX_WAIT.
FAILED_RETRY = 1.0


class Scheduler:
    """Enqueues the due ticks of the declared schedules on one database; a worker calls
    `enqueue_due()` when the seconds it last returned have passed.

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
        signals thread, runtime/announcer.py; by default, at once)."""
        self.db = db
        self.enqueued = enqueued or _send_enqueued
        if schedules is None:
            schedules, errors = declared()
            for error in errors:
                quietly(logger.error, "%s (not scheduled; %s)", error, error.id)
        self.schedules = {each.name: each for each in schedules}
        self._next: dict[str, datetime] = {}  # each schedule's next tick after its last one
        self._last: dict[str, datetime] = {}  # each schedule's last tick, as last read
        self._failures: dict[str, int] = {}  # each failing schedule's failures in a row
        # The database's clock minus this process's monotonic clock, in seconds: the time of
        # day is the database's, and a step of this machine's wall clock (NTP after a VM's
        # resume) changes nothing in when the schedules are looked at.
        self._offset = 0.0
        self._synced = False

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
                quietly(
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
        quietly(
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
        lost connection is every schedule's: it is raised, for the Ticker to reconnect."""
        name = periodic.name
        try:
            self._enqueue(periodic)
        except Exception as error:
            if isinstance(error, DatabaseError) and rows.connection_lost(error):
                raise
            self._failed(periodic, error)
        else:
            if self._failures.pop(name, 0):
                quietly(logger.info, "periodic %s: enqueued again after failing", name)

    def _failed(self, periodic: Periodic, error: Exception) -> None:
        failures = self._failures[periodic.name] = self._failures.get(periodic.name, 0) + 1
        pause = policy.doubling(FAILED_RETRY, failures, MAX_WAIT)
        self._next[periodic.name] = self._now() + timedelta(seconds=pause)
        quietly(
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
            quietly(
                logger.warning,
                "periodic %s: ticks after %s were missed; enqueued %d jobs, up to the tick of %s "
                "(missed=%r, grace=%gs)", periodic.name, last.isoformat(), len(ticks),
                latest.isoformat(), periodic.missed, periodic.grace,
            )  # fmt: skip
        elif len(ticks) > 1:  # late, but each tick within grace got its own job
            quietly(
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
