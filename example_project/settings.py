"""Settings for the example shop, read from the environment with django-environ.

DATABASE_URL, SECRET_KEY, DEBUG and ALLOWED_HOSTS come from the environment. Without
DATABASE_URL, the repository's embedded PostgreSQL (devdb.py, data in .pgdata/) is used.
"""

from __future__ import annotations

from pathlib import Path

import django
import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

SECRET_KEY = env.str("SECRET_KEY", default="django-insecure-example-project-only")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

if env.str("DATABASE_URL", default=""):
    DATABASES = {"default": env.db_url("DATABASE_URL")}
else:
    from devdb import database_config

    DATABASES = {"default": database_config()}
# Keep connections open between requests and between jobs (a worker's handler threads reuse
# theirs), checking them before reuse.
DATABASES["default"].setdefault("CONN_MAX_AGE", 60)
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_pgjobs",
    "example_project.shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
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
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Confirmation emails go to the worker's output unless EMAIL_BACKEND says otherwise. Django 6.1
# configures mail as MAILERS (its EMAIL_BACKEND setting is deprecated); earlier versions as
# EMAIL_BACKEND.
_EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.console.EmailBackend")
if django.VERSION >= (6, 1):
    MAILERS = {"default": {"BACKEND": _EMAIL_BACKEND}}
else:
    EMAIL_BACKEND = _EMAIL_BACKEND

# Every key is optional; see the settings reference. The shop keeps the defaults.
PGJOBS: dict[str, object] = {}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_pgjobs": {"handlers": ["console"], "level": "INFO"}},
}
