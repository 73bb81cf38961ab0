"""The dashboard: the admin's front door for jobs. The verdict, the jobs by state, each queue's
size, age, latency and throughput, and each task's states and runs over the last hour and day,
every number a link to the list it counts; with a live refresh (a toggle, off by default).

Read from the health report's figures (one limited transaction, no scan of the finished history)
and the statistics rolled up per task: the same few hundred rows with 1 worker or 100.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs import schema
from django_pgjobs.observability import report as reports
from django_pgjobs.observability import stats, tasks
from django_pgjobs.observability.figures import limited
from django_pgjobs.status import Status

#: The states shown (QueueDepth's fields), with the Jobs list's status filter that lists them.
STATES = (
    ("due", gettext_lazy("due"), "due"),
    ("scheduled", gettext_lazy("scheduled"), "scheduled"),
    ("running", gettext_lazy("running"), Status.RUNNING),
    ("expired", gettext_lazy("stuck"), "stuck"),
    ("retrying", gettext_lazy("retrying"), "retrying"),
    ("failed", gettext_lazy("dead"), Status.FAILED),
)
#: Seconds between two loads of the page while live refresh is on.
REFRESH_SECONDS = 5


def view(model_admin: admin.ModelAdmin[Any], request: HttpRequest) -> HttpResponse:
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    try:
        report = reports.collect()  # in its own transaction, with short timeouts
        db = stats.job_database()
        with limited(db):
            by_task = tasks.task_figures(report.depths, db)
    except DatabaseError as error:
        if schema.is_not_migrated(error):
            raise
        model_admin.message_user(
            request, _("The dashboard could not be read: %s") % error, messages.ERROR
        )
        report, by_task = None, []
    jobs = reverse("admin:pgjobs_job_changelist")

    def link(state: str, **where: str) -> str:
        status = next(filter_ for key, _label, filter_ in STATES if key == state)
        return f"{jobs}?{urlencode({'status__exact': status, **where})}"

    def states(figures: dict[str, Any], **where: str) -> list[dict[str, Any]]:
        return [
            {"key": key, "label": label, "count": figures[key], "url": link(key, **where)}
            for key, label, _filter in STATES
        ]

    queues, totals = [], {key: 0 for key, _label, _filter in STATES}
    if report is not None:
        for depth in report.queues:
            figures = vars(depth)
            for key in totals:
                totals[key] += figures[key]
            recent = report.activity_of(depth.queue, 300)
            queues.append({
                "queue": depth, "states": states(figures, queue=depth.queue),
                "workers": len(report.serving(depth.queue)),
                "throughput": recent.throughput if recent else None,
                "p50": recent.latency(0.5) if recent else None,
                "p95": recent.latency(0.95) if recent else None,
            })  # fmt: skip
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": _("Jobs dashboard"),
        "data": reports.as_dict(report) if report is not None else None,
        "totals": [
            {"key": key, "label": label, "count": totals[key], "url": link(key)}
            for key, label, _filter in STATES
        ],
        "queues": queues,
        "tasks": [
            {"figures": figures, "states": states(figures.now, task=figures.task)}
            for figures in by_task
        ],
        "refresh_seconds": REFRESH_SECONDS,
        "report_url": reverse("admin:pgjobs_queue_report"),
    }
    return TemplateResponse(request, "admin/pgjobs/dashboard.html", context)
