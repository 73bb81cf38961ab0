"""A throwaway PostgreSQL cluster for one benchmark run: durable settings, pg_stat_statements."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

DEBIAN_BIN = Path("/usr/lib/postgresql/15/bin")

#: Durable on purpose: the figures must hold for a production configuration.
SETTINGS = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_buffers": "512MB",
    "max_connections": "100",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.track_utility": "on",
    "track_io_timing": "on",
    "autovacuum_naptime": "10s",
    "listen_addresses": "127.0.0.1",
}


def _bin_dir() -> Path:
    if (DEBIAN_BIN / "pg_ctl").exists():
        return DEBIAN_BIN
    import pgserver  # type: ignore[import-not-found]

    return Path(pgserver.__file__).parent / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """initdb + pg_ctl start in a temp dir; ``stop()`` removes it all."""

    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.root = Path(tempfile.mkdtemp(prefix="pgjobs-bench-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.dbname = "bench"

    def _run(self, args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        return subprocess.run(
            [*prefix, *args], check=True, text=True, capture_output=True, **kwargs
        )

    def start(self) -> None:
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                   "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8"])  # fmt: skip
        options = " ".join(f"-c {key}={value}" for key, value in SETTINGS.items())
        options += f" -c port={self.port} -c unix_socket_directories={self.root}"
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l",
                   str(self.root / "server.log"), "-w", "-o", options, "start"])  # fmt: skip
        with self.connect("postgres") as conn:
            conn.execute(f"CREATE DATABASE {self.dbname}")
        with self.connect() as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
            conn.execute("CREATE ROLE bench_monitor SUPERUSER LOGIN")

    def stop(self) -> None:
        try:
            self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "stop"])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{self.dbname}"

    def connect(self, dbname: str | None = None, user: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=user, dbname=dbname or self.dbname,
            autocommit=True,
        )  # fmt: skip

    def pgbench(self, args: Sequence[str]) -> str:
        env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(self.port),
               "PGUSER": "postgres"}  # fmt: skip
        result = self._run([str(self.bin / "pgbench"), *args, self.dbname], env=env)
        return result.stdout

    def server_cpu(self) -> float:
        """CPU seconds used by the whole cluster so far (postmaster, backends, exited children)."""
        import psutil

        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        master = psutil.Process(pid)
        times = master.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in master.children():
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def version(self) -> str:
        with self.connect() as conn:
            row = conn.execute("SELECT version()").fetchone()
        return str(row[0]) if row else "?"

    def settings(self, names: Sequence[str]) -> dict[str, str]:
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
                [list(names)],
            ).fetchall()
        return dict(rows)


@contextmanager
def migrated(prefix: str = "") -> Iterator[tuple[Cluster, Path]]:
    """A started cluster with Django set up on it (bench.settings) and the schema migrated, and
    a fresh folder for the run's logs under .bench/; the cluster is removed at the end."""
    cluster = Cluster()
    cluster.start()
    try:
        os.environ["DATABASE_URL"] = cluster.url
        os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        logs = (
            Path(__file__).resolve().parent.parent
            / ".bench"
            / time.strftime(f"{prefix}%Y%m%d-%H%M%S")
        )
        logs.mkdir(parents=True, exist_ok=True)
        yield cluster, logs
    finally:
        cluster.stop()


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
