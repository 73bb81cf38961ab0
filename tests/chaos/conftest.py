"""Fixtures of the fault-injection suite: its size, pools of runjobs processes, the checker, and
the report printed at the end of the run (and written to $CHAOS_REPORT as JSON when set)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.db.backends.postgresql.base import DatabaseWrapper

from tests.chaos.checker import Checker, Report
from tests.chaos.servers import Bouncer, Cluster
from tests.conftest import connection_kwargs, wait_until
from tests.crash.conftest import ROOT, WorkerProcess

REPORTS: list[Report] = []

#: The database alias of the `cluster` fixture's server in the test's process.
ALIAS = "chaos_cluster"


class Size:
    """CI size by default; the full size with `pytest --chaos-full` or CHAOS_FULL=1."""

    def __init__(self, full: bool) -> None:
        self.full = full

    def __call__(self, ci: Any, full: Any) -> Any:
        return full if self.full else ci


@pytest.fixture
def size(request: pytest.FixtureRequest) -> Size:
    full = bool(request.config.getoption("--chaos-full")) or os.environ.get("CHAOS_FULL") == "1"
    return Size(full)


def worker_args(concurrency: int, lease: float, *extra: str) -> list[str]:
    """runjobs options for the chaos workers: claims of at most `concurrency` jobs, a short lease
    so that faults are recovered from within seconds, a quick poll."""
    return [
        "--concurrency", str(concurrency), "--batch-size", str(concurrency), "--lease", str(lease),
        "--poll-interval", "0.5", "--grace", "5", *extra,
    ]  # fmt: skip


class Workers:
    """runjobs processes in numbered slots; a slot's process can be killed and replaced."""

    def __init__(self, folder: Path, args: Sequence[str], env: dict[str, str]) -> None:
        self.folder = folder
        self.args = list(args)
        self.env = {"PGJOBS_CHAOS": "1", **env}
        self.slots: list[WorkerProcess] = []
        self.history: list[WorkerProcess] = []

    def start(self, count: int = 1, *extra: str) -> list[WorkerProcess]:
        started = [self._spawn(extra) for _ in range(count)]
        self.slots.extend(started)
        return started

    def _spawn(self, extra: Sequence[str] = ()) -> WorkerProcess:
        log = self.folder / f"worker-{len(self.history)}.log"
        worker = WorkerProcess([*self.args, *extra], log, env=self.env)
        self.history.append(worker)
        return worker

    def kill_random(self) -> int:
        """SIGKILL one worker at random and start a new one in its slot; returns the dead pid."""
        slot = random.randrange(len(self.slots))
        victim = self.slots[slot]
        victim.kill()
        self.slots[slot] = self._spawn()
        return victim.pid

    def revive(self) -> list[int]:
        """Replace the workers that died by themselves; returns their pids."""
        dead = []
        for slot, worker in enumerate(self.slots):
            if not worker.alive():
                worker.kill()  # closes its log
                dead.append(worker.pid)
                self.slots[slot] = self._spawn()
        return dead

    def pids(self) -> set[int]:
        return {worker.pid for worker in self.history}

    def stop(self, timeout: float = 30) -> list[int]:
        """SIGTERM every live worker and wait: their exit codes."""
        # A worker that has not installed its signal handlers yet would just die of the signal.
        wait_until(lambda: all(w.started() or not w.alive() for w in self.slots), timeout=30)
        for worker in self.slots:
            if worker.alive():
                worker.signal(signal.SIGTERM)
        return [worker.wait(timeout) for worker in self.slots]

    def close(self) -> None:
        for worker in self.history:
            worker.kill()
        for worker in self.slots:
            sys.stderr.write(f"--- {worker.log_path.name} ---\n{worker.log()[-2000:]}\n")


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Workers]]:
    """workers(args, env=None) -> a Workers pool; every process is killed at teardown."""
    pools: list[Workers] = []

    def make(args: Sequence[str], env: dict[str, str] | None = None) -> Workers:
        pool = Workers(tmp_path, args, env or {})
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def open_test_database() -> psycopg.Connection[Any]:
    return psycopg.connect(**connection_kwargs(), autocommit=True)


@pytest.fixture
def checker(transactional_db: None) -> Iterator[Callable[..., Checker]]:
    """checker(scenario, connect=...) -> a Checker with its audit trigger installed (on the test
    database unless `connect` says otherwise); the trigger is removed at teardown."""
    made: list[Checker] = []

    def make(
        scenario: str, connect: Callable[[], psycopg.Connection[Any]] = open_test_database
    ) -> Checker:
        instance = Checker(connect, scenario)
        instance.install()
        made.append(instance)
        return instance

    yield make
    for instance in made:
        with contextlib.suppress(psycopg.Error):  # a throwaway cluster may be gone already
            instance.remove()


@pytest.fixture
def publish() -> Callable[[Report], None]:
    """Keep a scenario's report for the summary at the end of the run."""
    return REPORTS.append


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORTS:
        return
    terminalreporter.section("chaos suite")
    for report in sorted(REPORTS, key=lambda r: r.scenario):
        terminalreporter.write_line(report.line())
    path = os.environ.get("CHAOS_REPORT")
    if path:
        Path(path).write_text(json.dumps([r.as_dict() for r in REPORTS], indent=2) + "\n")


@pytest.fixture
def bouncer() -> Iterator[Bouncer]:
    """PgBouncer in transaction pooling mode in front of the test database's server."""
    server = connection.settings_dict
    instance = Bouncer(server["HOST"] or "127.0.0.1", int(server["PORT"] or 5432))
    instance.start()
    yield instance
    instance.stop()


@pytest.fixture
def cluster(transactional_db: None) -> Iterator[Cluster]:
    """A migrated throwaway cluster (on 127.0.0.1: TCP), also reachable from this process as the
    ALIAS database alias (for the driver's enqueues)."""
    instance = Cluster()
    try:
        instance.start()
        env = {**os.environ, "DATABASE_URL": instance.url(), "PGJOBS_TEST_DATABASE": ""}
        migrate = ["manage.py", "migrate", "--run-syncdb", "--settings", "tests.settings"]
        subprocess.run(
            [sys.executable, *migrate], cwd=ROOT, env=env, check=True, stdout=subprocess.PIPE
        )
        # A connection made here rather than declared in DATABASES (Django's test case allows
        # those): it lives as long as the cluster.
        settings = {
            **connections["default"].settings_dict,
            "NAME": "chaos", "USER": "postgres", "PASSWORD": "", "HOST": "127.0.0.1",
            "PORT": str(instance.port),
        }  # fmt: skip
        connections[ALIAS] = DatabaseWrapper(settings, alias=ALIAS)
        yield instance
    finally:
        if hasattr(connections._connections, ALIAS):
            connections[ALIAS].close()
            del connections[ALIAS]
        sys.stderr.write(f"--- postgres log ---\n{instance.log()[-3000:]}\n")
        instance.stop()
