"""The worker's own database sessions, and what a worker warns of at start: queues that nothing
uses or no worker serves, a connection pool smaller than its handler threads."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from django.conf import settings as django_settings
from django.db import DatabaseError, connections
from django.db.backends.signals import connection_created

from django_pgjobs import periodic, registry
from django_pgjobs.conf import get_settings
from django_pgjobs.data import rows
from django_pgjobs.observability import stats
from django_pgjobs.runtime.reporting import log_safely

logger = logging.getLogger("django_pgjobs.runtime.worker")

#: The longest one of the worker's statements waits for a lock; past it the statement fails and
#: the worker tries again later, instead of stalling behind, say, an operator's open transaction.
LOCK_TIMEOUT = "5s"

#: The longest one of the worker's own transactions may sit idle: they never wait on Python
#: between their statements for more than moments, unless the process is stopped (SIGSTOP, a
#: frozen VM) or cut off from the database, and then the server ends the session and releases
#: its locks (a queue's row that every other worker's claim would otherwise skip) instead of
#: holding them until TCP gives up on the connection, hours later on a partition.
IDLE_IN_TRANSACTION = "10s"

#: The worker's own sessions (its main loop's, lease keeper's and listener's) are idle between
#: their statements by design: the listener always, the lease keeper for a third of a lease. An
#: idle_session_timeout the database or role sets (managed services do, PostgreSQL 14+) would
#: end them over and over, the listener's with a warning that reads like a crash, and each
#: reconnection of the listener is a gap in wake-ups. They opt out (0: none).
IDLE_SESSION = "0"

#: After this many executions psycopg prepares a statement on a worker's main loop connection
#: (its own default), and PostgreSQL plans it once for any parameters (plan_cache_mode
#: force_generic_plan): the turn's statement is no longer parsed, analysed and planned every
#: turn (docs/performance.md has the figures). Plans are made again when a backlog arrives,
#: and every 30 s (data/rows.py, replan). Every statement
#: that connection runs with parameters is one of data/sql.py's, written so that such a plan
#: reads the job table by its indexes (a test checks each). JIT is off there too: a plan made
#: without the parameters may cost enough to start it, and it is never worth it for
#: statements this short. Django leaves preparing off because a transaction-mode pooler
#: cannot keep prepared statements: see LockWaits for where these are not set.
PREPARE_THRESHOLD = 5

#: The most prepared statements psycopg keeps on such a connection: each is prepared again
#: in every generation of plans (data/rows.py, replan), and those of earlier ones are let go.
PREPARED_MAX = 16


#: libpq's TCP settings for a worker process's connections, those the project's DATABASES
#: OPTIONS leave out: a database that vanishes from the network without closing its
#: connections (a failover to another host, a partition, a machine lost) is noticed within
#: about 20 s, not after the kernel's two hours, during which the main loop and the lease keeper
#: would wait on their statements while every lease ran out.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,  # milliseconds: data sent and not acknowledged
}


def user_timeout(db: str) -> str:
    """The server's TCP_USER_TIMEOUT for the worker's own sessions (milliseconds): the client's
    (KEEPALIVES, or the project's OPTIONS). A process that stops reading (SIGSTOP, a paused
    container or VM) while the server sends it more than the sockets' buffers hold (a claim's
    big payloads, the listener's wake-ups) leaves its backend waiting inside the statement,
    where neither statement_timeout nor idle_in_transaction_session_timeout reaches: a claim's
    rows locked, every other worker's claim skipping them, or PostgreSQL's notification queue
    held back (once full, every enqueue that notifies fails). The server then ends the session
    (TCP only: a Unix socket has no such timeout)."""
    options = connections[db].settings_dict.get("OPTIONS", {})
    return str(int(options.get("tcp_user_timeout", KEEPALIVES["tcp_user_timeout"])))


def pooled(db: str) -> bool:
    """Whether `db` is reached through a transaction-mode pooler (DISABLE_SERVER_SIDE_CURSORS,
    what Django needs there): a session setting would leak to the pooler's other clients."""
    return bool(connections[db].settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"))


def unpooled(db: str) -> None:
    """Give this thread's connections to `db` a connection of their own, outside Django's
    connection pool (DATABASES OPTIONS "pool"). The worker's own threads hold theirs for as
    long as they run: taken from the pool, three of its four connections (its default size)
    went to them, and the handlers waited for the last one (up to the pool's 30 s timeout,
    the lease keeper among them, while every lease ran out); and a connection of theirs handed
    back to the pool after an error took their session settings (synchronous_commit off, a
    lock_timeout, an idle-in-transaction timeout, the worker's application_name) to whichever
    handler got it next."""
    connection = connections[db]
    options = connection.settings_dict.get("OPTIONS", {})
    if not options.get("pool"):
        return
    if connection.connection is not None:
        connection.close()  # not used yet by the worker: back to the pool as it came
    own = {key: value for key, value in options.items() if key != "pool"}
    connection.settings_dict = {**connection.settings_dict, "OPTIONS": own}


def warn_of_a_small_pool(db: str, concurrency: int, who: str) -> None:
    """Say so when Django's connection pool of `db` holds fewer connections than the worker
    `who` has handler threads: each holds one while its job runs, and the others wait for it
    (psycopg_pool's timeout, 30 s by default), then fail their attempts."""
    pool = connections.settings[db].get("OPTIONS", {}).get("pool")
    if not pool:
        return
    sizes = pool if isinstance(pool, dict) else {}
    size = sizes.get("max_size") or sizes.get("min_size", 4)  # psycopg_pool's defaults
    if isinstance(size, int) and size < concurrency:
        log_safely(
            logger.warning,
            "%s: the connection pool of database %r (DATABASES OPTIONS 'pool') holds at most %d "
            "connections, fewer than its %d handler threads: jobs will wait for a connection, "
            "and fail when none comes in time. Give the pool a max_size of at least %d (the "
            "worker's own connections are outside it), or run it with --concurrency %d",
            who, db, size, concurrency, concurrency, size,
        )  # fmt: skip


def keep_alive(db: str) -> bool:
    """Give this process's connections to `db` the KEEPALIVES settings their OPTIONS leave out
    (from their next connect); True when any was added."""
    options = connections[db].settings_dict.setdefault("OPTIONS", {})
    added = {key: value for key, value in KEEPALIVES.items() if key not in options}
    options.update(added)
    return bool(added)


def application_name(worker: str) -> str:
    """What the worker's own connections are called (jobstats counts them as the queue's)."""
    return f"pgjobs worker {worker}"


@contextlib.contextmanager
def named_connections(db: str, worker: str) -> Iterator[None]:
    """Name the connections this process makes to `db` meanwhile after `worker`, its handlers'
    included, unless the project's OPTIONS name them: jobstats and yielding tell the queue's
    sessions from the application's by their name. A startup parameter, so behind a pooler
    too."""
    options = connections.settings[db].setdefault("OPTIONS", {})
    if "application_name" in options:
        yield
        return
    options["application_name"] = application_name(worker)
    try:
        yield
    finally:
        options.pop("application_name", None)


class LockWaits:
    """Gives the worker's own threads' connections to `db` a lock_timeout, the worker's
    application_name (unless the database's OPTIONS set one) and its synchronous_commit, on
    every (re)connect; the main loop's (`plans=True`) also prepared statements planned once
    (data/rows.py, plan_once). Those only where the OPTIONS set neither a prepare_threshold
    (`None` included: the project's choice) nor server_side_binding (the ORM's statements
    would be planned once too, unvetted); the lease keeper's statements run every few seconds,
    where preparing saves nothing.

    Not behind a transaction-mode pooler (DISABLE_SERVER_SIDE_CURSORS): a session setting would
    leak to other clients of the pooled server connection. There, set it for the worker's role
    (``ALTER ROLE worker SET lock_timeout = '5s'``; see docs/howto/pgbouncer.md), and name the
    worker's connections in its OPTIONS.

    In all, the worker's own connections (its main thread's and lease keeper's, a NATS worker's
    main thread's and the relay's; handlers' connections are left alone) get: a lock_timeout,
    so that no statement of the worker's own waits long on a lock held elsewhere; an
    idle_in_transaction_session_timeout and the server's tcp_user_timeout (user_timeout), so
    that no lock of its own outlives a stopped process for long; no idle_session_timeout
    (IDLE_SESSION: they are idle between turns by design); an application_name that says whose
    they are in pg_stat_activity; synchronous_commit off unless
    PGJOBS["WORKER_SYNCHRONOUS_COMMIT"] (or the session must be durable: a NATS worker's); and
    prepared statements for what they run again and again. Every connection a worker process
    makes gets the TCP keepalives (KEEPALIVES).
    """

    def __init__(self, db: str, name: str = "pgjobs worker", durable: bool | None = None) -> None:
        self.db = db
        # None: PGJOBS["WORKER_SYNCHRONOUS_COMMIT"]. True where a commit must outlive a crash of
        # the server before the worker acts on it elsewhere (a NATS worker acknowledges the
        # message of a job it just wrote back to PostgreSQL).
        self.durable = durable
        # An application_name the project gave the database (DATABASES OPTIONS) is kept: it is
        # theirs to choose (and what their monitoring may already read).
        options = connections[db].settings_dict.get("OPTIONS", {})
        self.name = options.get("application_name") or name
        self.prepare = "prepare_threshold" not in options and not options.get("server_side_binding")
        self._threads: dict[int, bool] = {}  # thread → whether it plans once
        self.enabled = not pooled(db)

    def limit_this_thread(self, plans: bool = False) -> None:
        # TCP keepalives for every connection of the process (not a session setting: behind a
        # pooler too); one opened before them (the system checks') is made again with them.
        if keep_alive(self.db) and not connections[self.db].in_atomic_block:
            connections[self.db].close()
        unpooled(self.db)
        if not self.enabled:
            return
        if not self._threads:
            connection_created.connect(self._on_connect, weak=False)
        self._threads[threading.get_ident()] = plans
        connection = connections[self.db]
        if connection.connection is not None:
            try:
                self._set(connection, plans)
            except DatabaseError:
                connection.close()  # gone already: set again when the worker reconnects

    def stop(self) -> None:
        connection_created.disconnect(self._on_connect)
        self._threads.clear()

    def _on_connect(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        plans = self._threads.get(threading.get_ident())
        if connection.alias == self.db and plans is not None:
            self._set(connection, plans)

    def _set(self, connection: Any, plans: bool) -> None:
        # Each of the worker's statements commits on its own, whatever the DATABASES entry
        # (shared by every thread's connections, and a handler may have changed it) says.
        if not connection.in_atomic_block and not connection.get_autocommit():
            connection.set_autocommit(True)
        # And its few transactions of more than one statement (a limited queue's claim) are
        # READ COMMITTED, each statement seeing what committed before it: under a stricter
        # isolation_level of the OPTIONS (the handlers'), another worker's claim committed
        # after their snapshot made them fail as serialization failures, each an outage.
        if not connection.in_atomic_block:
            connection.connection.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        durable = self.durable or get_settings().WORKER_SYNCHRONOUS_COMMIT
        prepare = plans and self.prepare and rows.plans_once()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('lock_timeout', %(lock_timeout)s, false), "
                "set_config('idle_in_transaction_session_timeout', %(idle)s, false), "
                "set_config('tcp_user_timeout', %(user_timeout)s, false), "
                "set_config('idle_session_timeout', %(idle_session)s, false), "
                "set_config('application_name', %(name)s, false), "
                "set_config('synchronous_commit', %(synchronous_commit)s, false), "
                "set_config('plan_cache_mode', CASE WHEN %(prepare)s THEN 'force_generic_plan' "
                "ELSE (SELECT reset_val FROM pg_settings WHERE name = 'plan_cache_mode') END, "
                "false), "
                "set_config('jit', CASE WHEN %(prepare)s THEN 'off' "
                "ELSE (SELECT reset_val FROM pg_settings WHERE name = 'jit') END, false)",
                {
                    "lock_timeout": LOCK_TIMEOUT,
                    "idle": IDLE_IN_TRANSACTION,
                    "user_timeout": user_timeout(self.db),
                    "idle_session": IDLE_SESSION,
                    "name": self.name,
                    "synchronous_commit": "on" if durable else "off",
                    "prepare": prepare,
                },
            )
        if prepare:
            connection.connection.prepare_threshold = PREPARE_THRESHOLD
            connection.connection.prepared_max = PREPARED_MAX
            rows.plan_once(connection.connection)


# ---- the queues a worker serves -----------------------------------------------------------------

#: Django's Tasks framework's default queue (DEFAULT_TASK_QUEUE_NAME), for a backend whose
#: QUEUES setting allows any queue.
DJANGO_TASKS_QUEUE = "default"
BACKEND = "django_pgjobs.backend.PgJobsBackend"


def used_queues() -> dict[str, list[str]]:
    """The queues this process's code enqueues into, each with who uses it: registered tasks,
    periodic schedules, and the QUEUES of Django Tasks backends that are django-pgjobs'."""
    default = get_settings().DEFAULT_QUEUE
    used: dict[str, list[str]] = {}
    for task in registry.all_tasks().values():
        used.setdefault(task.queue or default, []).append(task.name)
    tasks = registry.all_tasks()
    for schedule in periodic.declared()[0]:
        of_task = tasks[schedule.task].queue if schedule.task in tasks else None
        queue = schedule.queue or of_task or default
        used.setdefault(queue, []).append(f"periodic schedule {schedule.name}")
    tasks_settings = getattr(django_settings, "TASKS", {}) or {}
    for alias, backend in tasks_settings.items():
        if isinstance(backend, dict) and backend.get("BACKEND") == BACKEND:
            for queue in backend.get("QUEUES") or [DJANGO_TASKS_QUEUE]:
                used.setdefault(queue, []).append(f"Django Tasks of TASKS[{alias!r}]")
    return used


def warn(db: str, queues: Sequence[str], who: str) -> None:
    """Log a warning for each queue served that nothing uses, and one for the tasks' queues
    that neither `who` (a worker, or a supervisor's workers) nor another running worker
    serves."""
    used = used_queues()
    for queue in queues:
        if queue not in used:
            log_safely(
                logger.warning,
                "the queue %r, served by %s, is used by no registered task, periodic schedule or "
                "Django Tasks backend (%s): a typo in --queue? Jobs reach it only when "
                "enqueued with queue=%r.",
                queue, who, _what_they_use(used), queue,
            )  # fmt: skip
    unserved = sorted(set(used) - set(queues))
    if not unserved:
        return
    try:
        others = stats.served_queues(stats.worker_stats(db))
    except DatabaseError:
        return  # the worker's loop says what is wrong with the database
    for queue in unserved:
        if queue not in others:
            log_safely(
                logger.warning,
                "no running worker serves the queue %r, which %s %s: its jobs wait until a "
                "worker does (runjobs --queue %s; served by %s: %s).",
                queue, _listed(used[queue]), "uses" if len(used[queue]) == 1 else "use", queue,
                who, _listed(queues),
            )  # fmt: skip


def _what_they_use(used: dict[str, list[str]]) -> str:
    if used:
        return f"they use {_listed(sorted(used))}"
    # Nothing at all: most likely the app whose tasks module declares them is not installed.
    return "no task is registered at all: is the app with your tasks module in INSTALLED_APPS?"


def _listed(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
