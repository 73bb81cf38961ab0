"""runjobs without its database: cut off mid-run, started with none, pointed at an unmigrated one.

A worker reaches the database through a TCP proxy the test can cut (listening socket and every
connection closed at once), or at a loopback port nothing listens on.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pytest

from django_pgjobs.models import Job
from tests.chaos.servers import free_port
from tests.conftest import connection_kwargs, wait_until
from tests.crash.conftest import WorkerProcess, scratch_database
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

GRACE = 3.0
#: How long past its grace a stopping worker may take to exit (a reconnect's pause included).
SLACK = 5.0
#: How long `runjobs --once` may take to give up on a database it cannot use.
GIVE_UP = 10.0


class Proxy:
    """A TCP proxy on a free loopback port in front of the test database; cut() takes the
    database away: the listening socket and every connection through it are closed."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="proxy", daemon=True)
        self._thread.start()

    def _upstream(self) -> socket.socket:
        kwargs = connection_kwargs()
        host, port = kwargs.get("host") or "/var/run/postgresql", int(kwargs.get("port") or 5432)
        if host.startswith("/"):  # a socket folder, as the embedded development server uses
            server = socket.socket(socket.AF_UNIX)
            server.connect(f"{host}/.s.PGSQL.{port}")
            return server
        return socket.create_connection((host, port), timeout=5)

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = self._upstream()
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            server.settimeout(None)
            with self._lock:
                if self._cut.is_set():
                    client.close()
                    server.close()
                    return
                self._sockets |= {client, server}
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                target.sendall(data)
        for end in (source, target):
            _close(end)

    def url(self) -> str:
        """The test database's URL through this proxy."""
        kwargs = connection_kwargs()
        user = quote(kwargs.get("user") or "postgres")
        password = f":{quote(kwargs['password'])}" if kwargs.get("password") else ""
        return f"postgres://{user}{password}@127.0.0.1:{self.port}/{kwargs['dbname']}"

    def cut(self) -> None:
        self._cut.set()
        self._listener.close()
        self._thread.join(5)
        with self._lock:
            ends = list(self._sockets)
        for end in ends:
            _close(end)


def _close(end: socket.socket) -> None:
    with contextlib.suppress(OSError):
        end.shutdown(socket.SHUT_RDWR)
    end.close()


def unreachable_url() -> str:
    """A database URL at a loopback port nothing listens on: connections are refused."""
    return f"postgres://postgres@127.0.0.1:{free_port()}/{connection_kwargs()['dbname']}"


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    made = Proxy()
    yield made
    made.cut()


def exit_code(worker: WorkerProcess, timeout: float) -> int:
    """The worker's exit code; fails if it is still running after `timeout` seconds."""
    try:
        return worker.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"runjobs still running after {timeout:g}s") from None


def has_run(n: int) -> Callable[[], bool]:
    return lambda: Execution.objects.filter(n=n).exists()


def test_sigterm_stops_a_worker_whose_database_went_away_within_its_grace(
    proxy: Proxy, start_worker
):
    Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 60})
    worker = start_worker("--grace", str(GRACE), "--lease", "3", env={"DATABASE_URL": proxy.url()})
    wait_until(has_run(1), timeout=20)
    logged = len(worker.log())
    proxy.cut()
    wait_until(lambda: len(worker.log()) > logged, timeout=10)  # it noticed
    worker.signal(signal.SIGTERM)
    # It cannot release the job it holds (the job returns when its lease expires): not a clean
    # stop, so not exit code 0.
    assert exit_code(worker, GRACE + SLACK) not in (0, -signal.SIGTERM)
    # Its turns while stopping, with nothing to record or claim, ran no statement: they said
    # "the database is back" and then a first failure again, with its traceback, every second.
    log = worker.log()
    assert "the database is back" not in log
    firsts = [
        line for line in log.splitlines()
        if line.startswith("cannot reach the database") and "(attempt " not in line
    ]  # fmt: skip
    assert len(firsts) == 1, log  # the first failure's line, with its traceback


def test_sigterm_stops_a_worker_started_while_its_database_is_unreachable(start_worker):
    worker = start_worker("--grace", str(GRACE), env={"DATABASE_URL": unreachable_url()})
    wait_until(lambda: worker.started() or not worker.alive(), timeout=20)
    logged = len(worker.log())
    wait_until(lambda: len(worker.log()) > logged or not worker.alive(), timeout=10)
    worker.signal(signal.SIGTERM)
    # By its own signal handler, not killed by the signal; it held no jobs: a clean stop.
    assert exit_code(worker, GRACE + SLACK) == 0


def test_runjobs_once_against_an_unreachable_database_exits_non_zero_with_one_clear_line(
    start_worker,
):
    worker = start_worker("--once", env={"DATABASE_URL": unreachable_url()})
    assert exit_code(worker, GIVE_UP) > 0
    log = worker.log()
    lines = [line for line in log.splitlines() if line.strip()]
    assert "Traceback" not in log
    assert len(lines) <= 3, log
    assert any(word in lines[-1].lower() for word in ("database", "connect")), log


@pytest.fixture
def unmigrated_database(transactional_db: None) -> Iterator[str]:
    """An empty database beside the test database: no pgjobs tables."""
    with scratch_database("unmigrated") as name:
        yield name


def test_runjobs_once_against_an_unmigrated_database_exits_non_zero_saying_to_migrate(
    unmigrated_database: str, start_worker
):
    worker = start_worker("--once", env={"PGJOBS_TEST_DATABASE": unmigrated_database})
    assert exit_code(worker, GIVE_UP) > 0
    assert "migrate" in worker.log()
