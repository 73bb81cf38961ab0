"""Settings for the test suite (and for the runjobs subprocesses the crash tests start)."""

from __future__ import annotations

import json
import os

import django

from devdb import database_config

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_pgjobs",
    "tests",
    "example_project.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {"default": database_config()}
# The chaos suite's workers: connections named after the process (its audit trigger reads the
# name), and what Django needs behind PgBouncer in transaction pooling mode.
if os.environ.get("PGJOBS_CHAOS"):
    DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = f"chaos:{os.getpid()}"
if os.environ.get("PGJOBS_TCP_USER_TIMEOUT"):  # the frozen-worker chaos test's, in milliseconds
    DATABASES["default"].setdefault("OPTIONS", {})["tcp_user_timeout"] = int(
        os.environ["PGJOBS_TCP_USER_TIMEOUT"]
    )
if os.environ.get("PGJOBS_TEST_POOL"):  # Django's connection pool: its options, as JSON
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = json.loads(
        os.environ["PGJOBS_TEST_POOL"]
    )
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django's rule with a pool
if os.environ.get("PGJOBS_PGBOUNCER"):
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
try:  # Django's Tasks framework: built in from Django 6, else the django-tasks backport
    import django.tasks

    IMMEDIATE_BACKEND = "django.tasks.backends.immediate.ImmediateBackend"
except ImportError:
    INSTALLED_APPS.append("django_tasks")
    IMMEDIATE_BACKEND = "django_tasks.backends.immediate.ImmediateBackend"
TASKS = {
    "default": {
        "BACKEND": "django_pgjobs.backend.PgJobsBackend",
        "QUEUES": ["default", "queue-1"],
    },
    # Retries, for Tasks that say so; any queue.
    "retrying": {
        "BACKEND": "django_pgjobs.backend.PgJobsBackend",
        "QUEUES": [],
        "OPTIONS": {"max_attempts": 3},
    },
    # Not ours: a job naming one of its Tasks must not run.
    "immediate": {"BACKEND": IMMEDIATE_BACKEND},
}
STATIC_URL = "/static/"
# Django 6.1 configures mail as MAILERS and warns on sending without it (the test runner swaps
# the backend for its outbox either way).
if django.VERSION >= (6, 1):
    MAILERS = {"default": {"BACKEND": "django.core.mail.backends.locmem.EmailBackend"}}
# The admin tests log users in by the dozen; the default hasher's cost is meant for production.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Workers yield to the application only in the tests about it, which set a budget: elsewhere
# the tests' own sessions, holding transactions on purpose, would read as an application to
# yield to, and slow every other test's workers.
PGJOBS = {"BACKOFF_BASE": 0.01, "BACKOFF_MAX": 0.05, "YIELD_BUDGET": None}
# The schedules of the periodic crash tests' runjobs processes.
if os.environ.get("PGJOBS_TEST_TIMEOUT"):  # PGJOBS["TIMEOUT"], seconds
    PGJOBS["TIMEOUT"] = float(os.environ["PGJOBS_TEST_TIMEOUT"])
if os.environ.get("PGJOBS_TEST_PERIODIC"):
    PGJOBS["PERIODIC"] = json.loads(os.environ["PGJOBS_TEST_PERIODIC"])
# The NATS tests' runjobs and relayjobs processes: the queues NATS carries, and its server.
if os.environ.get("PGJOBS_TEST_YIELD"):  # the yielding crash tests' YIELD_* settings
    PGJOBS.update(json.loads(os.environ["PGJOBS_TEST_YIELD"]))
if os.environ.get("PGJOBS_TEST_QUEUES"):
    PGJOBS["QUEUES"] = json.loads(os.environ["PGJOBS_TEST_QUEUES"])
    PGJOBS["NATS"] = json.loads(os.environ.get("PGJOBS_TEST_NATS_SETTINGS", "{}"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # A crash test that watches for the worker's debug lines starts it with
    # PGJOBS_TEST_LOG_LEVEL=DEBUG.
    "loggers": {
        "django_pgjobs": {
            "handlers": ["console"],
            "level": os.environ.get("PGJOBS_TEST_LOG_LEVEL", "INFO"),
        }
    },
}
# A crash test's worker with an application's filter that raises on the records it was not
# written for (tests/logfilters.py), on a handler of ERROR records.
if os.environ.get("PGJOBS_TEST_RAISING_FILTER"):
    LOGGING["filters"] = {"user": {"()": "tests.logfilters.RequestUser"}}
    LOGGING["handlers"]["errors"] = {  # type: ignore[index]
        "class": "logging.StreamHandler", "level": "ERROR", "filters": ["user"],
    }  # fmt: skip
    LOGGING["loggers"]["django_pgjobs"]["handlers"].append("errors")  # type: ignore[index]
