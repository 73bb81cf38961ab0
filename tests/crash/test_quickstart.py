"""The Quickstart followed as it is written (docs/quickstart.md): a new project from
`startproject`, the page's settings, task and view, its commands, and a worker that runs the job."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import quote, urlencode

import django
import psycopg
import pytest

from tests.conftest import connection_kwargs
from tests.crash.conftest import ROOT, scratch_database

# Through Django's own startproject, settings and email: what changes from one Django to the next.
pytestmark = pytest.mark.every_django

QUICKSTART = ROOT / "docs" / "quickstart.md"
SECTION = "## Add it to your project"


def quickstart_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the Quickstart's "Add it to your project", in order: (language,
    text), the list items' indentation taken off."""
    section = QUICKSTART.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^( *)```(\w+)\n(.*?)^\1```", section, re.MULTILINE | re.DOTALL)
    return [(language, textwrap.dedent(text)) for _, language, text in blocks]


def database_url(name: str) -> str:
    """A DATABASE_URL for the database `name` on the tests' server, a socket folder too (as
    libpq's host and port parameters, which django-environ passes on)."""
    kwargs = {**connection_kwargs(), "dbname": name}
    user = quote(kwargs.get("user") or "postgres", safe="")
    password = f":{quote(kwargs['password'], safe='')}" if kwargs.get("password") else ""
    server = {key: kwargs[key] for key in ("host", "port") if key in kwargs}
    return f"postgres://{user}{password}@/{name}?{urlencode(server)}"


class Project:
    """A folder a reader of the Quickstart works in, and the commands they type there."""

    def __init__(self, folder: Path, url: str) -> None:
        self.folder = folder
        self.env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("DJANGO_", "PGJOBS_"))  # the tests' own settings
        }
        # The django_pgjobs of this checkout, as the tests import it (not an installed copy)
        self.env |= {"DATABASE_URL": url, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def run(self, command: str) -> str:
        """Run a `$ ` line of the page; its output. A worker drains the queue and exits."""
        args = shlex.split(command)
        if args[0] == "python":
            args[0] = sys.executable
        elif args[0] == "django-admin":
            args[0] = str(Path(sys.executable).parent / "django-admin")
        if "runjobs" in args:
            args.append("--once")
        done = subprocess.run(
            args, cwd=self.folder, env=self.env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"$ {command}\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    def add(self, code: str) -> None:
        """Add a Python block of the page to the file its first line names (`# myapp/views.py`),
        as the reader would: below what is there. `...` in INSTALLED_APPS is what
        startproject listed."""
        heading, _, body = code.partition("\n")
        name = heading.removeprefix("# ").split(",")[0].split()[0]
        before = re.search(r"before Django (\d+)\.(\d+)", heading)
        if before and django.VERSION[:2] >= (int(before[1]), int(before[2])):
            return
        if name == "settings.py":
            (path,) = self.folder.glob("*/settings.py")
            body = re.sub(r"^(\s*)\.\.\.,$", r"\1*INSTALLED_APPS,", body, flags=re.MULTILINE)
        else:
            path = self.folder / name
        with path.open("a") as file:
            file.write(f"\n\n{heading}\n{body}")


@pytest.mark.django_db(transaction=True)
def test_the_quickstart_as_written_runs_a_job(tmp_path):
    # On Django 6.1 its EMAIL_BACKEND line, beside the MAILERS startproject writes, made every
    # command fail with ImproperlyConfigured.
    with scratch_database("quickstart") as name:
        project = Project(tmp_path, database_url(name))
        printed = []
        for language, text in quickstart_blocks():
            if language == "console":
                for line in text.splitlines():
                    command = line.removeprefix("$ ")
                    # The test's environment has its DATABASE_URL
                    if line.startswith("$ ") and not command.startswith("export "):
                        printed.append(project.run(command))
            elif language == "python":
                project.add(text)
        with psycopg.connect(**{**connection_kwargs(), "dbname": name}) as database:
            jobs = database.execute("SELECT task, status, last_error FROM pgjobs_job").fetchall()
    assert jobs == [("myapp.tasks.send_welcome", "succeeded", "")]
    assert "Subject: Welcome!" in printed[-1] and "To: ada@example.com" in printed[-1]
