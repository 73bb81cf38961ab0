"""Reads the yield section's CSVs (bench/monitor.py's samples and the per-second series) and
prints, per signal, how it reads in each case and in each phase of the step run, and the step
runs of several directories side by side; with `--plot FILE`, draws the first one's step run
(needs matplotlib). `python bench/yield_report.py DIR [DIR ...] [--plot FILE]`.

Phases of the step run: `idle` (before the worker), `queue` (the drain alone, from 2 s after
the worker started), `oltp` (the drain beside OLTP, from 2 s after OLTP started), `after`
(the drain alone again, from 2 s after OLTP stopped). The separation of a signal is the
probability that a sample of `oltp` reads higher than one of `queue` + `after` (0.5: none).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path
from typing import Any

#: The signals a worker could read (monitor.py's columns, or derived below), and their units.
SIGNALS = {
    "app_active": "sessions",
    "app_in_xact": "sessions",
    "app_waiting": "sessions",
    "app_active_ms_sum": "ms",
    "app_oldest_xact_ms": "ms",
    "select1_ms": "ms",
    "select1_again_ms": "ms",
    "pk_probe_ms": "ms",
    "head_probe_ms": "ms",
    "claim0_ms": "ms",
    "worker_turn_ms": "ms",
    "worker_busy": "share",
    "queue_active": "sessions",
    "commits_per_s": "/s",
    "wal_mb_per_s": "MB/s",
    "blks_read_per_s": "/s",
    "buffers_backend_per_s": "/s",
    "host_busy": "share",
}
SETTLE = 2.0  # seconds after a switch left out of a phase


def load(path: Path) -> list[dict[str, Any]]:
    rows = list(csv.DictReader(path.open()))
    out: list[dict[str, Any]] = []
    for row in rows:
        r: dict[str, Any] = {"t": float(row["t"])}
        for key in ("select1_ms", "select1_again_ms", "pk_probe_ms", "head_probe_ms",
                    "claim0_ms", "app_active", "app_waiting", "app_active_ms_sum",
                    "app_oldest_xact_ms", "pgbench_active"):  # fmt: skip
            r[key] = float(row[key])
        r["queue_active"] = float(row["queue_active"]) if row["queue_active"] else 0.0
        r["app_in_xact"] = float(row["app_active"]) + float(row["app_idle_in_xact"])
        r["app_waits"] = row["app_waits"]
        # A turn that finished: its whole duration; none while one is running (a lower bound).
        state = row["worker_state"]
        r["worker_turn_ms"] = float(row["worker_last_turn_ms"]) if state == "idle" else None
        r["worker_busy"] = 1.0 if state == "active" else 0.0 if state else None
        r["worker_running_ms"] = float(row["worker_running_ms"]) if state == "active" else None
        r["worker_wait"] = row["worker_wait"]
        for key in ("xact_commit", "blks_read", "wal_bytes", "buffers_backend",
                    "host_busy_jiffies", "host_jiffies"):  # fmt: skip
            r[key] = float(row[key])
        # The server's counters move when a backend flushes its statistics (at most once a
        # second): rates over the last second, not between samples.
        earlier = next((x for x in reversed(out) if x["t"] <= r["t"] - 1.0), None)
        if earlier is not None:
            dt = r["t"] - earlier["t"]
            for key, name, scale in (("xact_commit", "commits_per_s", 1),
                                     ("wal_bytes", "wal_mb_per_s", 2**20),
                                     ("blks_read", "blks_read_per_s", 1),
                                     ("buffers_backend", "buffers_backend_per_s", 1)):  # fmt: skip
                r[name] = (r[key] - earlier[key]) / dt / scale
            jiffies = r["host_jiffies"] - earlier["host_jiffies"]
            r["host_busy"] = (r["host_busy_jiffies"] - earlier["host_busy_jiffies"]) / jiffies
        out.append(r)
    return out


def events(directory: Path, case: str) -> dict[str, float]:
    path = directory / f"{case}-seconds.events"
    return {k: float(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def seconds(directory: Path, case: str) -> list[dict[str, Any]]:
    rows = []
    for row in csv.DictReader((directory / f"{case}-seconds.csv").open()):
        rows.append({
            "second": int(row["second"]), "oltp": int(row["oltp_transactions"]),
            "p50": float(row["oltp_p50_ms"]) if row["oltp_p50_ms"] else None,
            "p99": float(row["oltp_p99_ms"]) if row["oltp_p99_ms"] else None,
            "jobs": int(row["jobs_finished"]),
        })  # fmt: skip
    return rows


def phase(t: float, ev: dict[str, float]) -> str | None:
    if "worker" not in ev:
        return "oltp" if ev["oltp_on"] + SETTLE <= t <= ev["oltp_off"] else None
    if t < ev["worker"]:
        return "idle"
    if ev["worker"] + SETTLE <= t < ev["oltp_on"]:
        return "queue"
    if ev["oltp_on"] + SETTLE <= t <= ev["oltp_off"]:
        return "oltp"
    if t >= ev["oltp_off"] + SETTLE:
        return "after"
    return None


def values(samples: list[dict[str, Any]], key: str) -> list[float]:
    return [s[key] for s in samples if s.get(key) is not None]


def summary(xs: list[float]) -> str:
    if not xs:
        return "-"
    ordered = sorted(xs)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(xs):.3g} ({statistics.mean(xs):.3g}; p90 {p90:.3g})"


def separation(high: list[float], low: list[float]) -> float:
    """P(a sample of `high` > one of `low`), ties counted half (the AUC)."""
    if not high or not low:
        return float("nan")
    wins = sum((h > x) + 0.5 * (h == x) for h in high for x in low)
    return wins / (len(high) * len(low))


def rolling(samples: list[dict[str, Any]], key: str, width: float = 1.0) -> list[tuple]:
    """(t, mean over the last `width` seconds) for each sample."""
    out = []
    for i, s in enumerate(samples):
        window = [x[key] for x in samples[: i + 1] if x["t"] > s["t"] - width and x.get(key)
                  is not None]  # fmt: skip
        out.append((s["t"], statistics.mean(window) if window else None))
    return out


def detection(samples: list[dict[str, Any]], key: str, ev: dict[str, float],
              threshold: float) -> tuple[float | None, float | None]:  # fmt: skip
    """Seconds from OLTP on until the 1-s mean first crosses `threshold`; from OLTP off until it
    is back under it for good."""
    smooth = rolling(samples, key)
    up = next((t - ev["oltp_on"] for t, v in smooth if t >= ev["oltp_on"] and v is not None
               and v > threshold), None)  # fmt: skip
    after = [(t, v) for t, v in smooth if t >= ev["oltp_off"] and v is not None]
    down = None
    for i, (t, _) in enumerate(after):
        if all(v <= threshold for _, v in after[i:]):
            down = t - ev["oltp_off"]
            break
    return up, down


def report(directory: Path) -> None:
    cases = [c for c in ("alone", "normal-day", "backlog", "step")
             if (directory / f"{c}.csv").exists()]  # fmt: skip
    data = {c: load(directory / f"{c}.csv") for c in cases}
    print("| signal | " + " | ".join(cases[:-1]) + " | step: idle | step: queue alone | "
          "step: beside OLTP | step: after | step: separation | step: on/off medians | "
          "backlog vs normal day: separation |")  # fmt: skip
    print("|---" * (len(cases) + 7) + "|")
    ev = events(directory, "step")
    step = [dict(s, phase=phase(s["t"], ev)) for s in data["step"]]
    for key, unit in SIGNALS.items():
        cells, inside = [], {}
        for case in cases[:-1]:
            e = events(directory, case)
            window = [s for s in data[case] if e["oltp_on"] + SETTLE <= s["t"] <= e["oltp_off"]]
            inside[case] = values(window, key)
            cells.append(summary(inside[case]))
        versus = separation(inside.get("backlog", []), inside.get("normal-day", []))
        by_phase = {p: values([s for s in step if s["phase"] == p], key)
                    for p in ("idle", "queue", "oltp", "after")}  # fmt: skip
        off = by_phase["queue"] + by_phase["after"]
        sep = separation(by_phase["oltp"], off)
        ratio = (
            statistics.median(by_phase["oltp"]) / statistics.median(off)
            if off and by_phase["oltp"] and statistics.median(off)
            else float("nan")
        )
        print(f"| {key} ({unit}) | " + " | ".join(cells) + " | "
              + " | ".join(summary(by_phase[p]) for p in ("idle", "queue", "oltp", "after"))
              + f" | {sep:.2f} | {ratio:.2f} | {versus:.2f} |")  # fmt: skip
    print()
    print("Step, per second (OLTP p99 ms, jobs finished; the signals' 1-s means):")
    per = seconds(directory, "step")
    keys = ["app_active", "app_in_xact", "select1_ms", "claim0_ms", "worker_turn_ms",
            "host_busy"]  # fmt: skip
    print("| s | phase | oltp tx | oltp p99 | jobs | " + " | ".join(keys) + " |")
    print("|---" * (5 + len(keys)) + "|")
    origin = ev["worker"]
    for row in per:
        inside = [s for s in step if row["second"] <= s["t"] < row["second"] + 1]
        means = []
        for key in keys:
            xs = values(inside, key)
            means.append(f"{statistics.mean(xs):.2f}" if xs else "-")
        ph = phase(row["second"] + 0.5, ev) or "-"
        p99 = f"{row['p99']:.1f}" if row["p99"] is not None else "-"
        print(f"| {row['second'] - origin:+.0f} | {ph} | {row['oltp']} | {p99} | {row['jobs']} | "
              + " | ".join(means) + " |")  # fmt: skip
    suffering(directory, cases, data)


def per_second(directory: Path, cases: list[str], data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every whole second of every case: OLTP fully on or off, the queue draining or not, the
    OLTP p99 and the signals' means over that second."""
    out = []
    for case in cases:
        ev = events(directory, case)
        for row in seconds(directory, case):
            sec = row["second"]
            inside = [s for s in data[case] if sec <= s["t"] < sec + 1]
            oltp = ev["oltp_on"] + 1 <= sec and sec + 1 <= ev["oltp_off"]
            quiet = sec + 1 <= ev["oltp_on"] or sec >= ev["oltp_off"] + 1
            queue = "worker" in ev and sec >= ev["worker"] + SETTLE and sec + 1 <= ev["end"]
            if not (oltp or quiet) or not inside:
                continue
            means = {}
            for key in SIGNALS:
                xs = values(inside, key)
                means[key] = statistics.mean(xs) if xs else None
            # Little's law: the application's mean time in a transaction, from how many of its
            # sessions are in one and how many transactions it commits (a worker would take its
            # own commits from pg_stat_database's; here pgbench's count and the enqueuer's 50/s).
            if oltp and means["app_in_xact"] is not None and row["oltp"]:
                enqueuer = 50 if case != "alone" else 0
                means["little_ms"] = means["app_in_xact"] / (row["oltp"] + enqueuer) * 1000
            out.append(dict(means, case=case, second=sec, oltp=oltp, queue=queue,
                            p99=row["p99"], jobs=row["jobs"]))  # fmt: skip
    return out


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def suffering(directory: Path, cases: list[str], data: dict[str, Any]) -> None:
    """Per second, across every case: does a signal follow the OLTP p99 (Spearman), tell the
    seconds OLTP suffered from those it did not, and stay under its level while only the
    queue runs?"""
    rows = per_second(directory, cases, data)
    alone = [r["p99"] for r in rows if r["case"] == "alone" and r["oltp"] and r["p99"]]
    if not alone:
        return
    bar = 3 * statistics.median(alone)
    on = [r for r in rows if r["oltp"] and r["p99"] is not None]
    bad = [r for r in on if r["p99"] > bar]
    fine = [r for r in on if r["p99"] <= bar]
    queue_only = [r for r in rows if not r["oltp"] and r["queue"]]
    print()
    print(
        f"Per second, all cases: OLTP on {len(on)} s, of which suffering (p99 > 3 × the "
        f"median second alone, {bar:.1f} ms) {len(bad)} s; the queue alone {len(queue_only)} s."
    )
    print("| signal | Spearman with p99 (OLTP on) | suffering vs fine (AUC) | "
          "suffering vs queue alone (AUC) | queue alone: max | suffering above it | "
          "fine above it |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for key in [*SIGNALS, "little_ms"]:
        pairs = [(r[key], r["p99"]) for r in on if r.get(key) is not None]
        rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
        b = [r[key] for r in bad if r.get(key) is not None]
        f = [r[key] for r in fine if r.get(key) is not None]
        q = [r[key] for r in queue_only if r.get(key) is not None]
        top = max(q) if q else float("nan")
        above_bad = sum(x > top for x in b) / len(b) if b and q else float("nan")
        above_fine = sum(x > top for x in f) / len(f) if f and q else float("nan")
        print(
            f"| {key} | {rho:.2f} | {separation(b, f):.2f} | {separation(b, q):.2f} | "
            f"{top:.3g} | {above_bad:.0%} | {above_fine:.0%} |"
        )


def quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def steps(directories: list[Path]) -> None:
    """The step runs side by side: each signal's 1-s means with the queue alone and beside
    OLTP (median, p10-p90), their separation, and how long after OLTP started (stopped) the
    1-s mean first rose above (fell back under, for good) the highest it read before OLTP."""
    print()
    print("Step runs, 1-s means: queue alone / beside OLTP, median [p10-p90]; AUC; "
          "rise / fall (s) past the queue-alone maximum")  # fmt: skip
    names = [d.name for d in directories]
    print("| signal | " + " | ".join(names) + " |")
    print("|---" * (1 + len(names)) + "|")
    loaded = {d: load(d / "step.csv") for d in directories}
    for key in [*SIGNALS, "little_ms"]:
        cells = []
        for d in directories:
            rows = [r for r in per_second(d, ["step"], {"step": loaded[d]})
                    if r.get(key) is not None]  # fmt: skip
            q = [r[key] for r in rows if r["queue"] and not r["oltp"]]
            o = [r[key] for r in rows if r["oltp"]]
            if not o:
                cells.append("-")
                continue
            ev = events(d, "step")
            before = [v for t, v in rolling(loaded[d], key)
                      if ev["worker"] + SETTLE <= t < ev["oltp_on"] and v is not None]  # fmt: skip
            rise = fall = None
            if before and key != "little_ms":
                rise, fall = detection(loaded[d], key, ev, max(before))
            qs = (f"{statistics.median(q):.3g} [{quantile(q, 0.1):.3g}-{quantile(q, 0.9):.3g}]"
                  if q else "-")  # fmt: skip
            up = "-" if rise is None else f"{rise:.1f}"
            down = "-" if fall is None else f"{fall:.1f}"
            cells.append(
                f"{qs} / {statistics.median(o):.3g} [{quantile(o, 0.1):.3g}-"
                f"{quantile(o, 0.9):.3g}]; {separation(o, q):.2f}; {up} / {down}"
            )
        print(f"| {key} | " + " | ".join(cells) + " |")


def plot(directory: Path, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = events(directory, "step")
    origin = ev["worker"]
    samples = load(directory / "step.csv")
    per = seconds(directory, "step")
    t = [s["t"] - origin for s in samples]
    fig, axes = plt.subplots(6, 1, figsize=(11, 15), sharex=True)

    def shade(ax: Any) -> None:
        ax.axvspan(ev["oltp_on"] - origin, ev["oltp_off"] - origin, color="orange", alpha=0.15,
                   label="OLTP on")  # fmt: skip
        ax.axvline(0, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)

    def smooth(key: str) -> tuple[list[float], list[float]]:
        pairs = [(tt - origin, v) for tt, v in rolling(samples, key) if v is not None]
        return [a for a, _ in pairs], [b for _, b in pairs]

    ax = axes[0]
    xs = [r["second"] + 0.5 - origin for r in per if r["p99"] is not None]
    ax.plot(xs, [r["p99"] for r in per if r["p99"] is not None], "o-", color="crimson",
            label="OLTP p99 per second")  # fmt: skip
    ax.plot(xs, [r["p50"] for r in per if r["p50"] is not None], "s-", color="salmon",
            label="OLTP p50 per second")  # fmt: skip
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("Step run: a backlog draining, OLTP (pgbench -R) switched on and off; "
                 "t = 0 at the worker's start")  # fmt: skip
    ax2 = ax.twinx()
    ax2.plot(
        [r["second"] + 0.5 - origin for r in per],
        [r["jobs"] / 1000 for r in per],
        color="steelblue",
        drawstyle="steps-mid",
        label="jobs finished per second (k)",
    )
    ax2.set_ylabel("k jobs/s")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)

    ax = axes[1]
    ax.plot(t, [s["app_active"] for s in samples], ".", color="darkgreen", alpha=0.4,
            label="app sessions active (sample)")  # fmt: skip
    ax.plot(*smooth("app_active"), color="darkgreen", label="app sessions active (1 s mean)")
    ax.plot(*smooth("app_in_xact"), color="olive", label="app sessions in a transaction (1 s)")
    ax.plot(*smooth("app_waiting"), color="purple", label="app sessions waiting (1 s)")
    ax.set_ylabel("sessions")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    for key, color in (("select1_ms", "black"), ("select1_again_ms", "grey"),
                       ("pk_probe_ms", "teal")):  # fmt: skip
        ax.plot(t, [s[key] for s in samples], ".", color=color, alpha=0.3)
        ax.plot(*smooth(key), color=color, label=f"{key} (1 s mean)")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[3]
    for key, color in (("claim0_ms", "brown"), ("head_probe_ms", "darkorange")):
        ax.plot(t, [s[key] for s in samples], ".", color=color, alpha=0.3)
        ax.plot(*smooth(key), color=color, label=f"{key} (1 s mean)")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[4]
    turns = [(s["t"] - origin, s["worker_turn_ms"]) for s in samples
             if s["worker_turn_ms"] is not None]  # fmt: skip
    ax.plot([a for a, _ in turns], [b for _, b in turns], ".", color="navy", alpha=0.4,
            label="worker's last turn (sample)")  # fmt: skip
    ax.plot(*smooth("worker_turn_ms"), color="navy", label="worker's last turn (1 s mean)")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[5]
    ax.plot(*smooth("host_busy"), color="black", label="host CPU busy (context, 1 s)")
    ax.plot(*smooth("worker_busy"), color="navy", label="worker main session active (share)")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds since the worker started")
    ax.legend(loc="lower right", fontsize=8)
    for ax in axes:
        shade(ax)
    fig.tight_layout()
    fig.savefig(target, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directories", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path, help="the first directory's step run, drawn here")
    parser.add_argument("--steps-only", action="store_true", help="only the step runs' table")
    options = parser.parse_args()
    if not options.steps_only:
        for directory in options.directories:
            print(f"## {directory}")
            report(directory)
    steps(options.directories)
    if options.plot:
        plot(options.directories[0], options.plot)


if __name__ == "__main__":
    main()
