"""Real `runjobs` processes against the test database, stopped with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from tests.conftest import connection_kwargs

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(
        self, args: list[str], log: Path, env: dict[str, str] | None = None,
        command: str = "runjobs",
    ) -> None:  # fmt: skip
        self.log_path = log
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PGJOBS_TEST_DATABASE": connection.settings_dict["NAME"],
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "manage.py", command, *args],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text()

    def started(self) -> bool:
        """The worker logged its start (its signal handlers are in place by then)."""
        return " started: " in self.log()

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        self._log.close()


@pytest.fixture
def start_worker(transactional_db: None, tmp_path: Path) -> Iterator:
    """start_worker("--concurrency", "4", ..., env={...}) -> WorkerProcess; all are killed at
    teardown."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(list(args), tmp_path / f"worker-{len(started)}.log", env=env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
        sys.stderr.write(f"--- {worker.log_path.name} ---\n{worker.log()[-3000:]}\n")


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `manage.py *args` with the test settings (and `env` over the environment) to its end."""
    environ = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=environ, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


@contextmanager
def scratch_database(suffix: str) -> Iterator[str]:
    """A new, empty database of its own, named after the test database, dropped afterwards."""
    name = f"{connection.settings_dict['NAME'].removeprefix('test_')}_{suffix}"
    admin = {**connection_kwargs(), "dbname": "postgres"}
    with psycopg.connect(**admin, autocommit=True) as server:
        server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        server.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with psycopg.connect(**admin, autocommit=True) as server:
            server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
