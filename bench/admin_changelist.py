"""Time the admin's job pages over a big table (a script, not a test).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/pgjobs_bench_admin \\
        .venv/bin/python bench/admin_changelist.py [--rows 1000000] [--repeat 7]

Creates the database if needed, fills pgjobs_job with --rows jobs (COPY; mostly succeeded, with
ready, running, failed and cancelled ones, realistic payloads and error histories), then loads
each page through Django's test client as a superuser and prints the median and worst time, the
number of queries and the slowest query. For comparison it also times the exact COUNT(*) a stock
changelist would run on every load. Then it prints the plan (EXPLAIN ANALYZE) of every query of
the job table that each search runs, and fails if one of them reads the table sequentially.
Refuses to run without DATABASE_URL, so it never fills the development database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

# The example shop's registered tasks (the search box matches parts of registered names), and one
# rare task: a job in RARE_EVERY.
SHOP = "example_project.shop.tasks."
TASKS = [f"{SHOP}send_confirmation", f"{SHOP}charge_card", f"{SHOP}issue_invoice"]
RARE_TASK, RARE_EVERY = f"{SHOP}notify_warehouse", 10_000
QUEUES = ["default", "emails", "payments"]
#: The newest jobs: running (of which STUCK with their lease run out), and a backlog before them.
RUNNING, STUCK, BACKLOG = 300, 40, 20_000
TRACEBACK = 'Traceback (most recent call last):\n  File "shop/tasks.py", line 31\n' * 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument(
        "--stats", default="100x50", help="a day of statistics from WORKERSxQUEUES (0: none)"
    )
    args = parser.parse_args()
    if not os.environ.get("DATABASE_URL"):
        raise SystemExit("Set DATABASE_URL to a scratch database: this script fills it.")
    create_database(os.environ["DATABASE_URL"])

    import django
    from django.core.management import call_command
    from django.test.utils import setup_test_environment

    django.setup()
    setup_test_environment()  # lets the test client's host through ALLOWED_HOSTS
    call_command("migrate", verbosity=0)
    fill(args.rows)
    if args.stats != "0":
        workers, queues = map(int, args.stats.split("x"))
        fill_stats(workers, queues)
    report(args.repeat)
    explain_searches()


def create_database(url: str) -> None:
    import environ
    import psycopg

    config = environ.Env.db_url_config(url)
    with psycopg.connect(
        host=config["HOST"] or None, port=config["PORT"] or None, user=config["USER"] or None,
        password=config["PASSWORD"] or None, dbname="postgres", autocommit=True,
    ) as connection:  # fmt: skip
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [config["NAME"]]
        ).fetchone()
        if not exists:
            connection.execute(f'CREATE DATABASE "{config["NAME"]}"')


def fill(rows: int) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pgjobs_job")
        (have,) = cursor.fetchone()
    if have == rows:
        print(f"pgjobs_job already holds {rows:,} rows")
        return
    started = time.monotonic()
    columns = (
        "id, queue, task, payload, status, priority, run_at, attempts, max_attempts, "
        "leased_until, worker, last_error, errors, created_at, finished_at"
    )
    now_ms = time.time_ns() // 1_000_000
    raw = connection.connection
    assert raw is not None
    with raw.cursor() as cursor:
        cursor.execute("TRUNCATE pgjobs_job")
        with cursor.copy(f"COPY pgjobs_job ({columns}) FROM STDIN") as copy:
            for n in range(rows):
                copy.write_row(row(n, rows, now_ms))
    raw.commit()
    with raw.cursor() as cursor:
        raw.autocommit = True
        cursor.execute("VACUUM ANALYZE pgjobs_job")
    print(f"filled pgjobs_job with {rows:,} rows in {time.monotonic() - started:.0f}s")


def fill_stats(workers: int, queues: int, interval: int = 10) -> None:
    """A day of the statistics `workers` workers write every `interval` seconds, each serving
    `queues` queues, up to now: an hour at a time, each statement rolled up by the trigger as a
    worker's report is. Kept from an earlier run, they are brought up to now."""
    from django.db import connection

    params = {"workers": workers, "queues": queues, "step": interval, "tasks": TASKS}
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), EXTRACT(EPOCH FROM now() - max(at)) FROM pgjobs_queuestat")
        have, behind = cursor.fetchone()
        if have and behind < 86400 / 2:
            cursor.execute(STATS, {**params, "ago": float(behind), "span": float(behind)})
            print(f"statistics brought up to now ({behind:.0f}s behind)")
            return
        cursor.execute("TRUNCATE pgjobs_queuestat, pgjobs_rollup, pgjobs_worker")
        for hour in range(24, 0, -1):
            cursor.execute(STATS, {**params, "ago": hour * 3600.0, "span": 3600.0})
        for table in ("pgjobs_queuestat", "pgjobs_rollup", "pgjobs_worker"):
            cursor.execute(f"VACUUM ANALYZE {table}")
        cursor.execute("SELECT count(*) FROM pgjobs_queuestat")
        (rows,) = cursor.fetchone()
    print(f"filled pgjobs_queuestat with {rows:,} rows in {time.monotonic() - started:.0f}s")


# `span` seconds from `ago` seconds ago of every worker's report for every queue: claims,
# outcomes, a latency histogram and, for one queue in three, the task it ran.
STATS = """
    INSERT INTO pgjobs_queuestat (at, seconds, worker, queue, claimed, succeeded, retried,
                                  failed, latency_buckets, yielded, tasks)
    SELECT now() - make_interval(secs => %(ago)s) + make_interval(secs => t),
           %(step)s, 'bench-' || w, 'queue-' || q, 20, 18, 1, 1,
           '[0, 2, 6, 8, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]', 0,
           CASE WHEN q %% 3 = 0 THEN jsonb_build_object(
               (%(tasks)s::text[])[1 + q %% 3], jsonb_build_object(
                   'succeeded', 18, 'retried', 1, 'failed', 1,
                   'durations', '[0, 3, 8, 5, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]'::jsonb))
           END
    FROM generate_series(%(step)s, %(span)s::int, %(step)s) AS t,
         generate_series(1, %(workers)s) AS w, generate_series(1, %(queues)s) AS q
"""


def row(n: int, rows: int, now_ms: int) -> tuple[Any, ...]:
    """Job n of rows, one second apart, oldest first, as an operator's table looks: 5% dead
    letters (30 error types), 1% cancelled, the rest succeeded; but the newest 300 running
    (40 of them with their lease run out) and the 20,000 before them ready, a backlog."""
    ms = now_ms - (rows - n) * 1000
    job_id = uuid.UUID(int=(ms << 80) | (0x7 << 76) | (0x2 << 62) | (n & ((1 << 62) - 1)))
    at = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(ms / 1000))
    task, queue = TASKS[n % 3], QUEUES[n % 3]
    if n % RARE_EVERY == 5:
        task = RARE_TASK
    payload = json.dumps({"order_id": n, "email": f"user{n}@example.com", "note": "x" * 300})
    newest, kind = rows - n, n % 100
    status, attempts, lease, worker, error, errors, finished = (
        "succeeded", 1, None, None, "", "[]", at,
    )  # fmt: skip
    if newest <= RUNNING:
        later = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now_ms / 1000 + 300))
        lease = at if newest > RUNNING - STUCK else later
        status, worker, finished = "running", "web-2:91:3", None
    elif newest <= RUNNING + BACKLOG:
        status, attempts, finished = "ready", 0, None
    elif kind < 5:
        kind_of = f"Error{n % 30}"
        status, attempts, error = "failed", 5, f"{kind_of}: upstream timed out after 30s"
        entry = {"attempt": 5, "at": at, "worker": "web-1:77:1", "type": kind_of,
                 "message": "upstream timed out after 30s", "traceback": TRACEBACK}  # fmt: skip
        errors = json.dumps([entry] * 5)
    elif kind < 6:
        status, attempts = "cancelled", 0
    return (
        job_id, queue, task, payload, status, 0, at, attempts, 5, lease, worker, error, errors,
        at, finished,
    )  # fmt: skip


def report(repeat: int) -> None:
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from django_pgjobs.models import Job

    user, _ = User.objects.get_or_create(
        username="bench", defaults={"is_staff": True, "is_superuser": True}
    )
    client = Client()
    client.force_login(user)
    dead = Job.objects.dead().order_by("-id").first()
    assert dead is not None
    jobs, dead_letters = "/admin/pgjobs/job/", "/admin/pgjobs/deadletter/"
    pages = [
        ("jobs, first page", jobs),
        ("jobs, page 100", f"{jobs}?p=100"),
        ("jobs, status=ready", f"{jobs}?status__exact=ready"),
        ("jobs, status=failed", f"{jobs}?status__exact=failed"),
        ("jobs, queue=payments", f"{jobs}?queue=payments"),
        *((f"jobs, search {label}", f"{jobs}?q={term}") for label, term in searches(dead)),
        ("dead letters", dead_letters),
        ("dead letters, task", f"{dead_letters}?task={SHOP}charge_card"),
        ("dead letters, search short", f"{dead_letters}?q={dead.short_id}"),
        ("dead letters, search task", f"{dead_letters}?q=charge_card"),
        ("job detail", f"{jobs}{dead.pk}/change/"),
        ("health report", "/admin/pgjobs/queue/report/"),
        ("dashboard", "/admin/pgjobs/job/dashboard/"),
        ("jobs, stuck", f"{jobs}?status__exact=stuck"),
        ("jobs, search error", f"{jobs}?q=Connection+refused"),
        ("queues", "/admin/pgjobs/queue/"),
    ]
    print(f"\n{'page':<26}{'median ms':>10}{'max ms':>9}{'SQL ms':>8}{'queries':>9}  slowest query")
    for label, url in pages:
        client.get(url)  # warm caches
        times, sql, slowest = [], [], (0.0, "")
        for _ in range(repeat):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                response = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (url, response.status_code)
            sql.append(sum(float(q["time"]) for q in queries.captured_queries) * 1000)
            top = max(queries.captured_queries, key=lambda q: float(q["time"]))
            slowest = max(slowest, (float(top["time"]) * 1000, top["sql"][:60]))
        print(
            f"{label:<26}{statistics.median(times):>10.1f}{max(times):>9.1f}"
            f"{statistics.median(sql):>8.0f}{len(queries.captured_queries):>9}  "
            f"{slowest[0]:.0f} ms {slowest[1]}"
        )
    with connection.cursor() as cursor:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            cursor.execute("SELECT count(*) FROM pgjobs_job")
            times.append((time.perf_counter() - started) * 1000)
    label = "exact COUNT(*) (reference)"
    print(f"{label:<26}{statistics.median(times):>10.1f}{max(times):>9.1f}")
    time_large_replay(client, repeat)
    time_report_writes()


def time_report_writes(pairs: int = 200, queues: int = 50) -> None:
    """What the rollup's trigger costs a worker's report of `queues` queues: the report's insert
    with the trigger and without it, in turns (each pair's order alternating), each statement
    on its own as workers write them; its rows and their rollup removed afterwards."""
    import psycopg
    from django.db import connection

    report = (
        "INSERT INTO pgjobs_queuestat (at, seconds, worker, queue, claimed, succeeded, retried,"
        " failed, latency_buckets, yielded, tasks)"
        " SELECT now(), 10, %s, 'write-' || q, 20, 18, 1, 1,"
        " '[0, 2, 6, 8, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]', 0,"
        " jsonb_build_object('write.task', jsonb_build_object('succeeded', 18, 'retried', 1,"
        " 'failed', 1, 'durations', '[0, 3, 8, 5, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]'::jsonb))"
        " FROM generate_series(1, %s) AS q"
    )
    toggle = "ALTER TABLE pgjobs_queuestat {} TRIGGER pgjobs_queuestat_roll_up"
    settings = connection.settings_dict
    times: dict[bool, list[float]] = {True: [], False: []}
    with psycopg.connect(
        host=settings["HOST"] or None, port=settings["PORT"] or None, user=settings["USER"],
        dbname=settings["NAME"], autocommit=True,
    ) as raw:  # fmt: skip
        for n in range(pairs):
            for rolled in (True, False) if n % 2 else (False, True):
                raw.execute(toggle.format("ENABLE" if rolled else "DISABLE"))
                started = time.perf_counter()
                raw.execute(report, [f"bench-write-{n % 100}", queues])
                times[rolled].append((time.perf_counter() - started) * 1000)
        raw.execute(toggle.format("ENABLE"))
        raw.execute("DELETE FROM pgjobs_queuestat WHERE worker LIKE 'bench-write-%%'")
        raw.execute("DELETE FROM pgjobs_rollup WHERE name LIKE 'write-%%'")
        raw.execute("DELETE FROM pgjobs_worker WHERE name LIKE 'bench-write-%%'")
    with_, without = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"a report of {queues} queues: {with_:.1f} ms with the rollup, {without:.1f} ms without"
        f" ({pairs} pairs)"
    )


def time_large_replay(client: Any, repeat: int, dead: int = 200_000) -> None:
    """The "Replay all matching" request over `dead` dead letters (more made so, then put back):
    it counts them, enqueues the job that replays them, logs once and returns."""
    from django.db import connection, transaction

    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE pgjobs_job SET status = 'failed', attempts = 5, last_error = 'E: x' "
                "WHERE id IN (SELECT id FROM pgjobs_job WHERE status = 'succeeded' LIMIT "
                "%s - (SELECT count(*) FROM pgjobs_job WHERE status = 'failed'))",
                [dead],
            )
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            response = client.post("/admin/pgjobs/deadletter/replay-matching/", {"post": "yes"})
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 302, response.status_code
        transaction.set_rollback(True)
    label = f"replay all {dead:,}"
    print(f"{label:<26}{statistics.median(times):>10.1f}{max(times):>9.1f}")


def searches(dead: Any) -> list[tuple[str, str]]:
    """What the search box is given: each way a term names jobs."""
    return [
        ("full id", str(dead.pk)),
        ("id prefix", str(dead.pk)[:13]),
        ("short id", dead.short_id),
        ("task", "charge_card"),
        ("rare task", "notify_warehouse"),
    ]


def explain_searches() -> None:
    """The plan of every query of the job table each search page runs (EXPLAIN ANALYZE)."""
    from django.contrib.auth.models import User
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from django_pgjobs.models import Job

    client = Client()
    client.force_login(User.objects.get(username="bench"))
    dead = Job.objects.dead().order_by("-id").first()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pgjobs_job")
        (rows,) = cursor.fetchone()
    print(f"\nThe searches' plans over {rows:,} jobs")
    scans = []
    for url in ("/admin/pgjobs/job/", "/admin/pgjobs/deadletter/"):
        for label, term in searches(dead):
            with CaptureQueriesContext(connection) as queries:
                assert client.get(url, {"q": term}).status_code == 200
            print(f"\n== {url}?q={term}  ({label})")
            for query in queries.captured_queries:
                sql = query["sql"]
                if '"pgjobs_job"' not in sql or sql.startswith("EXPLAIN"):
                    continue
                with connection.cursor() as cursor:
                    cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
                    (measured,) = cursor.fetchone()
                    cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF, SUMMARY ON) {sql}")
                    plan = "\n".join(f"   {line}" for (line,) in cursor.fetchall())
                print(f"-- {sql[:110]}…\n{plan}")
                read = table_rows_read(measured[0]["Plan"])
                if read > rows // 10:
                    scans.append(f"{url}?q={term}: {read:,} rows read by {sql[:60]}")
    if scans:
        raise SystemExit("These searches read much of the job table:\n" + "\n".join(scans))


def table_rows_read(node: dict[str, Any]) -> int:
    """How many rows of the job table the plan's sequential scans read. (A capped count of a
    common match may read a few thousand rows in table order and stop: that is cheap.)"""
    read = 0
    if node["Node Type"] == "Seq Scan" and node.get("Relation Name") == "pgjobs_job":
        loops = node.get("Actual Loops", 1)
        read += (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * loops
    return read + sum(table_rows_read(child) for child in node.get("Plans", []))


if __name__ == "__main__":
    main()
