"""Enqueue: check a job's options, then insert it (one statement, in the caller's transaction)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django_pgjobs import registry, schema, validation
from django_pgjobs.arguments import check_arguments
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows, sql, wakeups
from django_pgjobs.data.records import NewJob
from django_pgjobs.errors import EnqueueError, PayloadMismatch
from django_pgjobs.ids import uuid7
from django_pgjobs.status import Status

if TYPE_CHECKING:
    from django_pgjobs.models import Job
    from django_pgjobs.registry import Task


#: The columns a new job has before anything happened to it (the database's defaults).
NEW_JOB: dict[str, Any] = {
    "status": Status.READY.value, "attempts": 0, "leased_until": None, "worker": None,
    "last_error": "", "errors": [], "finished_at": None, "started_at": None,
    "cancel_requested": False, "result": None, "claims": 0, "scheduled": False,
    "progress": None, "headers": None,
}  # fmt: skip


def new_jobs(
    task_or_name: Task | str,
    payloads: Sequence[dict[str, Any] | None],
    *,
    queue: str | None,
    priority: int | None,
    run_at: datetime | None,
    delay: float | timedelta | None,
    max_attempts: int | None,
    unique_key: str | None = None,
) -> list[NewJob]:
    """Jobs to insert, one per payload, every option checked once (each given, else the task's
    default, else the PGJOBS default) and each payload on its own: EnqueueError before anything
    is written, naming the payload's position when there are several."""
    settings = get_settings()
    task = registry.resolve(task_or_name)
    if run_at is not None and delay is not None:
        raise EnqueueError("Pass run_at or delay, not both.")
    options = NewJob(
        id=uuid7(),
        # An empty name is an error, not "the default queue" (`_first`, not `or`).
        queue=validation.check_queue(_first(queue, task.queue, settings.DEFAULT_QUEUE)),
        task=task.name,
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
    jobs = []
    for index, payload in enumerate(payloads):
        try:
            payload_json = _checked_payload(task, payload, settings.MAX_PAYLOAD_BYTES)
        except EnqueueError as error:
            if len(payloads) == 1:
                raise
            raise EnqueueError(f"payloads[{index}]: {error}") from None
        jobs.append(options._replace(id=uuid7(), payload_json=payload_json))
    return jobs


def _checked_payload(task: Task, payload: dict[str, Any] | None, max_bytes: int) -> str:
    """The payload as JSON text, once it survives jsonb and fits the task's handler."""
    text = validation.payload_json(payload, max_bytes)
    # An integration's job (a Django Task's) has a payload of its own shape: its backend
    # checks the arguments in it (backend.PgJobsBackend.enqueue).
    if registry.runner_for(task.name) is None:
        try:
            check_arguments(task.func, task.name, (), payload or {})
        except PayloadMismatch as error:
            raise EnqueueError(f"{error}.") from None
    return text


def insert(
    model: type[Job], db: str, jobs: Sequence[NewJob], payloads: Sequence[dict[str, Any]]
) -> list[Job]:
    """Insert jobs that differ only in their id and payload, in one statement; `payloads` are
    the checked payloads their JSON was made from (the returned Jobs hold them). A job whose
    unique_key a live job holds is not inserted and not returned."""
    first = jobs[0]
    wake_up = wakeups.to_send(db, [first.queue])
    params: dict[str, Any] = {
        "queue": first.queue,
        "task": first.task,
        "priority": first.priority,
        "run_at": first.run_at,
        "delay": first.delay,
        "max_attempts": first.max_attempts,
        "channel": wakeups.CHANNEL if wake_up else None,
    }
    if len(jobs) == 1:
        statement = sql.INSERT_JOB if first.unique_key is None else sql.INSERT_UNIQUE_JOB
        params |= {"id": first.id, "payload": first.payload_json, "unique_key": first.unique_key}
        found, headers = _execute(db, statement, params, jobs)
        inserted = {job_id: written for job_id, *written, _ in found}
    else:
        assert all(job.unique_key is None for job in jobs), "many jobs never share a unique_key"
        params |= {
            "ids": [job.id for job in jobs],
            "payloads": [job.payload_json for job in jobs],
        }
        ((*written, count, _),), headers = _execute(db, sql.INSERT_JOBS, params, jobs)
        assert count == len(jobs), "one statement inserts them all"
        inserted = dict.fromkeys(params["ids"], written)
    made = []
    for job, payload in zip(jobs, payloads, strict=True):
        if job.id not in inserted:
            continue  # its unique_key is held by a live job
        run_at, created_at, scheduled = inserted[job.id]
        columns = NEW_JOB | {
            "id": job.id, "queue": job.queue, "task": job.task, "payload": payload,
            "priority": job.priority, "run_at": run_at, "max_attempts": job.max_attempts,
            "created_at": created_at, "unique_key": job.unique_key,
            "scheduled": scheduled, "headers": headers,
        }  # fmt: skip
        made.append(rows.new_job(model, db, [columns[name] for name in sql.JOB_COLUMNS]))
    return made


def _execute(
    db: str, statement: str, params: dict[str, Any], jobs: Sequence[NewJob]
) -> tuple[list[Any], dict[str, str] | None]:
    """Run an insert of `jobs`, returning its rows and the headers written with every job. With
    PGJOBS["TRACING"] on, in the jobs' send span, whose trace context becomes their headers
    (tracing.py, imported only then: it imports opentelemetry); else the column stays NULL.
    A missing table raises NotMigrated, which says to run manage.py migrate."""
    if not get_settings().TRACING:
        with schema.migrated():
            return rows.execute(db, statement, params | {"headers": None}, binary=True), None
    from django_pgjobs import tracing

    with tracing.sending(jobs) as headers, schema.migrated():
        text = None if headers is None else json.dumps(headers)
        return rows.execute(db, statement, params | {"headers": text}, binary=True), headers


def _first(*values: Any) -> Any:
    return next(value for value in values if value is not None)
