"""App configuration: registers the system checks, the Django Tasks backend's runner when a
TASKS backend uses it, the report's stream figures, and imports every app's tasks module."""

from __future__ import annotations

import contextlib
import importlib
import sys
from datetime import datetime
from typing import TYPE_CHECKING

from django.apps import AppConfig
from django.conf import settings
from django.utils.module_loading import autodiscover_modules

from django_pgjobs import transports

if TYPE_CHECKING:
    from django_pgjobs.observability.stats import StreamStats

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
        # The report asks for NATS queues' figures here: observability never imports jetstream/.
        from django_pgjobs.observability import figures

        figures.stream_stats = stream_stats
        if reloading():
            from django.utils import autoreload

            # As for runserver: an error in a tasks module is raised at the worker's start, and
            # its file watched, so the reloader starts the worker once it is fixed.
            with contextlib.suppress(Exception):
                autoreload.check_errors(autodiscover_modules)("tasks")
        else:
            autodiscover_modules("tasks")


def reloading() -> bool:
    """Whether this process is ``runjobs --reload`` (the parent or its child), read from the
    command line as Django reads it for runserver: the command is not known yet at setup."""
    return sys.argv[1:2] == ["runjobs"] and "--reload" in sys.argv[2:]


def stream_stats(now: datetime) -> list[StreamStats]:
    """The report's figures of the queues carried by NATS, asked of the server through
    jetstream/, imported only then: it needs nats-py."""
    queues = transports.nats_queues()
    if not queues:
        return []
    from django_pgjobs.jetstream.streams import measure

    return measure(queues, now)
