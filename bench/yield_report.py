"""Reads the yield section's CSVs (bench/monitor.py's samples and the per-second series) and
prints, per signal, how it reads in each case and in each phase of the step run; with
`--plot FILE`, draws the step run (needs matplotlib). `python bench/yield_report.py DIR`.

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
    parser.add_argument("directory", type=Path)
    parser.add_argument("--plot", type=Path)
    options = parser.parse_args()
    report(options.directory)
    if options.plot:
        plot(options.directory, options.plot)


if __name__ == "__main__":
    main()
