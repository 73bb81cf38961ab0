"""The development commands (dev.py, devdb.py, the demo): a DATABASE_URL Django cannot use, or a
Python too old for a leg, is one line saying what is wrong and what to do; a failed run still
says what it took; what they leave behind is where the next run can use it."""

from __future__ import annotations

import dataclasses
import re
import sys
import venv
from pathlib import Path

import pytest

import dev
import devdb

ROOT = Path(dev.__file__).resolve().parent


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgres://postgres@127.0.0.1:5432/", "names no database"),
        (
            "mysql://root@127.0.0.1/shop",
            "must be a PostgreSQL URL (postgres://USER@HOST:5432/NAME), not mysql's",
        ),
        ("sqlite:////tmp/shop.db", "not sqlite3's"),
        ("garbage", "must be a PostgreSQL URL"),
    ],
)
def test_a_database_url_django_cannot_use_is_one_line(monkeypatch, url, said):
    # Each was "PostgreSQL 15" from the start-up check, then an 80-line traceback from Django.
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(devdb.DatabaseUnavailable) as raised:
        devdb.database_config()
    assert said in str(raised.value.code)


def test_the_start_up_check_connects_with_the_urls_options(monkeypatch):
    # It ignored them, and said the database was fine where Django then failed (sslmode=require
    # on a server without SSL; a bad connect_timeout).
    monkeypatch.setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/shop?connect_timeout=abc")
    with pytest.raises(devdb.DatabaseUnavailable, match="bad value for connect_timeout"):
        devdb.describe(devdb.database_config(), must_exist=True)


def test_a_failed_tier_still_prints_each_tiers_time(monkeypatch, capsys):
    # The times were printed only after every tier passed: a failed run said nothing of them.
    def pytest_run(command: list[str], check: bool = True) -> int:
        return 1 if command[command.index("-m") + 1] == "integration" else 0

    monkeypatch.delenv("PGJOBS_LEG", raising=False)
    monkeypatch.setattr(dev, "run", pytest_run)
    assert dev.pytest_in_tiers([]) == 1
    printed = capsys.readouterr().out
    assert "the integration tests failed; not run: property, crash, chaos, browser" in printed
    assert re.search(r"^tiers: unit \d+s, integration \d+s \(failed\)$", printed, re.MULTILINE)


@pytest.fixture
def python311(tmp_path: Path) -> str:
    """A program that answers dev.py's question for its version as a Python 3.11 does."""
    program = tmp_path / "python3.11"
    program.write_text("#!/bin/sh\necho 3.11\n")
    program.chmod(0o755)
    return str(program)


@pytest.fixture
def django6(tmp_path: Path, monkeypatch) -> dev.Leg:
    """The Django 6 leg with its virtualenv in tmp_path; no pip runs."""

    def no_pip(command: list[str], check: bool = True) -> int:
        raise AssertionError(f"ran {command}")

    monkeypatch.setattr(dev, "run", no_pip)
    return dataclasses.replace(dev.LEGS["6"], venv=tmp_path / ".venv-django6")


def test_a_pgjobs_python_too_old_for_the_leg_is_refused_before_the_venv_is_made(
    monkeypatch, python311, django6
):
    # It was taken: pip then listed every Django it could not install (5 KB), and every later
    # run failed the same way in the virtualenv left behind.
    monkeypatch.setenv("PGJOBS_PYTHON", python311)
    with pytest.raises(SystemExit) as raised:
        dev.ensure_venv(django6)
    said = str(raised.value.code)
    assert said == (
        f"dev.py: PGJOBS_PYTHON={python311} is Python 3.11, and Django 6 needs 3.12 or newer: "
        "point PGJOBS_PYTHON at a Python 3.12 or 3.13, or unset it to have one looked for"
    )
    assert not django6.venv.exists()


def test_a_venv_of_a_python_too_old_for_the_leg_says_to_delete_it(python311, django6):
    dev.venv_python(django6.venv).parent.mkdir(parents=True)
    dev.venv_python(django6.venv).symlink_to(python311)
    with pytest.raises(SystemExit) as raised:
        dev.ensure_venv(django6)
    assert raised.value.code == (
        "dev.py: .venv-django6/ runs Python 3.11, and Django 6 needs 3.12 or newer: delete it "
        f"(rm -rf {django6.venv}) and run again"
    )


def test_a_venv_whose_install_failed_is_removed_and_made_again_by_the_next_run(
    monkeypatch, capsys, django6
):
    # It was left with its Python and without the project: every later run skipped making it
    # and failed on the same install, until it was deleted by hand.
    made: list[Path] = []

    def pip_fails(command: list[str], check: bool = True) -> int:
        if command[1:3] == ["-m", "venv"]:
            made.append(Path(command[3]))
            venv.create(command[3], with_pip=False, symlinks=True)
            return 0
        if "-e" in command:
            raise SystemExit(f"command failed (1): {' '.join(command)}")
        return 0

    monkeypatch.setattr(dev, "find_python", lambda leg: "/usr/bin/python3.12")
    monkeypatch.setattr(dev, "run", pip_fails)
    for _ in range(2):
        with pytest.raises(SystemExit, match="command failed"):
            dev.ensure_venv(django6)
        assert not django6.venv.exists()
        assert "removed the unfinished .venv-django6/; the next run makes it again" in (
            capsys.readouterr().out
        )
    assert made == [django6.venv, django6.venv]


def test_the_demos_follow_up_commands_carry_the_database_url_it_ran_with():
    # Without it, runserver in a new shell opened the embedded database instead, log_safely.
    from example_project.shop.management.commands import demo

    url = "postgres://shop:s3cr&t@db.example.com:5432/shop"
    commands = [line.strip() for line in demo.look_around(url).splitlines()]
    manage = f"DATABASE_URL='{url}' {demo.shown(sys.executable)} manage.py"
    assert f"{manage} runserver" in commands
    assert any(line.startswith(f"{manage} runjobs --queue emails") for line in commands)
    assert "DATABASE_URL" not in demo.look_around("")


def test_the_demos_worker_log_is_kept_in_the_project_not_the_temporary_folder(settings):
    # Each demo left one more pgjobs-demo-worker-*.log in /tmp.
    from example_project.shop.management.commands import demo

    settings.BASE_DIR = ROOT  # the example project's (its settings would start a database)
    log = demo.worker_log()
    assert log.parent == ROOT
    ignored = ROOT / ".gitignore"
    if ignored.exists():  # a checkout's (an sdist has none, nor git)
        assert log.name in ignored.read_text().splitlines()
