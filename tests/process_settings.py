"""Settings of the --reload crash tests' workers: the tests' own, with Django's autoreloader
logging what it watches (a test waits for it to have seen a module it then rewrites)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import LOGGING

LOGGING["loggers"]["django.utils.autoreload"] = {"handlers": ["console"], "level": "DEBUG"}
