"""The test settings on SQLite: for showing what django-pgjobs says on another backend."""

from tests.settings import *  # noqa: F403

DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
