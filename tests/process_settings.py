"""Settings of the --reload crash test's worker: the tests' own, with Django's autoreloader
logging what it watches (the test waits for it to have seen the module it then rewrites)."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import LOGGING

LOGGING["loggers"]["django.utils.autoreload"] = {"handlers": ["console"], "level": "DEBUG"}
