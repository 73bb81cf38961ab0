"""Large admin actions, carried out by a job of the queue itself.

Replay, run now, cancel or delete over a whole list of more than LARGE jobs would hold the
request for seconds and write a log entry per job. Instead the confirmation enqueues `operate`,
which rebuilds the list as its user saw it (the same filters and search, the same permissions)
and changes OPERATION_BATCH jobs a transaction, reporting its progress; the admin log gets one
entry, with the filter and the count. A worker killed midway loses nothing: the job is claimed
again and goes on with the jobs that still match, and it never replays a job twice, as only jobs
that were there, and finished, before the confirmation match.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.admin.views.main import PAGE_VAR
from django.contrib.auth import get_user_model
from django.contrib.messages.storage.cookie import CookieStorage
from django.core.exceptions import FieldError, ObjectDoesNotExist
from django.db import connections, router, transaction
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.urls import reverse
from django.utils.dateparse import parse_datetime
from django.utils.translation import gettext as _

from django_pgjobs import registry
from django_pgjobs.errors import JobCancelled
from django_pgjobs.models import Job
from django_pgjobs.observability import stats
from django_pgjobs.runtime.execute import cancel_requested, progress

#: The JobQuerySet transitions an operation may carry out, and the permission each needs: its
#: payload names one (a payload can be edited, so it names nothing else).
TRANSITIONS = {"replay": "replay", "run_now": "run_now", "cancel": "cancel", "discard": "delete"}
#: Past this many jobs, an action over every job a list matches runs as a job.
LARGE = 5000
#: Jobs changed per transaction by the operation.
OPERATION_BATCH = 1000
#: How long the operation waits for a row another session holds, before it is retried later.
OPERATION_LOCK_WAIT = "5s"


def start(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, title: str, transition: str,
    count: int, options: dict[str, Any],
) -> HttpResponse:  # fmt: skip
    """Enqueue the operation (`title`: the action's) for the list as this request filters it,
    log it once, and send the user to its job's page, where its progress shows."""
    user_id = request.user.pk
    assert user_id is not None  # the admin lets no anonymous user this far
    query = request.GET.copy()
    query.pop(PAGE_VAR, None)
    db = router.db_for_write(Job)
    with transaction.atomic(using=db):
        with connections[db].cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")  # the database's clock
            (before,) = cursor.fetchone()
        job = operate.enqueue(
            transition=transition,
            model=model_admin.opts.label_lower,
            query=query.urlencode(),
            user=user_id,
            before=before.isoformat(),
            options=options,
            count=count,
        )
        shown = query.urlencode() or _("no filter")
        LogEntry.objects.log_actions(
            user_id,
            [job],
            ADDITION,
            change_message=_("%(title)s: %(count)s jobs matching %(query)s, by this job.")
            % {"title": title, "count": f"{count:,}", "query": shown},
        )
    model_admin.message_user(
        request,
        _("%(count)s jobs: “%(title)s” runs as a job; this page shows its progress.")
        % {"title": title, "count": f"{count:,}"},
        messages.SUCCESS,
    )
    served = stats.served_queues(stats.worker_stats(db))
    if job.queue not in served:
        model_admin.message_user(
            request,
            _("No running worker serves the queue '%s': it starts when one does.") % job.queue,
            messages.WARNING,
        )
    return HttpResponseRedirect(reverse("admin:pgjobs_job_change", args=[job.pk]))


# Its user gone or no longer allowed, or a filter the list no longer has: no retry changes that.
@registry.task(
    name="django_pgjobs.operate", max_attempts=25,
    permanent_errors=(PermissionError, ObjectDoesNotExist, FieldError),
)  # fmt: skip
def operate(
    *, transition: str, model: str, query: str, user: Any, before: str,
    options: dict[str, Any], count: int,
) -> dict[str, int]:  # fmt: skip
    """Carry out `transition` (one of TRANSITIONS) over the jobs the admin's list of `model`
    shows for `query` to `user`, who must still be allowed to, that were there, and finished,
    `before`."""
    if transition not in TRANSITIONS:
        raise PermissionError(f"{transition!r} is not an operation: one of {sorted(TRANSITIONS)}")
    jobs = matching(model, query, user, TRANSITIONS[transition])
    since = parse_datetime(before)
    assert since is not None
    jobs = jobs.filter(created_at__lte=since)
    if transition == "replay":  # a job replayed since, which failed again, is not replayed twice
        jobs = jobs.filter(finished_at__lte=since)
    total = max(count, 0)
    done = max(total - jobs.count(), 0)  # by an earlier attempt of this job
    changed = 0
    last = None
    ids = jobs.order_by("pk").values_list("pk", flat=True)
    rows = Job.objects.all()
    db = router.db_for_write(Job)
    while batch := list((ids if last is None else ids.filter(pk__gt=last))[:OPERATION_BATCH]):
        if cancel_requested():  # the operator cancelled this job: stop between two batches
            raise JobCancelled(f"cancelled after {done:,} of {total:,} jobs")
        with transaction.atomic(using=db):
            with connections[db].cursor() as cursor:  # a row held: given up, tried again later
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [OPERATION_LOCK_WAIT])
            changed += len(getattr(rows.filter(pk__in=batch), transition)(**options))
        done, last = done + len(batch), batch[-1]
        progress(min(done, total), total)
    return {"changed": changed}


def matching(model: str, query: str, user: Any, permission: str) -> QuerySet[Job]:
    """The jobs the admin's list shows for `query` to `user`, with `user`'s permissions now."""
    model_admin = admin.site._registry[apps.get_model(model)]
    request = HttpRequest()
    request.method = "GET"
    request.GET = QueryDict(query)
    # What the list says of its filters (a NUL in a search) is not shown to anyone.
    request._messages = CookieStorage(request)  # type: ignore[attr-defined]
    request.user = get_user_model()._default_manager.get(pk=user)
    allowed = getattr(model_admin, f"has_{permission}_permission")
    if not (model_admin.has_view_permission(request) and allowed(request)):
        raise PermissionError(f"{request.user} may no longer {permission} these jobs")
    return model_admin.get_changelist_instance(request).get_queryset(request)
