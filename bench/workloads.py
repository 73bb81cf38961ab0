"""W1–W9: our own figures, through the public API and real `runjobs` processes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.db import connection, connections, transaction
from django.test.utils import override_settings

from bench.ceiling import reset, tps
from bench.cluster import Cluster, wait_for
from django_pgjobs.models import Job

ROOT = Path(__file__).resolve().parent.parent
NOOP = "bench.tasks.noop"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


# ---- statistics from the server ---------------------------------------------------------------


@dataclass
class Counters:
    statements: int
    commits: int
    wal_bytes: int
    server_cpu: float
    updates: int
    hot_updates: int


def counters(cluster: Cluster) -> Counters:
    """Cumulative server counters (read by the bench_monitor role, so they can be told apart)."""
    with cluster.connect(user="bench_monitor") as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        statements = conn.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s "
            "JOIN pg_roles r ON r.oid = s.userid "
            "WHERE r.rolname = 'postgres' AND s.query NOT IN ('BEGIN', 'COMMIT', 'ROLLBACK')"
        ).fetchone()
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        wal = conn.execute("SELECT wal_bytes FROM pg_stat_wal").fetchone()
        tuples = conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'"
        ).fetchone()
    assert statements and commits and wal and tuples
    return Counters(
        int(statements[0]), int(commits[0]), int(wal[0]), cluster.server_cpu(),
        int(tuples[0]), int(tuples[1]),
    )  # fmt: skip


def reset_stats(cluster: Cluster) -> None:
    with cluster.connect(user="bench_monitor") as conn:
        conn.execute("SELECT pg_stat_statements_reset()")


class WaitSampler(threading.Thread):
    """Samples what the worker's backends are doing (pg_stat_activity) every 50 ms."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.samples: Counter[str] = Counter()
        self.queries = 0
        self._halt = threading.Event()

    def run(self) -> None:
        with self.cluster.connect(user="bench_monitor") as conn:
            while not self._halt.wait(0.05):
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
                    "WHERE usename = 'postgres' AND datname = current_database() "
                    "AND backend_type = 'client backend' AND query NOT LIKE 'LISTEN%%'"
                ).fetchall()
                self.queries += 1
                for state, kind, event in rows:
                    if state == "active":
                        self.samples[f"server:{kind}:{event}" if kind else "server:cpu"] += 1
                    elif state == "idle" and event == "ClientRead":
                        self.samples["client"] += 1
                    else:
                        self.samples[f"{state}:{event}"] += 1

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join()
        total = sum(self.samples.values()) or 1
        return {key: count / total for key, count in self.samples.most_common(4)}


# ---- worker processes -------------------------------------------------------------------------


def worker_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": cluster.url,
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        **extra,
    }


def start_worker(
    cluster: Cluster, args: list[str], log: Path, **env: str
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "django", "runjobs", *args],
        cwd=ROOT,
        env=worker_env(cluster, **env),
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def reap_child(process: subprocess.Popen[bytes]) -> float:
    """Wait for a worker process; returns the CPU seconds it used."""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"runjobs exited with {process.returncode}")
    return float(usage.ru_utime + usage.ru_stime)


# ---- W1 / W2: enqueue -------------------------------------------------------------------------


def bulk_enqueue(cluster: Cluster, count: int) -> tuple[float, float, float]:
    """Jobs/s, and the client's and the server's CPU in cores over the run."""
    reset(cluster)
    server = cluster.server_cpu()
    cpu, started = time.process_time(), time.perf_counter()
    Job.objects.bulk_enqueue(NOOP, (None for _ in range(count)))
    elapsed = time.perf_counter() - started
    client = (time.process_time() - cpu) / elapsed
    return count / elapsed, client, (cluster.server_cpu() - server) / elapsed


def single_enqueue(
    cluster: Cluster, threads: int, seconds: float, notify: bool
) -> tuple[float, float]:
    """Jobs/s of one-job transactions from `threads` client threads, and the client's CPU."""
    reset(cluster)
    done = Counter[int]()
    deadline = time.perf_counter() + seconds
    barrier = threading.Barrier(threads + 1)

    def client(n: int) -> None:
        connection.ensure_connection()
        barrier.wait()
        count = 0
        while time.perf_counter() < deadline:
            with transaction.atomic():
                Job.objects.enqueue(NOOP)
            count += 1
        done[n] = count
        connection.close()

    cpu = time.process_time()
    with override_settings(PGJOBS={"NOTIFY": notify}):
        pool = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in pool:
            thread.join()
        elapsed = time.perf_counter() - started
    return sum(done.values()) / elapsed, (time.process_time() - cpu) / elapsed


def enqueue_added_time(cluster: Cluster, count: int) -> dict[str, float]:
    """What `enqueue` adds inside a transaction that already ran a statement, and how many
    statements per enqueue reach the server (INSERTs plus coalesced wake-ups)."""
    reset(cluster)
    reset_stats(cluster)
    before = counters(cluster)
    durations = []
    for _ in range(count):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            started = time.perf_counter()
            Job.objects.enqueue(NOOP)
            durations.append((time.perf_counter() - started) * 1000)
    after = counters(cluster)
    with cluster.connect(user="bench_monitor") as conn:
        row = conn.execute(
            "SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%%INSERT INTO pgjobs_job%%'), 0),"
            " coalesce(sum(calls) FILTER (WHERE query LIKE '%%pg_notify%%'), 0) "
            "FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid "
            "WHERE r.rolname = 'postgres'"
        ).fetchone()
    assert row is not None
    return {
        "p50": percentile(durations, 50),
        "p99": percentile(durations, 99),
        # minus the SELECT 1 each transaction ran first
        "statements": (after.statements - before.statements) / count - 1,
        "inserts": int(row[0]) / count,
        "notifies": int(row[1]) / count,
    }


# ---- W3 / W4: drain ---------------------------------------------------------------------------


@dataclass
class Drain:
    jobs_per_second: float
    statements: float  # per job
    commits: float
    wal_bytes: float
    worker_cpu: float  # share of one core over the drain window
    server_cpu: float  # cores
    waits: dict[str, float] = field(default_factory=dict)


def startup_cpu(cluster: Cluster, logs: Path) -> float:
    """CPU seconds a `runjobs --once` spends on an empty queue (imports, setup, exit)."""
    reset(cluster)
    return reap_child(start_worker(cluster, ["--once"], logs / "startup.log"))


def drain(
    cluster: Cluster, count: int, processes: int, args: list[str], logs: Path, startup: float,
    fail_share: float | None = None, env: dict[str, str] | None = None, supervised: bool = False,
    scheduled: int = 0, batched: int = 0,
) -> Drain:  # fmt: skip
    """Enqueue `count` jobs, then time `processes` × `runjobs --once` draining them; or, when
    `supervised`, one `runjobs --processes <processes>` (a supervisor and its children: they
    do not exit when drained, so it is stopped with SIGTERM once no job is left). `scheduled`:
    that many jobs of a higher priority, due in an hour, enqueued first in the same queue.
    `batched`: the jobs in batches of that many, each with an on_complete callback (not
    counted)."""
    reset(cluster)
    for start in range(0, scheduled, 50_000):
        later = (None for _ in range(min(50_000, scheduled - start)))
        Job.objects.bulk_enqueue(NOOP, later, priority=10, delay=3600)
    if fail_share is not None:  # the failing task, failing that share (0: the same task, clean)
        rng = random.Random(7)
        payloads = [{"fail": rng.random() < fail_share} for _ in range(count)]
        Job.objects.bulk_enqueue("bench.tasks.flaky", payloads)
    elif batched:
        for start in range(0, count, batched):
            with Job.objects.batch(on_complete="bench.tasks.batch_done"):
                Job.objects.bulk_enqueue(NOOP, (None for _ in range(min(batched, count - start))))
    else:
        Job.objects.bulk_enqueue(NOOP, (None for _ in range(count)))
    with cluster.connect() as conn:
        conn.execute("VACUUM ANALYZE pgjobs_job")
        conn.execute("CHECKPOINT")
    reset_stats(cluster)
    before = counters(cluster)
    sampler = WaitSampler(cluster)
    sampler.start()
    polls = 0
    if supervised:
        supervisor = start_worker(
            cluster, ["--processes", str(processes), *args], logs / "drain.log", **(env or {})
        )
        polls = _wait_drained(cluster, supervisor)
        supervisor.send_signal(signal.SIGTERM)
        # The supervisor's own CPU and its children's (reaped by it, so counted in its usage).
        cpu = reap_child(supervisor)
        processes += 1  # the supervisor's start-up too
    else:
        workers = [
            start_worker(cluster, ["--once", *args], logs / "drain.log", **(env or {}))
            for _ in range(processes)
        ]
        cpu = sum(reap_child(worker) for worker in workers)
    waits = sampler.stop()
    after = counters(cluster)
    with cluster.connect() as conn:
        row = conn.execute(
            "SELECT count(*), extract(epoch FROM max(finished_at) - min(finished_at)) "
            "FROM pgjobs_job WHERE status = 'succeeded' AND task <> 'bench.tasks.batch_done'"
        ).fetchone()
    assert row is not None
    finished, window = int(row[0]), float(row[1] or 0.0)
    if finished != count:
        raise RuntimeError(f"drained {finished} of {count} jobs")
    window = max(window, 1e-3)
    commits = after.commits - before.commits - sampler.queries - polls - 6
    return Drain(
        jobs_per_second=(count - 1) / window,
        statements=(after.statements - before.statements) / count,
        commits=commits / count,
        wal_bytes=(after.wal_bytes - before.wal_bytes) / count,
        worker_cpu=max(0.0, cpu - processes * startup) / window,
        server_cpu=(after.server_cpu - before.server_cpu) / window,
        waits=waits,
    )


def _wait_drained(cluster: Cluster, worker: subprocess.Popen[bytes]) -> int:
    """Until no job is ready or running (by the monitor role, so that the statement counts
    leave these polls out); returns how many polls that took (each a commit)."""
    polls = 0
    with cluster.connect(user="bench_monitor") as conn:
        while True:
            polls += 1
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pgjobs_job WHERE status = 'running' "
                "OR (status = 'ready' AND run_at <= now()))"
            ).fetchone()
            if row is not None and not row[0]:
                return polls
            if worker.poll() is not None:
                raise RuntimeError(f"runjobs exited with {worker.returncode} before the drain")
            time.sleep(0.1)


# ---- W5: latency ------------------------------------------------------------------------------


def latency(
    cluster: Cluster, rate: float, seconds: float, listen: bool, logs: Path, **env: str
) -> dict[str, float]:
    """Enqueue `stamp` jobs at `rate`/s; enqueue-commit → handler-start, in milliseconds."""
    reset(cluster)
    stamps = Path(tempfile.mkstemp(prefix="stamps-", dir=logs)[1])
    args = [] if listen else ["--no-listen"]
    worker = start_worker(cluster, args, logs / "latency.log", BENCH_STAMPS=str(stamps), **env)
    committed: dict[str, float] = {}

    def enqueue_one() -> str:
        holder: list[float] = []
        with transaction.atomic():
            # Registered before enqueue's own hook, so it runs first: right after COMMIT.
            transaction.on_commit(lambda: holder.append(time.time()))
            job = Job.objects.enqueue("bench.tasks.stamp")
        committed[str(job.pk)] = holder[0]
        return str(job.pk)

    try:
        warm = enqueue_one()
        if not wait_for(lambda: warm in stamps.read_text(), 30):
            raise RuntimeError("the latency worker never started a job")
        time.sleep(1.0)
        committed.clear()
        total = int(rate * seconds)
        started = time.perf_counter()
        for n in range(total):
            pause = started + n / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            enqueue_one()
        achieved = total / (time.perf_counter() - started)

        def all_started() -> bool:
            seen = {line.split()[0] for line in stamps.read_text().splitlines()}
            return all(job_id in seen for job_id in committed)

        wait_for(all_started, 30, 0.2)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    started_at = dict(line.split() for line in stamps.read_text().splitlines())
    delays = [
        (float(started_at[job_id]) - at) * 1000
        for job_id, at in committed.items()
        if job_id in started_at
    ]
    return {
        "rate": achieved,
        "p50": percentile(delays, 50),
        "p95": percentile(delays, 95),
        "p99": percentile(delays, 99),
        "missing": len(committed) - len(delays),
    }


# ---- heartbeats -------------------------------------------------------------------------------


def heartbeat_hot_share(cluster: Cluster, jobs: int, beats: int) -> float:
    """Claim `jobs`, heartbeat them `beats` times; the share of those updates that were HOT."""
    reset(cluster)
    Job.objects.bulk_enqueue(NOOP, (None for _ in range(jobs)))
    claimed = Job.objects.claim(["default"], worker="bench-heartbeat", limit=jobs, lease=300)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    before = counters(cluster)
    for _ in range(beats):
        Job.objects.heartbeat(claimed, 300)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
    connection.close()  # a closing backend flushes its statistics
    time.sleep(0.5)
    after = counters(cluster)
    updates = after.updates - before.updates
    return (after.hot_updates - before.hot_updates) / max(1, updates)


class Producer(threading.Thread):
    """Enqueues no-op jobs at `rate`/s in batches every 20 ms, until `stop` is set, `jobs` are
    in or `seconds` have passed."""

    def __init__(
        self, rate: float, stop: threading.Event, jobs: int | None = None,
        seconds: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.rate, self.stop, self.jobs, self.seconds = rate, stop, jobs, seconds
        self.enqueued = 0

    def run(self) -> None:
        tick, started, n = 0.02, time.perf_counter(), 0
        while not self.stop.is_set():
            n += 1
            due = int(self.rate * tick * n) - self.enqueued
            if self.jobs is not None:
                due = min(due, self.jobs - self.enqueued)
            if due > 0:
                Job.objects.bulk_enqueue(NOOP, (None for _ in range(due)))
                self.enqueued += due
            if self.jobs is not None and self.enqueued >= self.jobs:
                break
            if self.seconds is not None and time.perf_counter() - started >= self.seconds:
                break
            pause = started + tick * n - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        connections.close_all()


# ---- W6: soak ---------------------------------------------------------------------------------


@dataclass
class Sample:
    at: float
    completed: int
    backlog: int
    size_mb: float
    dead: int


def soak(
    cluster: Cluster, rate: float, *, jobs: int | None, seconds: float | None,
    hold: tuple[float, float] | None, logs: Path,
) -> list[Sample]:  # fmt: skip
    """Enqueue at `rate`/s (until `jobs` are in, or for `seconds`) into one default worker that
    prunes with a short retention; sample progress, size and dead tuples every second. `hold`
    is (start, length) in seconds of a REPEATABLE READ transaction holding its snapshot."""
    reset(cluster)
    worker = start_worker(cluster, [], logs / "soak.log", BENCH_RETENTION="5")
    stop = threading.Event()

    def hold_snapshot() -> None:
        assert hold is not None
        if stop.wait(hold[0]):
            return
        with cluster.connect(user="bench_monitor") as conn:
            conn.autocommit = False
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute("SELECT count(*) FROM pgjobs_job WHERE false")
            stop.wait(hold[1])
            conn.rollback()

    samples: list[Sample] = []
    wait_for(lambda: "started" in (logs / "soak.log").read_text(), 30)
    producer = Producer(rate, stop, jobs, seconds)
    holder = threading.Thread(target=hold_snapshot, daemon=True)
    # The jobs done are counted from the table's update counter (a claim and a completion per
    # job), not by counting the backlog: under a held snapshot that count(*) became a parallel
    # scan of a table of gigabytes every second, which took the cores the queue was measured on.
    sampled = (
        "SELECT n_tup_upd, pg_total_relation_size('pgjobs_job'), n_dead_tup"
        " FROM pg_stat_user_tables WHERE relname = 'pgjobs_job'"
    )
    began = time.perf_counter()
    producer.start()
    if hold:
        holder.start()
    try:
        with cluster.connect(user="bench_monitor") as conn:
            row = conn.execute(sampled).fetchone()
            assert row is not None
            updated_before = int(row[0])
            while True:
                time.sleep(1.0)
                row = conn.execute(sampled).fetchone()
                assert row is not None
                done = (int(row[0]) - updated_before) // 2
                size, dead = int(row[1]), int(row[2])
                backlog = max(0, producer.enqueued - done)
                if not producer.is_alive() and backlog < 1000:
                    backlog = _backlog(conn)  # exact, once the producer is done
                    done = producer.enqueued - backlog
                samples.append(
                    Sample(time.perf_counter() - began, done, backlog, size / 2**20, dead)
                )
                if not producer.is_alive() and backlog == 0:
                    break
    finally:
        stop.set()
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    return samples


# ---- Yield: OLTP beside the queue ---------------------------------------------------------------


def oltp_init(cluster: Cluster, scale: int) -> None:
    """pgbench's TPC-B-like tables at `scale`, in the bench database beside the job table."""
    cluster.pgbench(["-i", "-q", "-s", str(scale)])


def oltp_maximum(cluster: Cluster, clients: int, seconds: float) -> float:
    """Unthrottled TPC-B-like tps from `clients` connections, nothing else running."""
    output = cluster.pgbench(["-n", "-c", str(clients), "-j", str(min(clients, 2)),
                              "-T", str(int(seconds))])  # fmt: skip
    return tps(output)


def _backlog(conn: Any) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pgjobs_job WHERE status IN ('ready', 'running')"
    ).fetchone()
    return int(row[0])


# ---- W9: worker memory ------------------------------------------------------------------------


@dataclass
class Memory:
    warm_mb: float  # resident memory once 10% of the jobs were done
    peak_mb: float
    end_mb: float
    jobs_per_second: float

    @property
    def growth(self) -> float:
        return self.end_mb / self.warm_mb - 1


def memory(cluster: Cluster, count: int, logs: Path) -> Memory:
    """The resident memory of one default `runjobs --once` draining `count` no-op jobs,
    sampled every 0.5 s, with the share still due read from the claim index."""
    import psutil

    reset(cluster)
    for start in range(0, count, 50_000):
        Job.objects.bulk_enqueue(NOOP, (None for _ in range(min(50_000, count - start))))
    with cluster.connect() as conn:
        conn.execute("VACUUM ANALYZE pgjobs_job")
    worker = start_worker(cluster, ["--once"], logs / "memory.log")
    process = psutil.Process(worker.pid)
    samples: list[tuple[int, float]] = []  # (jobs due, resident MB)
    began = time.perf_counter()
    with cluster.connect(user="bench_monitor") as conn:
        while worker.poll() is None:
            try:
                resident = process.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                break
            row = conn.execute("SELECT count(*) FROM pgjobs_job WHERE status = 'ready'").fetchone()
            assert row is not None
            samples.append((int(row[0]), resident))
            time.sleep(0.5)
    elapsed = time.perf_counter() - began
    if worker.returncode != 0:
        raise RuntimeError(f"runjobs exited with {worker.returncode}")
    warm = [mb for due, mb in samples if due <= 0.9 * count]
    if not warm:
        raise RuntimeError("the drain ended before a sample after the warm-up")
    return Memory(warm[0], max(mb for _, mb in samples), warm[-1], count / elapsed)


# ---- Yield: OLTP beside a draining backlog, and what a worker could read meanwhile -------------


@dataclass
class Yielded:
    case: str
    tps: float  # OLTP's, over its window (nan without OLTP)
    p50: float  # ms, from each transaction's scheduled start (pgbench -R)
    p99: float
    drain: float  # jobs/s the queue finished over the OLTP window
    left: int  # jobs enqueued but not yet finished when OLTP stopped (0: the backlog ran out)
    load: tuple[float, float]  # the machine's 1-minute load average before and after
    events: dict[str, float]  # epoch seconds: worker, oltp_on, oltp_off, end
    samples: Path  # the monitor's CSV (bench/monitor.py)
    series: Path  # per second: OLTP transactions, p50, p99; jobs finished
    #: Jobs/s finished over the OLTP window, per queue; and jobs finished per worker.
    queues: dict[str, float] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)
    #: OLTP's transactions: (completed at, epoch seconds; latency, ms).
    transactions: list[tuple[float, float]] = field(default_factory=list)


_RUNJOBS_HELP: list[str] = []


def runjobs_has(option: str, cluster: Cluster) -> bool:
    """Whether `runjobs --help` lists `option` (read once per process)."""
    if not _RUNJOBS_HELP:
        _RUNJOBS_HELP.append(subprocess.run(
            [sys.executable, "-m", "django", "runjobs", "--help"], cwd=ROOT, text=True,
            env=worker_env(cluster), capture_output=True, check=True,
        ).stdout)  # fmt: skip
    return option in _RUNJOBS_HELP[0].split()


class NamedProducer(Producer):
    """The Producer on a session named "bench enqueuer": an application's enqueues, told apart
    from pgbench's sessions in pg_stat_activity."""

    def run(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('application_name', 'bench enqueuer', false)")
        super().run()


def yield_case(
    cluster: Cluster, case: str, *, clients: int, limit: float | None, seconds: float,
    backlog: int, rate: float, out: Path, logs: Path, no_yield: bool = False,
    step: tuple[float, float, float] | None = None, workers: Sequence[Sequence[str]] = ((),),
    queues: Sequence[str] = ("default",), env: dict[str, str] | None = None,
) -> Yielded:  # fmt: skip
    """pgbench's TPC-B-like script throttled to `limit` tps (None: as fast as it goes) for
    `seconds`, beside `backlog` jobs in each of `queues` enqueued first and an enqueuer at `rate`
    jobs/s into the first, with a `runjobs --queue ...` per entry of `workers` (its other
    arguments; none when `backlog` and `rate` are both 0), sampled by bench/monitor.py into
    `out`/<case>.csv. `step` = (on, off, end): OLTP from `on` to `off` seconds after the workers
    started, the run ending at `end`. `no_yield` passes --no-yield to runjobs when it has that
    option; `env`, to the workers."""
    reset(cluster)
    for queue in queues:
        for start in range(0, backlog, 50_000):
            nones = (None for _ in range(min(50_000, backlog - start)))
            Job.objects.bulk_enqueue(NOOP, nones, queue=queue)
    with cluster.connect() as conn:
        conn.execute("VACUUM ANALYZE pgjobs_job")
        conn.execute("CHECKPOINT")
    load_before = os.getloadavg()[0]
    samples, series = out / f"{case}.csv", out / f"{case}-seconds.csv"
    monitor = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "monitor.py"), "--port", str(cluster.port),
         "--dbname", cluster.dbname, "--out", str(samples)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    stop = threading.Event()
    producer = NamedProducer(rate, stop)
    running: list[subprocess.Popen[bytes]] = []
    events: dict[str, float] = {"monitor": time.time()}
    prefix = cluster.root / f"yield-{case}"
    try:
        time.sleep(2.0)  # the idle baseline: neither OLTP nor the queue
        if backlog or rate:
            args = ["--no-yield"] if no_yield and runjobs_has("--no-yield", cluster) else []
            args += [f"--queue={queue}" for queue in queues]
            for n, more in enumerate(workers):
                log = logs / f"yield-{case}-{n}.log"
                running.append(start_worker(cluster, [*args, *more], log, **(env or {})))
                if not wait_for(lambda log=log: "started" in log.read_text(), 30):
                    raise RuntimeError(f"the worker did not start: see {log}")
            events["worker"] = time.time()
        if rate:
            producer.start()
        origin = events.get("worker", time.time())
        on, off, end = step or (2.0, 2.0 + seconds, 2.0 + seconds)
        time.sleep(max(0.0, origin + on - time.time()))
        events["oltp_on"] = time.time()
        throttle = [] if limit is None else ["-R", f"{limit:.0f}"]
        output = cluster.pgbench(["-n", "-c", str(clients), "-j", str(min(clients, 2)),
                                  "-T", str(int(off - on)), *throttle, "-l",
                                  f"--log-prefix={prefix}"])  # fmt: skip
        events["oltp_off"] = time.time()
        time.sleep(max(0.0, origin + end - time.time()))
        events["end"] = time.time()
    finally:
        stop.set()
        if producer.is_alive():
            producer.join()
        monitor.send_signal(signal.SIGTERM)
        monitor.wait(30)
        for worker in running:
            worker.send_signal(signal.SIGTERM)
        for worker in running:
            worker.wait(60)
    transactions = []  # (completed at, latency in ms)
    for path in cluster.root.glob(f"{prefix.name}.*"):
        # client_id transaction_no time script_no time_epoch time_us [schedule_lag]
        for line in path.read_text().splitlines():
            fields = line.split()
            transactions.append((int(fields[4]) + int(fields[5]) / 1e6, int(fields[2]) / 1000))
        path.unlink()
    with cluster.connect() as conn:
        finished = dict(conn.execute(
            "SELECT floor(extract(epoch FROM finished_at))::int8, count(*) FROM pgjobs_job "
            "WHERE finished_at IS NOT NULL GROUP BY 1"
        ).fetchall())  # fmt: skip
        row = conn.execute(
            "SELECT count(*) FROM pgjobs_job WHERE finished_at >= to_timestamp(%s) "
            "AND finished_at < to_timestamp(%s)",
            [events["oltp_on"], events["oltp_off"]],
        ).fetchone()
        left = conn.execute(
            "SELECT count(*) FROM pgjobs_job WHERE created_at <= to_timestamp(%(off)s) "
            "AND (finished_at IS NULL OR finished_at > to_timestamp(%(off)s))",
            {"off": events["oltp_off"]},
        ).fetchone()
        window = {"on": events["oltp_on"], "off": events["oltp_off"]}
        per_queue = dict(conn.execute(
            "SELECT queue, count(*) FROM pgjobs_job WHERE finished_at >= to_timestamp(%(on)s) "
            "AND finished_at < to_timestamp(%(off)s) GROUP BY queue", window,
        ).fetchall())  # fmt: skip
        # A worker's children claim under their own ids: the jobs each process finished.
        per_worker = dict(conn.execute(
            "SELECT worker, count(*) FROM pgjobs_job WHERE finished_at >= to_timestamp(%(on)s) "
            "AND finished_at < to_timestamp(%(off)s) GROUP BY worker", window,
        ).fetchall())  # fmt: skip
    assert row is not None and left is not None
    _write_seconds(series, transactions, finished, events)
    latencies = [ms for _, ms in transactions]
    span = events["oltp_off"] - events["oltp_on"]
    return Yielded(
        case, tps(output), percentile(latencies, 50), percentile(latencies, 99),
        int(row[0]) / span if running else float("nan"), int(left[0]),
        (load_before, os.getloadavg()[0]), events, samples, series,
        {queue: count / span for queue, count in per_queue.items()},
        {str(worker): int(count) for worker, count in per_worker.items()}, transactions,
    )  # fmt: skip


def _write_seconds(
    path: Path, transactions: list[tuple[float, float]], finished: dict[int, int],
    events: dict[str, float],
) -> None:  # fmt: skip
    """Per second of the run: OLTP transactions completed, their p50 and p99; jobs finished."""
    by_second: dict[int, list[float]] = {}
    for at, ms in transactions:
        by_second.setdefault(int(at), []).append(ms)
    with path.open("w") as out:
        out.write("second,oltp_transactions,oltp_p50_ms,oltp_p99_ms,jobs_finished\n")
        for second in range(int(events["monitor"]), int(events["end"]) + 1):
            values = by_second.get(second, [])
            p50, p99 = (percentile(values, 50), percentile(values, 99)) if values else ("", "")
            out.write(f"{second},{len(values)},{p50},{p99},{finished.get(second, 0)}\n")
    path.with_suffix(".events").write_text(
        "\n".join(f"{key} {value:.3f}" for key, value in events.items()) + "\n"
    )
