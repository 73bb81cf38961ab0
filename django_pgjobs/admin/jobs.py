"""The admin's Jobs and Dead letters: their lists, search, detail page and actions offered.

Both are read-only views of the job table; jobs change only through the actions, each gated by a
permission and recorded in Django's admin log.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION
from django.contrib.admin.options import IS_POPUP_VAR, IncorrectLookupParameters
from django.contrib.admin.templatetags.admin_urls import add_preserved_filters
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ERROR_FLAG, PAGE_VAR, ChangeList
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db import models
from django.db.models import Count, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.admin import dashboard, payloads, search
from django_pgjobs.admin.actions import (
    ACTIONS,
    DELETE,
    LOGGED,
    REPLAY,
    apply,
    changelist_url,
    perform,
)
from django_pgjobs.admin.columns import JobColumns, status, task, with_clock
from django_pgjobs.admin.lists import (
    ERROR_TYPE,
    NEWEST,
    ErrorTypeFilter,
    EstimatedCountPaginator,
    JobChangeList,
    QueueFilter,
    StatusFilter,
    TaskFilter,
    WorkerFilter,
    newest,
)
from django_pgjobs.admin.members import BatchFilter
from django_pgjobs.admin.missing import MigrateFirst
from django_pgjobs.admin.waits import WaitColumns, related
from django_pgjobs.data.queryset import JobQuerySet
from django_pgjobs.data.rows import Unreadable
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.transports import NATS, transport_of

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

    ModelAdmin = admin.ModelAdmin[Job]
else:
    ModelAdmin = admin.ModelAdmin  # generic only in the type stubs


# The job page's fields: the times are shown in the active time zone, with their age.
TRIES = "attempts_display"
PROGRESS = "progress_display"
TIMES = (
    "run_at_display", "created_at_display", "started_at_display", "finished_at_display",
    "time_spent",
)  # fmt: skip
LEASE = ("worker_display", "leased_until_display", "cancel_requested", "unique_key", "limit_key")
WAITS = ("batch_display", "dependencies_display")


class JobPermissions:
    """The Job model's permissions, which every page of jobs answers with: Jobs, Dead letters
    (a proxy) and Batches (whose pages count jobs and replay them)."""

    def _has(self, request: HttpRequest, action: str) -> bool:
        return request.user.has_perm(f"pgjobs.{get_permission_codename(action, Job._meta)}")

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return self._has(request, "view") or self._has(request, "change")

    def has_replay_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "replay")


class BaseJobAdmin(MigrateFirst, JobPermissions, JobColumns, WaitColumns, ModelAdmin):
    list_filter = (StatusFilter, QueueFilter, TaskFilter, BatchFilter, WorkerFilter)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would count the table per filter choice
    paginator = EstimatedCountPaginator
    sortable_by = ()  # newest first; other orders would sort the whole table
    ordering = ("-id",)
    list_display_links = ("short_id",)
    # The box is shown when search_fields is set; get_search_results does the searching.
    search_fields = ("task",)
    search_help_text = search.HELP
    # Each defined once in actions.ACTIONS; the has_<permission>_permission methods gate them.
    actions = [action.admin_action() for action in ACTIONS]
    fieldsets = [
        (None, {"fields": ["id", "task", "queue", "status_display", PROGRESS, "priority", TRIES]}),
        (gettext_lazy("Times"), {"fields": TIMES}),
        (gettext_lazy("Lease"), {"fields": LEASE}),
        (gettext_lazy("Payload and result"), {"fields": ["payload_display", "result_display"]}),
        (gettext_lazy("Errors"), {"fields": ["last_error", "error_history"]}),
    ]
    readonly_fields = [
        "id", "task", "queue", "status_display", PROGRESS, "priority", TRIES, *TIMES, *LEASE,
        "payload_display", "result_display", "last_error", "error_history", *WAITS,
    ]  # fmt: skip

    # ---- permissions: the proxy (dead letters) answers with the Job permissions ---------------

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # jobs change only through the actions

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are enqueued by code

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A running job's worker still runs its handler: deleting the row would not stop it.
        return self._has(request, "delete") and not _running(obj)

    def has_run_now_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "replay")  # making a job run is the replay permission's job

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "cancel")

    def has_edit_payload_permission(self, request: HttpRequest) -> bool:
        return self._has(request, "edit_payload")

    # ---- list --------------------------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        # Each job read with the database's clock, by which a running one is judged stuck.
        return with_clock(super().get_queryset(request))

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
        """An id, its start or its short form, a task name, or a live job's unique key
        (admin/search.py: each through an index)."""
        return search.search(queryset, search_term), False

    # ---- detail ------------------------------------------------------------------------------

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        """The job page's fields; its batch and what it waits for, when it has either."""
        fieldsets = list(super().get_fieldsets(request, obj))
        if isinstance(obj, Job) and related(obj):
            fieldsets.insert(1, (gettext_lazy("Batch and dependencies"), {"fields": WAITS}))
        return fieldsets

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        job = self.get_object(request, object_id)
        if request.method == "POST" and "action" in request.POST:
            return self.job_action_view(request, job, object_id)
        context = {**(extra_context or {}), "job_actions": self.job_actions(request, job)}
        if job is not None and payloads.applies(job) and payloads.may_edit(self, request, job):
            refused = payloads.refused(job)
            if refused:
                context["edit_payload_refused"] = refused
            else:
                context["edit_payload_url"] = reverse(self.url_name("edit_payload"), args=[job.pk])
        return super().change_view(request, object_id, form_url, context)

    def job_action_view(
        self, request: HttpRequest, job: Job | None, object_id: str
    ) -> HttpResponse:
        """A button of the job's page: confirmed on its own page, then back to the job's page."""
        if job is None:  # Django's page and message for it
            return self._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined,no-any-return]
                request, self.opts, object_id
            )
        name = request.POST["action"]
        action = next((a for a in ACTIONS if a.button and a.name == name), None)
        if action is None or name not in self.get_actions(request):
            raise PermissionDenied
        page = request.get_full_path()  # with the list's filters (_changelist_filters)
        selected = self.get_queryset(request).filter(pk=job.pk)
        response = perform(self, request, selected, action, cancel_url=page)
        return response or HttpResponseRedirect(self.after_action(request, job.pk, page))

    def after_action(self, request: HttpRequest, job_id: Any, page: str) -> str:
        """Where the job's page sends the user once an action is done: back to it; to the job's
        page under Jobs once it left this list (a replayed dead letter); to the list (with its
        filters) once its row is gone, or going to a NATS stream (the relay deletes it)."""
        job = Job.objects.only("status", "queue").filter(pk=job_id).first()
        if job is None or (job.status == Status.READY and transport_of(job.queue) == NATS):
            filters = self.get_preserved_filters(request)
            changelist = reverse(self.url_name("changelist"))
            return add_preserved_filters(
                {"opts": self.opts, "preserved_filters": filters}, changelist
            )
        if self.get_queryset(request).filter(pk=job_id).exists():
            return page
        return reverse("admin:pgjobs_job_change", args=[job_id])

    def job_actions(self, request: HttpRequest, job: Job | None) -> list[tuple[str, StrOrPromise]]:
        """The actions the detail page offers for this job: permitted and applicable."""
        if job is None:
            return []
        offered = self.get_actions(request)
        return [
            (action.name, action.button)
            for action in ACTIONS
            if action.button and action.name in offered and action.applies(job)
        ]

    # ---- delete: through the guarded transition, never a running job ------------------------

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Django's confirmation page; the deletion itself is JobQuerySet.discard, which leaves a
        job alone if it started running since the page was shown."""
        job = self.get_object(request, unquote(object_id))
        if job is None or not self._has(request, "delete"):
            return super().delete_view(request, object_id, extra_context)
        if request.method == "POST" and not _running(job):
            shown = str(job)
            changed, _seen = apply(
                request, Job.objects.filter(pk=job.pk), JobQuerySet.discard, DELETION,
                str(DELETE.logged), only=LOGGED,
            )  # fmt: skip
            if changed:
                return self.response_delete(request, shown, job.pk)  # type: ignore[arg-type]
            job = self.get_object(request, unquote(object_id))  # it changed meanwhile
        if _running(job):
            assert job is not None
            self.message_user(request, _refused(job), messages.ERROR)
            return HttpResponseRedirect(reverse(self.url_name("change"), args=[job.pk]))
        return super().delete_view(request, object_id, extra_context)

    def delete_model(self, request: HttpRequest, obj: Job) -> None:
        Job.objects.filter(pk=obj.pk).discard()

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        assert isinstance(queryset, JobQuerySet)
        queryset.discard()

    # ---- replay everything matching the current filter ---------------------------------------

    def url_name(self, view: str) -> str:
        return f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"

    def get_urls(self) -> list[Any]:
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        replay_matching = self.admin_site.admin_view(self.replay_matching_view)
        edit_payload = self.admin_site.admin_view(self.edit_payload_view)
        return [
            path("replay-matching/", replay_matching, name=f"{prefix}_replay_matching"),
            path("<path:object_id>/edit-payload/", edit_payload, name=f"{prefix}_edit_payload"),
            *super().get_urls(),
        ]

    def edit_payload_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return payloads.edit_payload_view(self, request, unquote(object_id))

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Job | None:
        """Django's; JSON Python cannot read (nested past its recursion limit, written by other
        means) is loaded as Unreadable, so that the job's pages still open."""
        try:
            return super().get_object(request, object_id, from_field)
        except RecursionError:  # read again, its JSON field by field
            json = [f.name for f in Job._meta.concrete_fields if isinstance(f, models.JSONField)]
            job = self.get_queryset(request).defer(*json).get(pk=object_id)
        for name in json:
            try:
                job.refresh_from_db(fields=[name])
            except RecursionError as error:
                setattr(job, name, Unreadable(error))
        return job

    def replay_matching_view(self, request: HttpRequest) -> HttpResponse:
        """Replay every job the changelist shows for these filters, with no rows selected."""
        if not (self.has_view_permission(request) and self.has_replay_permission(request)):
            raise PermissionDenied
        try:
            cl = self.get_changelist_instance(request)
        except IncorrectLookupParameters:  # as the list answers them
            return HttpResponseRedirect(
                f"{changelist_url(self, request).split('?')[0]}?{ERROR_FLAG}=1"
            )
        response = perform(self, request, cl.get_queryset(request), REPLAY, whole=True)
        return response or HttpResponseRedirect(changelist_url(self, request))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context and "cl" in context and IS_POPUP_VAR not in request.GET:
            cl = context["cl"]
            context["dashboard_url"] = reverse("admin:pgjobs_job_dashboard")
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


class JobAdmin(BaseJobAdmin):
    list_display = [
        "short_id", task, "queue", status, "priority", "attempts_display", "due", "created",
        "finished", "error_line",
    ]  # fmt: skip

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view(partial(dashboard.view, self))
        return [path("dashboard/", view, name="pgjobs_job_dashboard"), *super().get_urls()]


class DeadLetterAdmin(BaseJobAdmin):
    list_display = [
        "short_id", task, "queue", "attempts_display", "finished", "final_error",
    ]  # fmt: skip
    actions = [REPLAY.admin_action(), DELETE.admin_action()]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        queryset = super().get_queryset(request)
        assert isinstance(queryset, JobQuerySet)
        return queryset.dead()

    def offers_replay_matching(self, request: HttpRequest) -> bool:
        return True

    def get_list_filter(self, request: HttpRequest) -> tuple[type[admin.ListFilter], ...]:
        return (QueueFilter, TaskFilter, ErrorTypeFilter)

    def changelist_extra(self, cl: ChangeList) -> dict[str, Any]:
        """The summary above the list: dead letters (as filtered) by task and error type. It
        shows the ten largest groups and the ten that failed last, so that a new error shows
        however few its jobs, and the rest under a toggle."""
        groups = list(
            newest(cl.queryset)
            .annotate(error_type=ERROR_TYPE)
            .values("task", "error_type")
            .annotate(jobs=Count("*"), latest=models.Max("finished_at"))
            .order_by("-jobs", "task", "error_type")
        )
        read = sum(group["jobs"] for group in groups)
        last = sorted(groups[10:], key=lambda group: group["latest"], reverse=True)[:10]
        rest = [group for group in groups[10:] if group not in last]
        return {
            "summary": [group for group in groups if group not in rest],
            "summary_groups": len(groups),
            "summary_rest": rest,
            "summary_rest_jobs": sum(group["jobs"] for group in rest),
            "summary_of_newest": NEWEST if read >= NEWEST else None,
        }


def _running(job: Job | None) -> bool:
    return job is not None and job.status == Status.RUNNING


def _refused(job: Job) -> str:
    return _(
        "The job “%s” cannot be deleted while it runs: its worker still runs it. Cancel it instead."
    ) % (job,)
