"""Periodic jobs' declarations: schedules in PGJOBS["PERIODIC"] or @task(cron=...), checked, and
their due ticks (runtime/chores.py enqueues each tick exactly once however many workers run)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, register

from django_pgjobs import registry, validation
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.cron import CRON_HINT, check_cron, next_tick
from django_pgjobs.errors import EnqueueError, PayloadMismatch, UnknownTask

logger = logging.getLogger(__name__)

#: What a worker does with ticks that passed more than `grace` seconds ago without a job.
MISSED = ("latest", "skip")
#: Seconds after its time during which a tick still gets its own job.
DEFAULT_GRACE = 60.0
#: The longest grace (a year): it need only span a pause of every worker; more overflows datetime.
MAX_GRACE = 365 * 86400.0
#: The longest a worker goes without looking at its schedules (it looks earlier for a tick).
MAX_WAIT = 60.0
KEYS = ("task", "cron", "payload", "timezone", "queue", "priority", "missed", "grace", "pass_tick")


class DeclarationError(ValueError):
    """A periodic schedule declared wrongly; `id` is its system check id."""

    def __init__(self, name: str, message: str, hint: str, id: str) -> None:
        super().__init__(f"Periodic schedule {name!r}: {message}")
        self.hint = hint
        self.id = id


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

        Every tick at most `grace` seconds old gets its own job. Older ticks were missed: with
        missed="latest" the most recent of them gets one job unless a newer tick has one."""
        latest: datetime = croniter(
            self.cron, (now + timedelta(microseconds=1)).astimezone(self.timezone)
        ).get_prev(datetime)
        latest = latest.astimezone(UTC)
        if latest <= last:
            return [], last
        ticks = []
        # Compared before subtracting: `now - grace` of a grace past MAX_GRACE may overflow.
        late = (now - last).total_seconds()
        tick = last if late <= self.grace else now - timedelta(seconds=self.grace)
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
    if not grace <= MAX_GRACE:
        raise invalid(
            f"grace={grace!r} must be at most {MAX_GRACE:.0f} seconds (a year).",
            "grace only needs to cover the longest time no worker may run; ticks older than "
            "that are missed ticks, which missed='latest' still gives one job.",
        )
    if not isinstance(pass_tick, bool):
        raise invalid(f"pass_tick={pass_tick!r} must be True or False.")
    try:
        check_arguments(task.func, task.name, (), periodic.payload_for(datetime.now(UTC)))
    except PayloadMismatch as error:
        raise invalid(
            f"{error}.",
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
