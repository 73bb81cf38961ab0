"""Enqueue: check a job's options, then insert it (one statement, in the caller's transaction),
or many jobs (COPY)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import transaction

from django_pgjobs import batches, limits, registry, schema, validation
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows, sql, wakeups
from django_pgjobs.data.records import NewJob
from django_pgjobs.errors import EnqueueError, PayloadMismatch
from django_pgjobs.ids import uuid7, uuid7_batch
from django_pgjobs.status import Status
from django_pgjobs.transports import POSTGRES, transport_of

logger = logging.getLogger("django_pgjobs.enqueue")

if TYPE_CHECKING:
    from django_pgjobs.models import Job
    from django_pgjobs.registry import Task


#: The columns a new job has before anything happened to it (the database's defaults).
NEW_JOB: dict[str, Any] = {
    "status": Status.READY.value, "attempts": 0, "leased_until": None, "worker": None,
    "last_error": "", "errors": [], "finished_at": None, "started_at": None,
    "cancel_requested": False, "result": None, "claims": 0, "scheduled": False,
    "progress": None, "headers": None, "limit_key": None, "batch_id": None,
}  # fmt: skip


def new_job(task_or_name: Task | str, payload: dict[str, Any] | None, **options: Any) -> NewJob:
    """A job to insert, its options (those of `options_of`) and its payload checked: see there."""
    task, job = options_of(task_or_name, **options)
    text = payload_texts(task, [payload])[0]
    return job._replace(payload_json=text, limit_key=limit_keys(task, [payload])[0])


def options_of(
    task_or_name: Task | str,
    *,
    queue: str | None,
    priority: int | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
    max_attempts: int | None,
    unique_key: str | None,
) -> tuple[Task, NewJob]:
    """The registered task, and a job of it with an empty payload, every option checked: each
    option given, else the task's default, else the PGJOBS default."""
    settings = get_settings()
    task = registry.resolve(task_or_name)
    if task.late:
        warn_unknown_to_workers(
            task.name,
            "task %s was registered after start-up, when %s was imported: a worker imports each "
            "installed app's tasks module at its start-up (and what those import), so unless it "
            "imports %s too, its jobs become dead letters (UnknownTask). Define the task in a "
            "tasks.py, or import its module there or from AppConfig.ready().",
            task.func.__module__,
        )
    if run_at is not None and delay is not None:
        raise EnqueueError("Pass run_at or delay, not both.")
    # An empty name is an error, not "the default queue" (`_first`, not `or`).
    queue = validation.check_queue(_first(queue, task.queue, settings.DEFAULT_QUEUE))
    if task.limited and transport_of(queue) != POSTGRES:
        raise EnqueueError(
            f"task {task.name!r} has limits, which the claim in PostgreSQL holds, but queue "
            f"{queue!r} is carried by {transport_of(queue)}: enqueue it to a queue of "
            "PostgreSQL's (queue=...), or drop its limits."
        )
    return task, NewJob(
        id=uuid7(),
        queue=queue,
        task=validation.check_task_name(task.name),
        payload_json="{}",
        priority=validation.check_priority(
            _first(priority, task.priority, settings.DEFAULT_PRIORITY)
        ),
        run_at=None if run_at is None else validation.check_run_at(run_at),
        delay=None if delay is None else validation.check_delay(delay),
        max_attempts=validation.check_max_attempts(
            _first(max_attempts, task.max_attempts, settings.MAX_ATTEMPTS)
        ),
        unique_key=None if unique_key is None else validation.check_unique_key(unique_key),
    )


_warned: set[str] = set()


def warn_unknown_to_workers(name: str, message: str, module: str) -> None:
    """Say once per task (`name`) that workers may not know it, its jobs becoming dead letters
    (UnknownTask) at their first claim: `message`, with the name and its `module` (twice)."""
    if name not in _warned:
        _warned.add(name)
        with contextlib.suppress(Exception):  # the application's logging: not the enqueue's end
            logger.warning(message, name, module, module)


def callback(task: Task | str, payload: dict[str, Any]) -> dict[str, Any]:
    """A batch's callback (batches.py): the job to insert when the batch moves, its options and
    payload checked now, as an enqueue's are (its payload then gets `batch` too)."""
    registered, job = options_of(
        task, queue=None, priority=None, run_at=None, delay=None, max_attempts=None,
        unique_key=None,
    )  # fmt: skip
    if transport_of(job.queue) != POSTGRES:
        raise EnqueueError(
            f"queue {job.queue!r} is carried by {transport_of(job.queue)}: a callback is "
            "inserted by the statement that moves its batch. Give the task a queue of "
            "PostgreSQL's."
        )
    counts = {"id": "", "succeeded": 0, "failed": 0, "cancelled": 0}
    payload_texts(registered, [{**payload, "batch": counts}])
    (key,) = limit_keys(registered, [payload])
    return {
        "id": str(job.id), "queue": job.queue, "task": job.task, "payload": payload,
        "priority": job.priority, "max_attempts": job.max_attempts, "limit_key": key,
    }  # fmt: skip


def payload_texts(task: Task, payloads: Sequence[dict[str, Any] | None]) -> list[str]:
    """Each payload as JSON text, once it survives jsonb and fits the task's handler; the
    EnqueueError names the payload's position when there are several."""
    limit = get_settings().MAX_PAYLOAD_BYTES
    # An integration's job (a Django Task's) has a payload of its own shape, which it checks.
    handler = None if registry.runner_for(task.name) else task.func
    texts = []
    for index, payload in enumerate(payloads):
        try:
            texts.append(validation.payload_json(payload, limit))
            if handler is not None:
                check_arguments(handler, task.name, (), payload or {})
        except (EnqueueError, PayloadMismatch) as error:
            message = f"{error}." if isinstance(error, PayloadMismatch) else str(error)
            where = f"payloads[{index}]: " if len(payloads) > 1 else ""
            raise EnqueueError(where + message) from None
    return texts


def limit_keys(task: Task, payloads: Sequence[dict[str, Any] | None]) -> list[str | None]:
    """Each payload's limit key (limits.key_of); the EnqueueError names the payload's position
    when there are several."""
    if not task.limited:
        return [None] * len(payloads)
    keys = []
    for index, payload in enumerate(payloads):
        try:
            keys.append(limits.key_of(task, payload or {}))
        except EnqueueError as error:
            where = f"payloads[{index}]: " if len(payloads) > 1 else ""
            raise EnqueueError(where + str(error)) from error.__cause__
    return keys


def insert(
    model: type[Job], db: str, job: NewJob, payload: dict[str, Any], *, waiting: bool = False
) -> Job | None:
    """Insert one job (one statement); `payload` is the checked payload its JSON was made from
    (the returned Job holds it). None when its unique_key is held by a live job. `waiting`: it
    waits for dependencies (batches.add_dependencies), in no queue's claim until they succeed."""
    if waiting and transport_of(job.queue) != POSTGRES:
        raise EnqueueError(
            f"after=: queue {job.queue!r} is carried by {transport_of(job.queue)}, whose jobs "
            "cannot wait in the database: enqueue it to a queue of PostgreSQL's (queue=...)."
        )
    member = batches.member_of(job.queue)
    wake_up = not waiting and bool(wakeups.to_send(db, [job.queue]))
    statement = sql.INSERT_JOBS[_due(job), job.unique_key is not None, wake_up]
    params = {
        "id": job.id, "queue": job.queue, "task": job.task, "payload": job.payload_json,
        "priority": job.priority, "run_at": job.run_at, "delay": job.delay or 0.0,
        "max_attempts": job.max_attempts, "unique_key": job.unique_key,
        "limit_key": job.limit_key, "channel": wakeups.CHANNEL if wake_up else None,
        "status": Status.WAITING if waiting else Status.READY,
        "batch": None if member is None else member.id,
    }  # fmt: skip
    with _sending(job, 1) as headers, schema.migrated():  # a missing table: run migrate
        found = rows.execute(db, statement, params | {"headers": _text(headers)}, binary=True)
    if not found:
        return None  # its unique_key is held by a live job
    ((_, run_at, created_at, scheduled, *_),) = found
    columns = _columns(job, run_at, created_at, scheduled, headers) | {
        "limit_key": job.limit_key, "status": params["status"], "batch_id": params["batch"],
    }  # fmt: skip
    return next(rows.new_jobs(model, db, columns, [job.id], [payload]))


def insert_many(
    model: type[Job],
    db: str,
    options: NewJob,
    payloads: Sequence[dict[str, Any]],
    texts: Sequence[str],
    keys: Sequence[str | None],
    batch_size: int,
) -> list[Job]:
    """Insert one job of `options` (never with a unique_key) per payload, `batch_size` rows per
    COPY, in one transaction (the caller's, else its own); `texts` are the payloads' JSON and
    `keys` their limit keys."""
    if not payloads:
        return []
    ids = uuid7_batch(len(payloads))
    member = batches.member_of(options.queue)
    batch_id = None if member is None else member.id
    made: list[Job] = []
    with schema.migrated(), transaction.atomic(using=db, savepoint=False):
        wake_up = wakeups.to_send(db, [options.queue])
        params = {
            "queue": options.queue, "run_at": options.run_at, "delay": options.delay or 0.0,
            "channel": wakeups.CHANNEL if wake_up else None,
        }  # fmt: skip
        ((created_at, run_at, scheduled, _),) = rows.execute(
            db, sql.NEW_JOBS_TIMES, params, binary=True
        )
        for start in range(0, len(ids), batch_size):
            end = min(start + batch_size, len(ids))
            with _sending(options._replace(id=ids[start]), end - start) as headers:
                columns = _columns(options, run_at, created_at, scheduled, headers)
                columns["batch_id"] = batch_id
                jobs = rows.new_jobs(model, db, columns, ids[start:end], payloads[start:end])
                # Every column but the id and the payload is the same for every row of this COPY.
                queue, task = options.queue, options.task
                rest = (
                    *(options.priority, run_at, scheduled, options.max_attempts),
                    *(created_at, _text(headers)),
                )
                records = (
                    (job.id, queue, task, text, *rest, key, batch_id)
                    for job, text, key in zip(
                        _kept(_keyed(jobs, keys[start:end]), made), texts[start:end],
                        keys[start:end], strict=True,
                    )
                )  # fmt: skip
                rows.copy(db, sql.COPY_JOBS, sql.COPY_JOBS_TYPES, records)
    return made


#: From this many jobs on, a bulk enqueue pauses the garbage collector (collector_paused).
PAUSE_COLLECTOR_FROM = 1000


@contextmanager
def collector_paused(count: int) -> Iterator[None]:
    """Python's cyclic garbage collector paused while `count` jobs are checked and made, when
    that is PAUSE_COLLECTOR_FROM or more: each Job is several new containers, all kept, which
    the collector would scan again and again as the heap grows. One already off stays off."""
    if count < PAUSE_COLLECTOR_FROM or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _due(job: NewJob) -> str:
    """When `job` is due, as sql.INSERT_JOBS names it."""
    if job.run_at is not None:
        return "run_at"
    return "delay" if job.delay else "now"


def _keyed(jobs: Iterator[Job], keys: Sequence[str | None]) -> Iterator[Job]:
    """Each of `jobs` with its limit key."""
    for job, key in zip(jobs, keys, strict=True):
        job.limit_key = key
        yield job


def _kept(jobs: Iterator[Job], into: list[Job]) -> Iterator[Job]:
    """Each of `jobs`, appended to `into` as it passes."""
    for job in jobs:
        into.append(job)
        yield job


def _columns(
    job: NewJob, run_at: datetime, created_at: datetime, scheduled: bool, headers: Any
) -> dict[str, Any]:
    """Every column of a job just inserted but its id and payload (sql.JOB_COLUMNS)."""
    return NEW_JOB | {
        "queue": job.queue, "task": job.task, "priority": job.priority, "run_at": run_at,
        "max_attempts": job.max_attempts, "created_at": created_at,
        "unique_key": job.unique_key, "scheduled": scheduled, "headers": headers,
    }  # fmt: skip


@contextmanager
def _sending(first: NewJob, count: int) -> Iterator[dict[str, str] | None]:
    """Around the insert of `count` jobs like `first`, the headers to write with each: the send
    span's trace context with PGJOBS["TRACING"] on (only then is opentelemetry imported)."""
    if not get_settings().TRACING:
        yield None
        return
    from django_pgjobs import tracing

    with tracing.sending(first, count) as headers:
        yield headers


def _text(headers: dict[str, str] | None) -> str | None:
    return None if headers is None else json.dumps(headers)


def _first(*values: Any) -> Any:
    return next(value for value in values if value is not None)
