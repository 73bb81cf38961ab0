"""The physical ceiling: pgbench custom scripts over our own table and partial index."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from bench.cluster import Cluster

HERE = Path(__file__).resolve().parent

# pgbench runs these prepared (-M prepared): the best a client can do with these statements.
_LOAD = """
    INSERT INTO pgjobs_job (id, queue, task, payload, priority, run_at, max_attempts)
    SELECT lpad(to_hex(nextval('bench_ids')), 32, '0')::uuid, 'default', 'bench.tasks.noop',
           '{}', 0, statement_timestamp() - interval '1 second', 5
    FROM generate_series(1, %s)
"""


def reset(cluster: Cluster) -> None:
    """Empty the job table and its statistics' dead weight."""
    with cluster.connect() as conn:
        conn.execute("CREATE SEQUENCE IF NOT EXISTS bench_ids")
        conn.execute("TRUNCATE pgjobs_job, pgjobs_batch, pgjobs_dependency")
        conn.execute("VACUUM ANALYZE pgjobs_job")


def load(cluster: Cluster, count: int) -> None:
    with cluster.connect() as conn:
        conn.execute(_LOAD, [count])
        conn.execute("VACUUM ANALYZE pgjobs_job")
        conn.execute("CHECKPOINT")


def tps(output: str) -> float:
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", output)
    if not match:
        raise RuntimeError(f"no tps in pgbench output:\n{output}")
    return float(match.group(1))


def claim_complete(cluster: Cluster, batch: int, clients: int, jobs: int, repeat: int) -> float:
    """Jobs/s of raw claim(batch) + complete(batch) transactions by `clients` connections."""
    per_client = max(1, jobs // (batch * clients))
    results = []
    for _ in range(repeat):
        reset(cluster)
        # A margin of ready rows so no claim ever comes back empty.
        load(cluster, per_client * batch * clients + batch * clients * 10)
        output = cluster.pgbench(["-n", "-M", "prepared", "-c", str(clients), "-j",
                                  str(clients), "-t", str(per_client), "-D", f"batch={batch}",
                                  "-f", str(HERE / "claim_complete.sql")])  # fmt: skip
        results.append(tps(output) * batch)
    return statistics.median(results)


def insert(
    cluster: Cluster, rows: int, clients: int, seconds: float, repeat: int, explicit: bool = False
) -> float:
    """Jobs/s of INSERTs of `rows` jobs per transaction by `clients` connections; `explicit`:
    one row in a BEGIN … COMMIT block instead of an autocommitted statement."""
    script = "insert_one_txn.sql" if explicit else "insert_one.sql" if rows == 1 else (
        "insert_batch.sql"
    )  # fmt: skip
    results = []
    for _ in range(repeat):
        reset(cluster)
        output = cluster.pgbench(["-n", "-M", "prepared", "-c", str(clients), "-j",
                                  str(min(clients, 4)), "-T", str(int(seconds)),
                                  "-D", f"rows={rows}", "-f", str(HERE / script)])  # fmt: skip
        results.append(tps(output) * rows)
    return statistics.median(results)


def idle_round_trip(cluster: Cluster, pause: float, count: int = 200) -> float:
    """The median round trip of a prepared `SELECT 1`, in milliseconds, each after `pause`
    seconds of idling (0: back to back). W5's floor: at 50 jobs/s every wake-up comes after
    20 ms asleep, and on a virtual machine a process (the backend, the worker's threads) that
    slept that long takes far longer to run again than one that just ran."""
    times = []
    with cluster.connect() as conn:
        conn.prepare_threshold = 0
        for _ in range(count):
            time.sleep(pause)
            started = time.perf_counter()
            conn.execute("SELECT 1").fetchall()
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)
