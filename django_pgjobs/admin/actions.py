"""The admin's bulk actions on jobs: each defined once, all run by one confirm → apply → report.

An action is one row of ACTIONS: its label, its permission, the JobQuerySet transition it calls,
and its messages. `perform` confirms, `apply` runs the transition over the selection in keyset
batches (so "select all" over a million jobs stays cheap) and logs each row it changed, and
`report` tells the user the counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.admin.views.main import PAGE_VAR
from django.db import DatabaseError, connections, router, transaction
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext_lazy, ngettext, ngettext_lazy

from django_pgjobs.admin import operations
from django_pgjobs.admin.forms import ActionForm, ReplayForm
from django_pgjobs.data import rows as data_rows
from django_pgjobs.data.queryset import JobQuerySet
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.transports import nats_queues

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

#: Rows changed and logged per statement by a bulk action.
ACTION_BATCH = 1000
#: How long a bulk action waits for a row another session holds (unless lock_timeout is less).
ACTION_LOCK_WAIT = "5s"
#: Sets the transaction's lock_timeout to %s, unless the session's is shorter (not 0).
BOUND_LOCK_WAIT = (
    "SELECT set_config('lock_timeout', %s, true) FROM pg_settings WHERE name = 'lock_timeout' "
    "AND (setting::bigint = 0 OR setting::bigint > extract(epoch FROM %s::interval) * 1000)"
)
#: What the admin log's description of a job (str(job)) reads.
LOGGED = ("id", "task", "status")


@dataclass(frozen=True)
class Action:
    """One bulk action on jobs, from the menu entry to the message that reports it."""

    name: str  # the action's name in the admin (POST["action"])
    description: StrOrPromise  # its entry in the changelist's menu
    title: StrOrPromise  # the confirmation page's title
    question: StrOrPromise  # the confirmation page's question, "%d" the count, by ngettext_lazy
    permission: str  # ModelAdmin.has_<permission>_permission() decides who may
    transition: Callable[..., Sequence[Any]]  # returns the primary keys of the rows it changed
    flag: int  # the admin log's action flag, CHANGE or DELETION
    logged: StrOrPromise  # the admin log's message
    done: StrOrPromise  # "%d jobs …", by ngettext_lazy
    skipped: StrOrPromise | None = None  # why the rest were left alone; None: not reported
    form: type[ActionForm] | None = None
    button: StrOrPromise | None = None  # the detail page's button for a job it applies to
    applies: Callable[[Job], bool] = lambda job: False
    #: The admin log's message for a job, by its status before the change (default `logged`).
    logged_for: Callable[[Job], StrOrPromise] | None = None
    #: Whether the transition takes the acting user's name (`by=`), to record in the job.
    by_user: bool = False

    def admin_action(self) -> Callable[..., HttpResponse | None]:
        """The action as a ModelAdmin takes it in `actions`."""

        def action(
            model_admin: admin.ModelAdmin[Any], request: HttpRequest, queryset: QuerySet[Any]
        ) -> HttpResponse | None:
            # "Select all" asks for every job the list matches: a large action runs as a job.
            whole = request.POST.get("select_across") == "1"
            return perform(model_admin, request, queryset, self, whole=whole)

        action.__name__ = self.name
        return admin.action(description=self.description, permissions=[self.permission])(action)


REPLAY = Action(
    name="replay",
    description=gettext_lazy("Replay selected jobs…"),
    title=gettext_lazy("Replay jobs"),
    question=ngettext_lazy("Replay %d job?", "Replay %d jobs?"),
    permission="replay",
    transition=JobQuerySet.replay,
    flag=CHANGE,
    logged=gettext_lazy("Replayed."),
    done=ngettext_lazy("%d job replayed.", "%d jobs replayed."),
    skipped=gettext_lazy(
        "only failed or cancelled jobs are replayed, and of a unique key only the oldest, "
        "while no live job holds it"
    ),
    form=ReplayForm,
    by_user=True,
    button=gettext_lazy("Replay…"),
    applies=lambda job: job.status in (Status.FAILED, Status.CANCELLED),
)
RUN_NOW = Action(
    name="run_now",
    description=gettext_lazy("Run selected jobs now…"),
    title=gettext_lazy("Run jobs now"),
    question=ngettext_lazy("Run %d job now?", "Run %d jobs now?"),
    permission="run_now",
    transition=JobQuerySet.run_now,
    flag=CHANGE,
    logged=gettext_lazy("Run now."),
    done=ngettext_lazy("%d job made due now.", "%d jobs made due now."),
    skipped=gettext_lazy("only ready jobs scheduled for later are moved"),
    button=gettext_lazy("Run now…"),
    # The app's clock decides only whether to offer the button; the transition uses the database's.
    applies=lambda job: job.status == Status.READY and job.run_at > timezone.now(),
)
CANCEL = Action(
    name="cancel",
    description=gettext_lazy("Cancel selected jobs…"),
    title=gettext_lazy("Cancel jobs"),
    question=ngettext_lazy("Cancel %d job?", "Cancel %d jobs?"),
    permission="cancel",
    transition=JobQuerySet.cancel,
    flag=CHANGE,
    logged=gettext_lazy("Cancelled."),
    done=ngettext_lazy(
        "%d job cancelled (a running one stops if its handler checks, else finishes).",
        "%d jobs cancelled (running ones stop if their handler checks, else finish).",
    ),
    skipped=gettext_lazy("only ready jobs, and running ones not asked to stop yet, are cancelled"),
    button=gettext_lazy("Cancel…"),
    applies=lambda job: (
        job.status in (Status.READY, Status.WAITING)
        or (job.status == Status.RUNNING and not job.cancel_requested)
    ),
    # A running job is not cancelled yet: its handler may stop, or finish.
    logged_for=lambda job: (
        gettext_lazy("Cancellation requested.")
        if job.status == Status.RUNNING
        else gettext_lazy("Cancelled.")
    ),
)
DELETE = Action(
    name="delete_jobs",
    description=gettext_lazy("Delete selected jobs…"),
    title=gettext_lazy("Delete jobs"),
    question=ngettext_lazy("Delete %d job?", "Delete %d jobs?"),
    permission="delete",
    transition=JobQuerySet.discard,
    flag=DELETION,
    logged=gettext_lazy("Deleted."),
    done=ngettext_lazy("%d job deleted.", "%d jobs deleted."),
    skipped=gettext_lazy(
        "running jobs are not deleted while their worker runs them; cancel them instead"
    ),
)
ACTIONS = (REPLAY, RUN_NOW, CANCEL, DELETE)


def perform(
    model_admin: admin.ModelAdmin[Any],
    request: HttpRequest,
    queryset: QuerySet[Any],
    action: Action,
    *,
    cancel_url: str | None = None,
    whole: bool = False,
) -> HttpResponse | None:
    """Ask for confirmation (and the action's options), then apply and report. None sends the
    user back to the list, as Django's actions do; `cancel_url`: where "No" goes instead.
    `whole`: the queryset is every job the list matches for this request's filters, which past
    operations.LARGE jobs is changed by a job (operations.py)."""
    confirmed = "post" in request.POST
    form = action.form(request.POST if confirmed else None) if action.form else None
    if not confirmed or (form is not None and not form.is_valid()):
        return confirm(
            model_admin, request, queryset, action, form, cancel_url=cancel_url, whole=whole
        )
    options = form.options() if isinstance(form, ActionForm) else {}
    if action.by_user:
        options["by"] = request.user.get_username()
    if whole and (count := queryset.count()) > operations.LARGE:
        return operations.start(
            model_admin, request, str(action.title), action.transition.__name__, count, options
        )
    logged: str | Callable[[Any], str]
    if action.logged_for is not None:
        logged_for = action.logged_for
        logged = lambda job: str(logged_for(job))  # noqa: E731
    else:
        logged = str(action.logged) if form is None else form.change_message(str(action.logged))
    streams: list[str] = []

    def transition(rows: Any) -> Sequence[Any]:
        changed = action.transition(rows, **options)
        if action is REPLAY:  # read before the batch commits: then the relay may delete them
            streams.extend(streamed(changed))
        return changed

    changed, seen = apply(request, queryset, transition, action.flag, logged, only=LOGGED)
    skipped = seen - changed if action.skipped is not None else 0
    done = action.done % changed + handed(streams)
    report(model_admin, request, done, skipped, str(action.skipped or ""))
    return None


def streamed(ids: Sequence[Any]) -> list[str]:
    """The stream each of the replayed jobs `ids` of a NATS queue goes to: its row is an outbox
    entry now, which the relay deletes once it hands it to the stream."""
    queues = nats_queues()
    if not queues or not ids:
        return []
    found = Job.objects.filter(pk__in=ids, queue__in=queues).values_list("queue", flat=True)
    return [queues[queue].stream for queue in found]


def handed(streams: Sequence[str]) -> str:
    """What a replay's message adds for jobs of NATS queues: where they went."""
    if not streams:
        return ""
    return " " + ngettext(
        "%(n)d went to NATS JetStream (%(streams)s): its row leaves the job table once relayed.",
        "%(n)d went to NATS JetStream (%(streams)s): their rows leave the job table once relayed.",
        len(streams),
    ) % {"n": len(streams), "streams": ", ".join(sorted(set(streams)))}


def apply(
    request: HttpRequest,
    queryset: QuerySet[Any],
    transition: Callable[[Any], Sequence[Any]],
    flag: int,
    message: str | Callable[[Any], str],
    *,
    only: Sequence[str] = (),
) -> tuple[int, int]:
    """Run `transition` over the selection, ACTION_BATCH rows per statement, and log each row it
    changed (the primary keys it returns) with `message`, or `message(row)` as the row is after
    the change. Returns (changed, selected). `only` names the fields str(row) needs, read before
    the change so that the log names deleted rows too."""
    user_id = request.user.pk
    assert user_id is not None  # the admin lets no anonymous user this far
    model = queryset.model._meta.concrete_model
    assert model is not None
    rows: QuerySet[Model] = model._default_manager.all()
    ids = queryset.order_by("pk").values_list("pk", flat=True)
    changed = seen = held = 0
    waited = 0.0  # on held rows: the transition's own tries (about 5 s), then ACTION_LOCK_WAIT
    last: Any = None
    db = router.db_for_write(model)
    while batch := list((ids if last is None else ids.filter(pk__gt=last))[:ACTION_BATCH]):
        selected = rows.filter(pk__in=batch)
        started = time.monotonic()
        try:
            done = _batch(user_id, rows, selected, db, transition, flag, message, only)
        except DatabaseError as error:
            if not data_rows.lock_waited_out(error):
                raise
            held, last = held + len(batch), batch[-1]  # left as it was: the next batch
            waited += time.monotonic() - started
            continue
        changed, seen, last = changed + len(done), seen + len(batch), batch[-1]
    if held:
        messages.warning(request, ngettext(
            "%(n)d row was left as it was: another session held it, or a row of its batch, "
            "and it was waited for %(waited).0f s (a transaction left open?). Try again.",
            "%(n)d rows were left as they were: another session held them, or rows of their "
            "batches, and they were waited for %(waited).0f s (a transaction left open?). "
            "Try again.",
            held,
        ) % {"n": held, "waited": waited})  # fmt: skip
    return changed, seen


def _batch(
    user_id: Any,
    rows: QuerySet[Model],
    selected: QuerySet[Model],
    db: str,
    transition: Callable[[Any], Sequence[Any]],
    flag: int,
    message: str | Callable[[Any], str],
    only: Sequence[str],
) -> Sequence[Any]:
    """One batch of `apply`, in a transaction of its own so that its change and its log entries
    commit together. It waits at most ACTION_LOCK_WAIT for a row another session holds: past
    that, nothing of the batch is changed (the caller catches the error)."""
    with transaction.atomic(using=db):
        with connections[db].cursor() as cursor:
            cursor.execute(BOUND_LOCK_WAIT, [ACTION_LOCK_WAIT, ACTION_LOCK_WAIT])
        described = {row.pk: row for row in (selected.only(*only) if only else selected)}
        done = transition(selected)
        if not isinstance(message, str):  # what the change made of each row: a worker may
            after = rows.filter(pk__in=done)  # have claimed one since it was read
            described.update((row.pk, row) for row in (after.only(*only) if only else after))
        by_message: dict[str, list[Model]] = {}
        for row in (described[pk] for pk in done):
            text = message if isinstance(message, str) else message(row)
            by_message.setdefault(text, []).append(row)
        for text, logged in by_message.items():
            LogEntry.objects.log_actions(user_id, logged, flag, text)
    return done


def confirm(
    model_admin: admin.ModelAdmin[Any],
    request: HttpRequest,
    queryset: QuerySet[Any],
    action: Action,
    form: forms.Form | None = None,
    *,
    cancel_url: str | None = None,
    whole: bool = False,
) -> TemplateResponse:
    """The intermediate page of a bulk action: what it does, to how many jobs."""
    count = queryset.count()
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.opts,
        "title": action.title,
        "question": action.question % count,
        "count": count,
        "sample": list(queryset[:10]),
        "form": form,
        "action": request.POST.get("action", ""),
        "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
        "select_across": request.POST.get("select_across") == "1",
        "cancel_url": cancel_url or changelist_url(model_admin, request),
        "as_a_job": whole and count > operations.LARGE,
    }
    return TemplateResponse(request, "admin/pgjobs/confirm_action.html", context)


def report(
    model_admin: admin.ModelAdmin[Any],
    request: HttpRequest,
    done: str,
    skipped: int = 0,
    why: str = "",
) -> None:
    """Say what an action did; a warning when it left some of the selection alone."""
    if skipped:
        done += " " + ngettext("%d skipped: %s.", "%d skipped: %s.", skipped) % (skipped, why)
    model_admin.message_user(request, done, messages.WARNING if skipped else messages.SUCCESS)


def changelist_url(model_admin: admin.ModelAdmin[Any], request: HttpRequest) -> str:
    """The changelist, filtered as in this request."""
    query = request.GET.copy()
    query.pop(PAGE_VAR, None)
    opts = model_admin.opts
    changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    return f"{changelist}?{query.urlencode()}" if query else changelist
