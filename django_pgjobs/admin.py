"""The admin: jobs, dead letters, their error history, and audited replay, run now, cancel, delete.

Actions change jobs only through JobQuerySet transitions and record every job they changed in
Django's admin log. Everything shown from job data is escaped. Nothing here runs an exact
COUNT(*) over the table on a page load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.views.main import PAGE_VAR, ChangeList
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import CharField, Count, F, Func, Q, QuerySet, Value
from django.db.models.functions import Left
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.text import Truncator
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

# admin_health and admin_periodic register the Queue and Schedule admins when imported.
from django_pgjobs import admin_health, admin_periodic, registry  # noqa: F401
from django_pgjobs.conf import get_settings
from django_pgjobs.data.jobs import JobQuerySet
from django_pgjobs.errors import EnqueueError, UnknownTask
from django_pgjobs.models import DeadLetter, Job
from django_pgjobs.status import Status
from django_pgjobs.validation import check_queue

#: Up to this many rows a changelist counts exactly; beyond, it shows the planner's estimate.
EXACT_COUNT_LIMIT = 10_000
#: Jobs changed and logged per statement by a bulk action.
ACTION_BATCH = 1000
#: What the admin log's description of a job (str(job)) reads.
LOGGED = ("id", "task", "status")

# The part of `last_error` ("Type: message") before the first colon.
ERROR_TYPE = Func(
    F("last_error"), Value(":"), Value(1), function="split_part", output_field=CharField()
)


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


class JobChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        # The list never shows the payload or the history; it shows the head of the last error.
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        lean: QuerySet[Any] = queryset.defer("payload", "errors", "last_error").annotate(
            error_head=Left("last_error", 300)
        )
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
        if self.value() is None:
            return queryset
        return queryset.filter(**{str(self.parameter_name): self.value()})


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
        types = DeadLetter.objects.dead().annotate(error_type=ERROR_TYPE)
        names = types.values_list("error_type", flat=True).distinct().order_by("error_type")
        return [(name, name) for name in names[:50] if name]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() is None:
            return queryset
        return queryset.filter(
            Q(last_error=self.value()) | Q(last_error__startswith=f"{self.value()}:")
        )


class ReplayForm(forms.Form):
    queue = forms.CharField(
        label=gettext_lazy("Into queue"),
        required=False,
        max_length=100,
        help_text=gettext_lazy("Leave empty to replay each job into its own queue."),
    )

    def clean_queue(self) -> str | None:
        queue: str = self.cleaned_data["queue"].strip()
        try:
            return check_queue(queue) if queue else None
        except EnqueueError as error:
            raise ValidationError(str(error)) from None


if TYPE_CHECKING:
    ModelAdmin = admin.ModelAdmin[Job]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs


class BaseJobAdmin(ModelAdmin):
    list_filter = ("status", QueueFilter, TaskFilter)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would count the table per filter choice
    paginator = EstimatedCountPaginator
    sortable_by = ()  # newest first; other orders would sort the whole table
    ordering = ("-id",)
    list_display_links = ("short_id",)
    actions = ["replay", "run_now", "cancel", "delete_jobs"]
    fieldsets = [
        (None, {"fields": ["id", "task", "queue", "status", "priority", "attempts_display"]}),
        (gettext_lazy("Times"), {"fields": ["run_at", "created_at", "started_at", "finished_at"]}),
        (
            gettext_lazy("Lease"),
            {"fields": ["worker", "leased_until", "cancel_requested", "unique_key"]},
        ),
        (gettext_lazy("Payload and result"), {"fields": ["payload_display", "result_display"]}),
        (gettext_lazy("Errors"), {"fields": ["last_error", "error_history"]}),
    ]
    readonly_fields = [
        "id", "task", "queue", "status", "priority", "attempts_display", "run_at",
        "created_at", "started_at", "finished_at", "worker", "leased_until", "cancel_requested",
        "unique_key", "payload_display", "result_display", "last_error", "error_history",
    ]  # fmt: skip

    # ---- permissions: the proxy (dead letters) answers with the Job permissions ---------------

    def _has(self, request: HttpRequest, action: str) -> bool:
        return request.user.has_perm(f"pgjobs.{get_permission_codename(action, Job._meta)}")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._has(request, "view") or self._has(request, "change")

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # jobs change only through the actions

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are enqueued by code

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._has(request, "delete")

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "replay")

    def has_run_now_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "replay")  # making a job run is the replay permission's job

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "cancel")

    # ---- list --------------------------------------------------------------------------------

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return JobChangeList

    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        # Django 6.1 passes where the actions are shown; Django 5.2 and 6.0 do not.
        location = {} if action_location is None else {"action_location": action_location}
        actions = super().get_actions(request, **location)
        actions.pop("delete_selected", None)  # lists every object; ours confirms with a count
        return actions

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Job], search_term: str
    ) -> tuple[QuerySet[Job], bool]:
        """An id (full or the short form shown in the list), a task name, or a unique key."""
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            return queryset.filter(pk=UUID(term)), False  # the primary key index, nothing else
        except ValueError:
            pass
        match = Q(task__icontains=term) | Q(unique_key=term)
        if len(term) == 12 and all(c in "0123456789abcdef" for c in term.lower()):
            match |= Q(id__endswith=term.lower())
        return queryset.filter(match), False

    @admin.display(description=gettext_lazy("id"))
    def short_id(self, job: Job) -> str:
        return job.short_id

    @admin.display(description=gettext_lazy("attempts"))
    def attempts_display(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=gettext_lazy("last error"))
    def error_line(self, job: Job, width: int = 100) -> str:
        # The list annotates the head of last_error and defers the column itself.
        head: str = job.error_head if hasattr(job, "error_head") else job.last_error
        return Truncator(head.split("\n", 1)[0]).chars(width)

    # ---- detail ------------------------------------------------------------------------------

    @admin.display(description=gettext_lazy("payload"))
    def payload_display(self, job: Job) -> str:
        try:
            payload = registry.get_task(job.task).redacted(job.payload)
        except UnknownTask:
            payload = job.payload
        return _pretty_json(payload)

    @admin.display(description=gettext_lazy("result"))
    def result_display(self, job: Job) -> str:
        """The handler's return value, for tasks that keep it (e.g. Django Tasks)."""
        return "—" if job.result is None else _pretty_json(job.result)

    @admin.display(description=gettext_lazy("error history"))
    def error_history(self, job: Job) -> str:
        entries = [e if isinstance(e, dict) else {"message": repr(e)} for e in job.errors or []]
        return render_to_string("admin/pgjobs/error_history.html", {"entries": entries})

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        job = self.get_object(request, object_id)
        context = {**(extra_context or {}), "job_actions": self.job_actions(request, job)}
        return super().change_view(request, object_id, form_url, context)

    def job_actions(self, request: HttpRequest, job: Job | None) -> list[tuple[str, str]]:
        """The actions the detail page offers for this job: permitted and applicable."""
        if job is None:
            return []
        applicable = {
            "replay": job.status in (Status.FAILED, Status.CANCELLED),
            "run_now": job.status == Status.READY and job.run_at > timezone.now(),
            "cancel": job.status == Status.READY
            or (job.status == Status.RUNNING and not job.cancel_requested),
        }
        labels = {"replay": _("Replay…"), "run_now": _("Run now…"), "cancel": _("Cancel…")}
        actions = self.get_actions(request)
        return [(name, labels[name]) for name, ok in applicable.items() if ok and name in actions]

    # ---- actions: each calls one JobQuerySet transition -------------------------------------

    @admin.action(description=gettext_lazy("Replay selected jobs…"), permissions=["replay"])
    def replay(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        form = ReplayForm(request.POST if "post" in request.POST else None)
        if not form.is_valid():
            return self.confirm(request, queryset, _("Replay"), form)
        queue = form.cleaned_data["queue"]
        note = _("Replayed into queue %s.") % queue if queue else _("Replayed.")
        changed, seen = self.apply(request, queryset, lambda q: q.replay(queue=queue), CHANGE, note)
        self.report(
            request,
            ngettext("%d job replayed.", "%d jobs replayed.", changed) % changed,
            seen - changed,
            _("only failed or cancelled jobs are replayed"),
        )
        return None

    @admin.action(description=gettext_lazy("Run selected jobs now…"), permissions=["run_now"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if "post" not in request.POST:
            return self.confirm(request, queryset, _("Run now"))
        changed, seen = self.apply(request, queryset, JobQuerySet.run_now, CHANGE, _("Run now."))
        self.report(
            request,
            ngettext("%d job made due now.", "%d jobs made due now.", changed) % changed,
            seen - changed,
            _("only ready jobs scheduled for later are moved"),
        )
        return None

    @admin.action(description=gettext_lazy("Cancel selected jobs…"), permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if "post" not in request.POST:
            return self.confirm(request, queryset, _("Cancel"))
        changed, seen = self.apply(request, queryset, JobQuerySet.cancel, CHANGE, _("Cancelled."))
        self.report(
            request,
            ngettext(
                "%d job cancelled (a running one stops if its handler checks, else finishes).",
                "%d jobs cancelled (running ones stop if their handler checks, else finish).",
                changed,
            )
            % changed,
            seen - changed,
            _("only ready and running jobs are cancelled"),
        )
        return None

    @admin.action(description=gettext_lazy("Delete selected jobs…"), permissions=["delete"])
    def delete_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> HttpResponse | None:
        if "post" not in request.POST:
            return self.confirm(request, queryset, _("Delete"))
        changed, _seen = self.apply(request, queryset, JobQuerySet.discard, DELETION, _("Deleted."))
        self.report(request, ngettext("%d job deleted.", "%d jobs deleted.", changed) % changed)
        return None

    def apply(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        transition: Callable[[JobQuerySet], list[UUID]],
        flag: int,
        message: str,
    ) -> tuple[int, int]:
        """Run `transition` over the selection, ACTION_BATCH jobs per statement, and log each
        job it changed (the transition returns their ids). Returns (changed, selected)."""
        user_id = request.user.pk
        assert user_id is not None  # the admin lets no anonymous user this far
        ids = queryset.order_by("pk").values_list("pk", flat=True)
        changed = seen = 0
        last: UUID | None = None
        while batch := list((ids if last is None else ids.filter(pk__gt=last))[:ACTION_BATCH]):
            # Read before the change, to name the jobs in the log even after a delete.
            described = {job.pk: job for job in Job.objects.filter(pk__in=batch).only(*LOGGED)}
            done = transition(Job.objects.filter(pk__in=batch))
            if done:
                LogEntry.objects.log_actions(user_id, [described[pk] for pk in done], flag, message)
            changed, seen, last = changed + len(done), seen + len(batch), batch[-1]
        return changed, seen

    def confirm(
        self,
        request: HttpRequest,
        queryset: QuerySet[Job],
        verb: str,
        form: forms.Form | None = None,
    ) -> TemplateResponse:
        """The intermediate page of a bulk action: what it does, to how many jobs."""
        action = request.POST.get("action", "")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("%s jobs?") % verb,
            "verb": verb,
            "count": queryset.count(),
            "sample": list(queryset[:10]),
            "form": form,
            "action": action,
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "select_across": request.POST.get("select_across") == "1",
            "cancel_url": self.changelist_url(request),
        }
        return TemplateResponse(request, "admin/pgjobs/confirm_action.html", context)

    def url_name(self, view: str) -> str:
        return f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"

    def changelist_url(self, request: HttpRequest) -> str:
        """The changelist, filtered as in this request."""
        query = request.GET.copy()
        query.pop(PAGE_VAR, None)
        changelist = reverse(self.url_name("changelist"))
        return f"{changelist}?{query.urlencode()}" if query else changelist

    def report(self, request: HttpRequest, done: str, skipped: int = 0, why: str = "") -> None:
        if skipped:
            done += " " + ngettext("%d skipped: %s.", "%d skipped: %s.", skipped) % (skipped, why)
        self.message_user(request, done, messages.WARNING if skipped else messages.SUCCESS)

    # ---- replay everything matching the current filter ---------------------------------------

    def get_urls(self) -> list[Any]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_replay_matching"
        view = self.admin_site.admin_view(self.replay_matching_view)
        return [path("replay-matching/", view, name=name), *super().get_urls()]

    def replay_matching_view(self, request: HttpRequest) -> HttpResponse:
        """Replay every job the changelist shows for these filters, with no rows selected."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        cl = self.get_changelist_instance(request)
        response = self.replay(request, cl.get_queryset(request))
        return response or HttpResponseRedirect(self.changelist_url(request))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context and "cl" in context and IS_POPUP_VAR not in request.GET:
            cl = context["cl"]
            if self.has_replay_permission(request) and self.offers_replay_matching(request):
                url = reverse(self.url_name("replay_matching"))
                context["replay_matching_url"] = url + cl.get_query_string(remove=[PAGE_VAR])
            context.update(self.changelist_extra(cl))
        return response

    def changelist_extra(self, cl: ChangeList) -> dict[str, Any]:
        return {}

    def offers_replay_matching(self, request: HttpRequest) -> bool:
        """Whether to offer "Replay all matching": when the list shows replayable jobs."""
        return request.GET.get("status__exact") in (Status.FAILED, Status.CANCELLED)


@admin.register(Job)
class JobAdmin(BaseJobAdmin):
    list_display = [
        "short_id", "task", "queue", "status", "priority", "attempts_display", "run_at",
        "created_at", "finished_at", "error_line",
    ]  # fmt: skip


@admin.register(DeadLetter)
class DeadLetterAdmin(BaseJobAdmin):
    list_display = [
        "short_id", "task", "queue", "attempts_display", "finished_at", "final_error",
    ]  # fmt: skip
    actions = ["replay", "delete_jobs"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        queryset = super().get_queryset(request)
        assert isinstance(queryset, JobQuerySet)
        return queryset.dead()

    def offers_replay_matching(self, request: HttpRequest) -> bool:
        return True

    def get_list_filter(self, request: HttpRequest) -> tuple[type[admin.ListFilter], ...]:
        return (QueueFilter, TaskFilter, ErrorTypeFilter)

    @admin.display(description=gettext_lazy("final error"))
    def final_error(self, job: Job) -> str:
        return self.error_line(job, width=200)

    def changelist_extra(self, cl: ChangeList) -> dict[str, Any]:
        """The summary above the list: dead letters (as filtered) by task and error type."""
        groups = (
            cl.queryset.order_by()
            .annotate(error_type=ERROR_TYPE)
            .values("task", "error_type")
            .annotate(jobs=Count("*"))
            .order_by("-jobs", "task", "error_type")
        )
        return {"summary": list(groups[:20])}


def _pretty_json(value: Any) -> str:
    pretty = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)
    return format_html('<pre class="pgjobs-json">{}</pre>', pretty)
