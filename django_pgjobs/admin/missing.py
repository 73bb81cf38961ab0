"""The admin's answer to a database without the pgjobs tables (a page that says to run
``manage.py migrate``), and to a page held up by a lock (one that says so)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import SEARCH_VAR, ChangeList
from django.db import DatabaseError, connections, router, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import SimpleTemplateResponse, TemplateResponse
from django.utils.translation import gettext as _

from django_pgjobs import schema
from django_pgjobs.admin import actions
from django_pgjobs.data import rows
from django_pgjobs.errors import first_line
from django_pgjobs.models import Job
from django_pgjobs.observability import report as reports

View = Callable[..., HttpResponse]


class MigrateFirst:
    """Every page of this ModelAdmin, its own views included, answers a missing pgjobs table or
    column with the "run manage.py migrate" page (status 503)."""

    admin_site: admin.AdminSite

    @property
    def urls(self) -> list[Any]:
        patterns = self.get_urls()  # type: ignore[attr-defined]
        for pattern in patterns:
            pattern.callback = self.migrate_first(pattern.callback)
        return patterns  # type: ignore[no-any-return]

    def migrate_first(self, view: View) -> View:
        @wraps(view)
        def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method in ("GET", "HEAD"):
                    return self.bounded(view, request, *args, **kwargs)
                return view(request, *args, **kwargs)
            except DatabaseError as error:
                if schema.is_not_migrated(error):
                    return self.not_migrated(request, error)
                if not rows.lock_waited_out(error):
                    raise
                if request.method in ("GET", "HEAD"):
                    return self.locked(request, error)
                # A change that gave up on a row held elsewhere: rolled back, said, the page again.
                messages.error(request, self.locked_out(error))
                return HttpResponseRedirect(request.get_full_path())

        return guarded

    def bounded(self, view: View, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        """A page that only reads, rendered in a transaction whose statements wait at most
        ACTION_LOCK_WAIT for a lock, not as long as a LOCK TABLE or a stuck migration holds it."""
        db = router.db_for_read(Job)
        with transaction.atomic(using=db):
            with connections[db].cursor() as cursor:
                cursor.execute(actions.BOUND_LOCK_WAIT, [actions.ACTION_LOCK_WAIT] * 2)
            response = view(request, *args, **kwargs)
            if isinstance(response, SimpleTemplateResponse):
                response.render()  # its queries run as the template reads them
        return response

    def locked_out(self, error: DatabaseError) -> str:
        """What held the page up: the table lock and its holder, when that can be told."""
        reason = reports.locked_out()
        if reason is not None:
            return f"{reason.summary}: {reason.detail}"
        return _(
            "This page waited %(wait)s for a row or table another session holds (%(error)s). "
            "Nothing was changed; try again."
        ) % {"wait": actions.ACTION_LOCK_WAIT, "error": first_line(error)}

    def locked(self, request: HttpRequest, error: DatabaseError) -> HttpResponse:
        """The page for a read that gave up on a lock: who holds it, when that can be told."""
        context = {
            **self.admin_site.each_context(request),
            "title": _("The jobs are locked"),
            "error": self.locked_out(error),
            "waited": actions.ACTION_LOCK_WAIT,
        }
        return TemplateResponse(request, "admin/pgjobs/locked.html", context, status=503)

    def not_migrated(self, request: HttpRequest, error: DatabaseError) -> HttpResponse:
        db = router.db_for_write(Job)
        if connections[db].in_atomic_block:
            # ATOMIC_REQUESTS: the failed statement aborted the transaction: roll it back.
            connections[db].set_rollback(True)
        context = {
            **self.admin_site.each_context(request),
            "title": _("The django-pgjobs tables are missing"),
            "database": db,
            "error": schema.explained(error),
        }
        return TemplateResponse(request, "admin/pgjobs/not_migrated.html", context, status=503)

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        """Django's; a filter value holding a NUL, which PostgreSQL refuses in a query, is an
        incorrect lookup (the ?e=1 page)."""
        if any("\x00" in value for key, values in request.GET.lists() if key != SEARCH_VAR
               for value in values):  # fmt: skip
            raise IncorrectLookupParameters("a NUL character in a filter")
        changelist: ChangeList = super().get_changelist_instance(request)  # type: ignore[misc]
        return changelist
