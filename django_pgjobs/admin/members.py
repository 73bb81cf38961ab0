"""A batch's members as the admin counts them, its state in words, and the Jobs list's batch filter.

Each count is one range of pgjobs_job_batch_idx (batch, status), exact up to EXACT_COUNT_LIMIT
and the planner's estimate past it, as the lists count: a batch of a million jobs opens as fast
as one of ten.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db import connections, router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.admin.lists import EXACT_COUNT_LIMIT
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import LIVE, Status

#: The statuses as a batch's page lists them: a member's life, then how it ended.
ORDER = (
    Status.WAITING, Status.READY, Status.RUNNING,
    Status.SUCCEEDED, Status.FAILED, Status.CANCELLED,
)  # fmt: skip
#: What "Replay failed members" replays.
REPLAYABLE = (Status.FAILED, Status.CANCELLED)

# A batch's members of one status, counted up to %(most)s: one range of pgjobs_job_batch_idx.
# The batch and the status are each written in, not joined from a list, so that the planner
# judges each count by their statistics (a batch of a million jobs is not a batch of ten).
COUNT = """(
    SELECT count(*) FROM (
        SELECT FROM pgjobs_job WHERE batch_id = %(batch_{n})s AND status = '{status}'
        LIMIT %(most)s
    ) AS capped
)"""
# The planner's estimate of a batch's members of one status, for a count past the limit.
ESTIMATE = "EXPLAIN (FORMAT JSON) SELECT FROM pgjobs_job WHERE batch_id = %s AND status = %s"
# Where a batch's counts are kept on it once read (`of`), for the page's fields to share.
_KEPT = "_pgjobs_members"


@dataclass(frozen=True)
class Count:
    """How many jobs; `estimated`: the planner's estimate, past EXACT_COUNT_LIMIT."""

    n: int
    estimated: bool = False

    def __add__(self, other: Count) -> Count:
        return Count(self.n + other.n, self.estimated or other.estimated)


@dataclass(frozen=True)
class Members:
    """A batch's jobs now, by status (a status not counted reads as none)."""

    batch: Batch
    counts: dict[str, Count]

    def __getitem__(self, status: str) -> Count:
        return self.counts.get(status, Count(0))

    @property
    def live(self) -> Count:
        return sum((self[status] for status in LIVE), Count(0))

    @property
    def done(self) -> Count:
        """The jobs the batch no longer waits for: finished, or pruned or deleted since."""
        if self.batch.succeeded_at is not None:
            return Count(self.batch.size)  # its jobs may be pruned: counted when it succeeded
        live = self.live
        return Count(max(self.batch.size - live.n, 0), live.estimated)

    @property
    def gone(self) -> int:
        """Members no longer in the table (pruned, or deleted); 0 when a count is estimated."""
        counted = sum((self[status] for status in ORDER), Count(0))
        return 0 if counted.estimated else max(self.batch.size - counted.n, 0)

    @property
    def replayable(self) -> int:
        return sum(self[status].n for status in REPLAYABLE)


def counts_sql(batches: int, statuses: Sequence[str]) -> str:
    """The statement that counts the members of `batches` batches (parameters batch_0, ...) of
    each of `statuses`: a row per batch, its id then a count per status."""
    known = [Status(status).value for status in statuses]  # written in: only the statuses
    rows = [
        ", ".join([f"%(batch_{n})s::uuid", *(COUNT.format(n=n, status=s) for s in known)])
        for n in range(batches)
    ]
    return " UNION ALL ".join(f"SELECT {row}" for row in rows)


def count(batches: Sequence[Batch], statuses: Iterable[str] = ORDER) -> dict[UUID, Members]:
    """The members of `batches` of each of `statuses`, in one statement; when only live ones
    are asked for, a succeeded batch (which has none) is not read."""
    statuses = [str(status) for status in statuses]
    only_live = set(statuses) <= set(LIVE)
    read = [b.pk for b in batches if not (only_live and b.succeeded_at is not None)]
    found: dict[UUID, dict[str, Count]] = {batch.pk: {} for batch in batches}
    if read:
        params: dict[str, Any] = {f"batch_{n}": batch_id for n, batch_id in enumerate(read)}
        params["most"] = EXACT_COUNT_LIMIT + 1
        with connections[router.db_for_read(Job)].cursor() as cursor:
            cursor.execute(counts_sql(len(read), statuses), params)
            for batch_id, *numbers in cursor.fetchall():
                for status, n in zip(statuses, numbers, strict=True):
                    if n > EXACT_COUNT_LIMIT:  # past it, the planner's estimate, as lists do
                        n = max(_estimate(cursor, batch_id, status), n)
                    found[batch_id][status] = Count(n, estimated=n > EXACT_COUNT_LIMIT)
    return {batch.pk: Members(batch, found[batch.pk]) for batch in batches}


def _estimate(cursor: Any, batch_id: UUID, status: str) -> int:
    cursor.execute(ESTIMATE, [batch_id, status])
    (plan,) = cursor.fetchone()
    parsed = json.loads(plan) if isinstance(plan, str) else plan
    return int(parsed[0]["Plan"]["Plan Rows"])


def keep(batches: Sequence[Batch], statuses: Iterable[str] = LIVE) -> None:
    """Count the members of `batches` (a list's page: their live ones, for the progress) in one
    statement, for `of` to find."""
    counted = count(batches, statuses)
    for batch in batches:
        batch.__dict__[_KEPT] = counted[batch.pk]


def of(batch: Batch) -> Members:
    """The batch's members, as `keep` counted them or else counted now (every status)."""
    kept: Members | None = batch.__dict__.get(_KEPT)
    if kept is None:
        kept = batch.__dict__[_KEPT] = count([batch])[batch.pk]
    return kept


def state(batch: Batch) -> str:
    """Where the batch is, from its row: open, completed (with how many failed and were
    cancelled, as counted then), or succeeded."""
    if batch.succeeded_at is not None:
        return _("succeeded")
    if batch.completed_at is not None:
        return _(
            "completed, not succeeded: %(failed)s failed and %(cancelled)s cancelled of "
            "%(size)s; it succeeds once they are replayed and succeed"
        ) % {"failed": batch.failed, "cancelled": batch.cancelled, "size": batch.size}
    return _("open")


def jobs_url(batch: Batch | UUID, status: str | None = None) -> str:
    """The Jobs list filtered to the batch's members (of `status`)."""
    query = {"batch": str(batch.pk if isinstance(batch, Batch) else batch)}
    if status is not None:
        query["status__exact"] = status
    return f"{reverse('admin:pgjobs_job_changelist')}?{urlencode(query)}"


class BatchFilter(admin.SimpleListFilter):
    """Jobs in a batch, or in the one named (the batch page links here with its id)."""

    title = gettext_lazy("batch")
    parameter_name = "batch"
    ANY = "any"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        choices = [(self.ANY, str(_("In a batch")))]
        value = self.value()
        if value and value != self.ANY:
            batch_id = _uuid(value)
            shown = _("batch %s") % batch_id.hex[-12:] if batch_id else value
            choices.append((value, shown))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value == self.ANY:
            return queryset.filter(batch__isnull=False)
        batch_id = _uuid(value)
        if batch_id is None:
            raise IncorrectLookupParameters(f"not a batch's id: {value!r}")
        return queryset.filter(batch_id=batch_id)


def _uuid(value: str) -> UUID | None:
    try:
        return UUID(value)
    except ValueError:
        return None
