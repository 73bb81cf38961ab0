"""Servers the chaos suite starts and breaks itself: a throwaway PostgreSQL cluster and PgBouncer.

Both run as the `postgres` system user when the tests run as root (PostgreSQL and PgBouncer
refuse to run as root), on a free port of 127.0.0.1, with their files in a fresh temporary folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import wait_until


def _owner(user: str = "postgres") -> dict[str, Any]:
    """subprocess arguments that run a server as `user` when we are root."""
    if os.geteuid() != 0:
        return {}
    return {"user": user, "group": user, "env": {**os.environ, "HOME": "/tmp"}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def require(path: str | None, what: str) -> str:
    """The binary's path; without it, skip locally but fail in CI (CI=true), where it must exist."""
    if path and Path(path).exists():
        return path
    message = f"{what} is not installed; this chaos scenario needs it"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def postgres_bin() -> Path | None:
    """The newest Debian PostgreSQL bin folder, else the one holding pg_ctl on PATH."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3])
    )
    if candidates:
        return candidates[-1].parent
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def _scratch(prefix: str, user: str = "postgres") -> Path:
    # Not pytest's tmp_path: its parent folder is private to root, out of the server user's reach.
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        shutil.chown(folder, user, user)
    return folder


class Cluster:
    """A PostgreSQL cluster of our own, to restart at will."""

    def __init__(self) -> None:
        bin_dir = postgres_bin()
        self.pg_ctl = require(str(bin_dir / "pg_ctl") if bin_dir else None, "PostgreSQL (pg_ctl)")
        self.initdb = require(str(bin_dir / "initdb") if bin_dir else None, "initdb")
        self.root = _scratch("pgjobs-chaos-pg-")
        self.data = self.root / "data"
        self.port = free_port()

    def start(self) -> None:
        self._run(
            self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
            "--no-sync", "--no-instructions",
        )  # fmt: skip
        self._start()
        with self.connect("postgres") as connection:
            connection.execute("CREATE DATABASE chaos")

    def _start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            "-c max_connections=100 -c shared_buffers=32MB -c max_prepared_transactions=5"
        )
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                  "-w", "-t", "60", "start")  # fmt: skip

    def restart(self, mode: str) -> None:
        """Stop in `mode` (fast: disconnect everyone and shut down cleanly; immediate: crash,
        with WAL recovery at the next start), then start again."""
        self._run(self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        self._start()

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(self.pg_ctl, "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def url(self, dbname: str = "chaos") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str = "chaos") -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True,
            connect_timeout=5,
        )  # fmt: skip

    def log(self) -> str:
        path = self.root / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _run(self, *command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=False, **_owner())
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")


class Bouncer:
    """PgBouncer in transaction pooling mode in front of a PostgreSQL server.

    A server reached through a socket folder (the embedded development server) is reached as
    the folder's owner, who alone may enter it.
    """

    def __init__(self, server_host: str, server_port: int) -> None:
        self.binary = require(shutil.which("pgbouncer") or "/usr/sbin/pgbouncer", "pgbouncer")
        self.user = "postgres"
        if server_host.startswith("/") and Path(server_host).owner() != "root":
            self.user = Path(server_host).owner()
        self.root = _scratch("pgjobs-chaos-bouncer-", self.user)
        self.port = free_port()
        (self.root / "users.txt").write_text('"postgres" ""\n')
        (self.root / "pgbouncer.ini").write_text(
            f"""[databases]
* = host={server_host} port={server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.root}/users.txt
pool_mode = transaction
default_pool_size = 20
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
logfile = {self.root}/pgbouncer.log
"""
        )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, str(self.root / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **_owner(self.user),
        )  # fmt: skip
        wait_until(self._accepts, timeout=20, interval=0.1)

    def _accepts(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        path = self.root / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""
