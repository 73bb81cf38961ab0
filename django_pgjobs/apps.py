"""App configuration: registers the system checks, the Django Tasks backend's runner when a
TASKS backend uses it, and imports every app's tasks module."""

from __future__ import annotations

import importlib

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules

BACKEND = "django_pgjobs.backend.PgJobsBackend"


class PgJobsConfig(AppConfig):
    name = "django_pgjobs"
    label = "pgjobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Imported once the models are ready: these modules register checks (and a runner).
        importlib.import_module("django_pgjobs.checks")
        importlib.import_module("django_pgjobs.periodic")
        backends = getattr(settings, "TASKS", {}).values()
        if any(backend.get("BACKEND") == BACKEND for backend in backends):
            importlib.import_module("django_pgjobs.backend")
        autodiscover_modules("tasks")
