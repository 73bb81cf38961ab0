"""The embedded development server: every process finds it running without pgserver's help."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import devdb
from tests.crash.conftest import ROOT

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")), reason="the tests run on DATABASE_URL's server"
)


@pytest.fixture
def damaged_pid_list() -> Iterator[Path]:
    """pgserver's list of processes left empty, as by a process killed while rewriting it."""
    path = devdb.PGDATA / ".handle_pids.json"
    before = path.read_bytes() if path.exists() else None
    path.write_text("")
    try:
        yield path
    finally:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(before)


def test_a_process_finds_the_running_server_whatever_pgservers_list_holds(damaged_pid_list):
    # CI failed two legs' crash tests at once on this: every later Django process, the workers
    # and manage.py commands the tests start, died in pgserver on "Expecting value" (JSON).
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Expecting value" not in done.stderr, done.stderr
    assert damaged_pid_list.read_text() == ""  # not read, not rewritten


def test_the_running_server_is_found_from_its_postmaster_pid():
    assert devdb.running_socket_dir() == devdb.start_embedded()


def test_no_server_is_found_where_none_runs(tmp_path):
    assert devdb.running_socket_dir(tmp_path) is None
    # A stale file from a server that was killed: its socket answers nothing
    lines = ["4242", str(tmp_path), "0", "5432", str(tmp_path), "", "0", "ready"]
    (tmp_path / "postmaster.pid").write_text("\n".join(lines) + "\n")
    assert devdb.running_socket_dir(tmp_path) is None


@pytest.mark.parametrize("text", ["", "[12", "\x00\x00"])
def test_a_damaged_list_is_emptied_before_pgserver_reads_it(tmp_path, text):
    path = tmp_path / devdb.PID_LIST
    path.write_text(text)
    devdb.mend_pid_list(path)
    assert path.read_text() == "[]"
    assert sorted(p.name for p in tmp_path.iterdir()) == [devdb.PID_LIST]


def test_a_sound_list_or_none_is_left_alone(tmp_path):
    path = tmp_path / devdb.PID_LIST
    devdb.mend_pid_list(path)
    assert not path.exists()
    path.write_text("[1, 2]")
    devdb.mend_pid_list(path)
    assert path.read_text() == "[1, 2]"


def test_a_server_shutting_down_is_said_to_be(tmp_path):
    lines = ["4242", str(tmp_path), "0", "5432", str(tmp_path), "", "0", "stopping"]
    (tmp_path / "postmaster.pid").write_text("\n".join(lines) + "\n")
    with pytest.raises(devdb.DatabaseUnavailable, match=r"is shutting down\. Run again once"):
        devdb.running_socket_dir(tmp_path)


def test_a_server_that_does_not_answer_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    # pgserver trusts a postmaster.pid whose pid is alive (a zombie postmaster, a reused pid)
    # and hands back its socket folder, where nothing answers: a psycopg traceback.
    monkeypatch.setattr(devdb, "start_embedded", lambda: tmp_path)
    with pytest.raises(devdb.DatabaseUnavailable) as raised:
        devdb.database_config()
    said = str(raised.value)
    assert "does not answer" in said and "dev.py stopdb" in said and "postmaster.pid" in said


def test_a_server_that_takes_connections_and_never_answers_is_said_within_a_bound(
    tmp_path, monkeypatch
):
    # A postmaster stopped (SIGSTOP) still has its socket: the kernel takes the connection into
    # its backlog and nothing answers. Every process of the tests waited for ever.
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(tmp_path / ".s.PGSQL.5432"))
    listening.listen(8)
    (tmp_path / "postmaster.pid").write_text("4242\n")
    monkeypatch.setattr(devdb, "PGDATA", tmp_path)
    monkeypatch.setattr(devdb, "start_embedded", lambda: tmp_path)
    raised: list[BaseException] = []

    def configure() -> None:
        try:
            devdb.database_config()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=configure, daemon=True)
    thread.start()
    thread.join(timeout=devdb.CONNECT_SECONDS + 20)
    listening.close()
    assert not thread.is_alive(), "database_config() still waits on a server that never answers"
    assert isinstance(raised[0], devdb.DatabaseUnavailable), raised
    said = str(raised[0])
    assert "does not answer" in said and "kill -CONT 4242" in said, said


def test_a_list_that_cannot_be_read_is_left_to_pgserver(tmp_path):
    path = tmp_path / devdb.PID_LIST
    path.mkdir()  # not a file: an OSError, as a list of another user's is
    devdb.mend_pid_list(path)
    assert path.is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="as root only")
def test_as_root_a_normal_users_data_is_refused_not_taken_over(tmp_path, monkeypatch):
    data = tmp_path / ".pgdata"
    data.mkdir()
    os.chown(data, 54321, 54321)
    monkeypatch.setattr(devdb, "PGDATA", data)
    with pytest.raises(devdb.DatabaseUnavailable, match="belongs to the user '54321'"):
        devdb.start_embedded()
    assert data.stat().st_uid == 54321
