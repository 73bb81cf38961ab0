"""The database for development, the demo and the tests: DATABASE_URL, or an embedded PostgreSQL."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import psycopg

ROOT = Path(__file__).resolve().parent
PGDATA = ROOT / ".pgdata"
DATABASE_NAME = os.environ.get("PGJOBS_DB_NAME", "pgjobs")


def database_config() -> dict[str, Any]:
    """Django's DATABASES["default"]: from DATABASE_URL when set, else an embedded server.

    The embedded server keeps running after this process exits (worker subprocesses and the
    next run reuse it); `python dev.py stopdb` stops it.
    """
    import environ

    env = environ.Env()
    if env.str("DATABASE_URL", default=""):
        config: dict[str, Any] = _from_url(env)
    else:
        config = _embedded_config()
    # Each Django leg of `dev.py test` (PGJOBS_LEG) has test databases of its own, so that the
    # legs can run at the same time on one server.
    if os.environ.get("PGJOBS_LEG", "5.2") != "5.2":
        leg = os.environ["PGJOBS_LEG"].replace(".", "_")
        config["TEST"] = {"NAME": f"test_{config['NAME']}_django{leg}"}
    # And a run beside them (CI's chaos tier) has its own too.
    if os.environ.get("PGJOBS_TEST_BESIDE"):
        config["TEST"] = {"NAME": f"test_{config['NAME']}_{os.environ['PGJOBS_TEST_BESIDE']}"}
    # Tests run worker subprocesses against the test database pytest-django created.
    if os.environ.get("PGJOBS_TEST_DATABASE"):
        config["NAME"] = os.environ["PGJOBS_TEST_DATABASE"]
    return config


def _from_url(env: Any) -> dict[str, Any]:
    """DATABASES["default"] from DATABASE_URL: a PostgreSQL database named in it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # environ warns of a URL it cannot read, then fails
        try:
            config: dict[str, Any] = env.db_url("DATABASE_URL")
        except Exception as error:
            raise DatabaseUnavailable(f"DATABASE_URL cannot be read ({_one_line(error)})") from None
    if config.get("ENGINE") != "django.db.backends.postgresql":
        engine = config.get("ENGINE", "").rsplit(".", 1)[-1]
        raise DatabaseUnavailable(
            "DATABASE_URL must be a PostgreSQL URL (postgres://USER@HOST:5432/NAME)"
            + (f", not {engine}'s" if engine else "")
        )
    if not config.get("NAME"):
        raise DatabaseUnavailable("DATABASE_URL names no database (postgres://USER@HOST:5432/NAME)")
    return config


def describe(config: dict[str, Any], *, must_exist: bool) -> str:
    """Where `config` points, in a few words; raises DatabaseUnavailable if the server cannot be
    reached, or the database does not exist and `must_exist` (the demo migrates it; the tests
    only need the server, on which they create test databases of their own)."""
    import psycopg

    where = (
        f"DATABASE_URL (database {config['NAME']!r} on {config['HOST'] or 'localhost'})"
        if os.environ.get("DATABASE_URL")
        else f"the embedded PostgreSQL in {PGDATA.name}/ (database {config['NAME']!r})"
    )
    kwargs = {
        "user": config.get("USER") or None,
        "password": config.get("PASSWORD") or None,
        "host": config.get("HOST") or None,
        "port": config.get("PORT") or None,
        "connect_timeout": 10,
        # The URL's own options (sslmode, say), as Django will connect
        **{k: v for k, v in config.get("OPTIONS", {}).items() if k != "pool"},
    }
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    missing = ""
    try:
        with psycopg.connect(dbname=config["NAME"], **kwargs) as connection:
            version = connection.info.server_version
    except psycopg.Error as error:
        # A database that does not exist yet fails the connection like a server that is down.
        if must_exist or f'database "{config["NAME"]}" does not exist' not in str(error):
            raise DatabaseUnavailable(f"cannot connect to {where} ({_one_line(error)})") from error
        try:
            with psycopg.connect(dbname="postgres", **kwargs) as connection:
                version = connection.info.server_version
        except psycopg.Error:
            raise DatabaseUnavailable(f"cannot connect to {where} ({_one_line(error)})") from error
        missing = f"; database {config['NAME']!r} does not exist (the tests do not need it)"
    return f"{where}, PostgreSQL {version // 10000}.{version % 10000}{missing}"


def _embedded_config() -> dict[str, Any]:
    import psycopg

    socket_dir = start_embedded()
    try:
        _create_database(socket_dir)
    except psycopg.Error as error:
        if _is_busy(error):
            raise _busy(error) from None
        if not isinstance(error, psycopg.OperationalError):  # e.g. a PGJOBS_DB_NAME it refuses
            raise DatabaseUnavailable(
                f"the embedded PostgreSQL refused to create the database {DATABASE_NAME!r} "
                f"({_one_line(error)})"
            ) from None
        # pgserver took a postmaster.pid whose process is alive for a running server: a
        # postmaster killed and not yet reaped, a pid since given to another process, or a
        # postmaster stopped (SIGSTOP: its socket takes the connection and nothing answers).
        pid = _postmaster_pid(PGDATA)
        raise DatabaseUnavailable(
            f"the embedded PostgreSQL in {PGDATA} does not answer ({_one_line(error)})",
            hint=(
                f"If its postmaster (pid {pid}) is stopped, `kill -CONT {pid}`; else stop it "
                f"with `python3 dev.py stopdb`, and if no PostgreSQL of {PGDATA.name}/ runs, "
                f"delete {PGDATA / 'postmaster.pid'} and run again. {USE_YOUR_OWN_SERVER}"
            ),
        ) from error
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DATABASE_NAME,
        "USER": "postgres",
        "HOST": str(socket_dir),
        "PORT": str(_port()),  # not the caller's PGPORT: the one it was started with
    }


def start_embedded() -> Path:
    """Start (or find running) the embedded PostgreSQL in .pgdata/ and return its socket folder.

    Every way this can fail ends the process with one line that says what to do
    (DatabaseUnavailable), never a traceback from inside pgserver.
    """
    running = running_socket_dir(PGDATA)
    if running is not None:
        UNFINISHED.unlink(missing_ok=True)  # it runs: its first start finished
        return running
    _check_owner()
    with _starting():
        running = running_socket_dir(PGDATA)  # started by another process meanwhile
        if running is not None:
            return running
        _clear_what_a_stopped_start_left()
        if not (PGDATA / "PG_VERSION").exists():
            with contextlib.suppress(OSError):  # one a run as root left: ours to remove
                UNFINISHED.unlink(missing_ok=True)
                UNFINISHED.touch()
        socket_dir = _start()
        UNFINISHED.unlink(missing_ok=True)
        return socket_dir


def _start() -> Path:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            # From its module: the package's __init__ does not re-export them (mypy --strict)
            from pgserver.postgres_server import PostgresServer, get_server
    except ImportError:
        return _start_with_binaries_on_path()
    # pgserver narrates every command at INFO and logs a failed one with its whole output at
    # ERROR: keep that output's last line for the one line DatabaseUnavailable prints.
    failures = _LastError()
    pgserver_log = logging.getLogger("pgserver")
    pgserver_log.setLevel(logging.ERROR)
    pgserver_log.propagate = False
    pgserver_log.handlers = [failures]
    if any(character.isspace() for character in str(PGDATA)):
        raise DatabaseUnavailable(
            f"the embedded PostgreSQL cannot start in {PGDATA}: pgserver gives PostgreSQL its "
            "folder unquoted, and the path has a space",
            hint=f"Clone the project to a path without spaces. {USE_YOUR_OWN_SERVER}",
        )
    if os.geteuid() == 0:
        _ensure_system_user()
    # pgserver waits for ever for a lock of its own, one per user and machine: held by a process
    # stopped while it started a server (Ctrl-Z), every later start of any checkout hung.
    lock = PostgresServer._lock
    if not lock.acquire(timeout=STARTING_SECONDS):
        raise _held_up(f"an embedded PostgreSQL (it holds pgserver's lock {lock.path!r})")
    lock.release()
    try:
        mend_pid_list(PGDATA / PID_LIST)
        server = get_server(PGDATA, cleanup_mode=None)
        return Path(server.get_postmaster_info().socket_dir)
    except Exception as error:  # whatever pgserver raises, the reader needs one line
        said = failures.last_line or _one_line(error)
        if isinstance(error, subprocess.TimeoutExpired):  # its log's last line is an old one
            said = f"it had not started within {error.timeout:g}s; it may still be starting"
        raise DatabaseUnavailable(
            f"the embedded PostgreSQL did not start in {PGDATA} ({said})",
            hint=f"See {PGDATA / 'log'} if it exists. {USE_YOUR_OWN_SERVER}",
        ) from error
    finally:
        # With cleanup_mode=None its exit hook only takes this pid off the list again: a read
        # and rewrite of that file that can fail, and that nothing of ours needs. Registered
        # before anything can fail, it is unregistered whatever happened.
        made = PostgresServer._instances.get(PGDATA.resolve())
        if made is not None:
            atexit.unregister(made._cleanup)


#: Beside .pgdata/ while its first start has not finished: a start stopped during initdb
#: (SIGKILL: a CI job cancelled, `docker kill`) left a half-made cluster that every later
#: start failed on. The next start makes it again.
UNFINISHED = ROOT / ".pgdata.unfinished"


def _held_up(what: str) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"another process has been starting {what} for over {STARTING_SECONDS}s",
        hint=f"If it is stopped (Ctrl-Z), resume it or end it. {USE_YOUR_OWN_SERVER}",
    )


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """Held while this process starts the embedded server: one process at a time, so that what
    a stopped start left (UNFINISHED, a stale postmaster.pid) is no other process's work. Waited
    for STARTING_SECONDS at most (its holder may be stopped: Ctrl-Z)."""
    import fcntl

    path = ROOT / ".pgdata.lock"
    descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + STARTING_SECONDS
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise _held_up(f"the embedded PostgreSQL (it holds {path})") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(descriptor)


def _clear_what_a_stopped_start_left() -> None:
    """A half-made .pgdata/ (UNFINISHED) is made again; a postmaster.pid whose process is not
    PostgreSQL (it died and its pid went to another program, as after a container's restart;
    or the file is damaged) is removed: PostgreSQL and pgserver refuse to start beside it."""
    stale = _stale_postmaster(PGDATA)
    deadline = time.monotonic() + WRITING_SECONDS + 1
    while stale is None and _damaged(PGDATA) and time.monotonic() < deadline:
        time.sleep(0.5)  # being written, or left damaged: it says which once old enough
        stale = _stale_postmaster(PGDATA)
    if UNFINISHED.exists() and stale is not None:
        print(f"devdb: {PGDATA} was left half made by a first start that was stopped; making it "
              "again", file=sys.stderr)  # fmt: skip
        shutil.rmtree(PGDATA, ignore_errors=True)
    elif stale not in (None, NO_FILE):
        (PGDATA / "postmaster.pid").unlink(missing_ok=True)
        for socket_lock in PGDATA.glob(".s.PGSQL.*.lock"):  # the same server's, in a copy
            socket_lock.unlink(missing_ok=True)
        print(f"devdb: removed {PGDATA / 'postmaster.pid'}: no PostgreSQL runs from it ({stale})",
              file=sys.stderr)  # fmt: skip


NO_FILE = "no postmaster.pid"


def _damaged(pgdata: Path) -> bool:
    """Whether pgdata's postmaster.pid exists and names no pid."""
    found = PostmasterPid.peek(pgdata)
    return found is not None and found.pid is None


#: A postmaster.pid younger than this may be one a server is writing (PostgreSQL creates it
#: empty, then fills it): never called damaged.
WRITING_SECONDS = 10


def _stale_postmaster(pgdata: Path) -> str | None:
    """Why pgdata's postmaster.pid is stale (NO_FILE when there is none), or None when a
    PostgreSQL may still run on pgdata: then nothing may be removed. Stale only when nothing
    answers on its socket nor attaches its shared memory (_alive), and it is a copied
    checkout's, damaged and not being written, or its pid is not a PostgreSQL (gone, or
    another program's now)."""
    try:
        found = PostmasterPid.read(pgdata)
        age = time.time() - (pgdata / "postmaster.pid").stat().st_mtime
    except FileNotFoundError:
        return NO_FILE
    except OSError:
        return None
    if found is None:
        return NO_FILE
    if _alive(pgdata, found):
        return None
    if found.pid is None:
        return "the file is damaged" if age > WRITING_SECONDS else None
    if found.copied(pgdata):
        return f"it is the server's of {found.data_dir}, copied with this checkout"
    if _is_postgres(found.pid, pgdata):
        return None
    program = _program(found.pid)
    return f"pid {found.pid} is {repr(program) if program else 'no process'}"


def _program(pid: int) -> str | None:
    """The program running as `pid` (its argv[0]), "" when none does (or a zombie), None when
    this system cannot tell."""
    arguments = _arguments(pid)
    return None if arguments is None else (arguments or [""])[0]


def _arguments(pid: int) -> list[str] | None:
    """The command line of `pid`, [] when no process runs as it (or a zombie), None when this
    system cannot tell."""
    for _ in range(2):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return [] if Path("/proc/self").is_dir() else None
        except OSError:
            return None
        if argv:
            break
        time.sleep(0.05)  # empty for a zombie, but also for a moment while a process execs
    return [part.decode(errors="replace") for part in argv.split(b"\0") if part]


#: How long a connection to the embedded server may take before it is said not to answer.
CONNECT_SECONDS = 5

#: pgserver's list of the processes using its server, a JSON file it rewrites in place.
PID_LIST = ".handle_pids.json"


class PostmasterPid(NamedTuple):
    """What a data folder's postmaster.pid says (PostgreSQL writes it; see its pidfile.h)."""

    pid: int | None  # None: the file is damaged
    data_dir: str  # line 2
    port: int  # line 4: the socket's name is .s.PGSQL.<port>
    socket_dir: str  # line 5
    shmid: int | None  # line 7: its shared memory segment (key, then id)
    status: str  # line 8: "starting", "ready", "stopping"

    @classmethod
    def read(cls, pgdata: Path) -> PostmasterPid | None:
        """None when there is none; OSError when it cannot be read."""
        try:
            data = (pgdata / "postmaster.pid").read_bytes()
        except FileNotFoundError:
            return None
        lines = [*data.decode(errors="replace").splitlines(), *[""] * 8]
        try:
            pid: int | None = abs(int(lines[0]))  # initdb's single-user backend: negative
        except ValueError:
            pid = None
        port = int(lines[3]) if lines[3].strip().isdigit() else 5432
        shm = lines[6].split()
        shmid = int(shm[1]) if len(shm) == 2 and shm[1].isdigit() else None
        return cls(pid, lines[1].strip(), port, lines[4].strip(), shmid, lines[7].strip())

    @classmethod
    def peek(cls, pgdata: Path) -> PostmasterPid | None:
        """read, with None also when it cannot be read (not ours to read)."""
        try:
            return cls.read(pgdata)
        except OSError:
            return None

    def copied(self, pgdata: Path) -> bool:
        """Whether it is another data folder's, copied with this checkout (cp -a, a tarball):
        that folder exists and is not `pgdata`. One that no longer exists (the checkout was
        moved) or that is `pgdata` under another path (a symlink, a container's mount) is
        `pgdata`'s own."""
        if not self.data_dir:
            return False
        try:
            return not os.path.samefile(self.data_dir, pgdata)
        except OSError:
            return False

    def socket_in(self, pgdata: Path) -> Path:
        """Its socket folder: the one it names, or `pgdata` when that is gone (a moved checkout,
        a container's view of it)."""
        named = Path(self.socket_dir) if self.socket_dir else pgdata
        return named if named.is_dir() else pgdata


def _alive(pgdata: Path, found: PostmasterPid) -> bool:
    """Whether a PostgreSQL may run on `pgdata` whatever its postmaster.pid's pid says (a pid of
    another pid namespace, a container's, is no process here): its socket takes connections (a
    stopped server's still does), or its shared memory is still attached (PostgreSQL's own
    interlock)."""
    import socket

    sockets = {found.socket_in(pgdata) / f".s.PGSQL.{found.port}"}
    sockets |= {path for path in pgdata.glob(".s.PGSQL.*") if path.suffix != ".lock"}
    for path in sockets:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(2)
            try:
                probe.connect(str(path))
                return True
            except OSError:
                continue
    return found.shmid is not None and _attached(found.shmid)


def _attached(shmid: int) -> bool:
    """Whether a process still attaches the shared memory segment `shmid`."""
    try:
        rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return False
    for row in rows:
        fields = row.split()
        if len(fields) > 6 and fields[1] == str(shmid):
            return fields[6] != "0"
    return False


#: How long a process waits for a server another one is starting (a crash recovery on a busy
#: machine takes a while) before it says so.
STARTING_SECONDS = 60


def running_socket_dir(pgdata: Path = PGDATA) -> Path | None:
    """The socket folder of the embedded server when it already runs and takes connections.

    Found from its postmaster.pid, without pgserver: every Django process of the tests, the demo
    and their workers asks, and pgserver would read and rewrite its list of processes in each
    (PID_LIST). A process killed while rewriting it (the crash tests SIGKILL workers as they
    start) leaves it empty, and pgserver then failed every later process on its JSON.
    """
    import psycopg

    deadline = time.monotonic() + STARTING_SECONDS
    while True:
        found = PostmasterPid.peek(pgdata)
        if found is None or found.copied(pgdata):
            return None  # none, or a copied checkout's: not this one's server
        if found.status == "stopping" and _is_postgres(found.pid, pgdata):
            raise DatabaseUnavailable(
                f"the embedded PostgreSQL in {pgdata} is shutting down",
                hint=(
                    "Run again once it has stopped (a smart shutdown waits for its clients to "
                    f"disconnect). {USE_YOUR_OWN_SERVER}"
                ),
            )
        starting = found.status == "starting" and _is_postgres(found.pid, pgdata)
        if not starting:
            break
        if time.monotonic() > deadline:
            raise DatabaseUnavailable(
                f"the embedded PostgreSQL in {pgdata} (pid {found.pid}) has been starting for "
                f"over {STARTING_SECONDS}s",
                hint=f"See {pgdata / 'log'}, and run again in a moment. {USE_YOUR_OWN_SERVER}",
            )
        time.sleep(0.2)
    if found.status != "ready":
        return None
    socket_dir = found.socket_in(pgdata)
    try:
        _connect(socket_dir, found.port).close()
    except psycopg.OperationalError as error:
        if _is_busy(error):
            raise _busy(error) from None
        return None  # not running after all: pgserver starts it, or says why it cannot
    return socket_dir


def _is_busy(error: Exception) -> bool:
    """Whether the server refused a connection because every one it allows is in use (53300;
    a refused connection carries no SQLSTATE in psycopg, only the server's message)."""
    return getattr(error, "sqlstate", None) == "53300" or "too many clients" in str(error)


def _busy(error: Exception) -> DatabaseUnavailable:
    return DatabaseUnavailable(
        f"the embedded PostgreSQL in {PGDATA} is busy ({_one_line(error)})",
        hint="End some of the processes using it (test runs, workers), or run again later",
    )


def _is_postgres(pid: int | None, pgdata: Path) -> bool:
    """Whether a PostgreSQL of `pgdata` runs as `pid`: True when this system cannot tell, or
    when the folder it names (-D) is gone (a moved checkout's server); False for another data
    folder's (its pid was reused by another cluster's postmaster)."""
    arguments = None if pid is None else _arguments(pid)
    if arguments is None:
        return pid is not None
    if not arguments or Path(arguments[0]).name != "postgres":
        return False
    folder = arguments[arguments.index("-D") + 1] if "-D" in arguments[:-1] else None
    try:
        return folder is None or os.path.samefile(folder, pgdata)
    except OSError:
        return True


def _postmaster_pid(pgdata: Path) -> str:
    """The postmaster's pid its postmaster.pid gives, or "unknown"."""
    found = PostmasterPid.peek(pgdata)
    return str(found.pid) if found is not None and found.pid is not None else "unknown"


def _port() -> int:
    """The port of the embedded server's socket (.s.PGSQL.<port>), as its postmaster.pid says:
    it took PGPORT from the environment of the process that started it, if any."""
    found = PostmasterPid.peek(PGDATA)
    return found.port if found is not None else 5432


def mend_pid_list(path: Path) -> None:
    """Empty pgserver's list of processes if it is not JSON, so that pgserver can start.

    The list only decides whether the last process to exit stops the server, which ours never
    asks for (cleanup_mode=None).
    """
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as error:
        if not isinstance(error, ValueError):
            return  # missing, or not ours to read: pgserver says what is wrong
        spare = path.with_name(f"{path.name}.{os.getpid()}")
        spare.write_text("[]")
        os.replace(spare, path)  # at once: pgserver in another process may be reading it


class _LastError(logging.Handler):
    """Keeps the last line a failed PostgreSQL command wrote (pgserver logs its stderr)."""

    last_line = ""

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().split("stderr:", 1)[-1]
        lines = [line.strip() for line in text.splitlines() if line.strip() not in ("", "---")]
        # The server's log ends with "database system is shut down" after the reason it gives
        fatal = [line for line in lines if "FATAL:" in line]
        if fatal or lines:
            self.last_line = (fatal or lines)[-1]


class DatabaseUnavailable(SystemExit):
    """No database for the demo or the tests: a one-line message that ends the process."""

    def __init__(self, problem: str, hint: str | None = None) -> None:
        if hint is None:
            hint = (
                "Check DATABASE_URL (a database that exists, e.g. createdb pgjobs), or unset it to "
                "use the embedded PostgreSQL"
                if os.environ.get("DATABASE_URL")
                else USE_YOUR_OWN_SERVER
            )
        super().__init__(f"No database: {problem}. {hint}.")


#: The way out of every failure to start the embedded server.
USE_YOUR_OWN_SERVER = (
    "Or use a PostgreSQL server of your own: createdb pgjobs, then set "
    "DATABASE_URL=postgres://USER@HOST:5432/pgjobs"
)

#: The system user pgserver runs PostgreSQL as when we are root (PostgreSQL refuses root).
SYSTEM_USER = "pgserver"


def _check_owner() -> None:
    """Refuse a .pgdata/ that another user made. As root, a normal user's: pgserver would make
    it its system user's, and its owner could no longer use it. As a normal user, one made by a
    run as root (its system user's): neither readable nor removable by this user."""
    import pwd

    try:
        owner = PGDATA.stat().st_uid
    except FileNotFoundError:
        return
    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = str(owner)
    if os.geteuid() == 0 and owner != 0 and name != SYSTEM_USER:
        raise DatabaseUnavailable(
            f"{PGDATA} belongs to the user {name!r}, and as root the embedded PostgreSQL would "
            f"take it over for the system user {SYSTEM_USER!r}",
            hint=f"Run this as {name!r}. {USE_YOUR_OWN_SERVER}",
        )
    if os.geteuid() not in (0, owner):
        raise DatabaseUnavailable(
            f"{PGDATA} belongs to the user {name!r}: it was made by a run as root",
            hint=(
                f"Run this as root, or have root delete it (`sudo rm -rf {PGDATA}`; it holds "
                f"only the demo's and the tests' databases). {USE_YOUR_OWN_SERVER}"
            ),
        )


def _ensure_system_user() -> None:
    """As root, create the unprivileged user pgserver runs PostgreSQL as, if it is missing.

    pgserver would run `useradd` itself, but only from PATH, and a root shell's PATH often
    lacks /usr/sbin (su without -l, containers): look there too.
    """
    import pwd

    try:
        pwd.getpwnam(SYSTEM_USER)
        return
    except KeyError:
        pass
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    useradd = shutil.which("useradd", path=path)
    if useradd is None:
        raise DatabaseUnavailable(
            f"as root, the embedded PostgreSQL runs as the system user {SYSTEM_USER!r}, which "
            f"does not exist, and there is no useradd to create it: create it "
            f"(e.g. adduser -D {SYSTEM_USER}) or run as a normal user"
        )
    created = subprocess.run(
        [useradd, "--system", "--user-group", "-s", "/bin/sh", SYSTEM_USER],
        capture_output=True,
        text=True,
    )
    if created.returncode != 0:
        raise DatabaseUnavailable(
            f"as root, the embedded PostgreSQL runs as the system user {SYSTEM_USER!r}, and "
            f"{useradd} could not create it ({_one_line(created.stderr)})"
        )


def _one_line(error: object) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _start_with_binaries_on_path() -> Path:
    """Fallback for Pythons pgserver has no wheel for: initdb/pg_ctl from PATH."""
    if not (shutil.which("initdb") and shutil.which("pg_ctl")):
        raise DatabaseUnavailable(
            "pgserver (the embedded PostgreSQL) has no wheel for this Python and initdb/pg_ctl "
            "are not on PATH"
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
                f"-h '' -k '{PGDATA}'",
                "start",
            ],
            check=True,
            capture_output=True,
        )
    return PGDATA


def stop_embedded() -> int:
    """Stop the embedded server if it runs (with pgserver's pg_ctl from either virtualenv, else
    pg_ctl on PATH; needs neither Django nor pgserver importable); pg_ctl's exit status."""
    try:
        _check_owner()
        with _starting():  # not while a process starts it: its postmaster.pid is half written
            return _stop()
    except DatabaseUnavailable as refused:
        print(str(refused.code).removeprefix("No database: "))
        return 1


def _stop() -> int:
    stale = _stale_postmaster(PGDATA)
    if stale is not None:
        # pg_ctl would signal whatever process has the pid now (a reused one: not ours)
        if stale != NO_FILE:
            (PGDATA / "postmaster.pid").unlink(missing_ok=True)
        said = f" (removed its stale postmaster.pid: {stale})" if stale != NO_FILE else ""
        print(f"the embedded PostgreSQL is not running{said}")
        return 0
    found = PostmasterPid.peek(PGDATA)
    if found is None or not _is_postgres(found.pid, PGDATA):
        # It answers, but its pid here is another process's: it runs in another pid
        # namespace (a container), and pg_ctl would signal the wrong process.
        print(f"the embedded PostgreSQL of {PGDATA} runs, but not as a process of this system "
              "(another pid namespace: a container?): stop it where it was started")  # fmt: skip
        return 1
    bundled = sorted(ROOT.glob(".venv*/lib/python3*/site-packages/pgserver/pginstall/bin/pg_ctl"))
    pg_ctl = str(bundled[0]) if bundled else shutil.which("pg_ctl") or "pg_ctl"
    # PostgreSQL refuses root: as root, pg_ctl runs as the data's owner (pgserver's system user
    # when a run as root made it).
    user = _owner_name() if os.geteuid() == 0 else None
    stopped = subprocess.run([pg_ctl, "-D", str(PGDATA), "-w", "stop", "-m", "fast"], user=user)
    return stopped.returncode


def _owner_name() -> str | None:
    """The name of .pgdata/'s owner when it is not root, else None."""
    import pwd

    owner = PGDATA.stat().st_uid
    return pwd.getpwuid(owner).pw_name if owner != 0 else None


def _connect(socket_dir: Path, port: int) -> psycopg.Connection[Any]:
    """An autocommit connection to the embedded server's maintenance database, bounded: a
    postmaster stopped (SIGSTOP) takes it into its socket's backlog and never answers, and
    every process of the tests and the demo would wait for ever."""
    import psycopg

    return psycopg.connect(
        host=str(socket_dir), port=port, user="postgres", dbname="postgres", autocommit=True,
        connect_timeout=CONNECT_SECONDS,
    )  # fmt: skip


def _create_database(socket_dir: Path) -> None:
    import psycopg

    with _connect(socket_dir, _port()) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE_NAME]
        ).fetchone()
        if not exists:
            # Two first runs at once (the CI's two Django legs) may both get here: the loser
            # sees DuplicateDatabase, or, when both insert into pg_database at the same moment,
            # the catalog's UniqueViolation (seen in CI).
            with contextlib.suppress(
                psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation
            ):
                connection.execute(f'CREATE DATABASE "{DATABASE_NAME}"')
