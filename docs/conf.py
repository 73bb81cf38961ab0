"""Sphinx configuration for the django-pgjobs documentation."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402
from django.conf import settings  # noqa: E402

# Settings of the docs' own: autodoc imports the package's modules, which needs the apps loaded
# but never a database (the docs build on their own, with only the `docs` extra, as on Read the
# Docs; no DATABASE_URL, no embedded server).
if not os.environ.get("DJANGO_SETTINGS_MODULE"):
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django_pgjobs",
        ],
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "unused"}},
        USE_TZ=True,
    )
django.setup()

project = "django-pgjobs"
author = "the django-pgjobs authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
myst_enable_extensions = ["colon_fence", "deflist"]
html_theme = "furo"
html_title = "django-pgjobs"
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"


# ---- The reference must not drift from the code ---------------------------------------------
# Every PGJOBS key (with its default) and every runjobs option must appear in the reference;
# a missing one is a warning, which `sphinx-build -W` turns into a failed build.

DOCS = Path(__file__).resolve().parent


def _literal(value: object) -> str:
    """A default as the settings table writes it."""
    from datetime import timedelta

    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
            if seconds % size == 0:
                return f"timedelta({unit}={seconds // size})"
        return f"timedelta(seconds={seconds})"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
        return f"{value:_}"
    return repr(value)


def _check_reference(app: object) -> None:
    import re
    from dataclasses import fields
    from importlib import import_module

    from django.core.management import find_commands
    from django.core.management.base import BaseCommand
    from sphinx.util import logging

    from django_pgjobs import management
    from django_pgjobs.conf import DEFAULTS

    logger = logging.getLogger("django_pgjobs.docs")
    settings_page = (DOCS / "reference" / "settings.md").read_text()
    from django_pgjobs.observability.health import Thresholds

    # Each PGJOBS key, then each PGJOBS["HEALTH"] key, in a table row with its default.
    for defaults, key in ((DEFAULTS, "PGJOBS[%r]"), (Thresholds(), "PGJOBS['HEALTH'][%r]")):
        for field in fields(defaults):
            default = _literal(getattr(defaults, field.name))
            row = rf"\|\s*`{field.name}`\s*\|\s*`{re.escape(default)}`\s*\|"
            if not re.search(row, settings_page):
                logger.warning(
                    f"reference/settings.md has no row for {key} with its default `%s`",
                    field.name,
                    default,
                )
    commands_page = (DOCS / "reference" / "commands.md").read_text()
    common = {
        option
        for action in BaseCommand().create_parser("manage.py", "x")._actions
        for option in action.option_strings
    }
    for name in find_commands(str(Path(management.__file__).parent)):
        if f"## {name}\n" not in commands_page:
            logger.warning("reference/commands.md has no section for %s", name)
        command = import_module(f"django_pgjobs.management.commands.{name}").Command()
        for action in command.create_parser("manage.py", name)._actions:
            for option in set(action.option_strings) - common:
                if f"`{option}" not in commands_page:
                    logger.warning("reference/commands.md does not document %s %s", name, option)


def setup(app: object) -> None:
    app.connect("builder-inited", _check_reference)  # type: ignore[attr-defined]
