"""Periodic jobs: schedules declared in PGJOBS["PERIODIC"] or with @task(cron=...), their due
ticks, and enqueueing each tick exactly once however many workers run.

Each schedule has a row in pgjobs_schedule holding its last tick. A worker that finds a tick due
reads the row and the database's clock, works out which ticks are due, and in one transaction
moves last_tick forward with an UPDATE guarded on the value it read (a compare-and-set) and
inserts the ticks' jobs. Only one worker's UPDATE can match; the others change nothing. The
jobs commit with the tick, so a tick is neither enqueued twice nor lost. No leader is elected.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter
from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, register
from django.db import ProgrammingError, connections, transaction
from django.db.models import DateTimeField, Func
from django.db.models.functions import Now

from django_pgjobs import registry, validation
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import EnqueueError, UnknownTask

logger = logging.getLogger(__name__)

#: What a worker does with ticks that passed more than `grace` seconds ago without a job.
MISSED = ("latest", "skip")
#: Seconds after its time during which a tick still gets its own job.
DEFAULT_GRACE = 60.0
#: The longest a worker goes without looking at its schedules (it looks earlier for a tick).
MAX_WAIT = 60.0
KEYS = ("task", "cron", "payload", "timezone", "queue", "priority", "missed", "grace", "pass_tick")
CRON_HINT = (
    "Use five fields (minute hour day-of-month month day-of-week), e.g. '0 3 * * *', or six "
    "with seconds last, e.g. '* * * * * */10'."
)


class DeclarationError(ValueError):
    """A periodic schedule declared wrongly; `id` is its system check id."""

    def __init__(self, name: str, message: str, hint: str, id: str) -> None:
        super().__init__(f"Periodic schedule {name!r}: {message}")
        self.hint = hint
        self.id = id


def check_cron(cron: Any, where: str) -> str:
    """The cron expression, or ValueError saying what is wrong with it."""
    if not isinstance(cron, str):
        raise ValueError(f"{where} must be a cron expression (a string), got {cron!r}. {CRON_HINT}")
    try:
        croniter.expand(cron, strict=True)
        croniter(cron, datetime.now(UTC)).get_next(datetime)
    except CroniterError as error:
        raise ValueError(
            f"{where}: {cron!r} is not a valid cron expression ({error}). {CRON_HINT}"
        ) from None
    return cron


def next_tick(cron: str, zone: ZoneInfo, after: datetime) -> datetime:
    """The first tick of `cron` (read on `zone`'s wall clock) strictly after `after`, in UTC.

    UTC because Python compares times of one zone by their wall clock, ignoring DST's fold:
    the two 02:30s of an autumn night would compare equal.
    """
    tick: datetime = croniter(cron, after.astimezone(zone)).get_next(datetime)
    return tick.astimezone(UTC)


@dataclass(frozen=True)
class Periodic:
    """One declared schedule: enqueue `task` with `payload` at every tick of `cron`."""

    name: str
    task: str
    cron: str
    timezone: ZoneInfo
    payload: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    missed: str = "latest"
    grace: float = DEFAULT_GRACE
    #: Add the tick's time to the payload as tick="<ISO 8601 in the schedule's time zone>".
    pass_tick: bool = False

    def next_tick(self, after: datetime) -> datetime:
        return next_tick(self.cron, self.timezone, after)

    def due(self, last: datetime, now: datetime) -> tuple[list[datetime], datetime]:
        """The ticks to enqueue, given the last tick handled and the database's `now`, and the
        new last tick (the most recent tick at or before `now`).

        Every tick at most `grace` seconds old gets its own job, so a short pause of every
        worker loses nothing. Older ticks were missed (no worker ran): with missed="latest"
        the most recent of them gets one job unless a newer tick has one; with "skip", none.
        """
        latest: datetime = croniter(
            self.cron, (now + timedelta(microseconds=1)).astimezone(self.timezone)
        ).get_prev(datetime)
        latest = latest.astimezone(UTC)
        if latest <= last:
            return [], last
        ticks = []
        tick = max(last, now - timedelta(seconds=self.grace))
        while (tick := self.next_tick(tick)) <= now:
            ticks.append(tick)
        if not ticks and self.missed == "latest":
            ticks = [latest]
        return ticks, latest

    def payload_for(self, tick: datetime) -> dict[str, Any]:
        if not self.pass_tick:
            return dict(self.payload)
        return {**self.payload, "tick": tick.astimezone(self.timezone).isoformat()}


# ---- declarations ----------------------------------------------------------------------------


def declared() -> tuple[list[Periodic], list[DeclarationError]]:
    """Every schedule declared on tasks (@task(cron=...)) and in PGJOBS["PERIODIC"], and the
    errors in those that could not be read. A settings entry overrides a task's schedule of the
    same name; None there switches it off."""
    declarations: dict[str, Any] = {
        each.name: {"task": each.name, "cron": each.cron}
        for each in registry.all_tasks().values()
        if each.cron is not None
    }
    errors: list[DeclarationError] = []
    in_settings: Any = get_settings().PERIODIC  # from settings: may be anything
    if isinstance(in_settings, Mapping):
        declarations.update(in_settings)
    else:
        errors.append(
            DeclarationError(
                "PERIODIC",
                f"PGJOBS['PERIODIC'] must be a dict of schedules by name, got "
                f"{type(in_settings).__name__}.",
                'Write PGJOBS["PERIODIC"] = {"name": {"task": "app.tasks.f", "cron": "0 3 * * *"}}',
                "pgjobs.E010",
            )
        )
    schedules = []
    for name, declaration in declarations.items():
        if declaration is None:
            continue
        try:
            schedules.append(parse(name, declaration))
        except DeclarationError as error:
            errors.append(error)
    return schedules, errors


def declared_names() -> set[str]:
    """The names of the declared schedules, valid or not (cheap: nothing is parsed)."""
    names = {each.name for each in registry.all_tasks().values() if each.cron is not None}
    in_settings: Any = get_settings().PERIODIC
    if isinstance(in_settings, Mapping):
        names |= {name for name, value in in_settings.items() if value is not None}
        names -= {name for name, value in in_settings.items() if value is None}
    return names


def parse(name: Any, declaration: Any) -> Periodic:
    """One declaration from PGJOBS["PERIODIC"], checked; DeclarationError says what is wrong."""

    def invalid(message: str, hint: str = "", id: str = "pgjobs.E010") -> DeclarationError:
        return DeclarationError(str(name), message, hint or _DECLARATION_HINT, id)

    if not isinstance(name, str) or not 0 < len(name) <= 200:
        raise invalid("the name must be a string of 1 to 200 characters.")
    if not isinstance(declaration, Mapping):
        raise invalid(f"the declaration must be a dict, got {type(declaration).__name__}.")
    unknown = sorted(map(str, set(declaration) - set(KEYS)))
    if unknown:
        raise invalid(f"unknown keys {', '.join(map(repr, unknown))}.")
    missing = [key for key in ("task", "cron") if key not in declaration]
    if missing:
        raise invalid(f"{' and '.join(map(repr, missing))} must be given.")
    try:
        task = registry.get_task(declaration["task"])
    except (UnknownTask, TypeError) as error:
        raise invalid(
            str(error),
            "Check the task's name, and that an installed app's tasks module registers it with "
            "@task.",
            "pgjobs.E012",
        ) from None
    try:
        cron = check_cron(declaration["cron"], "'cron'")
    except ValueError as error:
        raise invalid(str(error), CRON_HINT, "pgjobs.E011") from None
    zone_name = declaration.get("timezone") or django_settings.TIME_ZONE or "UTC"
    try:
        zone = ZoneInfo(zone_name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise invalid(
            f"unknown time zone {zone_name!r}.",
            "Use an IANA time zone name such as 'Europe/Paris' or 'UTC'.",
            "pgjobs.E013",
        ) from None
    payload = declaration.get("payload") or {}
    missed = declaration.get("missed", "latest")
    grace = declaration.get("grace", DEFAULT_GRACE)
    pass_tick = declaration.get("pass_tick", False)
    try:
        validation.payload_json(payload, get_settings().MAX_PAYLOAD_BYTES)
        queue = declaration.get("queue")
        priority = declaration.get("priority")
        periodic = Periodic(
            name=name,
            task=task.name,
            cron=cron,
            timezone=zone,
            payload=payload,
            queue=None if queue is None else validation.check_queue(queue),
            priority=None if priority is None else validation.check_priority(priority),
            missed=missed,
            grace=grace,
            pass_tick=pass_tick,
        )
    except EnqueueError as error:
        raise invalid(str(error)) from None
    if missed not in MISSED:
        raise invalid(f"missed={missed!r} must be one of {', '.join(map(repr, MISSED))}.")
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
        raise invalid(f"grace={grace!r} must be zero or more seconds.")
    if not isinstance(pass_tick, bool):
        raise invalid(f"pass_tick={pass_tick!r} must be True or False.")
    try:
        inspect.signature(task.func).bind(**periodic.payload_for(datetime.now(UTC)))
    except TypeError as error:
        raise invalid(
            f"{task.name} cannot be called with this payload: {error}.",
            "Make the payload's keys match the function's parameters (with pass_tick=True, "
            "it also receives tick=...).",
        ) from None
    return periodic


_DECLARATION_HINT = (
    "A schedule is a dict with 'task' and 'cron', and optionally 'payload', 'timezone', "
    "'queue', 'priority', 'missed', 'grace' and 'pass_tick'; see the periodic jobs how-to."
)


@register()
def check_periodic(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [Error(str(error), hint=error.hint, id=error.id) for error in declared()[1]]


# ---- enqueueing due ticks --------------------------------------------------------------------


class Scheduler:
    """Enqueues the due ticks of the declared schedules on one database; a worker calls
    `enqueue_due()` when the seconds it last returned have passed.

    Each schedule's last tick is kept in memory, and the database's clock is estimated from
    its last reading, so looking costs no query until a tick is due.
    """

    def __init__(self, db: str, schedules: list[Periodic] | None = None) -> None:
        self.db = db
        if schedules is None:
            schedules, errors = declared()
            for error in errors:
                logger.error("%s (not scheduled; %s)", error, error.id)
        self.schedules = {each.name: each for each in schedules}
        self._next: dict[str, datetime] = {}  # each schedule's next tick after its last one
        self._offset = 0.0  # the database's clock minus this machine's, in seconds
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
                logger.error(
                    "periodic schedules are off until the pgjobs migrations are applied "
                    "(manage.py migrate pgjobs); looking again in %gs", MAX_WAIT, exc_info=True,
                )  # fmt: skip
                return MAX_WAIT
        for name, periodic in self.schedules.items():
            if self._next[name] <= self._now():
                self._enqueue(periodic)
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
            self._next[name] = self.schedules[name].next_tick(last_tick)
        self._synced = True
        logger.info(
            "periodic schedules: %s",
            "; ".join(
                f"{each.name} ({each.cron}, {each.timezone.key}) → {each.task}" for each in declared
            ),
        )

    def _enqueue(self, periodic: Periodic) -> None:
        from django_pgjobs.models import Job, Schedule

        schedule = Schedule.objects.using(self.db).filter(name=periodic.name)
        with transaction.atomic(using=self.db):
            row = schedule.annotate(now=_STATEMENT_TIME).values_list("last_tick", "now").first()
            if row is None:  # the row was deleted: create it again, counting from now
                self._synced = False
                return
            last, now = row
            self._observe(now)
            ticks, latest = periodic.due(last, now)
            # The compare-and-set: of the workers that read `last`, only the first to write
            # moves the tick on; the others' UPDATE finds last_tick changed and matches nothing.
            won = latest > last and bool(
                schedule.filter(last_tick=last).update(last_tick=latest, updated_at=Now())
            )
            if won:
                jobs = Job.objects.db_manager(self.db)
                for tick in ticks:
                    jobs.enqueue(
                        periodic.task,
                        periodic.payload_for(tick),
                        queue=periodic.queue,
                        priority=periodic.priority,
                    )
            elif latest > last:  # another worker moved it on first: take its last tick
                latest = schedule.values_list("last_tick", flat=True).first() or last
        self._next[periodic.name] = periodic.next_tick(latest)
        if won and ticks != [periodic.next_tick(last)]:
            logger.warning(
                "periodic %s: ticks after %s were missed; enqueued %d jobs, up to the tick of %s "
                "(missed=%r, grace=%gs)", periodic.name, last.isoformat(), len(ticks),
                latest.isoformat(), periodic.missed, periodic.grace,
            )  # fmt: skip

    def _observe(self, database_now: datetime) -> None:
        self._offset = database_now.timestamp() - time.time()

    def _now(self) -> datetime:
        return datetime.fromtimestamp(time.time() + self._offset, UTC)


# The database's clock now (Now() is the transaction's start, older inside a long transaction).
_STATEMENT_TIME = Func(function="statement_timestamp", output_field=DateTimeField())

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
