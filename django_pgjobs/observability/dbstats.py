"""The job table's and the database's figures, from PostgreSQL's statistics views.

Sizes, live and dead tuples, vacuum, what holds vacuum's horizon back, idle transactions, the
NOTIFY queue, connections, and the locks that stop the workers. Each query reads a catalog or
statistics view, never the job table, so none of them waits for a lock on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import connections

from django_pgjobs.observability.stats import job_database


@dataclass(frozen=True)
class TableStats:
    """The job table's size, tuples and vacuum history."""

    live_tuples: int
    dead_tuples: int
    table_bytes: int  # the heap, with its TOAST table and maps
    index_bytes: int  # all indexes
    indexes: dict[str, int]  # each index's size in bytes
    last_vacuum: datetime | None
    last_autovacuum: datetime | None
    last_analyze: datetime | None
    last_autoanalyze: datetime | None
    autovacuum_count: int
    modified_since_analyze: int


@dataclass(frozen=True)
class DatabaseStats:
    """Connections, idle transactions, vacuum's horizon and the NOTIFY queue."""

    connections: dict[str, int]  # this database's client connections by state
    connections_used: int  # client connections to the whole server
    connections_max: int  # max_connections less the slots reserved for superusers
    idle_in_transaction: int  # sessions of this database idle inside a transaction
    idle_in_transaction_seconds: float  # the longest such wait
    #: The session whose snapshot or transaction id is oldest: vacuum's horizon.
    oldest_snapshot_seconds: float  # its transaction's age
    oldest_snapshot_xids: int  # how many transaction ids old its horizon is
    oldest_snapshot_pid: int | None
    oldest_snapshot_state: str
    oldest_snapshot_query: str
    oldest_prepared_seconds: float  # the oldest prepared (two-phase) transaction's age
    #: Replication slots holding a horizon: (slot, active, xids behind).
    slots: list[tuple[str, bool, int]] = field(default_factory=list)
    notify_queue_usage: float = 0.0  # pg_notification_queue_usage(): 0 to 1
    #: Whether pg_stat_activity shows every session; else the session figures are this user's.
    sees_all_sessions: bool = True
    #: Why the database refuses writes ("in recovery" or "read-only"); "" when it takes them.
    refuses_writes: str = ""

    @property
    def connections_ratio(self) -> float:
        return self.connections_used / self.connections_max if self.connections_max else 0.0


#: The locks on the job table that conflict with the ROW EXCLUSIVE lock every claim, heartbeat
#: and outcome of a worker takes (CREATE INDEX, most ALTER TABLE, VACUUM FULL, LOCK TABLE...).
BLOCKING_MODES = {
    "ShareLock": "SHARE",
    "ShareRowExclusiveLock": "SHARE ROW EXCLUSIVE",
    "ExclusiveLock": "EXCLUSIVE",
    "AccessExclusiveLock": "ACCESS EXCLUSIVE",
}
#: The locks on the queue controls' table that conflict with the workers' reads of it and a
#: limited queue's claim (SELECT … FOR UPDATE: ROW SHARE).
CONTROLS_BLOCKING_MODES = ("ExclusiveLock", "AccessExclusiveLock")


@dataclass(frozen=True)
class TableLock:
    """A session holding, or queued for, a lock on the job table that stops the workers (a
    request queued waits behind the holders, and every later one, the workers', behind it)."""

    pid: int | None  # None: a prepared transaction holds it
    mode: str  # as PostgreSQL's LOCK command names it: "ACCESS EXCLUSIVE"
    granted: bool
    #: Held: the age of the holder's transaction; queued: how long its statement has waited.
    seconds: float
    query: str  # the session's current or last statement (hidden without pg_read_all_stats)
    blocked_by: tuple[int, ...] = ()  # queued: the sessions it waits for
    table: str = "pgjobs_job"  # or pgjobs_queue, the queue controls'

    def describe(self) -> str:
        who = "a prepared transaction" if self.pid is None else f"pid {self.pid}"
        if self.granted:
            text = f"{who} holds {self.mode} for {self.seconds:.0f}s"
        else:
            ahead = ", ".join(map(str, self.blocked_by)) or "?"
            text = f"{who} waits {self.seconds:.0f}s for {self.mode} behind pid {ahead}"
        return f"{text} ({self.query!r})" if self.query else text


def table_locks(db: str | None = None) -> list[TableLock]:
    """The sessions (or prepared transactions) holding or queued for a lock that stops the
    workers (BLOCKING_MODES, CONTROLS_BLOCKING_MODES), held ones first, the oldest first."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(LOCKS_SQL, [list(BLOCKING_MODES), list(CONTROLS_BLOCKING_MODES)])
        found = cursor.fetchall()
    return [
        TableLock(
            pid, BLOCKING_MODES[mode], granted, float(seconds), query, tuple(ahead or ()), table
        )
        for table, pid, mode, granted, seconds, query, ahead in found
    ]


# pg_blocking_pids() only for the queued requests: it briefly takes the lock manager's locks.
# A prepared transaction's locks have no pid: their age is since it was prepared.
LOCKS_SQL = """
    SELECT CASE WHEN l.relation = to_regclass('pgjobs_job') THEN 'pgjobs_job'
                ELSE 'pgjobs_queue' END,
           l.pid, l.mode, l.granted,
           COALESCE(EXTRACT(EPOCH FROM statement_timestamp()
                    - CASE WHEN l.granted THEN COALESCE(a.xact_start, p.prepared)
                           ELSE a.query_start END), 0),
           COALESCE(left(a.query, 200), 'PREPARE TRANSACTION ' || quote_literal(p.gid), ''),
           CASE WHEN NOT l.granted THEN pg_blocking_pids(l.pid) END
    FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         LEFT JOIN pg_locks x ON l.pid IS NULL AND x.locktype = 'transactionid'
                             AND x.virtualtransaction = l.virtualtransaction
         LEFT JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
    WHERE l.locktype = 'relation'
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ((l.relation = to_regclass('pgjobs_job') AND l.mode = ANY(%s))
           OR (l.relation = to_regclass('pgjobs_queue') AND l.mode = ANY(%s)))
      AND l.pid IS DISTINCT FROM pg_backend_pid()
    ORDER BY l.granted DESC, 5 DESC
"""


def table_stats(db: str | None = None) -> TableStats:
    """The job table's statistics (pg_stat_user_tables, pg_stat_user_indexes, sizes)."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(
            """
            SELECT n_live_tup, n_dead_tup, pg_table_size(relid), pg_indexes_size(relid),
                   last_vacuum, last_autovacuum, last_analyze, last_autoanalyze,
                   autovacuum_count, n_mod_since_analyze
            FROM pg_stat_user_tables WHERE relid = to_regclass('pgjobs_job')
            """
        )
        row = cursor.fetchone() or (0, 0, 0, 0, None, None, None, None, 0, 0)
        cursor.execute(
            "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
            "WHERE relid = to_regclass('pgjobs_job') ORDER BY indexrelname"
        )
        indexes = {name: int(size) for name, size in cursor.fetchall()}
    live, dead, heap, index_bytes, vacuum, autovacuum, analyze, autoanalyze, runs, changed = row
    return TableStats(
        int(live), int(dead), int(heap), int(index_bytes), indexes, vacuum, autovacuum,
        analyze, autoanalyze, int(runs), int(changed),
    )  # fmt: skip


_IDLE = "state IN ('idle in transaction', 'idle in transaction (aborted)')"

# Since PostgreSQL 14 vacuum of an ordinary table waits only for sessions of its own database,
# and for those without one (WAL senders with hot_standby_feedback): the others are left out.
HORIZON_SQL = """
    SELECT COALESCE(EXTRACT(EPOCH FROM now() - xact_start), 0),
           greatest(age(backend_xmin), age(backend_xid)), pid, COALESCE(state, ''),
           left(query, 200)
    FROM pg_stat_activity
    WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
      AND pid <> pg_backend_pid() AND backend_type IN ('client backend', 'walsender')
      AND (datname = current_database() OR datname IS NULL)
    ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC LIMIT 1
"""


#: default_transaction_read_only on for everyone: the server's or database's, not the role's.
_READ_ONLY = """
    SELECT setting = 'on' AND source NOT IN ('user', 'database user', 'client', 'session')
    FROM pg_settings WHERE name = 'default_transaction_read_only'
"""


def database_stats(db: str | None = None) -> DatabaseStats:
    """Connections, idle transactions, the oldest snapshot, prepared transactions, replication
    slots and the NOTIFY queue (pg_stat_activity and a few catalog views)."""
    with connections[job_database(db)].cursor() as cursor:
        cursor.execute(
            """
            SELECT COALESCE(state, 'unknown'), count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND backend_type = 'client backend' GROUP BY 1
            """
        )
        by_state = {state: int(count) for state, count in cursor.fetchall()}
        cursor.execute(
            f"""
            SELECT (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'),
                   current_setting('max_connections')::int
                   - current_setting('superuser_reserved_connections')::int,
                   count(*) FILTER (WHERE {_IDLE}),
                   COALESCE(EXTRACT(EPOCH FROM max(now() - state_change)
                            FILTER (WHERE {_IDLE})), 0),
                   pg_notification_queue_usage(),
                   (SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(prepared)), 0)
                    FROM pg_prepared_xacts),
                   pg_has_role('pg_read_all_stats', 'USAGE'),
                   CASE WHEN pg_is_in_recovery() THEN 'in recovery'
                        WHEN ({_READ_ONLY}) THEN 'read-only'
                        ELSE '' END
            FROM pg_stat_activity WHERE datname = current_database()
            """
        )
        used, usable, idle, idle_seconds, notify_usage, prepared, all_sessions, refuses = (
            cursor.fetchone()
        )
        cursor.execute(HORIZON_SQL)
        seconds, xids, pid, state, query = cursor.fetchone() or (0, 0, None, "", "")
        cursor.execute(
            """
            SELECT slot_name, active, greatest(age(xmin), age(catalog_xmin))
            FROM pg_replication_slots
            WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL ORDER BY 3 DESC
            """
        )
        slots = [(name, bool(active), int(age)) for name, active, age in cursor.fetchall()]
    return DatabaseStats(
        connections=by_state,
        connections_used=int(used),
        connections_max=int(usable),
        idle_in_transaction=int(idle),
        idle_in_transaction_seconds=float(idle_seconds),
        oldest_snapshot_seconds=float(seconds),
        oldest_snapshot_xids=int(xids or 0),
        oldest_snapshot_pid=pid,
        oldest_snapshot_state=state,
        oldest_snapshot_query=query or "",
        oldest_prepared_seconds=float(prepared),
        slots=slots,
        notify_queue_usage=float(notify_usage),
        sees_all_sessions=bool(all_sessions),
        refuses_writes=refuses,
    )
