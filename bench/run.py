"""The benchmark: `python bench/run.py [--quick]`. Starts a throwaway durable PostgreSQL, measures
the pgbench ceiling over our schema and W1–W9 through django-pgjobs, and prints one table with
every figure's ratio to the ceiling of the same shape (docs/performance.md explains it)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Sizes:
    repeat: int
    ceiling_jobs: dict[int, int]  # per batch size
    insert_seconds: float
    bulk: int
    enqueue_seconds: float
    drain: int
    strict: int
    latency_seconds: float
    soak_jobs: int
    hold: tuple[float, float, float]  # before, hold, after (seconds)
    scheduled: int  # W7: delayed jobs of a higher priority in the drained queue
    oltp_seconds: float  # yield: the pgbench run that measures its maximum
    memory_jobs: int  # W9
    yield_seconds: float  # yield: each case's OLTP
    backlog: int  # yield: enough to last the OLTP window at the drain's rate beside it
    step: tuple[float, float, float]  # yield's step: OLTP on, off, the end (s after the worker)
    step_backlog: int  # enough to last the step's whole run


FULL = Sizes(3, {1: 8_000, 10: 60_000, 100: 200_000}, 5, 100_000, 5, 100_000, 20_000, 20,
             1_000_000, (60, 300, 60), 200_000, 30, 1_000_000, 30, 500_000, (10, 30, 45),
             800_000)  # fmt: skip
QUICK = Sizes(1, {1: 2_000, 10: 10_000, 100: 40_000}, 2, 20_000, 2, 20_000, 4_000, 4,
              40_000, (10, 10, 15), 200_000, 10, 100_000, 10, 200_000, (5, 15, 22),
              400_000)  # fmt: skip


@dataclass
class Row:
    workload: str
    value: float
    unit: str
    ceiling: str = ""
    ceiling_value: float | None = None
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> str:
        if not self.ceiling_value:
            return ""
        return f"{self.value / self.ceiling_value:.2f}"


def fmt(value: float, unit: str) -> str:
    if unit in ("jobs/s", "rows/s", "tps"):
        return f"{value:,.0f} {unit}"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "MB":
        return f"{value:.1f} MB"
    if unit in ("", "×", "share"):
        return f"{value:.2f}{' ×' if unit == '×' else ''}"
    return f"{value:,.2f} {unit}"


def table(rows: list[Row]) -> str:
    lines = [
        "| workload | figure | ceiling (same shape) | ratio | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ceiling = f"{row.ceiling}: {fmt(row.ceiling_value, row.unit)}" if row.ceiling_value else ""
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        figure = fmt(row.value, row.unit) + (f" ({row.note})" if row.note else "")
        lines.append(
            f"| {row.workload} | {figure} | {ceiling} | {row.ratio} | {row.target} | {met} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, str]:
    import django
    import psycopg

    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": f"{os.cpu_count()} × {cpu}",
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "django": django.__version__,
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
        "load before the run": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes: a few minutes")
    parser.add_argument("--soak-jobs", type=int, help="W6 size (full: 1,000,000)")
    parser.add_argument("--hold-seconds", type=float, help="W6 snapshot hold (full: 300)")
    parser.add_argument("--repeat", type=int, help="runs per noisy figure; the median is shown")
    parser.add_argument(
        "--naptime", help="the cluster's autovacuum_naptime (default 10s), e.g. 1s: W6 with it"
    )
    parser.add_argument(
        "--only", default="ceiling,w1,w2,w3,w4,w5,w6,w7,w9,heartbeat,nats,yield,limits",
        help="comma-separated sections to run (the ceiling is always measured for ratios)",
    )  # fmt: skip
    parser.add_argument(
        "--yield-pairs",
        type=int,
        default=3,
        help="yield: interleaved pairs (and runs) of each case whose figure is a median",
    )
    parser.add_argument(
        "--yield-parts",
        default="pairs,step,four,saturated,idle",
        help="yield: which of its parts to run (bench/yielding.py)",
    )
    parser.add_argument(
        "--oltp-tps",
        type=float,
        help="yield: run OLTP at this rate instead of half its maximum measured first",
    )
    parser.add_argument(
        "--yield-out",
        type=Path,
        help="yield: where the monitor's CSVs go (default: the run's folder)",
    )
    options = parser.parse_args()
    sizes = QUICK if options.quick else FULL
    if options.soak_jobs or options.hold_seconds or options.repeat:
        before, hold, after = sizes.hold
        sizes = Sizes(**{
            **asdict(sizes),
            "soak_jobs": options.soak_jobs or sizes.soak_jobs,
            "hold": (before, options.hold_seconds or hold, after),
            "repeat": options.repeat or sizes.repeat,
        })  # fmt: skip
    sections = set(options.only.split(","))

    from bench.cluster import SETTINGS, migrated

    if options.naptime:
        SETTINGS["autovacuum_naptime"] = options.naptime
    with migrated() as (cluster, logs):
        # The yield and limits sections need no ceiling: alone, they run without one.
        alone = {"yield", "limits"}
        rows = run(cluster, sizes, sections - alone, logs) if sections - alone else []
        if "yield" in sections:
            from bench import yielding

            rows += yielding.rows(cluster, sizes, logs, options, Row, say)
        if "limits" in sections:
            from bench import limits

            backlog = 100_000 if options.quick else 1_000_000
            say(f"limits: {backlog:,} jobs over 10,000 keys, then 200 claims of 10")
            rows += limits.rows(cluster, backlog, 10_000, 200, Row)
        info = {
            "postgres": cluster.version(),
            **{f"pg {k}": v for k, v in cluster.settings([*SETTINGS, "wal_sync_method"]).items()},
            **machine(),
        }
    report = "\n".join(
        [
            table(rows),
            "",
            "| setting | value |",
            "|---|---|",
            *(f"| {key} | {value} |" for key, value in info.items()),
        ]
    )
    print(report)
    (logs / "report.md").write_text(report + "\n")
    (logs / "report.json").write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "info": info}, indent=1)
    )
    print(f"\n(report and worker logs in {logs.relative_to(ROOT)})", file=sys.stderr)


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(cluster: Any, sizes: Sizes, sections: set[str], logs: Path) -> list[Row]:
    from bench import ceiling, workloads
    from django_pgjobs.runtime.worker import Options

    rows: list[Row] = []
    repeat = sizes.repeat

    say("ceiling: pgbench claim + complete, inserts")
    claim = {
        (batch, clients): ceiling.claim_complete(cluster, batch, clients, jobs, repeat)
        for batch, jobs in sizes.ceiling_jobs.items()
        for clients in (1, 2)
    }
    insert_one = {c: ceiling.insert(cluster, 1, c, sizes.insert_seconds, repeat) for c in (1, 16)}
    insert_txn = {
        c: ceiling.insert(cluster, 1, c, sizes.insert_seconds, repeat, explicit=True)
        for c in (1, 16)
    }
    insert_batch = ceiling.insert(cluster, 1000, 1, sizes.insert_seconds, repeat)
    for (batch, clients), value in claim.items():
        rows.append(Row(f"ceiling: claim {batch} + complete, {clients} conn", value, "jobs/s"))
    rows.append(Row("ceiling: 1-row INSERT per txn, 1 conn", insert_one[1], "jobs/s"))
    rows.append(Row("ceiling: 1-row INSERT per txn, 16 conn", insert_one[16], "jobs/s"))
    rows.append(Row("ceiling: BEGIN; 1-row INSERT; COMMIT, 1 conn", insert_txn[1], "jobs/s"))
    rows.append(Row("ceiling: BEGIN; 1-row INSERT; COMMIT, 16 conn", insert_txn[16], "jobs/s"))
    rows.append(Row("ceiling: 1000-row INSERT per txn, 1 conn", insert_batch, "jobs/s"))

    def claim_ceiling(batch: float, clients: int = 1) -> tuple[str, float]:
        # The smallest measured batch at least as large: a ceiling the figure must earn.
        near = min(
            (b for b in sizes.ceiling_jobs if b >= batch - 0.5), default=max(sizes.ceiling_jobs)
        )
        return f"claim {near} + complete, {clients} conn", claim[(near, clients)]

    def same_batch(drain: Any, clients: int = 1) -> tuple[str, float]:
        """The ceiling at the batch the workers actually ran: jobs per statement (each claims
        and completes), threads plus prefetch, not the thread count."""
        return claim_ceiling(1 / drain.statements, clients)

    if "w1" in sections:
        say("W1 bulk enqueue")
        runs = sorted(workloads.bulk_enqueue(cluster, sizes.bulk) for _ in range(repeat))
        value, client, server = runs[len(runs) // 2]
        rows.append(Row(f"W1 bulk_enqueue {sizes.bulk:,}", value, "jobs/s",
                        "1000-row INSERT", insert_batch, "≥ 100,000 jobs/s", value >= 100_000,
                        f"client CPU {client:.2f} cores, server {server:.2f}"))  # fmt: skip

    if "w2" in sections:
        say("W2 transactional enqueue")
        single: dict[tuple[int, bool], float] = {}
        cpu: dict[tuple[int, bool], float] = {}
        for threads in (1, 16):
            for notify in (True, False):
                runs = sorted(
                    workloads.single_enqueue(cluster, threads, sizes.enqueue_seconds, notify)
                    for _ in range(repeat)
                )
                single[(threads, notify)], cpu[(threads, notify)] = runs[len(runs) // 2]
        for threads, target in ((1, 4_000), (16, 10_000)):
            for notify in (True, False):
                value = single[(threads, notify)]
                rows.append(Row(
                    f"W2 enqueue in atomic(), {threads} thread(s), wake-ups "
                    f"{'on' if notify else 'off'}", value, "jobs/s", "BEGIN; INSERT; COMMIT",
                    insert_txn[threads], f"≥ {target:,} jobs/s", value >= target,
                    f"client CPU {cpu[(threads, notify)]:.2f} cores",
                ))  # fmt: skip
            share = single[(threads, True)] / single[(threads, False)]
            rows.append(Row(f"W2 wake-ups on / off, {threads} thread(s)", share, "×",
                            target="≥ 0.8", met=share >= 0.8))  # fmt: skip
        added = workloads.enqueue_added_time(cluster, 2000 if repeat > 1 else 500)
        rows.append(Row("W2 time enqueue adds in atomic(), p50", added["p50"], "ms",
                        target="≤ 0.3 ms", met=added["p50"] <= 0.3))  # fmt: skip
        rows.append(Row("W2 time enqueue adds in atomic(), p99", added["p99"], "ms",
                        target="≤ 1 ms", met=added["p99"] <= 1.0))  # fmt: skip
        rows.append(Row("W2 statements per enqueue", added["statements"], "",
                        target="one statement", met=added["inserts"] == 1.0,
                        note=f"{added['inserts']:.2f} INSERT, carrying the coalesced wake-up "
                        f"in {added['notifies']:.0%} of them"))  # fmt: skip

    w3: float | None = None
    if sections & {"w3", "w4", "w6", "w7"}:
        startup = workloads.startup_cpu(cluster, logs)
        say("W3 drain, default settings, 1 process")
        runs = [
            workloads.drain(cluster, sizes.drain, 1, [], logs, startup)
            for _ in range(repeat if "w3" in sections else 1)
        ]
        result = sorted(runs, key=lambda d: d.jobs_per_second)[len(runs) // 2]
        w3 = result.jobs_per_second
        name, ceil = same_batch(result)
        if "w3" in sections:
            rows.append(Row(
                f"W3 drain {sizes.drain:,}, defaults, 1 process", w3, "jobs/s", name, ceil,
                "≥ 20,000 jobs/s and ≥ 0.6 × ceiling", w3 >= 20_000 and w3 / ceil >= 0.6,
                _cause(result),
            ))  # fmt: skip
            rows.append(Row("W3 defaults: statements per job", result.statements, "",
                            target="≤ 0.25", met=result.statements <= 0.25))  # fmt: skip
            rows.append(Row("W3 defaults: commits per job", result.commits, "",
                            target="≤ 0.25", met=result.commits <= 0.25))  # fmt: skip
            rows.append(Row("W3 defaults: WAL bytes per job", result.wal_bytes, "B"))
    if "w3" in sections:
        say("W3 drain, WORKER_SYNCHRONOUS_COMMIT (the worker's commits durable)")
        runs = [
            workloads.drain(cluster, sizes.drain, 1, [], logs, startup, env={"BENCH_SYNC": "1"})
            for _ in range(repeat)
        ]
        durable = sorted(runs, key=lambda d: d.jobs_per_second)[len(runs) // 2]
        name, ceil = same_batch(durable)
        slower = w3 / durable.jobs_per_second
        rows.append(Row("W3 drain, WORKER_SYNCHRONOUS_COMMIT = True", durable.jobs_per_second,
                        "jobs/s", name, ceil,
                        note=f"the default is {slower:.2f} × this; {_cause(durable)}"))  # fmt: skip
        say("W3 drain, prepared statements")
        prepared = workloads.drain(cluster, sizes.drain, 1, [], logs, startup,
                                   env={"BENCH_PREPARE": "5"})  # fmt: skip
        name, ceil = same_batch(prepared)
        rows.append(Row("W3 drain, defaults + prepare_threshold=5", prepared.jobs_per_second,
                        "jobs/s", name, ceil, note=_cause(prepared)))  # fmt: skip
        say("W3 drain, --concurrency 100")
        wide = workloads.drain(cluster, sizes.drain, 1, ["--concurrency", "100"], logs, startup)
        name, ceil = claim_ceiling(100)
        rows.append(Row("W3 drain, --concurrency 100 (claims of up to 100)", wide.jobs_per_second,
                        "jobs/s", name, ceil, note=_cause(wide)))  # fmt: skip
        rows.append(Row("W3 --concurrency 100: statements / commits per job", wide.statements,
                        "", note=f"{wide.commits:.3f} commits"))  # fmt: skip
        say("W3 drain, 2 processes")
        two = workloads.drain(cluster, sizes.drain, 2, [], logs, startup)
        name, ceil = same_batch(two, 2)
        rows.append(Row(f"W3 drain {sizes.drain:,}, defaults, 2 processes", two.jobs_per_second,
                        "jobs/s", name, ceil, note=_cause(two)))  # fmt: skip
        say("W3 drain, --processes 2 (one supervisor, two children)")
        runs = [
            workloads.drain(cluster, sizes.drain, 2, [], logs, startup, supervised=True)
            for _ in range(repeat)
        ]
        supervised = sorted(runs, key=lambda d: d.jobs_per_second)[len(runs) // 2]
        value = supervised.jobs_per_second
        name, ceil = same_batch(supervised, 2)
        assert w3 is not None
        rows.append(Row(
            f"W3 drain {sizes.drain:,}, defaults, --processes 2", value, "jobs/s", name, ceil,
            "≥ 1.7 × 1 process and ≥ 20,000 jobs/s", value >= 1.7 * w3 and value >= 20_000,
            f"{value / w3:.2f} × 1 process ({two.jobs_per_second / w3:.2f} × for 2 separate "
            f"processes); {_cause(supervised)}",
        ))  # fmt: skip
        say("W3 strict mode")
        strict = workloads.drain(cluster, sizes.strict, 1, ["--batch-size", "1"], logs, startup)
        name, ceil = claim_ceiling(1)
        rows.append(Row(f"W3 strict (--batch-size 1), {sizes.strict:,}", strict.jobs_per_second,
                        "jobs/s", name, ceil, "≥ 2,500 jobs/s", strict.jobs_per_second >= 2500,
                        _cause(strict)))  # fmt: skip
        rows.append(Row("W3 strict: statements per job", strict.statements, "",
                        target="≤ 2", met=strict.statements <= 2))  # fmt: skip
        rows.append(Row("W3 strict: commits per job", strict.commits, "",
                        target="≤ 2", met=strict.commits <= 2))  # fmt: skip

    if "w4" in sections:
        say("W4 failing mix")
        # W4's task takes a payload and reads current_job(), W3's no-op neither: the same task
        # with no failure, in alternated runs, separates the failures' cost from the task's.
        pairs = [
            (workloads.drain(cluster, sizes.drain, 1, [], logs, startup, fail_share=0.1),
             workloads.drain(cluster, sizes.drain, 1, [], logs, startup, fail_share=0.0))
            for _ in range(repeat)
        ]  # fmt: skip
        mix = sorted((m for m, _ in pairs), key=lambda d: d.jobs_per_second)[len(pairs) // 2]
        same = statistics.median(c.jobs_per_second for _, c in pairs)
        name, ceil = same_batch(mix)
        assert w3 is not None
        rows.append(Row("W4 drain, 10% fail once", mix.jobs_per_second, "jobs/s", name, ceil,
                        "≥ 0.85 × W3", mix.jobs_per_second >= 0.85 * w3,
                        f"{mix.jobs_per_second / w3:.2f} × W3; "
                        f"{mix.jobs_per_second / same:.2f} × the same task with none failing "
                        f"({same:,.0f} jobs/s)"))  # fmt: skip

    if "w5" in sections:
        say("W5's floor: a round trip after 20 ms idle")
        idle = {pause: ceiling.idle_round_trip(cluster, pause) for pause in (0.0, 0.02)}
        rows.append(Row("floor: SELECT 1 round trip after 20 ms idle (W5's 50/s pace), p50",
                        idle[0.02], "ms",
                        note=f"{idle[0.02] / idle[0.0]:.1f} × back to back "
                        f"({idle[0.0]:.3f} ms)"))  # fmt: skip
        for listen in (True, False):
            for rate in (50, 1000):
                say(f"W5 latency {rate}/s {'LISTEN' if listen else 'poll-only'}")
                lat = workloads.latency(cluster, rate, sizes.latency_seconds, listen, logs)
                mode = "LISTEN" if listen else "poll-only"
                label = f"W5 {rate}/s {mode} (achieved {lat['rate']:.0f}/s)"
                if listen and rate == 50:
                    checks = [("p50", 1.0), ("p99", 3.0)]
                elif listen:
                    checks = [("p50", 5.0), ("p99", 25.0)]
                else:
                    checks = [("p99", Options().poll_interval * 1000 + 10)]
                for key in ("p50", "p95", "p99"):
                    limit = dict(checks).get(key)
                    rows.append(Row(f"{label} {key}", lat[key], "ms",
                                    target=f"≤ {limit:g} ms" if limit else "",
                                    met=None if limit is None else lat[key] <= limit,
                                    note=f"{lat['missing']:.0f} missing" if lat["missing"]
                                    else ""))  # fmt: skip

    if "w5" in sections:
        say("W5 latency 50/s LISTEN, WORKER_SYNCHRONOUS_COMMIT")
        lat = workloads.latency(cluster, 50, sizes.latency_seconds, True, logs, BENCH_SYNC="1")
        for key in ("p50", "p95", "p99"):
            rows.append(Row(f"W5 50/s LISTEN, WORKER_SYNCHRONOUS_COMMIT = True, {key}", lat[key],
                            "ms"))  # fmt: skip

    if "heartbeat" in sections:
        say("heartbeats: HOT share")
        for beats, wanted in ((1, 0.85), (3, 0.90), (20, 0.90)):  # issue #17's targets
            share = workloads.heartbeat_hot_share(cluster, 1000, beats)
            rows.append(Row(f"Heartbeat updates that are HOT, {beats} per job", share, "share",
                            target=f"≥ {wanted:.2f}", met=share >= wanted))  # fmt: skip

    if "w7" in sections:
        say(f"W7 drain beside {sizes.scheduled:,} scheduled jobs of a higher priority")
        assert w3 is not None
        runs = [
            workloads.drain(cluster, sizes.drain, 1, [], logs, startup, scheduled=sizes.scheduled)
            for _ in range(repeat)
        ]
        backlog = sorted(runs, key=lambda d: d.jobs_per_second)[len(runs) // 2]
        value = backlog.jobs_per_second
        name, ceil = same_batch(backlog)
        rows.append(Row(
            f"W7 drain {sizes.drain:,} beside {sizes.scheduled:,} scheduled", value, "jobs/s",
            name, ceil, "≥ 0.9 × W3", value >= 0.9 * w3,
            f"{value / w3:.2f} × W3; {_cause(backlog)}",
        ))  # fmt: skip

    if "w9" in sections:
        say(f"W9 worker memory over {sizes.memory_jobs:,} jobs")
        mem = workloads.memory(cluster, sizes.memory_jobs, logs)
        rows.append(Row(f"W9 worker resident memory, {sizes.memory_jobs:,} jobs: growth after "
                        "warm-up", mem.growth * 100, "%", target="≤ 5%", met=mem.growth <= 0.05,
                        note=f"{mem.warm_mb:.1f} MB at 10% of the jobs, {mem.end_mb:.1f} MB at "
                        f"the last sample; {mem.jobs_per_second:,.0f} jobs/s"))  # fmt: skip
        rows.append(Row("W9 worker resident memory, peak", mem.peak_mb, "MB",
                        target="≤ 100 MB", met=mem.peak_mb <= 100))  # fmt: skip

    if "nats" in sections:
        rows.extend(_nats_rows(cluster, sizes, logs))

    if "w6" in sections:
        assert w3 is not None
        rate = 0.7 * w3
        name, ceil = same_batch(result)
        say(f"W6 soak: {sizes.soak_jobs:,} jobs at {rate:,.0f}/s")
        samples = workloads.soak(cluster, rate, jobs=sizes.soak_jobs, seconds=None, hold=None,
                                 logs=logs)  # fmt: skip
        rows.extend(_soak_rows(samples, sizes.soak_jobs, rate, name, ceil))
        before, hold, after = sizes.hold
        say(f"W6 held snapshot: {before:g}s + {hold:g}s held + {after:g}s")
        samples = workloads.soak(cluster, rate, jobs=None, seconds=before + hold + after,
                                 hold=(before, hold), logs=logs)  # fmt: skip
        rows.extend(_hold_rows(samples, before, hold))
    return rows


def _nats_rows(cluster: Any, sizes: Sizes, logs: Path) -> list[Row]:
    """N1–N2: a queue carried by NATS JetStream ($BENCH_NATS), beside the PostgreSQL drain."""
    from bench import nats_queues as nats
    from bench import workloads

    url = os.environ.get("BENCH_NATS", "nats://127.0.0.1:4222")
    count = sizes.drain // 2
    rows = []
    say(f"N1 relay throughput, {count:,} jobs")
    with nats.nats_queue(url) as env:
        relay = nats.relay_throughput(cluster, count)
        rows.append(Row(f"N1 relay {count:,} outbox rows to JetStream", relay.jobs_per_second,
                        "jobs/s", note=f"{relay.statements:.3f} statements, {relay.commits:.3f} "
                        "commits per job on PostgreSQL"))  # fmt: skip
        say(f"N2 drain through JetStream, {count:,} jobs")
        through = nats.drain(cluster, count, env, logs)
    say(f"N2 PostgreSQL drain, {count:,} jobs, beside it")
    local = workloads.drain(cluster, count, 1, [], logs, workloads.startup_cpu(cluster, logs))
    rows.append(Row(f"N2 drain {count:,} through JetStream (relay + runjobs, 1 process)",
                    through.jobs_per_second, "jobs/s",
                    note=f"{through.statements:.3f} statements, {through.commits:.3f} commits "
                    "per job on PostgreSQL; wall time with start-up"))  # fmt: skip
    rows.append(Row(f"N2 drain {count:,} in PostgreSQL (runjobs, 1 process)",
                    local.jobs_per_second, "jobs/s",
                    note=f"{local.statements:.3f} statements, {local.commits:.3f} commits "
                    "per job"))  # fmt: skip
    return rows


def _cause(drain: Any) -> str:
    waits = ", ".join(f"{k} {v:.0%}" for k, v in drain.waits.items())
    return (
        f"worker CPU {drain.worker_cpu:.2f} cores, server {drain.server_cpu:.2f} cores; "
        f"backends: {waits}"
    )


def _crossing(samples: list[Any], count: float) -> float:
    """Interpolated time at which `count` jobs had completed."""
    previous_at, previous = 0.0, 0
    for sample in samples:
        if sample.completed >= count:
            span = sample.completed - previous
            share = (count - previous) / span if span else 1.0
            return float(previous_at + share * (sample.at - previous_at))
        previous_at, previous = sample.at, sample.completed
    return float(samples[-1].at)


def _soak_rows(samples: list[Any], jobs: int, rate: float, name: str, ceil: float) -> list[Row]:
    slices = []
    for k in range(10):
        start, end = _crossing(samples, jobs * k / 10), _crossing(samples, jobs * (k + 1) / 10)
        slices.append(jobs / 10 / max(end - start, 1e-3))
    steady = samples[len(samples) // 5 :] or samples
    size = max(s.size_mb for s in steady)
    dead = max(s.dead for s in samples)
    return [
        Row(f"W6 soak {jobs:,} at {rate:,.0f}/s: slices", statistics.median(slices), "jobs/s",
            name, ceil, note="per 10%: " + " ".join(f"{s / 1000:.1f}k" for s in slices)),
        Row("W6 soak: last 10% / first 10%", slices[-1] / slices[0], "×", target="≥ 0.9",
            met=slices[-1] / slices[0] >= 0.9),
        Row("W6 soak: table + indexes, steady state (max)", size, "MB", target="≤ 96 MB",
            met=size <= 96),
        Row("W6 soak: dead tuples (max)", dead, "", target="< 100k", met=dead < 100_000),
    ]  # fmt: skip


def _rate(samples: list[Any], start: float, end: float) -> float:
    inside = [s for s in samples if start <= s.at <= end]
    if len(inside) < 2:
        return 0.0
    return (inside[-1].completed - inside[0].completed) / (inside[-1].at - inside[0].at)


def _hold_rows(samples: list[Any], before: float, hold: float) -> list[Row]:
    clean = _rate(samples, min(5.0, before / 2), before)
    during = _rate(samples, before, before + hold)
    released = before + hold
    recovered = None
    for sample in samples:
        if sample.at > released + 5 and _rate(samples, sample.at - 5, sample.at) >= 0.95 * clean:
            recovered = sample.at - released
            break
    size = max(s.size_mb for s in samples)
    dead = max(s.dead for s in samples)
    return [
        Row("W6 held snapshot: during the hold / clean", during / clean if clean else 0.0, "×",
            target="≥ 0.5", met=clean > 0 and during / clean >= 0.5,
            note=f"clean {clean:,.0f}/s, held {during:,.0f}/s"),
        Row("W6 held snapshot: back to ≥ 0.95 × clean after", recovered or float("inf"), "s",
            target="≤ 60 s", met=recovered is not None and recovered <= 60),
        Row("W6 held snapshot: table + indexes (max) / dead tuples (max)", size, "MB",
            note=f"{dead:,} dead tuples"),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
