"""Interleaved A/B pairs on one throwaway cluster, for a shared, noisy machine: each pair runs
both variants back to back (in alternating order), and the median of the per-pair ratios is
what a change is judged by. `python bench/ab.py [--quick] [--pairs N] COMPARISON ...`

Comparisons: `sync` (the default drain against WORKER_SYNCHRONOUS_COMMIT = True), `latency`
(W5's 50/s LISTEN p50 and p99, the same two), `w7` (a drain beside 200,000 scheduled jobs
against a clean one), `w4` (a drain where 10% fail once against a clean one), `prepare` (the
drain and W5's latency by default against prepare_threshold None on every connection), `insert`
(W2, one thread: the enqueue's statement for its case against one text for every case), `bulk`
(W1 with the garbage collector paused, the default, against left running), `fillfactor` (the
job table at fillfactor 55 against 70: heartbeats' HOT share, the drain, W1), `claim` (W5 with
sql.CLAIM for turns without outcomes, the default, against SETTLE_AND_CLAIM for every turn),
`signals` (the drain with Prometheus metrics counting every outcome: its receivers on the
signals thread, the default, against on the main thread; and against no receivers), `batches`
(the drain with every job in a batch of 1,000, each with an on_complete callback, against
none in a batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    comparisons = [
        "sync", "latency", "w7", "w4", "prepare", "insert", "bulk", "fillfactor", "claim",
        "signals", "batches",
    ]  # fmt: skip
    parser.add_argument("comparisons", nargs="+", choices=comparisons)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="20,000-job drains (else 100,000)")
    options = parser.parse_args()
    from bench.cluster import migrated

    with migrated("ab-") as (cluster, logs):
        count = 20_000 if options.quick else 100_000
        for name in options.comparisons:
            for label, a, b in comparison(name, cluster, count, logs):
                pairs = []
                for n in range(options.pairs):
                    first, second = (a, b) if n % 2 == 0 else (b, a)
                    x, y = first(), second()
                    pairs.append((x, y) if n % 2 == 0 else (y, x))
                a_values, b_values = [p[0] for p in pairs], [p[1] for p in pairs]
                ratio = statistics.median(x / y for x, y in pairs)
                print(
                    f"| {label} | {statistics.median(a_values):,.2f} | "
                    f"{statistics.median(b_values):,.2f} | {ratio:.2f} | "
                    f"{' '.join(f'{x / y:.2f}' for x, y in pairs)} |",
                    flush=True,
                )


Measure = Callable[[], float]

#: The enqueue's statement before sql.INSERT_JOBS: one text for every case (no unique_key).
ONE_TEXT = """
    INSERT INTO pgjobs_job AS j
        (id, queue, task, payload, priority, run_at, scheduled, max_attempts, unique_key,
         headers)
    VALUES (
        %(id)s, %(queue)s, %(task)s, %(payload)s::jsonb, %(priority)s,
        COALESCE(%(run_at)s::timestamptz,
                 statement_timestamp() + %(delay)s::float8 * interval '1 second'),
        COALESCE(%(run_at)s::timestamptz > statement_timestamp(),
                 %(delay)s::float8 * interval '1 second' > interval '0'),
        %(max_attempts)s, %(unique_key)s, %(headers)s::jsonb
    )
    RETURNING j.id, j.run_at, j.created_at, j.scheduled,
              (SELECT pg_notify(%(channel)s, %(queue)s) WHERE %(channel)s IS NOT NULL)
"""


def comparison(
    name: str, cluster: object, count: int, logs: Path
) -> list[tuple[str, Measure, Measure]]:
    """(label, A, B) for each figure of the comparison; the table shows A, B and A / B."""
    from bench import workloads

    startup = workloads.startup_cpu(cluster, logs)

    def drain(**kwargs: object) -> Measure:
        return lambda: (
            workloads.drain(cluster, count, 1, [], logs, startup, **kwargs).jobs_per_second
        )

    if name == "sync":
        return [("drain jobs/s: default / WORKER_SYNCHRONOUS_COMMIT", drain(),
                 drain(env={"BENCH_SYNC": "1"}))]  # fmt: skip
    if name == "w7":
        return [("drain jobs/s: beside 200,000 scheduled / clean", drain(scheduled=200_000),
                 drain())]  # fmt: skip
    if name == "batches":
        return [("drain jobs/s: in batches of 1,000 / in none", drain(batched=1000), drain())]
    if name == "w4":
        return [("drain jobs/s: 10% failing once / the same task, none failing",
                 drain(fail_share=0.1), drain(fail_share=0.0))]  # fmt: skip

    def enqueue(texts: dict[tuple[str, bool, bool], str], key: str) -> Measure:
        """W2, one thread, wake-ups on, with sql.INSERT_JOBS' `texts` in place: its rate
        ("rate") or the time an enqueue adds in atomic() ("p50")."""
        from django_pgjobs.data import sql

        def measure() -> float:
            with patch.dict(sql.INSERT_JOBS, texts):
                if key == "rate":
                    return workloads.single_enqueue(cluster, 1, 3, True)[0]
                return workloads.enqueue_added_time(cluster, 1000)["p50"]

        return measure

    def bulk(pause_from: int) -> Measure:
        """W1's rate with enqueue.PAUSE_COLLECTOR_FROM at `pause_from`."""
        from django_pgjobs.data import enqueue as module

        def measure() -> float:
            with patch.object(module, "PAUSE_COLLECTOR_FROM", pause_from):
                return workloads.bulk_enqueue(cluster, count)[0]

        return measure

    if name == "bulk":
        return [("W1 jobs/s: collector paused / running", bulk(1000), bulk(10**12))]

    def at_fillfactor(value: int, measure: Measure) -> Measure:
        def run() -> float:
            with cluster.connect() as conn:  # type: ignore[attr-defined]
                conn.execute(f"ALTER TABLE pgjobs_job SET (fillfactor = {value})")
            try:
                return measure()
            finally:
                with cluster.connect() as conn:  # type: ignore[attr-defined]
                    conn.execute("ALTER TABLE pgjobs_job SET (fillfactor = 55)")  # migration 0011

        return run

    if name == "fillfactor":
        figures: list[tuple[str, Measure]] = [
            *((f"heartbeats HOT, {beats} per job",
               lambda beats=beats: workloads.heartbeat_hot_share(cluster, 1000, beats))
              for beats in (1, 3)),
            ("drain jobs/s", drain()),
            ("W1 jobs/s", lambda: workloads.bulk_enqueue(cluster, count)[0]),
        ]  # fmt: skip
        return [
            (f"{label}: fillfactor 55 / 70", at_fillfactor(55, measure),
             at_fillfactor(70, measure))
            for label, measure in figures
        ]  # fmt: skip

    if name == "insert":
        one_text = dict.fromkeys([("now", False, False), ("now", False, True)], ONE_TEXT)
        return [
            ("W2 1 thread jobs/s: statement per case / one text", enqueue({}, "rate"),
             enqueue(one_text, "rate")),
            ("W2 time enqueue adds, p50 ms: statement per case / one text", enqueue({}, "p50"),
             enqueue(one_text, "p50")),
        ]  # fmt: skip

    def latency(key: str, **env: str) -> Measure:
        return lambda: workloads.latency(cluster, 50, 4, True, logs, **env)[key]

    if name == "prepare":
        unprepared = {"BENCH_PREPARE": "none"}
        return [
            ("drain jobs/s: default / prepare_threshold None", drain(), drain(env=unprepared)),
            *((f"W5 50/s LISTEN {key} ms: default / prepare_threshold None", latency(key),
               latency(key, **unprepared)) for key in ("p50", "p99")),
        ]  # fmt: skip

    if name == "signals":
        metrics = {"BENCH_METRICS": "1"}
        return [
            ("drain jobs/s, metrics on: the signals thread / the main thread", drain(env=metrics),
             drain(env=metrics | {"BENCH_ANNOUNCE": "inline"})),
            ("drain jobs/s: metrics on (the signals thread) / none", drain(env=metrics), drain()),
        ]  # fmt: skip

    if name == "claim":
        one_text = {"BENCH_TURN_TEXT": "one"}
        return [
            (f"W5 50/s LISTEN {key} ms: the claim alone / the turn's one text", latency(key),
             latency(key, **one_text))
            for key in ("p50", "p99")
        ]  # fmt: skip

    return [
        (f"W5 50/s LISTEN {key} ms: default / WORKER_SYNCHRONOUS_COMMIT", latency(key),
         latency(key, BENCH_SYNC="1"))
        for key in ("p50", "p99")
    ]  # fmt: skip


if __name__ == "__main__":
    main()
