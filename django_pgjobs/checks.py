"""System checks: the database must be PostgreSQL; the PGJOBS settings must make sense."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from django_pgjobs.conf import unknown_keys


@register(Tags.compatibility)
def check_database(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from django_pgjobs.models import Job

    alias = router.db_for_write(Job)
    vendor = connections[alias].vendor
    if vendor == "postgresql":
        return []
    return [
        Error(
            f"django-pgjobs needs PostgreSQL, but the database {alias!r} is {vendor}.",
            hint="Point DATABASES (or your router for pgjobs.Job) at a PostgreSQL database.",
            id="pgjobs.E001",
        )
    ]


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [
        Warning(
            f"PGJOBS has an unknown key {key!r}; it is ignored.",
            hint="See the settings reference for the keys django-pgjobs reads.",
            id="pgjobs.W001",
        )
        for key in unknown_keys()
    ]
