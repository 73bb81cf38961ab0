"""JobQuerySet: filters over jobs, and the transitions an operator applies to a selection of
them, each re-checking its guard on every row it writes and returning the ids it changed."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.apps import apps
from django.core.exceptions import EmptyResultSet
from django.db import IntegrityError, connections, models, transaction
from django.db.models.functions import Now

from django_pgjobs import batches, validation
from django_pgjobs.conf import get_settings
from django_pgjobs.data import sql
from django_pgjobs.ids import uuid7_floor
from django_pgjobs.status import HOLDS_KEY, Status

if TYPE_CHECKING:
    from django_pgjobs.models import Job  # noqa: F401  (named in the QuerySet's type)

#: How far an enqueuer's clock may run ahead of the database's before pruning is delayed.
ID_CLOCK_MARGIN = timedelta(minutes=10)

#: How often replay looks again when a job took one of its keys while it ran.
REPLAY_TRIES = 3

#: A transition skips rows another session holds (a worker's turn may wait on rows it wrote: a
#: deadlock), and retries them after a pause doubling from CHANGE_PAUSE, waiting at the last.
CHANGE_PAUSE = 0.02
CHANGE_TRIES = 8


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

    # Transitions over a selection of jobs; each returns the ids of the jobs it changed.

    def replay(self, *, queue: str | None = None, by: str | None = None) -> list[UUID]:
        """Failed or cancelled → ready, due now, with a fresh attempt budget (optionally into
        another queue). Skips other statuses, jobs whose unique_key a live job holds, and of several
        selected jobs sharing a unique_key all but the oldest; never fails as a whole. The replay
        joins the error history (when, `by` whom, into which queue); last_error is cleared."""
        into = None if queue is None else validation.check_queue(queue)
        kept = sql.errors_kept(get_settings().ERRORS_KEPT)
        self._for_write = True
        for _ in range(REPLAY_TRIES):
            try:
                with transaction.atomic(using=self.db):  # a savepoint inside the caller's
                    return self._replayable()._change(
                        # A job that waits for others waits again (batches.py judges it).
                        "status = CASE WHEN EXISTS (SELECT FROM pgjobs_dependency AS d "
                        "WHERE d.job_id = j.id) THEN 'waiting' ELSE 'ready' END, "
                        "attempts = 0, run_at = statement_timestamp(), "
                        "scheduled = false, "
                        "finished_at = NULL, leased_until = NULL, cancel_requested = false, "
                        "queue = COALESCE(%s, j.queue), last_error = '', "
                        "errors = jsonb_path_query_array(j.errors || jsonb_build_array("
                        "jsonb_build_object('replayed_at', statement_timestamp(), "
                        "'by', %s::text, 'queue', COALESCE(%s, j.queue))), %s::jsonpath)",
                        [into, by, into, kept],
                        guard="j.status IN ('failed', 'cancelled')",
                        follow=True,
                    )
            except IntegrityError:
                # A job took one of the keys meanwhile: look again, and this time that key is held.
                continue
        return []

    def _replayable(self) -> JobQuerySet:
        """The selected dead or cancelled jobs that replay may make live: those without a
        unique_key, and the oldest of each key no live job holds."""
        jobs = self.model._default_manager.using(self.db)
        held = jobs.filter(status__in=HOLDS_KEY, unique_key__isnull=False).values("unique_key")
        finished = self.filter(status__in=[Status.FAILED, Status.CANCELLED])
        oldest_of_each_key = (
            finished.filter(unique_key__isnull=False)
            .exclude(unique_key__in=held)
            .order_by("unique_key", "id")
            .distinct("unique_key")
            .values("pk")
        )
        return finished.filter(
            models.Q(unique_key__isnull=True) | models.Q(pk__in=oldest_of_each_key)
        )

    def cancel(self) -> list[UUID]:
        """Ready → cancelled at once; for running jobs, request cancellation: the handler can
        notice (``django_pgjobs.cancel_requested()``) and stop, and when the attempt ends other
        than by succeeding, the job is recorded as cancelled instead of being retried."""
        return self._change(
            "status = CASE WHEN j.status = 'running' THEN j.status ELSE 'cancelled' END, "
            "finished_at = CASE WHEN j.status <> 'running' THEN statement_timestamp() END, "
            "cancel_requested = j.status = 'running'",
            guard="(j.status IN ('ready', 'waiting') "
            "OR (j.status = 'running' AND NOT j.cancel_requested))",
            follow=True,
        )

    def run_now(self) -> list[UUID]:
        """Make ready jobs scheduled for later due now."""
        return self._change(
            "run_at = statement_timestamp(), scheduled = false",
            guard="j.status = 'ready' AND j.run_at > statement_timestamp()",
        )

    def discard(self) -> list[UUID]:
        """Delete the selected jobs, except running ones: their worker still owns them."""
        return self._change(None, guard="j.status <> 'running'", follow=True)

    def replace_payload(self, payload: Any) -> list[UUID]:
        """Give the selected failed or cancelled jobs `payload`, checked as enqueue checks one
        (EnqueueError before anything is written); returns the ids changed. Only the payload
        changes: replay the jobs to run them."""
        text = validation.payload_json(payload, get_settings().MAX_PAYLOAD_BYTES)
        return self._change(
            "payload = %s::jsonb", [text], guard="j.status IN ('failed', 'cancelled')"
        )

    def _change(
        self,
        assignments: str | None,
        params: Sequence[Any] = (),
        *,
        guard: str,
        follow: bool = False,
    ) -> list[UUID]:
        """An UPDATE (or, without assignments, a DELETE) of the selected jobs that pass `guard`,
        returning their ids. The selection is read once (a slice would take other rows if run
        again); the guard is re-checked on each row as it is written. Rows locked elsewhere are
        taken once free (CHANGE_PAUSE). `follow`: the jobs changed are followed up once this
        commits (batches.py: their batches, the jobs waiting for them, and their own waits)."""
        self._for_write = True  # as QuerySet.update() does: route to the database for writes
        db = self.db
        try:
            selected, selected_params = self.values("pk").query.get_compiler(db).as_sql()
        except EmptyResultSet:  # e.g. filter(pk__in=[]): nothing selected, nothing to change
            return []
        if assignments is None:
            head, lock = "DELETE FROM pgjobs_job AS j", "FOR UPDATE"
        else:
            head, lock = f"UPDATE pgjobs_job AS j SET {assignments}", "FOR NO KEY UPDATE"
        changed: list[UUID] = []
        batch_ids: set[UUID] = set()
        with connections[db].cursor() as cursor:
            cursor.execute(selected, selected_params)
            left = [job_id for (job_id,) in cursor.fetchall()]
            for attempt in range(CHANGE_TRIES + 1):
                if attempt:  # the selected rows that pass the guard and were passed over
                    cursor.execute(
                        f"SELECT j.id FROM pgjobs_job AS j WHERE j.id = ANY(%s::uuid[]) "
                        f"AND {guard} AND NOT j.id = ANY(%s::uuid[])",
                        [left, changed],
                    )
                    left = [job_id for (job_id,) in cursor.fetchall()]
                    if left:
                        time.sleep(CHANGE_PAUSE * 2 ** (attempt - 1))
                if not left:
                    break
                waits = attempt == CHANGE_TRIES  # locked all along: wait for them now
                cursor.execute(
                    f"{head} WHERE j.id IN (SELECT j.id FROM pgjobs_job AS j "
                    f"WHERE j.id = ANY(%s::uuid[]) AND {guard} "
                    f"{lock}{'' if waits else ' SKIP LOCKED'}) AND {guard} "
                    "RETURNING j.id, j.batch_id",
                    [*params, left],
                )
                for job_id, batch_id in cursor.fetchall():
                    changed.append(job_id)
                    if batch_id is not None:
                        batch_ids.add(batch_id)
        if follow:
            batches.after_commit(db, jobs=changed, batches=batch_ids, waiters=changed)
        return changed

    def prunable(self, retention: Mapping[str, timedelta | None] | None = None) -> JobQuerySet:
        """Finished jobs older than their status's retention (default PGJOBS["RETENTION"]; a
        status whose retention is None is kept)."""
        kept = get_settings().retention() if retention is None else retention
        old = models.Q(pk__in=[])
        for status, age in kept.items():
            if age is not None:
                old |= models.Q(status=status, finished_at__lt=Now() - age)
        # Kept while a job waits for it, or its batch has not completed: their follow-ups read
        # it (a dependency gone reads as deleted; a batch counts its jobs when it completes).
        dependency, batch = (
            apps.get_model("pgjobs", "Dependency"),
            apps.get_model("pgjobs", "Batch"),
        )
        waited = dependency.objects.filter(after_job=models.OuterRef("pk"), job__status="waiting")
        counting = batch.objects.filter(pk=models.OuterRef("batch_id"), completed_at__isnull=True)
        old &= ~models.Exists(waited) & ~models.Exists(counting)
        ages = [age for age in kept.values() if age is not None]
        if not ages:
            return self.filter(old)
        # Ids are UUIDv7s, so bounding the id makes this a range of the primary key. finished_at
        # still decides: a skewed enqueuer's clock can delay pruning, never hasten it.
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
            # Bounded batches under SKIP LOCKED, read first, then deleted by primary key: a LIMIT
            # subquery may run again per row, deleting every prunable row in one statement.
            batch = old.select_for_update(skip_locked=True).values_list("pk", flat=True)
            with transaction.atomic(using=self.db):
                ids = list(batch[: settings.PRUNE_BATCH])
                deleted, _ = self.model._default_manager.using(self.db).filter(pk__in=ids).delete()
            total, batches = total + deleted, batches + 1
            if deleted < settings.PRUNE_BATCH:
                break
        return total
