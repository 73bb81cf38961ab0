"""The database for development, the demo and the tests: DATABASE_URL, or an embedded PostgreSQL."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import environ

ROOT = Path(__file__).resolve().parent
PGDATA = ROOT / ".pgdata"
DATABASE_NAME = os.environ.get("PGJOBS_DB_NAME", "pgjobs")


def database_config() -> dict[str, Any]:
    """Django's DATABASES["default"]: from DATABASE_URL when set, else an embedded server.

    The embedded server keeps running after this process exits (worker subprocesses and the
    next run reuse it); `python dev.py stopdb` stops it.
    """
    env = environ.Env()
    if env.str("DATABASE_URL", default=""):
        config: dict[str, Any] = env.db_url("DATABASE_URL")
    else:
        config = _embedded_config()
    # Tests run worker subprocesses against the test database pytest-django created.
    if os.environ.get("PGJOBS_TEST_DATABASE"):
        config["NAME"] = os.environ["PGJOBS_TEST_DATABASE"]
    return config


def _embedded_config() -> dict[str, Any]:
    socket_dir = start_embedded()
    _create_database(socket_dir)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": "postgres",
        "HOST": str(socket_dir),
        "PORT": "",
    }


def start_embedded() -> Path:
    """Start (or find running) the embedded PostgreSQL in .pgdata/ and return its socket folder."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import pgserver
    except ImportError:
        return _start_with_binaries_on_path()
    # pgserver narrates every handle it opens and closes at INFO; keep only its warnings.
    logging.getLogger("pgserver").setLevel(logging.WARNING)
    server = pgserver.get_server(PGDATA, cleanup_mode=None)
    return Path(server.get_postmaster_info().socket_dir)


def _start_with_binaries_on_path() -> Path:
    """Fallback for Pythons pgserver has no wheel for: initdb/pg_ctl from PATH."""
    if not (shutil.which("initdb") and shutil.which("pg_ctl")):
        raise SystemExit(
            "No PostgreSQL available: pgserver has no wheel for this Python and initdb/pg_ctl "
            "are not on PATH. Set DATABASE_URL to a PostgreSQL server, e.g. "
            "DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres"
        )
    if not (PGDATA / "PG_VERSION").exists():
        subprocess.run(
            ["initdb", "-D", str(PGDATA), "-U", "postgres", "--auth=trust", "-E", "utf8"],
            check=True,
            capture_output=True,
        )
    status = subprocess.run(["pg_ctl", "-D", str(PGDATA), "status"], capture_output=True)
    if status.returncode != 0:
        subprocess.run(
            [
                "pg_ctl",
                "-D",
                str(PGDATA),
                "-w",
                "-l",
                str(PGDATA / "log"),
                "-o",
                f"-h '' -k {PGDATA}",
                "start",
            ],
            check=True,
            capture_output=True,
        )
    return PGDATA


def stop_embedded() -> None:
    """Stop the embedded server if it runs."""
    if not (PGDATA / "postmaster.pid").exists():
        return
    pg_ctl = shutil.which("pg_ctl")
    user = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from pgserver._commands import POSTGRES_BIN_PATH
        pg_ctl = str(POSTGRES_BIN_PATH / "pg_ctl")
        user = "pgserver" if os.geteuid() == 0 else None
    except ImportError:
        pass
    command = [pg_ctl or "pg_ctl", "-D", str(PGDATA), "-w", "stop", "-m", "fast"]
    if user:
        command = ["su", user, "-s", "/bin/sh", "-c", " ".join(command)]
    subprocess.run(command, check=False)


def _create_database(socket_dir: Path) -> None:
    import psycopg

    with psycopg.connect(
        host=str(socket_dir), user="postgres", dbname="postgres", autocommit=True
    ) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
        ).fetchone()
        if not exists:
            connection.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
