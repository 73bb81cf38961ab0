"""The yield benchmark (`bench/run.py --only yield`): OLTP (pgbench's TPC-B-like script, scale
10, 4 clients, throttled to half its maximum) beside the queue, with runjobs' guard on (its
defaults) and off (--no-yield).

- Pairs: the normal day (a steady enqueue, a worker keeping up), then a 200,000-job backlog
  draining beside the same enqueue with the guard on and off, in turns (A B A B), so that the
  machine's drift falls on both sides; the figures are medians over the pairs.
- Step: OLTP switched on in the middle of a drain, then off: how soon its p99 is back within
  1.5 × the normal day's, and how soon the queue is back to 90 % of its rate before.
- Four workers (two `runjobs --processes 2`): the same figures, and each worker's share.
- Saturation: OLTP unthrottled beside two queues, one that yields and one that never does.
- Idle: W3's drain with the guard on and off, no OLTP (one process, and --processes 2).

Each case's monitor samples and per-second series land in --yield-out (bench/yield_report.py
draws them).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: The steady enqueue beside OLTP, jobs/s: the normal day's whole load on the queue.
RATE = 1_000
#: A queue that never yields beside one that does, for the saturation case.
URGENT = {"BENCH_PGJOBS_NATS": json.dumps({"QUEUES": {"urgent": {"YIELD_BUDGET": None}}})}


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def settled_after(
    series: Path, start: float, end: float, ok: Callable[[dict[str, str]], bool]
) -> float | None:
    """Seconds from `start` (epoch) to the first second from which every second up to `end` is
    `ok`; None if none is."""
    rows = [row for row in _seconds(series) if start <= int(row["second"]) < end]
    for n, row in enumerate(rows):
        if all(ok(later) for later in rows[n:]):
            return max(0.0, int(row["second"]) - start)
    return None


def _seconds(series: Path) -> list[dict[str, str]]:
    import csv

    with series.open() as rows:
        return list(csv.DictReader(rows))


def p99_within(
    transactions: list[tuple[float, float]], start: float, end: float, target: float
) -> float | None:
    """Seconds from `start` until the p99 of every transaction completed from then to `end`
    is at most `target` (ms), in steps of a second; None if never."""
    from bench.workloads import percentile

    for after in range(int(end - start)):
        later = [ms for at, ms in transactions if start + after <= at < end]
        if len(later) >= 100 and percentile(later, 99) <= target:
            return float(after)
    return None


def jobs_per_second(series: Path, start: float, end: float) -> float:
    rows = [row for row in _seconds(series) if start <= int(row["second"]) < end]
    return sum(int(row["jobs_finished"]) for row in rows) / max(1, len(rows))


def rows(cluster: Any, sizes: Any, logs: Path, options: Any, row: Any, say: Any) -> list[Any]:
    """The section's rows (bench/run.py's Row, passed in as `row`)."""
    from bench import workloads

    out = options.yield_out or logs
    out.mkdir(parents=True, exist_ok=True)
    say(f"yield: pgbench -i -s {workloads_scale()}, its unthrottled maximum")
    workloads.oltp_init(cluster, workloads_scale())
    found = []
    if options.oltp_tps:
        limit = options.oltp_tps
    else:
        maximum = workloads.oltp_maximum(cluster, CLIENTS, sizes.oltp_seconds)
        limit = maximum / 2
        found.append(row(f"Y OLTP (TPC-B-like, scale {workloads_scale()}, {CLIENTS} clients) "
                         "unthrottled, alone", maximum, "tps"))  # fmt: skip
    seconds = sizes.yield_seconds

    def case(name: str, backlog: int = 0, rate: float = RATE, **kwargs: Any) -> Any:
        say(f"yield {name}: OLTP at {kwargs.get('limit', limit) or 0:,.0f} tps, backlog "
            f"{backlog:,}, enqueue {rate:,.0f}/s")  # fmt: skip
        kwargs.setdefault("limit", limit)
        kwargs.setdefault("seconds", seconds)
        return workloads.yield_case(
            cluster, name, clients=CLIENTS, backlog=backlog, rate=rate, out=out, logs=logs,
            **kwargs,
        )  # fmt: skip

    alone = case("alone", rate=0)
    found += [
        row("Y OLTP alone: tps", alone.tps, "tps", note=f"target {limit:,.0f}"),
        row("Y OLTP alone: p99", alone.p99, "ms", note=f"p50 {alone.p50:.2f} ms"),
    ]
    if "pairs" in options.yield_parts:
        found += _pairs(case, sizes, options.yield_pairs, limit, row)
    if "step" in options.yield_parts:
        found += _step(case, sizes, options.yield_pairs, row)
    if "four" in options.yield_parts:
        found += _four(case, sizes, row)
    if "saturated" in options.yield_parts:
        found += _saturated(case, sizes, row)
    if "idle" in options.yield_parts:
        found += _idle(cluster, sizes, logs, options.yield_pairs, row, say)
    return found


CLIENTS = 4


def workloads_scale() -> int:
    return 10


def _pairs(case: Any, sizes: Any, pairs: int, limit: float, row: Any) -> list[Any]:
    """Normal day, then backlog with the guard on and off in turns."""
    normal, on, off = [], [], []
    for n in range(pairs):
        normal.append(case(f"normal-{n}"))
        order = (False, True) if n % 2 == 0 else (True, False)
        for no_yield in order:
            name = f"backlog-{'off' if no_yield else 'on'}-{n}"
            result = case(name, backlog=sizes.backlog, no_yield=no_yield)
            (off if no_yield else on).append(result)
    on_ratio = [a.p99 / b.p99 for a, b in zip(on, normal, strict=True)]
    off_ratio = [a.p99 / b.p99 for a, b in zip(off, normal, strict=True)]
    return [
        row(f"Y normal day ({RATE:,}/s enqueued, kept up): OLTP p99, {pairs} runs",
            median([r.p99 for r in normal]), "ms",
            note="runs " + " ".join(f"{r.p99:.1f}" for r in normal)),
        row(f"Y backlog, guard on: OLTP p99 / the normal day's, {pairs} pairs", median(on_ratio),
            "×", target="≤ 1.5", met=median(on_ratio) <= 1.5,
            note="pairs " + " ".join(f"{r:.2f}" for r in on_ratio)
            + f"; p99 {median([r.p99 for r in on]):.1f} ms"),
        row("Y backlog, guard on: OLTP tps / its target", median([r.tps / limit for r in on]),
            "×", target="≥ 0.97", met=median([r.tps / limit for r in on]) >= 0.97),
        row("Y backlog, guard on: jobs finished", median([r.drain for r in on]), "jobs/s",
            target="≥ 2,000", met=median([r.drain for r in on]) >= 2000,
            note="runs " + " ".join(f"{r.drain:,.0f}" for r in on)),
        row(f"Y backlog, guard off: OLTP p99 / the normal day's, {pairs} pairs",
            median(off_ratio), "×", note="pairs " + " ".join(f"{r:.2f}" for r in off_ratio)
            + f"; p99 {median([r.p99 for r in off]):.1f} ms"),
        row("Y backlog, guard off: jobs finished", median([r.drain for r in off]), "jobs/s"),
    ]  # fmt: skip


def _step(case: Any, sizes: Any, runs: int, row: Any) -> list[Any]:
    """OLTP switched on mid-drain, then off (guard on), against a normal day run just before."""
    on_after, off_after, ratios = [], [], []
    for n in range(runs):
        normal = case(f"step-normal-{n}")
        result = case(f"step-{n}", backlog=sizes.step_backlog, step=sizes.step)
        events, series = result.events, result.series
        before = jobs_per_second(series, events["worker"] + 1, events["oltp_on"])
        on_after.append(p99_within(result.transactions, events["oltp_on"],
                                   events["oltp_off"], 1.5 * normal.p99))  # fmt: skip
        off_after.append(settled_after(
            series, events["oltp_off"], events["end"] - 1,
            lambda r, before=before: int(r["jobs_finished"]) >= 0.9 * before,
        ))  # fmt: skip
        ratios.append(before)
    shown = [float("inf") if x is None else x for x in on_after]
    back = [float("inf") if x is None else x for x in off_after]
    return [
        row(f"Y step: OLTP on mid-drain → p99 ≤ 1.5 × the normal day's after, {runs} runs",
            median(shown), "s", target="≤ 5 s", met=median(shown) <= 5,
            note="runs " + " ".join(f"{x:g}" for x in shown)),
        row(f"Y step: OLTP off → the queue at ≥ 90 % of its rate before after, {runs} runs",
            median(back), "s", target="≤ 10 s", met=median(back) <= 10,
            note="runs " + " ".join(f"{x:g}" for x in back)
            + "; rates before " + " ".join(f"{r:,.0f}" for r in ratios)),
    ]  # fmt: skip


def _four(case: Any, sizes: Any, row: Any) -> list[Any]:
    """Two `runjobs --processes 2` (four workers) draining beside OLTP, guard on."""
    normal = case("four-normal")
    result = case("four", backlog=sizes.backlog, workers=(("--processes=2",),) * 2)
    shares = sorted(result.workers.values())
    fairness = shares[0] / shares[-1] if shares and shares[-1] else float("nan")
    return [
        row("Y four workers, guard on: OLTP p99 / the normal day's", result.p99 / normal.p99,
            "×", target="≤ 1.5", met=result.p99 / normal.p99 <= 1.5,
            note=f"p99 {result.p99:.1f} ms, normal day {normal.p99:.1f} ms"),
        row("Y four workers, guard on: jobs finished", result.drain, "jobs/s"),
        row("Y four workers: the smallest worker's jobs / the largest's", fairness, "×",
            target="≥ 0.5", met=fairness >= 0.5,
            note=f"{len(shares)} workers: " + " ".join(f"{s:,}" for s in shares)),
    ]  # fmt: skip


def _saturated(case: Any, sizes: Any, row: Any) -> list[Any]:
    """OLTP as fast as it goes beside two queues: "default" yields, "urgent" never does."""
    runs = {}
    for no_yield in (False, True):
        name = f"saturated-{'off' if no_yield else 'on'}"
        runs[no_yield] = case(
            name, backlog=sizes.backlog // 4, rate=0, limit=None, queues=("default", "urgent"),
            env=URGENT, no_yield=no_yield,
        )  # fmt: skip
    on, off = runs[False], runs[True]
    urgent = on.queues.get("urgent", 0.0) / max(off.queues.get("urgent", 0.0), 1e-9)
    return [
        row("Y OLTP saturating, guard on: the yielding queue's jobs finished",
            on.queues.get("default", 0.0), "jobs/s", target="≥ its floor (10)",
            met=on.queues.get("default", 0.0) >= 10,
            note=f"guard off {off.queues.get('default', 0.0):,.0f} jobs/s; OLTP {on.tps:,.0f} "
            f"tps on, {off.tps:,.0f} off"),
        row("Y OLTP saturating: the never-yield queue, guard on / off", urgent, "×",
            target="≈ 1", note=f"{on.queues.get('urgent', 0.0):,.0f} and "
            f"{off.queues.get('urgent', 0.0):,.0f} jobs/s"),
    ]  # fmt: skip


def _idle(cluster: Any, sizes: Any, logs: Path, pairs: int, row: Any, say: Any) -> list[Any]:
    """W3's drain with no OLTP, the guard on and off in turns: what the guard costs."""
    from bench import workloads

    found = []
    for processes, supervised in ((1, False), (2, True)):
        ratios = []
        for n in range(pairs):
            rates = {}
            for no_yield in (False, True) if n % 2 == 0 else (True, False):
                say(f"yield idle: W3 {sizes.drain:,} jobs, {processes} process(es), "
                    f"{'--no-yield' if no_yield else 'guard on'}")  # fmt: skip
                startup = workloads.startup_cpu(cluster, logs)
                drained = workloads.drain(
                    cluster, sizes.drain, processes, ["--no-yield"] if no_yield else [], logs,
                    startup, supervised=supervised,
                )  # fmt: skip
                rates[no_yield] = drained.jobs_per_second
            ratios.append(rates[False] / rates[True])
        found.append(row(
            f"Y idle: W3 drain, guard on / --no-yield, {processes} process(es), {pairs} pairs",
            median(ratios), "×", target="≥ 0.95", met=median(ratios) >= 0.95,
            note="pairs " + " ".join(f"{r:.3f}" for r in ratios),
        ))  # fmt: skip
    return found
