"""Django settings for the benchmark's workers and clients: DATABASE_URL names the bench cluster."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import environ

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_pgjobs",
    "bench",
]
DATABASES = {"default": environ.Env().db_url("DATABASE_URL")}
if os.environ.get("BENCH_PREPARE"):
    # psycopg prepares a statement after this many executions; "none": never, on every
    # connection (Django's default, and the workers' own connections then prepare nothing
    # either: runtime/sessions.py).
    threshold = os.environ["BENCH_PREPARE"]
    DATABASES["default"]["OPTIONS"] = {
        "prepare_threshold": None if threshold == "none" else int(threshold)
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
PGJOBS = {
    "NOTIFY": os.environ.get("BENCH_NOTIFY", "1") == "1",
    "WORKER_SYNCHRONOUS_COMMIT": os.environ.get("BENCH_SYNC") == "1",
    # Short, so the soak reaches a steady state that pruning keeps bounded.
    "RETENTION": timedelta(seconds=float(os.environ.get("BENCH_RETENTION", "3600"))),
}
# bench/nats.py's workers: the run's NATS queue and server.
if os.environ.get("BENCH_PGJOBS_NATS"):
    PGJOBS.update(json.loads(os.environ["BENCH_PGJOBS_NATS"]))
