"""The embedded development server: every process finds it running without pgserver's help."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import devdb
from tests.conftest import wait_until
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


def test_a_server_shutting_down_is_said_to_be(tmp_path, monkeypatch):
    lines = ["4242", str(tmp_path), "0", "5432", str(tmp_path), "", "0", "stopping"]
    (tmp_path / "postmaster.pid").write_text("\n".join(lines) + "\n")
    # Left so by a postmaster killed while it shut down: every run failed on it, for good
    assert devdb.running_socket_dir(tmp_path) is None
    monkeypatch.setattr(devdb, "_is_postgres", lambda pid, pgdata: pid == 4242)  # it runs
    with pytest.raises(devdb.DatabaseUnavailable, match=r"is shutting down\. Run again once"):
        devdb.running_socket_dir(tmp_path)


def test_stopdb_never_stops_another_clusters_server_that_took_a_stale_pid(
    tmp_path, monkeypatch, capsys
):
    # Only the program's name was looked at: "postgres", so pg_ctl stopped it.
    monkeypatch.setattr(devdb, "PGDATA", tmp_path)
    other = devdb.PostmasterPid.read(ROOT / ".pgdata").pid  # the tests' own server
    write_postmaster_pid(tmp_path, other)
    assert "postgres" in devdb._stale_postmaster(tmp_path)
    assert devdb.stop_embedded() == 0
    assert "removed its stale postmaster.pid" in capsys.readouterr().out
    os.kill(other, 0)  # alive
    assert devdb.running_socket_dir(ROOT / ".pgdata") is not None


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


def test_as_root_a_normal_users_data_is_refused_not_taken_over(tmp_path, monkeypatch):
    data = tmp_path / ".pgdata"
    data.mkdir()
    if os.geteuid() == 0:
        os.chown(data, 54321, 54321)
    else:  # the data is this user's: the run is root's only in what devdb is told
        monkeypatch.setattr(os, "geteuid", lambda: 0)
    owner = data.stat().st_uid
    monkeypatch.setattr(devdb, "PGDATA", data)
    with pytest.raises(
        devdb.DatabaseUnavailable, match=f"belongs to the user '{user_name(owner)}'"
    ):
        devdb.start_embedded()
    assert data.stat().st_uid == owner


def user_name(uid: int) -> str:
    """The name devdb gives the user `uid` (its number when it has none)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@pytest.fixture
def another_program() -> Iterator[int]:
    """The pid of a live process that is not PostgreSQL: what a dead server's pid becomes once
    the system gives it to another program (a container's restart)."""
    process = subprocess.Popen(["sleep", "60"])
    # Its command line is empty for a moment while it execs
    wait_until(lambda: Path(f"/proc/{process.pid}/cmdline").read_bytes(), timeout=5)
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def write_postmaster_pid(folder: Path, pid: object) -> None:
    lines = [str(pid), str(folder), "0", "5432", str(folder), "", "0", "ready"]
    (folder / "postmaster.pid").write_text("\n".join(lines) + "\n")


def test_a_postmaster_pid_is_stale_unless_a_postgresql_runs_as_its_pid(tmp_path, another_program):
    assert devdb._stale_postmaster(devdb.PGDATA) is None  # the tests' own server runs
    assert devdb._stale_postmaster(tmp_path) == devdb.NO_FILE
    write_postmaster_pid(tmp_path, another_program)
    assert "sleep" in devdb._stale_postmaster(tmp_path)
    for damaged in (b"", b"\x00" * 120, bytes(range(256))):
        (tmp_path / "postmaster.pid").write_bytes(damaged)
        # PostgreSQL creates it empty, then fills it: a moment old, it may be being written
        assert devdb._stale_postmaster(tmp_path) is None
        old = time.time() - devdb.WRITING_SECONDS - 1
        os.utime(tmp_path / "postmaster.pid", (old, old))
        assert devdb._stale_postmaster(tmp_path) == "the file is damaged"
        assert devdb.running_socket_dir(tmp_path) is None  # not a UnicodeDecodeError


def test_stopdb_never_signals_the_program_that_took_a_stale_pid(
    tmp_path, monkeypatch, another_program, capsys
):
    # pg_ctl stop sent SIGINT to whatever process had the pid now, killing it, and exited 0.
    monkeypatch.setattr(devdb, "PGDATA", tmp_path)
    write_postmaster_pid(tmp_path, another_program)
    assert devdb.stop_embedded() == 0
    assert "removed its stale postmaster.pid" in capsys.readouterr().out
    assert not (tmp_path / "postmaster.pid").exists()
    os.kill(another_program, 0)  # alive


@pytest.fixture
def second_cluster(monkeypatch) -> Iterator[Path]:
    """A .pgdata of its own beside the tests' (its parents are ready for pgserver's system user
    as root), stopped and removed afterwards."""
    data = ROOT / f".pgdata-test-{os.getpid()}"
    monkeypatch.setattr(devdb, "PGDATA", data)
    monkeypatch.setattr(devdb, "UNFINISHED", data.with_name(data.name + ".unfinished"))
    try:
        yield data
    finally:
        if data.exists():
            devdb.stop_embedded()
        shutil.rmtree(data, ignore_errors=True)
        devdb.UNFINISHED.unlink(missing_ok=True)


def test_a_first_start_stopped_during_initdb_is_made_again(second_cluster, capsys):
    # A start SIGKILLed during initdb left PG_VERSION and initdb's single-user backend's
    # postmaster.pid (7 lines, a negative pid): every later run failed on it, for good, with a
    # Python repr for its one line; deleting the file as told led to 'database "postgres" does
    # not exist'.
    second_cluster.mkdir()
    (second_cluster / "PG_VERSION").write_text("16\n")
    (second_cluster / "postmaster.pid").write_text(f"-424242\n{second_cluster}\n1\n5432\n\n\n0 0\n")
    devdb.UNFINISHED.touch()
    socket_dir = devdb.start_embedded()
    assert "was left half made" in capsys.readouterr().err
    assert not devdb.UNFINISHED.exists()
    devdb._connect(socket_dir, devdb._port()).close()


@pytest.fixture
def roots_folder(tmp_path: Path) -> Path:
    """A folder root owns, as a .pgdata/ made by a run as root: made here when the tests run as
    root; else the file system's root, which this user can neither write nor give away."""
    if os.geteuid() == 0:
        (tmp_path / ".pgdata").mkdir()
        return tmp_path / ".pgdata"
    if Path("/").stat().st_uid != 0:  # a user namespace that maps no user to root
        pytest.skip("no folder here belongs to root")
    return Path("/")


def test_a_normal_user_is_told_in_one_line_that_root_made_the_data(
    roots_folder, monkeypatch, capsys
):
    # A run as root had made .pgdata/ its system user's: the owner of the checkout got a
    # PermissionError's line from pgserver, and a traceback from stopdb.
    monkeypatch.setattr(devdb, "PGDATA", roots_folder)
    monkeypatch.setattr(os, "geteuid", lambda: 54321)
    with pytest.raises(devdb.DatabaseUnavailable, match=r"made by a run as root\. Run"):
        devdb.start_embedded()
    assert devdb.stop_embedded() == 1
    assert "made by a run as root" in capsys.readouterr().out


def test_a_copied_checkouts_postmaster_pid_is_not_this_ones_server(tmp_path):
    # A copy taken while the server ran (cp -a, a tarball) used the original's database, and
    # its stopdb stopped the original's server.
    write_postmaster_pid(tmp_path, os.getpid())
    lines = (tmp_path / "postmaster.pid").read_text().replace(str(tmp_path), str(devdb.PGDATA), 1)
    (tmp_path / "postmaster.pid").write_text(lines)
    assert devdb.running_socket_dir(tmp_path) is None
    assert "copied with this checkout" in devdb._stale_postmaster(tmp_path)


def test_the_server_is_reached_on_the_port_it_was_started_with_whatever_pgport_says(
    monkeypatch,
):
    # PGPORT=5433 in the caller's environment (a second PostgreSQL on the machine): the
    # embedded server "did not answer", with advice to stop it.
    monkeypatch.setenv("PGPORT", "5433")
    started = devdb.PostmasterPid.read(devdb.PGDATA)
    assert devdb.running_socket_dir() is not None
    assert devdb.database_config()["PORT"] == str(started.port)


def test_a_checkout_path_with_a_space_is_one_line(tmp_path, monkeypatch):
    # pgserver gives PostgreSQL the socket folder unquoted: 'Try "postgres --help"', for good.
    monkeypatch.setattr(devdb, "PGDATA", tmp_path / "My Projects" / ".pgdata")
    with pytest.raises(devdb.DatabaseUnavailable, match="the path has a space"):
        devdb._start()


def test_a_start_held_up_by_a_stopped_process_is_one_line_not_a_hang(monkeypatch):
    # A process stopped (Ctrl-Z) while it started the server held the lock: every later start
    # waited for ever, silently.
    import fcntl

    monkeypatch.setattr(devdb, "STARTING_SECONDS", 0.3)
    descriptor = os.open(ROOT / ".pgdata.lock", os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    try:
        with (
            pytest.raises(devdb.DatabaseUnavailable, match=r"resume it or end it"),
            devdb._starting(),
        ):
            pass
    finally:
        os.close(descriptor)


def test_nothing_is_removed_while_a_server_answers_on_the_data_whatever_its_pid_says(
    tmp_path, monkeypatch, capsys
):
    # A server of another pid namespace (a container sharing the checkout: its pid is no
    # process here), or of the same data reached by another path (a moved checkout): its
    # postmaster.pid was removed, and a second postmaster started on the same data.
    data = tmp_path / ".pgdata"
    data.mkdir()
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(data / ".s.PGSQL.5432"))
    listening.listen(8)
    try:
        write_postmaster_pid(data, 999_999)
        lines = (data / "postmaster.pid").read_text().replace(str(data), "/gone/.pgdata")
        (data / "postmaster.pid").write_text(lines)
        assert devdb._stale_postmaster(data) is None
        monkeypatch.setattr(devdb, "PGDATA", data)
        monkeypatch.setattr(devdb, "ROOT", tmp_path)
        assert devdb.stop_embedded() == 1  # pg_ctl would signal pid 999999 of this system
        assert "another pid namespace" in capsys.readouterr().out
        assert (data / "postmaster.pid").exists()
    finally:
        listening.close()
