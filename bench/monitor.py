"""Samples what a worker could read about the primary's health, every `--interval` seconds, from
its own connection, into a CSV: `python bench/monitor.py --port P --out FILE` until SIGTERM.

Run as a process of its own so that the benchmark's other threads (the enqueuer's) do not
delay its timings. Per sample: the application's sessions in pg_stat_activity (every client
backend but this one and those whose application_name starts with "pgjobs"), what they wait
on; probes timed on this connection (`SELECT 1`, a primary-key lookup, the claim index's head,
the claim statement with limit 0, planned each time); the worker's last turn from its main session's
query_start and state_change; the server's cumulative counters; and the host's CPU (context
only: a worker on another machine cannot read it).
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The worker's sessions are named "pgjobs worker <id>" (runtime/sessions.py, application_name).
QUEUE_APPLICATION = "pgjobs%"

ACTIVITY = """
    SELECT
        count(*) FILTER (WHERE state = 'active'),
        count(*) FILTER (WHERE state = 'active' AND wait_event_type IS NOT NULL),
        count(*) FILTER (WHERE state = 'active' AND wait_event_type = 'Lock'),
        count(*) FILTER (WHERE state = 'active' AND wait_event_type = 'LWLock'),
        count(*) FILTER (WHERE state = 'active' AND wait_event_type = 'IO'),
        count(*) FILTER (WHERE state LIKE 'idle in transaction%%'),
        count(*) FILTER (WHERE state = 'active' AND application_name = 'pgbench'),
        coalesce(sum(extract(epoch FROM clock_timestamp() - query_start))
                 FILTER (WHERE state = 'active'), 0) * 1000,
        coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0) * 1000,
        string_agg(wait_event_type || ':' || wait_event, ' ' ORDER BY wait_event)
            FILTER (WHERE state = 'active' AND wait_event_type IS NOT NULL)
    FROM pg_stat_activity
    WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
      AND datname = current_database()
      AND coalesce(application_name, '') NOT LIKE %(queue)s
"""

# The worker's main session: the one whose statement is a turn (sql.CLAIM, SETTLE_AND_CLAIM;
# told by their first words, pg_stat_activity keeping only the first track_activity_query_size).
# Idle: state_change - query_start is its last turn (execution and commit). Active: how long
# the turn in progress has run so far.
WORKER = """
    SELECT state,
           extract(epoch FROM state_change - query_start) * 1000,
           extract(epoch FROM clock_timestamp() - query_start) * 1000,
           wait_event_type || ':' || wait_event,
           (SELECT count(*) FROM pg_stat_activity a
            WHERE a.application_name LIKE %(queue)s AND a.state = 'active')
    FROM pg_stat_activity
    WHERE application_name LIKE %(queue)s AND query ~ '^[[:space:]]*WITH (due|succeeded) AS [(]'
    ORDER BY query_start DESC LIMIT 1
"""

COUNTERS = """
    SELECT d.xact_commit, d.xact_rollback, d.blks_read, d.blks_hit, d.tup_updated,
           d.tup_inserted, w.wal_bytes, w.wal_sync, b.buffers_backend, b.buffers_clean,
           b.buffers_checkpoint
    FROM pg_stat_database d, pg_stat_wal w, pg_stat_bgwriter b
    WHERE d.datname = current_database()
"""

# A primary-key lookup (of no row): an index probe whose cost the queue's churn does not change.
PK_PROBE = "SELECT id FROM pgjobs_job WHERE id = '00000000-0000-0000-0000-000000000000'"

# The claim index's head, as a claim reads it but from the start: after a drain it walks over
# the entries of jobs claimed since the last vacuum (a worker's claim starts past them).
HEAD_PROBE = """
    SELECT id FROM pgjobs_job
    WHERE status = 'ready' AND NOT scheduled AND limit_key IS NULL AND queue = 'default'
      AND run_at <= statement_timestamp()
    ORDER BY priority DESC, run_at, id LIMIT 1
"""

COLUMNS = [
    "t", "select1_ms", "select1_again_ms", "pk_probe_ms", "head_probe_ms", "claim0_ms",
    "app_active", "app_waiting", "app_lock", "app_lwlock", "app_io", "app_idle_in_xact",
    "pgbench_active", "app_active_ms_sum", "app_oldest_xact_ms", "app_waits",
    "worker_state", "worker_last_turn_ms", "worker_running_ms", "worker_wait", "queue_active",
    "xact_commit", "xact_rollback", "blks_read", "blks_hit", "tup_updated", "tup_inserted",
    "wal_bytes", "wal_sync", "buffers_backend", "buffers_clean", "buffers_checkpoint",
    "host_busy_jiffies", "host_jiffies", "sample_ms",
]  # fmt: skip


def host_busy() -> tuple[float, float]:
    """Cumulative (busy, total) jiffies of every CPU, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def timed(conn: Any, statement: str, params: Any = None, prepare: bool | None = None) -> float:
    started = time.perf_counter()
    conn.execute(statement, params, prepare=prepare).fetchall()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dbname", default="bench")
    parser.add_argument("--user", default="bench_monitor")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.2)
    options = parser.parse_args()
    halt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    signal.signal(signal.SIGINT, lambda *_: halt.set())
    from django_pgjobs.data import sql

    claim_params = {
        "queues": ["default"], "rooms": [0], "after_priority": [None], "after_run_at": [None],
        "after_id": [None], "limit": 0, "worker": "bench monitor", "lease": 30.0,
    }  # fmt: skip
    queue = {"queue": QUEUE_APPLICATION}
    conn = psycopg.connect(host="127.0.0.1", port=options.port, user=options.user,
                           dbname=options.dbname, autocommit=True,
                           application_name="bench monitor")  # fmt: skip
    with conn, options.out.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        started = time.perf_counter()
        n = 0
        while not halt.is_set():
            n += 1
            at = time.time()
            began = time.perf_counter()
            # The first round trip after the pause, then one back to back: a process woken
            # after sleeping waits for a core longer than one that just ran.
            select1 = timed(conn, "SELECT 1", prepare=True)
            again = timed(conn, "SELECT 1", prepare=True)
            pk = timed(conn, PK_PROBE, prepare=True)
            head = timed(conn, HEAD_PROBE, prepare=True)
            claim0 = timed(conn, sql.CLAIM, claim_params, prepare=False)
            activity = conn.execute(ACTIVITY, queue).fetchone()
            worker = conn.execute(WORKER, queue).fetchone() or (None,) * 5
            counters = conn.execute(COUNTERS).fetchone()
            busy, total = host_busy()
            assert activity is not None and counters is not None
            writer.writerow([
                f"{at:.3f}", f"{select1:.3f}", f"{again:.3f}", f"{pk:.3f}", f"{head:.3f}",
                f"{claim0:.3f}",
                *activity[:7], f"{activity[7]:.1f}", f"{activity[8]:.1f}", activity[9] or "",
                worker[0] or "", _ms(worker[1]), _ms(worker[2]), worker[3] or "",
                worker[4] if worker[4] is not None else "",
                *counters, f"{busy:.0f}", f"{total:.0f}",
                f"{(time.perf_counter() - began) * 1000:.2f}",
            ])  # fmt: skip
            out.flush()
            pause = started + n * options.interval - time.perf_counter()
            if pause > 0:
                halt.wait(pause)
    os._exit(0)


def _ms(value: Any) -> str:
    return "" if value is None else f"{float(value):.3f}"


if __name__ == "__main__":
    main()
