"""Every query that changes a queue's controls: pause and resume, and an operator's edit
(Queue.objects)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.core.exceptions import EmptyResultSet
from django.db import connections, models
from django.db.models.functions import Now

if TYPE_CHECKING:
    from django_pgjobs.models import Queue  # noqa: F401  (named in QuerySet["Queue"] below)


class QueueQuerySet(models.QuerySet["Queue"]):
    # Filters: they never write.

    def paused(self) -> QueueQuerySet:
        return self.filter(paused=True)

    # Transitions over a selection of queues; each returns the names of the queues it changed.

    def pause(self) -> list[str]:
        """Pause the selected queues that are not paused yet: workers stop claiming their jobs
        at their next read of the controls, and let the running ones finish."""
        return self._set_paused(True)

    def change(self, name: str, changes: Mapping[str, Any], shown: Mapping[str, Any]) -> bool:
        """Write `changes` (field → value) to queue `name`, only where each of those fields
        still holds the value the operator was shown (`shown`) or already the new one, so
        nobody else's change since is overwritten. False when nothing was written."""
        guard = models.Q()
        for field, value in changes.items():
            guard &= models.Q(**{field: shown.get(field)}) | models.Q(**{field: value})
        return bool(self.filter(guard, pk=name).update(**changes, updated_at=Now()))

    def resume(self) -> list[str]:
        """Resume the selected paused queues."""
        return self._set_paused(False)

    def _set_paused(self, paused: bool) -> list[str]:
        """One UPDATE of the selected queues whose `paused` differs, guarded on each row as it
        is written, so a queue someone else changed meanwhile is not reported."""
        self._for_write = True  # as QuerySet.update() does: route to the database for writes
        db = self.db
        try:
            selected, params = self.values("pk").query.get_compiler(db).as_sql()
        except EmptyResultSet:
            return []  # e.g. .none(): nothing selected, nothing to change
        with connections[db].cursor() as cursor:
            cursor.execute(
                "UPDATE pgjobs_queue AS q SET paused = %s, updated_at = statement_timestamp() "
                f"WHERE q.name IN ({selected}) AND q.paused <> %s RETURNING q.name",
                [paused, *params, paused],
            )
            return [name for (name,) in cursor.fetchall()]
