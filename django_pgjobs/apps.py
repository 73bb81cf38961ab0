"""App configuration: registers the system checks and imports every app's tasks module."""

from __future__ import annotations

from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class PgJobsConfig(AppConfig):
    name = "django_pgjobs"
    label = "pgjobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from django_pgjobs import checks, periodic  # noqa: F401  (registers the checks)

        autodiscover_modules("tasks")
