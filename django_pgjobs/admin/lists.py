"""The job lists' parts that keep them cheap over millions of rows: count, columns, filters.

The paginator counts exactly only up to EXACT_COUNT_LIMIT rows, the changelist leaves out the
payload and history, and the filters offer what the registry knows, not the table's values.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db.models import CharField, F, Func, Q, QuerySet, Subquery, Value
from django.db.models.functions import Left, Now
from django.http import HttpRequest
from django.utils.formats import number_format
from django.utils.translation import gettext_lazy

from django_pgjobs import registry
from django_pgjobs.conf import get_settings
from django_pgjobs.data.queryset import JobQuerySet
from django_pgjobs.models import DeadLetter
from django_pgjobs.status import Status

#: Up to this many rows a changelist counts exactly; beyond, it shows the planner's estimate.
EXACT_COUNT_LIMIT = 10_000

# The part of `last_error` ("Type: message") before the first colon.
ERROR_TYPE = Func(
    F("last_error"), Value(":"), Value(1), function="split_part", output_field=CharField()
)


#: The dead letters' summary and error-type filter read the newest this many, not all of them.
NEWEST = 10_000


def newest(jobs: QuerySet[Any]) -> QuerySet[Any]:
    """The newest NEWEST of `jobs` (ids are UUIDv7s: by the primary key's index)."""
    manager: Any = jobs.model._default_manager
    found: QuerySet[Any] = manager.filter(
        pk__in=Subquery(jobs.order_by("-pk").values("pk")[:NEWEST])
    )
    return found


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts exactly up to EXACT_COUNT_LIMIT rows and asks the planner beyond, so a changelist
    over millions of jobs never runs an exact COUNT(*). `estimated` says which it did."""

    estimated = False

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        assert isinstance(queryset, QuerySet)
        # Unordered, so PostgreSQL may stop at the first EXACT_COUNT_LIMIT + 1 rows it finds.
        capped = queryset.order_by()[: EXACT_COUNT_LIMIT + 1].count()
        if capped <= EXACT_COUNT_LIMIT:
            return capped
        self.estimated = True
        plan = queryset.explain(format="json")
        return max(int(json.loads(plan)[0]["Plan"]["Plan Rows"]), capped)

    @property
    def rounded_count(self) -> str:
        """The count as the pages show an estimate: to two significant figures, grouped
        ("41,000"), as close as the planner's estimate is."""
        return number_format(round(self.count, 2 - len(str(self.count))), force_grouping=True)


class JobChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        # The list never shows the payload or the history; it shows the head of the last error.
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        lean: QuerySet[Any] = queryset.defer(
            "payload", "errors", "last_error", "result", "headers"
        ).annotate(error_head=Left("last_error", 300))
        return lean


class RegisteredValueFilter(admin.SimpleListFilter):
    """Offers the values the task registry knows, plus any value given in the URL. (Listing the
    distinct values in the table would read every row on every page load.)"""

    def known(self) -> set[str]:
        raise NotImplementedError

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = self.known() | ({self.value()} if self.value() else set())
        return [(value, value) for value in sorted(v for v in values if v)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if "\x00" in value:  # no text column holds one (PostgreSQL refuses it in a query)
            return queryset.none()
        return queryset.filter(**{str(self.parameter_name): value})


class TaskFilter(RegisteredValueFilter):
    title = gettext_lazy("task")
    parameter_name = "task"

    def known(self) -> set[str]:
        return set(registry.all_tasks())


class QueueFilter(RegisteredValueFilter):
    title = gettext_lazy("queue")
    parameter_name = "queue"

    def known(self) -> set[str]:
        queues = {task.queue for task in registry.all_tasks().values() if task.queue}
        return queues | {get_settings().DEFAULT_QUEUE}


class ErrorTypeFilter(admin.SimpleListFilter):
    title = gettext_lazy("error type")
    parameter_name = "error_type"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        types = newest(DeadLetter.objects.dead()).annotate(error_type=ERROR_TYPE)
        names = types.values_list("error_type", flat=True).distinct().order_by("error_type")
        return [(name, name) for name in names[:50] if name]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() is None:
            return queryset
        return queryset.filter(
            Q(last_error=self.value()) | Q(last_error__startswith=f"{self.value()}:")
        )


class StatusFilter(admin.SimpleListFilter):
    """Each status; the ready ones also as due, scheduled (for later) and retrying (after a
    failed attempt), as the dashboard counts them; and stuck: running jobs whose lease ran out.
    Times by the database's clock. Its parameter is the one Django's status filter has, so that
    links such as ?status__exact=failed still work."""

    title = gettext_lazy("status")
    parameter_name = "status__exact"
    STUCK = "stuck"
    #: The ready jobs' parts: each a choice of its own, listed after "ready".
    READY_PARTS = {
        "due": (gettext_lazy("ready, due"), Q(run_at__lte=Now())),
        "scheduled": (gettext_lazy("ready, scheduled for later"), Q(run_at__gt=Now())),
        "retrying": (gettext_lazy("ready, retrying"), Q(attempts__gt=0)),
    }

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        choices: list[tuple[str, Any]] = []
        for value, label in Status.choices:
            choices.append((value, label))
            if value == Status.READY:
                choices += [(part, label) for part, (label, _) in self.READY_PARTS.items()]
            if value == Status.RUNNING:
                choices.append((self.STUCK, gettext_lazy("stuck (lease ran out)")))
        return choices

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value is None:
            return queryset
        if value in self.READY_PARTS:
            return queryset.filter(self.READY_PARTS[value][1], status=Status.READY)
        if value == self.STUCK:
            assert isinstance(queryset, JobQuerySet)
            return queryset.expired()
        if value not in Status.values:  # as Django's own filter answers it: the list's ?e=1
            raise IncorrectLookupParameters(f"not a status: {value!r}")
        return queryset.filter(status=value)


class WorkerFilter(RegisteredValueFilter):
    """The jobs a worker holds (running), through pgjobs_job_running_idx, which is keyed on the
    worker; the job page links here. Shown only while a worker is named."""

    title = gettext_lazy("held by worker")
    parameter_name = "worker"

    def known(self) -> set[str]:
        return set()

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        held = super().queryset(request, queryset)
        return held if self.value() is None else held.filter(status=Status.RUNNING)
