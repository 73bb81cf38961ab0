"""System checks: PostgreSQL, sane PGJOBS values, connection settings that break LISTEN or
prepared statements, tracing without OpenTelemetry, the job table's indexes, and queues that no
running worker serves. Imported by the app's ready(), once the models can be."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Info, Tags, Warning, register
from django.db import connections, router

from django_pgjobs import registry, schema, transports, validation
from django_pgjobs.conf import budget_problems, get_settings, unknown_keys
from django_pgjobs.models import Job, QueueStat
from django_pgjobs.observability import stats
from django_pgjobs.observability.health import THRESHOLD_NAMES
from django_pgjobs.status import FINISHED

#: Leases shorter than this are lost to an ordinary pause (a database failover, a long GC).
MIN_LEASE = 10.0
SETTINGS_DOC = "See docs/reference/settings.md."


def _alias() -> str:
    return router.db_for_write(Job)


@register(Tags.compatibility)
def check_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    alias = _alias()
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        return []
    return [
        Error(
            f"django-pgjobs needs PostgreSQL, but the database {alias!r} is {vendor}.",
            hint="Point DATABASES (or your router for pgjobs.Job) at a PostgreSQL database.",
            id="pgjobs.E001",
        )
    ]


@register(Tags.compatibility)
def check_time_zone_support(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    # Times are timestamptz, compared with aware datetimes: with USE_TZ off the ORM returns naive.
    if django_settings.USE_TZ:
        return []
    return [
        Error(
            "django-pgjobs needs USE_TZ = True: its times (when a job is due, its lease, its "
            "schedule) are aware datetimes, and with USE_TZ = False Django hands them back naive.",
            hint="Set USE_TZ = True (Django's default since 5.0); TIME_ZONE still sets the zone "
            "that templates and forms show. See Django's time zones documentation for what "
            "else it changes in your project.",
            id="pgjobs.E003",
        )
    ]


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    messages: list[CheckMessage] = [
        Warning(
            f"PGJOBS has an unknown key {key!r}; it is ignored.",
            hint="See the settings reference for the keys django-pgjobs reads.",
            id="pgjobs.W001",
        )
        for key in unknown_keys()
    ]
    settings = get_settings()
    problems = [
        *_positive("LEASE", settings.LEASE),
        *([] if settings.TIMEOUT is None else _positive("TIMEOUT", settings.TIMEOUT)),
        *_positive("PRUNE_BATCH", settings.PRUNE_BATCH, whole=True),
        *_positive("MAX_ATTEMPTS", settings.MAX_ATTEMPTS, whole=True),
        *_retention(settings.RETENTION),
        *_health(settings.HEALTH),
        *budget_problems("PGJOBS['YIELD_BUDGET']", settings.YIELD_BUDGET),
        *_positive("YIELD_FLOOR", settings.YIELD_FLOOR),
    ]
    messages += [Error(problem, hint=SETTINGS_DOC, id="pgjobs.E020") for problem in problems]
    if not problems:
        messages += _leases(settings.LEASE)
    return messages


def _positive(name: str, value: Any, whole: bool = False) -> list[str]:
    kind: Any = int if whole else (int, float)
    most = validation.MAX_ATTEMPTS if whole else validation.MAX_SECONDS
    if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value <= most:
        number = "a whole number" if whole else "a number"
        return [
            f"PGJOBS[{name!r}] must be {number} greater than 0 and at most {most:.0f}, "
            f"not {value!r}."
        ]
    return []


def _retention(value: Any) -> list[str]:
    if isinstance(value, timedelta):
        values: Mapping[Any, Any] = {"succeeded": value}
    elif isinstance(value, Mapping):
        values = value
    else:
        return [f"PGJOBS['RETENTION'] must be a timedelta or a dict by status, not {value!r}."]
    problems = []
    for status, age in values.items():
        if status not in FINISHED:
            problems.append(
                f"PGJOBS['RETENTION'] has the key {status!r}; the final statuses are "
                f"{', '.join(map(repr, map(str, FINISHED)))}."
            )
        elif not (age is None or (isinstance(age, timedelta) and age >= timedelta(0))):
            problems.append(
                f"PGJOBS['RETENTION'][{status!r}] must be a timedelta of 0 or more, or None "
                f"to keep those jobs, not {age!r}."
            )
    return problems


def _health(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return [f"PGJOBS['HEALTH'] must be a dict of thresholds, not {value!r}."]
    return [
        f"PGJOBS['HEALTH'][{key!r}] must be a number of 0 or more, not {threshold!r}."
        for key, threshold in value.items()
        if isinstance(threshold, bool)
        or not isinstance(threshold, int | float)
        or not threshold >= 0  # NaN included
    ]


@register(Tags.compatibility)
def check_health_keys(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    health: Any = get_settings().HEALTH
    if not isinstance(health, Mapping):
        return []  # pgjobs.E020 says so
    return [
        Warning(
            f"PGJOBS['HEALTH'] has an unknown key {key!r}; it is ignored.",
            hint=f"The thresholds are {', '.join(sorted(THRESHOLD_NAMES))}.",
            id="pgjobs.W020",
        )
        for key in sorted(set(health) - THRESHOLD_NAMES)
    ]


def _leases(default: float) -> list[CheckMessage]:
    leases = {"PGJOBS['LEASE']": default}
    leases |= {f"task {t.name!r}": t.lease for t in registry.all_tasks().values() if t.lease}
    return [
        Warning(
            f"The lease of {owner} is {lease:g}s. Heartbeats go out every lease/3 and the reaper "
            f"looks every 5 s, so a worker paused for more than {lease:g}s (a database "
            "failover, a long garbage collection) loses its jobs to another worker while "
            "their handlers still run.",
            hint=f"Use a lease of {MIN_LEASE:g} seconds or more.",
            id="pgjobs.W021",
        )
        for owner, lease in leases.items()
        if lease < MIN_LEASE
    ]


@register(Tags.compatibility)
def check_pooler(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A transaction-mode pooler (Django's DISABLE_SERVER_SIDE_CURSORS is set for one) makes
    LISTEN a no-op and, before PgBouncer 1.21, breaks prepared statements."""
    alias = _alias()
    database = connections[alias].settings_dict
    if not database.get("DISABLE_SERVER_SIDE_CURSORS"):
        return []
    messages: list[CheckMessage] = []
    if get_settings().NOTIFY:
        messages.append(
            Warning(
                f"The database {alias!r} is reached through a transaction-mode pooler "
                "(DISABLE_SERVER_SIDE_CURSORS is set), where LISTEN does nothing, but "
                "PGJOBS['NOTIFY'] is on: every enqueue pays for a NOTIFY no worker hears.",
                hint="Set PGJOBS['NOTIFY'] = False and run workers with --no-listen "
                "(see docs/howto/pgbouncer.md).",
                id="pgjobs.W022",
            )
        )
    if database.get("OPTIONS", {}).get("prepare_threshold") is not None:
        messages.append(
            Warning(
                f"The database {alias!r} is reached through a transaction-mode pooler and "
                "OPTIONS['prepare_threshold'] is set: a statement prepared on one server "
                "connection is missing on the next one.",
                hint="Remove prepare_threshold, unless your PgBouncer is 1.21 or newer with "
                "max_prepared_statements set.",
                id="pgjobs.W023",
            )
        )
    return messages


@register(Tags.compatibility)
def check_tracing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """PGJOBS['TRACING'] needs opentelemetry-api, which is imported only then (tracing.py)."""
    if not get_settings().TRACING:
        return []
    try:
        importlib.import_module("opentelemetry.propagate")
    except ImportError as error:
        return [
            Error(
                f"PGJOBS['TRACING'] is on, but OpenTelemetry cannot be imported ({error}).",
                hint='Install the otel extra: pip install "django-pgjobs[otel]".',
                id="pgjobs.E030",
            )
        ]
    return []


@register(Tags.database)
def check_indexes(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Every index the models declare exists and is valid (a failed CREATE INDEX CONCURRENTLY
    leaves an invalid one, which the planner never uses). Needs `check --database`."""
    alias = _alias()
    if databases is None or alias not in databases or not _postgresql(alias):
        return []  # another backend is pgjobs.E001's to report, without a crash here
    if schema.pending_migrations(alias):
        return []  # not migrated yet (migrate runs these checks first): migrate builds them
    messages: list[CheckMessage] = []
    with connections[alias].cursor() as cursor:
        for model in (Job, QueueStat):
            table = model._meta.db_table
            cursor.execute(
                "SELECT c.relname, i.indisvalid FROM pg_index AS i "
                "JOIN pg_class AS c ON c.oid = i.indexrelid WHERE i.indrelid = to_regclass(%s)",
                [table],
            )
            found = dict(cursor.fetchall())
            if not found:
                continue  # not migrated yet: migrate creates them all
            declared = [index.name for index in model._meta.indexes]
            declared += [c.name for c in model._meta.constraints if hasattr(c, "fields")]
            for name in declared:
                if found.get(name) is None:
                    problem = "is missing"
                elif not found[name]:
                    problem = "is invalid (a CREATE INDEX CONCURRENTLY that failed)"
                else:
                    continue
                messages.append(
                    Error(
                        f"The index {name} of {table} {problem}; the queries it serves read "
                        "the whole table instead.",
                        hint=f"Rebuild it: REINDEX INDEX CONCURRENTLY {name}; or, if it is "
                        "missing, find which migration dropped it (manage.py showmigrations "
                        "pgjobs).",
                        id="pgjobs.E021",
                    )
                )
    return messages


def _postgresql(alias: str) -> bool:
    return connections[alias].vendor == "postgresql"


@register(deploy=True)
def check_database_checks_ran(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """`check --deploy` without --database skips the checks that need the database: say so,
    once, and how to run them."""
    alias = _alias()
    if databases is not None and alias in databases:
        return []
    return [
        Info(
            "django-pgjobs's database checks did not run: whether its migrations are applied "
            "(W025), whether the job table's indexes are valid (E021), which queues no running "
            "worker serves (W024).",
            hint=f"Run `manage.py check --deploy --database {alias}` to run them.",
            id="pgjobs.I001",
        )
    ]


@register(Tags.database, deploy=True)
def check_migrations(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """This app's migrations are all applied. A warning, not an error: a deploy that runs this
    check before `migrate` must still get to migrate."""
    alias = _alias()
    if databases is None or alias not in databases or not _postgresql(alias):
        return []
    pending = schema.pending_migrations(alias)
    if not pending:
        return []
    shown = ", ".join(pending[:3]) + (f" and {len(pending) - 3} more" if len(pending) > 3 else "")
    return [
        Warning(
            f"{len(pending)} migrations of django-pgjobs are not applied on the database "
            f"{alias!r} ({shown}): enqueue, runjobs, jobstats and the admin fail at the "
            "missing tables or columns until they are.",
            hint="Run `manage.py migrate` (before starting the workers of a new release).",
            id="pgjobs.W025",
        )
    ]


@register(Tags.database, deploy=True)
def check_served_queues(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Registered tasks whose queue no running worker serves, judged from the workers'
    QueueStat rows; silent when no worker runs at all (a build machine, say)."""
    alias = _alias()
    if databases is None or alias not in databases or not _postgresql(alias):
        return []
    if schema.pending_migrations(alias):
        return []  # pgjobs.W025 says so; the workers' rows may not even have a table yet
    alive = [worker for worker in stats.worker_stats(alias) if worker.alive]
    if not alive:
        return []
    served = stats.served_queues(alive)
    default = get_settings().DEFAULT_QUEUE
    unserved: dict[str, list[str]] = {}
    for task in registry.all_tasks().values():
        if (task.queue or default) not in served:
            unserved.setdefault(task.queue or default, []).append(task.name)
    return [
        Warning(
            f"No running worker takes jobs from the queue {queue!r}, which the tasks "
            f"{', '.join(sorted(names))} use; their jobs will wait.",
            hint=f"The {len(alive)} running workers serve {', '.join(sorted(served))}. Start "
            f"one with --queue {queue}, or check the task's queue= for a typo.",
            id="pgjobs.W024",
        )
        for queue, names in sorted(unserved.items())
    ]


@register(Tags.compatibility)
def check_transports(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """PGJOBS["QUEUES"] and PGJOBS["NATS"] make sense, and a NATS queue has its client."""
    messages: list[CheckMessage] = [
        Error(problem, hint="See docs/reference/settings.md#queues.", id="pgjobs.E040")
        for problem in transports.problems()
    ]
    queues = transports.nats_queues()
    if queues and importlib.util.find_spec("nats") is None:
        messages.append(
            Error(
                f"The queues {', '.join(sorted(queues))} use NATS JetStream, but the nats-py "
                "package is not installed.",
                hint="pip install 'django-pgjobs[nats]'",
                id="pgjobs.E041",
            )
        )
    return messages
