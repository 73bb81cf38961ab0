"""On a database other than PostgreSQL, a clear error, never a crash of the checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "command", [["migrate"], ["check", "--deploy", "--database", "default"]], ids=" ".join
)
def test_on_sqlite_pgjobs_says_it_needs_postgresql_without_a_traceback(command):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.sqlite_settings"}
    env.pop("PGJOBS_TEST_DATABASE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", *command], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "pgjobs.E001" in done.stderr and "needs PostgreSQL" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # Nothing beside it about what SQLite lacks for the job table's indexes (models.W040)
    assert "pgjobs.Job: (models." not in done.stderr, done.stderr
