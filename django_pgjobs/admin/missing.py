"""The admin's answer to a database without the pgjobs tables: a page that says to run
``manage.py migrate``, instead of a server error about a relation that does not exist."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib import admin
from django.db import DatabaseError, connections, router
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _

from django_pgjobs import schema
from django_pgjobs.models import Job

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
                return view(request, *args, **kwargs)
            except DatabaseError as error:
                if not schema.is_not_migrated(error):
                    raise
                return self.not_migrated(request, error)

        return guarded

    def not_migrated(self, request: HttpRequest, error: DatabaseError) -> HttpResponse:
        db = router.db_for_write(Job)
        if connections[db].in_atomic_block:
            # ATOMIC_REQUESTS: the failed statement aborted the request's transaction; roll it
            # back at the end rather than commit. Nothing below queries the database.
            connections[db].set_rollback(True)
        context = {
            **self.admin_site.each_context(request),
            "title": _("The django-pgjobs tables are missing"),
            "database": db,
            "error": schema.explained(error),
        }
        return TemplateResponse(request, "admin/pgjobs/not_migrated.html", context, status=503)
