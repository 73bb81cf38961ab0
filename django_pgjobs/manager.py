"""Every query that changes a job: enqueue, claim, complete, fail, release, reap, replay, prune.

Each transition is one short statement guarded so it changes only what it should, and returns
what it changed. Times are the database's (``statement_timestamp()``), never the app's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
from django.db import connections, models, router, transaction
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from django_pgjobs import notify, registry, signals, validation
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import EnqueueError
from django_pgjobs.ids import uuid7, uuid7_floor
from django_pgjobs.status import LIVE, Status

if TYPE_CHECKING:
    from django_pgjobs.models import Job
    from django_pgjobs.registry import Task

#: How far ahead of the database's clock an enqueuing process's clock may run before pruning
#: its jobs is delayed (see JobQuerySet.prunable).
ID_CLOCK_MARGIN = timedelta(minutes=10)

#: A failed attempt to record: (job, failure, permanent?, seconds before the retry).
FailedAttempt = tuple["Job", "Failure", bool, float]

#: The claim's ORDER BY within one queue, and the claim index's columns after `queue`.
#: One constant for both, so the claim stays an index range scan with no sort.
CLAIM_ORDER = ("-priority", "run_at", "id")

# Text written on the failure path must never make that write fail (a NUL byte in an error
# message once left jobs stuck in other queues), so it is cleaned and bounded first.
MESSAGE_LIMIT = 2000
TRACEBACK_LIMIT = 4000


@dataclass(frozen=True)
class Failure:
    """What a failed attempt leaves in the job's error history."""

    type: str
    message: str
    traceback: str = ""

    def as_json(self) -> str:
        return json.dumps(
            {
                "type": clean_text(self.type, 200),
                "message": clean_text(self.message, MESSAGE_LIMIT),
                "traceback": clean_text(self.traceback, TRACEBACK_LIMIT, keep="tail"),
            }
        )

    @property
    def summary(self) -> str:
        return clean_text(
            f"{self.type}: {self.message}" if self.message else self.type, MESSAGE_LIMIT
        )


def clean_text(text: str, limit: int, keep: str = "head") -> str:
    """Text PostgreSQL will accept: no NUL bytes, no lone surrogates, at most `limit` characters."""
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep == "tail" else text[: limit - 1] + "…"


# Appends one entry to the bounded error history; %(error)s is the entry's JSON, the
# attempt, time and worker come from the row and the database clock.
_APPEND_ERROR = """
    jsonb_path_query_array(
        j.errors || jsonb_build_array(
            jsonb_build_object(
                'attempt', j.attempts, 'at', statement_timestamp(), 'worker', j.worker
            )
            || %(error)s::jsonb
        ),
        %(keep)s::jsonpath
    )
"""

# run_at: when given, else now + delay (the database's clock).
_RUN_AT = """COALESCE(%s::timestamptz,
                      statement_timestamp() + make_interval(secs => COALESCE(%s::float8, 0)))"""

# Enqueue, keyed by (with a unique_key?, with a wake-up?). One job is a VALUES row, the
# cheapest statement to plan. ON CONFLICT only with a unique_key: a speculative insertion costs
# more CPU and WAL than a plain one, and a NULL key can never conflict. The wake-up is part of
# the statement (see notify.to_send), evaluated only for an inserted row.
_INSERT = f"""
    INSERT INTO pgjobs_job AS j
        (id, queue, task, payload, priority, run_at, max_attempts, unique_key)
    VALUES (%s, %s, %s, %s::jsonb, %s, {_RUN_AT}, %s, %s)
    {{on_conflict}}
    RETURNING j.id, j.run_at, j.created_at{{wake_up}}
"""
_ON_CONFLICT = """ON CONFLICT (unique_key)
    WHERE status IN ('ready', 'running') AND unique_key IS NOT NULL DO NOTHING"""
_WAKE_UP = ", pg_notify(%s, %s)"
_INSERT_ONE = {
    (unique, wake): _INSERT.format(
        on_conflict=_ON_CONFLICT if unique else "", wake_up=_WAKE_UP if wake else ""
    )
    for unique in (False, True)
    for wake in (False, True)
}
# Many jobs of one task with the same options (and no unique_key): their ids and payloads as
# parallel arrays, the rest bound once. The arrays bind in binary (%b): text arrays would have
# every JSON payload quoted and escaped by Python first. Every row gets the same run_at (one
# statement_timestamp()) and created_at (the transaction's now()), so one row of them comes
# back instead of a row per job.
_INSERT_MANY_TEMPLATE = f"""
    WITH inserted AS (
        INSERT INTO pgjobs_job AS j (id, queue, task, payload, priority, run_at, max_attempts)
        SELECT i.id, %s, %s, i.payload::jsonb, %s, {_RUN_AT}, %s
        FROM unnest(%b::uuid[], %b::text[]) AS i(id, payload)
        RETURNING j.run_at, j.created_at
    )
    SELECT min(run_at), min(created_at), max(run_at) = min(run_at), count(*){{wake_up}}
    FROM inserted
"""
_INSERT_MANY = {  # by "with a wake-up?"
    wake: _INSERT_MANY_TEMPLATE.format(wake_up=_WAKE_UP if wake else "") for wake in (False, True)
}


#: The fields of a newly enqueued Job, in model order (_insert builds rows in this order).
_ENQUEUED = (
    "id", "queue", "task", "payload", "status", "priority", "run_at", "attempts", "max_attempts",
    "leased_until", "worker", "last_error", "errors", "created_at", "finished_at", "unique_key",
    "started_at", "cancel_requested", "result",
)  # fmt: skip


class JobQuerySet(models.QuerySet["Job"]):
    # Filters: they never write.

    def ready(self) -> JobQuerySet:
        return self.filter(status=Status.READY)

    def due(self) -> JobQuerySet:
        return self.filter(status=Status.READY, run_at__lte=Now())

    def running(self) -> JobQuerySet:
        return self.filter(status=Status.RUNNING)

    def expired(self) -> JobQuerySet:
        return self.filter(status=Status.RUNNING, leased_until__lt=Now())

    def dead(self) -> JobQuerySet:
        return self.filter(status=Status.FAILED)

    # Transitions over a selection of jobs; each returns the ids of the jobs it changed, so
    # callers can report how many and the admin can log exactly which.

    def replay(self, *, queue: str | None = None) -> list[UUID]:
        """Failed or cancelled → ready, due now, with a fresh attempt budget (optionally into
        another queue). Skips other statuses, and jobs whose unique_key a live job holds."""
        held_keys = self.model._default_manager.filter(
            status__in=LIVE, unique_key__isnull=False
        ).values("unique_key")
        return self.exclude(unique_key__in=held_keys)._change(
            "status = 'ready', attempts = 0, run_at = statement_timestamp(), finished_at = NULL, "
            "leased_until = NULL, cancel_requested = false, queue = COALESCE(%s, j.queue)",
            [None if queue is None else validation.check_queue(queue)],
            guard="j.status IN ('failed', 'cancelled')",
        )

    def cancel(self) -> list[UUID]:
        """Ready → cancelled at once; for running jobs, request cancellation: the handler can
        notice (``django_pgjobs.cancel_requested()``) and stop, and when the attempt ends other
        than by succeeding, the job is recorded as cancelled instead of being retried."""
        return self._change(
            "status = CASE WHEN j.status = 'ready' THEN 'cancelled' ELSE j.status END, "
            "finished_at = CASE WHEN j.status = 'ready' THEN statement_timestamp() END, "
            "cancel_requested = j.status = 'running'",
            guard="(j.status = 'ready' OR (j.status = 'running' AND NOT j.cancel_requested))",
        )

    def run_now(self) -> list[UUID]:
        """Make ready jobs scheduled for later due now."""
        return self._change(
            "run_at = statement_timestamp()",
            guard="j.status = 'ready' AND j.run_at > statement_timestamp()",
        )

    def discard(self) -> list[UUID]:
        """Delete the selected jobs, except running ones: their worker still owns them."""
        return self._change(None, guard="j.status <> 'running'")

    def _change(
        self, assignments: str | None, params: Sequence[Any] = (), *, guard: str
    ) -> list[UUID]:
        """One UPDATE (or, without assignments, DELETE) of the selected jobs that pass `guard`,
        returning their ids. The guard is re-checked on each row as it is written, so a job
        whose status changed since it was selected is left alone."""
        self._for_write = True  # as QuerySet.update() does: route to the database for writes
        db = self.db
        selected, selected_params = self.values("pk").query.get_compiler(db).as_sql()
        head = "DELETE FROM pgjobs_job AS j" if assignments is None else (
            f"UPDATE pgjobs_job AS j SET {assignments}"
        )  # fmt: skip
        with connections[db].cursor() as cursor:
            cursor.execute(
                f"{head} WHERE j.id IN ({selected}) AND {guard} RETURNING j.id",
                [*params, *selected_params],
            )
            return [job_id for (job_id,) in cursor.fetchall()]

    def prunable(self, retention: Mapping[str, timedelta | None] | None = None) -> JobQuerySet:
        """Finished jobs older than their status's retention (default PGJOBS["RETENTION"]; a
        status whose retention is None is kept)."""
        kept = get_settings().retention() if retention is None else retention
        old = models.Q(pk__in=[])
        for status, age in kept.items():
            if age is not None:
                old |= models.Q(status=status, finished_at__lt=Now() - age)
        ages = [age for age in kept.values() if age is not None]
        if not ages:
            return self.filter(old)
        # Ids are UUIDv7s made at enqueue, so a job finished before the cutoff has an id from
        # before it: bounding the id makes this a range of the primary key instead of a scan of
        # every finished job. The bound is the enqueuer's clock (with a margin); the database's
        # finished_at still decides, so a skewed clock can delay pruning, never hasten it.
        newest = time.time() - min(ages).total_seconds() + ID_CLOCK_MARGIN.total_seconds()
        return self.filter(old, pk__lt=uuid7_floor(newest))

    def prune(
        self,
        *,
        older_than: timedelta | None = None,
        retention: Mapping[str, timedelta | None] | None = None,
        max_batches: int | None = None,
    ) -> int:
        """Delete finished jobs older than their status's retention (`retention`, by default
        PGJOBS["RETENTION"]; `older_than` sets it for succeeded and cancelled jobs), PRUNE_BATCH
        rows per statement; returns how many."""
        settings = get_settings()
        retention = {**settings.retention(), **(retention or {})}
        if older_than is not None:
            retention.update(succeeded=older_than, cancelled=older_than)
        old = self.prunable(retention)
        total, batches = 0, 0
        while max_batches is None or batches < max_batches:
            # Bounded batches keep each transaction short and the locks few; SKIP LOCKED lets
            # every worker prune at once without queueing behind each other.
            batch = old.values("pk").select_for_update(skip_locked=True)
            with transaction.atomic(using=self.db):
                deleted, _ = (
                    self.model._default_manager.using(self.db)
                    .filter(pk__in=batch[: settings.PRUNE_BATCH])
                    .delete()
                )
            total, batches = total + deleted, batches + 1
            if deleted < settings.PRUNE_BATCH:
                break
        return total


class JobManager(models.Manager.from_queryset(JobQuerySet)):  # type: ignore[misc]
    """Job.objects: the seam through which every job changes state."""

    # ---- enqueue -----------------------------------------------------------------------------

    def enqueue(
        self,
        task: Task | str,
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
    ) -> Job:
        """Write one job in the caller's transaction (one INSERT on the caller's connection).

        With a `unique_key` that a ready or running job already holds, nothing is written and
        that job is returned instead.
        """
        row = self._row(task, payload, queue, priority, run_at, delay, max_attempts, unique_key)
        while True:
            jobs = self._insert([row], [payload or {}])
            if jobs:
                signals.send(signals.job_enqueued, jobs=jobs)
                return jobs[0]
            existing: Job | None = self.filter(unique_key=unique_key, status__in=LIVE).first()
            if existing is not None:
                return existing
            # The job holding the key finished between the insert and the look: insert again.

    def bulk_enqueue(
        self,
        task: Task | str,
        payloads: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        batch_size: int = 5000,
    ) -> list[Job]:
        """Write many jobs of one task, `batch_size` per statement. Every payload is checked
        before anything is written."""
        # The options are the same for every job: check them once, then each payload.
        _, queue, name, _, priority, run_at, delay, max_attempts, _ = self._row(
            task, None, queue, priority, run_at, delay, max_attempts, None
        )
        limit = get_settings().MAX_PAYLOAD_BYTES
        checked = [{} if payload is None else payload for payload in payloads]
        rows = [
            (uuid7(), queue, name, validation.payload_json(payload, limit), priority, run_at,
             delay, max_attempts, None)
            for payload in checked
        ]  # fmt: skip
        jobs: list[Job] = []
        for start in range(0, len(rows), batch_size):
            end = start + batch_size
            jobs.extend(self._insert(rows[start:end], checked[start:end]))
        signals.send(signals.job_enqueued, jobs=jobs)
        return jobs

    def _row(
        self,
        task_or_name: Task | str,
        payload: dict[str, Any] | None,
        queue: str | None,
        priority: int | None,
        run_at: datetime | None,
        delay: float | timedelta | None,
        max_attempts: int | None,
        unique_key: str | None,
    ) -> tuple[Any, ...]:
        settings = get_settings()
        task = registry.resolve(task_or_name)
        if run_at is not None and delay is not None:
            raise EnqueueError("Pass run_at or delay, not both.")
        return (
            uuid7(),
            # An empty name is an error, not "the default queue" (`_first`, not `or`).
            validation.check_queue(_first(queue, task.queue or settings.DEFAULT_QUEUE)),
            task.name,
            validation.payload_json(payload, settings.MAX_PAYLOAD_BYTES),
            validation.check_priority(_first(priority, task.priority, settings.DEFAULT_PRIORITY)),
            None if run_at is None else validation.check_run_at(run_at),
            None if delay is None else validation.check_delay(delay),
            validation.check_max_attempts(
                _first(max_attempts, task.max_attempts, settings.MAX_ATTEMPTS)
            ),
            None if unique_key is None else validation.check_unique_key(unique_key),
        )

    def _insert(self, rows: list[tuple[Any, ...]], payloads: list[dict[str, Any]]) -> list[Job]:
        """Insert rows made by _row that differ only in their id and payload; `payloads` are
        the checked payloads the rows' JSON was made from (the returned jobs hold them)."""
        db = self._write_db()
        _, queue, task, _, priority, run_at, delay, max_attempts, key = rows[0]
        wake_up = [notify.CHANNEL, queue] if notify.to_send(db, [queue]) else []
        # Binary results: uuids and timestamps load in C rather than by parsing text.
        with _cursor(db, binary=True) as cursor:
            if len(rows) == 1:
                cursor.execute(_INSERT_ONE[key is not None, bool(wake_up)], [*rows[0], *wake_up])
                inserted = {job_id: (at, created) for job_id, at, created, *_ in cursor.fetchall()}
            else:
                assert key is None, "many jobs never share a unique_key"
                ids = [row[0] for row in rows]
                payloads_json = [row[3] for row in rows]
                cursor.execute(
                    _INSERT_MANY[bool(wake_up)],
                    [queue, task, priority, run_at, delay, max_attempts, ids, payloads_json,
                     *wake_up],
                )  # fmt: skip
                first_run_at, created_at, same, count, *_ = cursor.fetchone()
                assert same and count == len(rows), "one statement, one run_at"
                inserted = dict.fromkeys(ids, (first_run_at, created_at))
        attnames = list(_ENQUEUED)
        jobs = []
        for row, payload in zip(rows, payloads, strict=True):
            job_id, queue, task, _json, priority, _run_at, _delay, max_attempts, key = row
            if job_id not in inserted:
                continue  # unique_key already held by a live job
            run_at, created_at = inserted[job_id]
            # from_db with every field in order: the fast way to build a model instance.
            values: tuple[Any, ...] = (
                job_id, queue, task, payload, Status.READY.value, priority, run_at,
                0, max_attempts, None, None, "", [], created_at, None, key, None, False, None,
            )  # fmt: skip
            jobs.append(self.model.from_db(db, attnames, values))
        return jobs

    # ---- claim and finish ------------------------------------------------------------------

    def claim(
        self, queues: Sequence[str], *, worker: str, limit: int = 1, lease: float | None = None
    ) -> list[Job]:
        """Take up to `limit` due jobs from `queues`, highest priority first, then oldest run_at.

        One statement: an UPDATE over a ``SELECT … FOR UPDATE SKIP LOCKED`` subquery, so
        concurrent workers never claim the same job and never wait for each other. Each job
        comes back running, leased to `worker` for `lease` seconds, with `attempts` counting
        this one. Run the jobs after this returns (the claim has committed, unless the caller
        wrapped it in its own transaction).
        """
        return self.finish_and_claim([], [], queues, worker=worker, limit=limit, lease=lease)[2]

    def finish_and_claim(
        self,
        succeeded: Sequence[Job],
        failed: Sequence[FailedAttempt],
        queues: Sequence[str],
        *,
        worker: str,
        limit: int,
        lease: float | None = None,
        results: Mapping[UUID, str] | None = None,
    ) -> tuple[set[UUID], dict[UUID, str], list[Job]]:
        """Record the outcomes of `worker`'s finished jobs and claim up to `limit` due jobs, in
        one statement: one round trip and one commit per turn of a worker's loop.

        `succeeded` are completed as by `complete_many`, keeping the return values in
        `results` (job id → JSON text) as their `result`; each of `failed` — (job, failure,
        permanent, delay) — is recorded as by `fail`, guarded the same way. Returns the ids of
        `succeeded` this worker still owned, the new status of each of `failed` it still owned,
        and the claimed jobs (as `claim`).
        """
        claiming = bool(queues) and limit >= 1
        if not (claiming or succeeded or failed):
            return set(), {}, []
        workers = {job.worker for job in succeeded} | {f[0].worker for f in failed} | {worker}
        if len(workers) != 1:
            raise ValueError(f"jobs of one worker at a time, got {sorted(map(str, workers))}")
        db = self._write_db()
        queue_count, limit = (len(queues), limit) if claiming else (0, 0)
        params: list[Any] = []
        if claiming:
            lease = get_settings().LEASE if lease is None else lease
            params += [
                worker,
                lease,
                *_bind_queues(_claim_select(db, queue_count, limit)[1], queues),
            ]
        if succeeded:
            params += [[job.pk for job in succeeded], [job.attempts for job in succeeded]]
            if results:
                params.append([results.get(job.pk) for job in succeeded])
            params.append(worker)
        if failed:
            params += [
                _keep_last(get_settings().ERRORS_KEPT),
                [job.pk for job, *_ in failed],
                [job.attempts for job, *_ in failed],
                [permanent for _, _, permanent, _ in failed],
                [float(delay) for *_, delay in failed],
                [failure.summary for _, failure, *_ in failed],
                [failure.as_json() for _, failure, *_ in failed],
                worker,
            ]
        sql = _finish_sql(
            db, queue_count, limit, bool(succeeded), bool(succeeded and results), bool(failed)
        )
        # Binary results: uuids, timestamps and jsonb load in C rather than by parsing text.
        with _cursor(db, binary=True) as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        done = {row[1] for row in rows if row[0] == _DONE}
        status_at = 1 + _columns(self.model).index("status")
        dead_or_retried = {row[1]: row[status_at] for row in rows if row[0] == _FAILED}
        jobs = _from_rows(self.model, db, (row[1:] for row in rows if row[0] == _CLAIMED))
        jobs.sort(key=lambda job: (-job.priority, job.run_at, job.id))
        return done, dead_or_retried, jobs

    def claim_limited(
        self, queue: str, *, worker: str, limit: int, lease: float | None = None
    ) -> list[Job]:
        """Claim as `claim` from one queue that has controls (a Queue row): nothing while it is
        paused, and never more than its `max_running` jobs running at once across all workers.

        Claims on such a queue take turns: the transaction locks the queue's row first, so the
        count of running jobs that follows (a statement with a fresh snapshot) sees every claim
        committed before it, and the claim takes at most the room left.
        """
        db = self._write_db()
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            cursor.execute(
                "SELECT paused, max_running FROM pgjobs_queue WHERE name = %s FOR UPDATE", [queue]
            )
            paused, max_running = cursor.fetchone() or (False, None)
            if paused:
                return []
            if max_running is not None:
                cursor.execute(
                    "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND queue = %s",
                    [queue],
                )
                (running,) = cursor.fetchone()
                limit = min(limit, max_running - running)
            if limit < 1:
                return []
            return self.claim([queue], worker=worker, limit=limit, lease=lease)

    def complete(self, job: Job, result_json: str | None = None) -> bool:
        """Record success, keeping `result_json` (the return value as JSON text) when given.
        False means the lease ran out and another worker owns the job now."""
        if result_json is None:
            return job.pk in self.complete_many([job])
        assert job.worker is not None, "only a claimed job can complete"
        results = {job.pk: result_json}
        done = self.finish_and_claim([job], [], [], worker=job.worker, limit=0, results=results)
        return job.pk in done[0]

    def complete_many(self, jobs: Sequence[Job]) -> set[UUID]:
        """Record success for many jobs of one worker in one statement; returns the ids it still
        owned (the others were reaped and possibly claimed again: their outcome is not ours)."""
        return set(self._guarded(jobs, _SUCCEEDED))

    def release(self, jobs: Sequence[Job]) -> set[UUID]:
        """Running → ready without spending an attempt (a worker shutting down)."""
        return set(self._guarded(jobs, f"{_READY_OR_CANCELLED}, attempts = j.attempts - 1"))

    def heartbeat(self, jobs: Sequence[Job], lease: float | None = None) -> set[UUID]:
        """Extend the lease of a worker's running jobs by `lease` seconds from now; returns the
        ids still owned. Touches only unindexed columns, so the update can be HOT."""
        lease = get_settings().LEASE if lease is None else lease
        owned = self._guarded(
            jobs, "leased_until = statement_timestamp() + make_interval(secs => %s)", [lease]
        )
        # A cancellation requested meanwhile: the handler sees it on its Job at once.
        for job in jobs:
            if owned.get(job.pk):
                job.cancel_requested = True
        return set(owned)

    def retry_later(self, job: Job, delay: float) -> bool:
        """The handler asked to run again in `delay` seconds: ready again, attempt not counted."""
        return job.pk in self._guarded(
            [job],
            f"{_READY_OR_CANCELLED}, attempts = j.attempts - 1, "
            "run_at = statement_timestamp() + make_interval(secs => %s)",
            [delay],
        )

    def fail(self, job: Job, failure: Failure, *, permanent: bool, delay: float) -> str | None:
        """Record a failed attempt: back to ready in `delay` seconds while attempts remain and the
        error is not permanent, else failed (the dead letter). Returns the new status, or None
        when this worker no longer owned the job."""
        if job.worker is None:
            return None  # never claimed: no worker holds it, so none may record its outcome
        statuses = self.finish_and_claim(
            [], [(job, failure, permanent, delay)], [], worker=job.worker, limit=0
        )[1]
        return statuses.get(job.pk)

    def reap(self, *, limit: int = 1000) -> tuple[int, int]:
        """Take back running jobs whose lease expired: to ready (after a backoff), or to failed
        when no attempts remain, recording "lease expired" as the attempt's error. Safe to run
        from every worker at once (SKIP LOCKED). Returns (returned to ready, failed)."""
        settings = get_settings()
        sql = f"""
            WITH expired AS (
                SELECT id FROM pgjobs_job
                WHERE status = 'running' AND leased_until < statement_timestamp()
                LIMIT %(limit)s FOR UPDATE SKIP LOCKED
            )
            UPDATE pgjobs_job AS j SET
                status = CASE WHEN j.cancel_requested THEN 'cancelled'
                              WHEN j.attempts >= j.max_attempts THEN 'failed' ELSE 'ready' END,
                finished_at = CASE WHEN j.cancel_requested OR j.attempts >= j.max_attempts
                                   THEN statement_timestamp() END,
                run_at = statement_timestamp() + make_interval(
                    secs => random() * least(%(cap)s, %(base)s * 2 ^ least(j.attempts - 1, 62))),
                leased_until = NULL,
                last_error = 'WorkerLost: lease expired while held by ' || j.worker,
                errors = {_APPEND_ERROR}
            FROM expired
            WHERE j.id = expired.id AND j.status = 'running'
              AND j.leased_until < statement_timestamp()
            RETURNING j.status
        """
        error = Failure(
            "WorkerLost",
            "lease expired: the worker holding the job died, hung or lost its connection",
        )
        params: dict[str, Any] = {
            "limit": limit,
            "cap": settings.BACKOFF_MAX,
            "base": settings.BACKOFF_BASE,
            "error": error.as_json(),
            "keep": _keep_last(settings.ERRORS_KEPT),
        }
        with connections[self._write_db()].cursor() as cursor:
            cursor.execute(sql, params)
            statuses = [status for (status,) in cursor.fetchall()]
        failed = statuses.count(Status.FAILED)
        return statuses.count(Status.READY), failed

    # ---- helpers -----------------------------------------------------------------------------

    def _guarded(
        self, jobs: Sequence[Job], assignments: str, params: Sequence[Any] = ()
    ) -> dict[UUID, bool]:
        """Apply `assignments` to those of `jobs` this worker still owns, in one statement;
        returns their ids, each with whether a cancellation of it was requested.

        The guard is the claim itself — (id, running, worker, attempts) — so a worker whose
        lease expired cannot overwrite the attempt that replaced it.
        """
        if not jobs:
            return {}
        workers = {job.worker for job in jobs}
        if len(workers) != 1:
            raise ValueError(f"jobs of one worker at a time, got {sorted(map(str, workers))}")
        with _cursor(self._write_db()) as cursor:
            cursor.execute(
                _guarded_sql(assignments),
                [*params, [job.pk for job in jobs], [job.attempts for job in jobs], workers.pop()],
            )
            return dict(cursor.fetchall())

    def _write_db(self) -> str:
        return self._db or router.db_for_write(self.model)


def _first(*values: Any) -> Any:
    return next(value for value in values if value is not None)


def _keep_last(count: int) -> str:
    return f"$[last - {max(count, 1) - 1} to last]"


@lru_cache(maxsize=512)
def _claim_select(db: str, queue_count: int, limit: int) -> tuple[str, tuple[Any, ...]]:
    """The SELECT of due job ids that the claim locks, compiled by the ORM once per shape.

    One subquery per queue, each ordered like the claim index so it is an index range scan that
    stops after `limit` rows. With several queues, their few rows are taken in turns — every
    queue's best job, then every queue's second best, and so on (ties by the claim order) — so
    a backlog of old jobs in one queue never starves the others. Queue names stay bound
    parameters (placeholders for them are returned as _QUEUE and filled in by _bind_queues).
    """
    from django_pgjobs.models import Job

    def per_queue(columns: Sequence[str]) -> tuple[str, tuple[Any, ...]]:
        queryset = (
            Job.objects.using(db)
            .filter(_IS_READY, queue=_QUEUE, run_at__lte=Now())
            .order_by(*CLAIM_ORDER)
            .select_for_update(skip_locked=True)
            .values_list(*columns)[:limit]
        )
        # The compiler refuses FOR UPDATE outside a transaction; the claim runs as one
        # statement, which is its own transaction.
        with transaction.atomic(using=db):
            sql, params = queryset.query.get_compiler(using=db).as_sql()
        return sql, tuple(params)

    if queue_count == 1:
        return per_queue(["id"])
    part_sql, part_params = per_queue(["id", "priority", "run_at"])
    names = [f"q{n}" for n in range(queue_count)]
    ctes = ", ".join(f"{name} AS ({part_sql})" for name in names)
    union = " UNION ALL ".join(
        f"SELECT {n} AS queue, * FROM {name}" for n, name in enumerate(names)
    )
    order = "priority DESC, run_at, id"
    sql = (
        f"WITH {ctes} SELECT id FROM ("
        f"SELECT *, row_number() OVER (PARTITION BY queue ORDER BY {order}) AS turn "
        f"FROM ({union}) AS due(queue, id, priority, run_at)"
        f") AS turns ORDER BY turn, {order} LIMIT {int(limit)}"
    )
    return sql, part_params * queue_count


# Stands for a queue name in the cached claim SQL's parameters (never a valid queue name).
_QUEUE = "<queue placeholder>"


def _bind_queues(params: tuple[Any, ...], queues: Sequence[str]) -> list[Any]:
    names = iter(queues)
    return [next(names) if param == _QUEUE else param for param in params]


# A literal, never a bound parameter: the planner matches the claim index's predicate
# (status = 'ready') only against a constant, and a prepared statement's generic plan would
# otherwise lose the index.
_IS_READY = RawSQL(
    f'"pgjobs_job"."status" = \'{Status.READY.value}\'', (), output_field=models.BooleanField()
)

# The claim's UPDATE; %(returning)s lists the columns that come back.
_CLAIM = """
    UPDATE pgjobs_job AS j
    SET status = 'running', attempts = j.attempts + 1, worker = %%s,
        started_at = statement_timestamp(),
        leased_until = statement_timestamp() + make_interval(secs => %%s)
    WHERE j.id IN (%(select)s)
    RETURNING %(returning)s
"""

# A change to a worker's own running jobs, guarded on the claim itself (id, running, worker,
# attempts); {assignments} are the SET clause. Used by _guarded and, for completions, inside
# the turn's statement (_finish_sql).
_GUARDED = """
    UPDATE pgjobs_job AS j SET {assignments}
    FROM unnest(%s::uuid[], %s::int4[]{more}) AS mine(id, attempts{more_columns})
    WHERE j.id = mine.id AND j.attempts = mine.attempts
      AND j.status = 'running' AND j.worker = %s
    RETURNING j.id, j.cancel_requested
"""
# Back to ready, or cancelled when someone asked to cancel the job while it ran.
_READY_OR_CANCELLED = """
    status = CASE WHEN j.cancel_requested THEN 'cancelled' ELSE 'ready' END,
    finished_at = CASE WHEN j.cancel_requested THEN statement_timestamp() END,
    leased_until = NULL"""
_SUCCEEDED = "status = 'succeeded', finished_at = statement_timestamp(), leased_until = NULL"
# Completions that keep the handlers' return values: a third array, of JSON texts.
_SUCCEEDED_WITH_RESULTS = {
    "assignments": f"{_SUCCEEDED}, result = mine.result",
    "more": ", %s::jsonb[]",
    "more_columns": ", result",
}


def _guarded_sql(assignments: str) -> str:
    return _GUARDED.format(assignments=assignments, more="", more_columns="")


# Records failed attempts, guarded like _guarded: cancelled if a cancellation was requested,
# back to ready after f.delay while attempts remain and the error is not permanent, else failed
# (the dead letter).
_FAIL = f"""
    UPDATE pgjobs_job AS j SET
        status = CASE WHEN j.cancel_requested THEN 'cancelled'
                      WHEN f.permanent OR j.attempts >= j.max_attempts THEN 'failed'
                      ELSE 'ready' END,
        finished_at = CASE WHEN j.cancel_requested OR f.permanent
                                OR j.attempts >= j.max_attempts
                           THEN statement_timestamp() END,
        run_at = CASE WHEN j.cancel_requested OR f.permanent OR j.attempts >= j.max_attempts
                      THEN j.run_at
                      ELSE statement_timestamp() + make_interval(secs => f.delay) END,
        leased_until = NULL,
        last_error = f.summary,
        errors = {_APPEND_ERROR % {"error": "f.error", "keep": "%s"}}
    FROM unnest(%s::uuid[], %s::int4[], %s::bool[], %s::float8[], %s::text[], %s::text[])
         AS f(id, attempts, permanent, delay, summary, error)
    WHERE j.id = f.id AND j.attempts = f.attempts
      AND j.status = 'running' AND j.worker = %s
    RETURNING j.id, j.status
"""

# What each row of _finish_sql's result is.
_CLAIMED, _DONE, _FAILED = 0, 1, 2


@lru_cache(maxsize=512)
def _finish_sql(
    db: str, queue_count: int, limit: int, completing: bool, results: bool, failing: bool
) -> str:
    """One statement that claims (when `queue_count`), completes (keeping return values when
    `results`) and records failures. Rows
    come back as (_CLAIMED, *columns), (_DONE, id, NULL, ...) or (_FAILED, id, ..., status,
    ...): the columns of a job, so they can share one result."""
    from django_pgjobs.models import Job

    columns = _columns(Job)
    parts, selects = [], []
    if queue_count:
        select_sql = _claim_select(db, queue_count, limit)[0]
        returning = ", ".join(f"j.{column}" for column in columns)
        parts.append(f"claimed AS ({_CLAIM % {'select': select_sql, 'returning': returning}})")
        selects.append(f"SELECT {_CLAIMED}, claimed.* FROM claimed")
    if completing:
        done = _GUARDED.format(**_SUCCEEDED_WITH_RESULTS) if results else _guarded_sql(_SUCCEEDED)
        parts.append(f"done AS ({done})")
        nulls = ", ".join("id" if column == "id" else "NULL" for column in columns)
        selects.append(f"SELECT {_DONE}, {nulls} FROM done")
    if failing:
        parts.append(f"failed AS ({_FAIL})")
        kept = ("id", "status")
        nulls = ", ".join(column if column in kept else "NULL" for column in columns)
        selects.append(f"SELECT {_FAILED}, {nulls} FROM failed")
    return f"WITH {', '.join(parts)} {' UNION ALL '.join(selects)}"


@contextmanager
def _cursor(db: str, binary: bool = False) -> Iterator[Any]:
    """A Django cursor on `db` that binds parameters on the server, for the hot path.

    Arrays of ids travel as binary parameters instead of being quoted into the SQL by Python,
    and psycopg prepares statements it sees often when the connection allows it (Django's
    OPTIONS["prepare_threshold"]; off by default, which PgBouncer in transaction mode needs).
    It is Django's cursor wrapper all the same: error translation, execute wrappers and query
    logging (assertNumQueries, the debug toolbar) see these statements like any other.
    """
    wrapper = connections[db]
    wrapper.close_if_health_check_failed()
    wrapper.ensure_connection()
    wrapper.validate_thread_sharing()
    raw: Any = psycopg.Cursor(wrapper.connection)
    if binary:
        raw.format = psycopg.pq.Format.BINARY
    cursor = wrapper.make_debug_cursor(raw) if wrapper.queries_logged else wrapper.make_cursor(raw)
    with cursor:
        yield cursor


@lru_cache(maxsize=8)
def _columns(model: type[Job]) -> tuple[str, ...]:
    return tuple(str(field.column) for field in model._meta.concrete_fields)


@lru_cache(maxsize=8)
def _loading(model: type[Job]) -> tuple[list[str], list[tuple[int, Any]]]:
    """The model's attribute names, and the fields whose database values need converting.

    Rows come in binary, where psycopg has already loaded jsonb into Python objects, so JSON
    fields need no converting (Django's converter parses only the text format)."""
    fields = model._meta.concrete_fields
    converters = [
        (n, field)
        for n, field in enumerate(fields)
        if hasattr(field, "from_db_value") and not isinstance(field, models.JSONField)
    ]
    return [field.attname for field in fields], converters


def _from_rows(model: type[Job], db: str, rows: Iterable[Sequence[Any]]) -> list[Job]:
    """Jobs from binary result rows with every concrete column in model order."""
    attnames, converters = _loading(model)
    connection = connections[db]
    jobs = []
    for row in rows:
        values = list(row)
        for n, field in converters:
            values[n] = field.from_db_value(values[n], None, connection)
        jobs.append(model.from_db(db, attnames, values))
    return jobs
