"""The health report's charts: throughput, claim latency (p50, p95), retries, failures and
yielding (the rate claimed, and the rate allowed while yielding) per queue over the last hour
(a point a minute) and the last day (a point an hour), from the workers' statistics rolled up
(Rollup).

Drawn on the server as inline SVG (no script), coloured with the admin's CSS variables so that
they read in its light and dark themes; each chart has a table of its numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from html import escape
from itertools import zip_longest
from typing import Any

from django.db import connections
from django.utils import timezone
from django.utils.safestring import mark_safe
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.observability.figures import limited
from django_pgjobs.observability.stats import job_database, latency_quantile

#: (label, seconds shown, seconds per point: the Rollup rows' step).
WINDOWS = (
    (gettext_lazy("Last hour"), 3600, 60),
    (gettext_lazy("Last day"), 86400, 3600),
)
WIDTH, HEIGHT = 520, 150
LEFT, RIGHT, TOP, BOTTOM = 48, 10, 10, 22
#: The most lines a chart draws: past it, the quietest queues are drawn added up as one.
LINES = 8
#: One colour per queue, mid-tone so that they read on the light and the dark theme alike.
COLOURS = (
    "#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
)  # fmt: skip

# A window's points are its Rollup rows: one per queue and minute (or hour), through the
# rollup's unique index, whatever the number of workers.
SERIES_SQL = """
    SELECT name, floor(EXTRACT(EPOCH FROM at) / step)::bigint, succeeded, retried, failed,
           claimed, allowed, latency
    FROM pgjobs_rollup
    WHERE kind = 'queue' AND step = %(step)s AND at >= %(since)s AND at <= %(now)s
"""


@dataclass
class Chart:
    """One chart: a line per series over the window's points, and the geometry to draw it."""

    title: str
    unit: str
    slots: list[int]  # the points' slot numbers (start time // step)
    step: int
    # Each: name, queue, colour, dashed, values.
    series: list[dict[str, Any]] = field(default_factory=list)

    @cached_property  # read for every point; the series are complete before it is
    def top(self) -> float:
        values = [v for s in self.series for v in s["values"] if v is not None]
        return nice(max(values, default=0.0))

    def x(self, index: int) -> float:
        span = max(len(self.slots) - 1, 1)
        return LEFT + (WIDTH - LEFT - RIGHT) * index / span

    def y(self, value: float) -> float:
        return TOP + (HEIGHT - TOP - BOTTOM) * (1 - value / (self.top or 1))

    def label(self, index: int) -> str:
        moment = datetime.fromtimestamp(self.slots[index] * self.step, UTC)
        return timezone.localtime(moment).strftime("%H:%M")

    @property
    def zone(self) -> str:
        """The name of the time zone the labels are in: the active one."""
        return timezone.get_current_timezone_name()

    def description(self) -> str:
        """The chart in words, for those who cannot see it (its <desc>): the queues, the highest
        value and when, and each line's latest value."""
        queues = ", ".join(dict.fromkeys(serie["queue"] for serie in self.series))
        latest, points = [], []
        for serie in self.series:
            known = [(v, i) for i, v in enumerate(serie["values"]) if v is not None]
            points += [(v, i, serie["name"]) for v, i in known]
            if known:
                value, index = known[-1]
                latest.append(f"{serie['name']} {show(value)} {self.unit} ({self.label(index)})")
        if not points:
            return _("Queues %(queues)s: no data.") % {"queues": queues}
        value, index, name = max(points, key=lambda point: point[0])
        return _(
            "Queues %(queues)s, times in %(zone)s. Highest: %(value)s %(unit)s (%(name)s, "
            "%(at)s). Latest: %(latest)s."
        ) % {
            "queues": queues, "zone": self.zone, "value": show(value), "unit": self.unit,
            "name": name, "at": self.label(index), "latest": "; ".join(latest),
        }  # fmt: skip

    def drawing(self) -> dict[str, Any]:
        """What the template draws: lines (split where there is no data), a column per point
        whose title gives every line's number there, axis ticks, and the table."""
        lines = []
        for serie in self.series:
            segments: list[list[str]] = [[]]
            for index, value in enumerate(serie["values"]):
                if value is None:
                    segments.append([])
                    continue
                segments[-1].append(f"{self.x(index):.1f},{self.y(value):.1f}")
            for segment in segments:
                if segment:
                    lines.append({**serie, "points": " ".join(segment)})
        count = len(self.slots)
        width = (WIDTH - LEFT - RIGHT) / max(count - 1, 1)
        points = []
        for index in range(count):
            shown = [
                f"{s['name']} {show(s['values'][index])} {self.unit}"
                for s in self.series
                if s["values"][index] is not None
            ]
            if shown:
                when = self.label(index)  # the zone is in the caption
                points.append({
                    "x": f"{self.x(index) - width / 2:.1f}", "width": f"{width:.1f}",
                    "title": f"{when} · {'; '.join(shown)}",
                })  # fmt: skip
        ticks = [{"x": f"{self.x(i):.1f}", "label": self.label(i)} for i in range(0, count, 10)]
        levels = [
            {"y": f"{self.y(self.top * part):.1f}", "label": show(self.top * part)}
            for part in (0, 0.5, 1)
        ]
        # Made here, not cell by cell in the template: thousands of cells with many queues.
        rows = mark_safe("".join(
            "<tr>" + "".join(f'<td class="n">{escape(cell)}</td>' for cell in row) + "</tr>"
            for row in (
                [self.label(i), *(show(s["values"][i]) for s in self.series)] for i in range(count)
            )
        ))  # fmt: skip
        return {
            "chart": self, "lines": lines, "points": points, "ticks": ticks, "levels": levels,
            "rows": rows, "width": WIDTH, "height": HEIGHT, "left": LEFT,
            "right": WIDTH - RIGHT, "bottom": HEIGHT - BOTTOM, "top": TOP,
            "plot_height": HEIGHT - TOP - BOTTOM,
        }  # fmt: skip


def nice(value: float) -> float:
    """A round upper bound for an axis: 1, 2 or 5 times a power of ten."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(float(m * power) for m in (1, 2, 5, 10) if m * power >= value)


def show(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if value >= 100 or value == int(value) else f"{value:.3g}"


def windows(db: str | None = None) -> list[dict[str, Any]]:
    """The charts of each window, for the report page, within the report's time limits
    (DatabaseError past them)."""
    db = job_database(db)
    with limited(db), connections[db].cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")  # rows written earlier in this transaction
        (now,) = cursor.fetchone()
        shown = []
        for label, span, step in WINDOWS:
            first = math.floor(now.timestamp() / step) - span // step + 1  # the first point
            since = datetime.fromtimestamp(first * step, UTC)
            cursor.execute(SERIES_SQL, {"step": step, "since": since, "now": now})
            shown.append({"label": label, "charts": charts(cursor.fetchall(), now, span, step)})
    return shown


def charts(rows: list[tuple[Any, ...]], now: datetime, span: int, step: int) -> list[Any]:
    """The five charts of one window from its rows (queue, slot, succeeded, retried, failed,
    claimed, allowed jobs while yielding, latency histogram)."""
    last = math.floor(now.timestamp() / step)
    slots = list(range(last - span // step + 1, last + 1))
    by_queue: dict[str, dict[int, tuple[Any, ...]]] = {}
    for queue, slot, *figures in rows:
        by_queue.setdefault(queue, {})[slot] = tuple(figures)
    by_queue = busiest(by_queue)
    made = {
        "throughput": Chart(_("Throughput"), _("jobs/min"), slots, step),
        "latency": Chart(_("Claim latency, p50 and p95 (dashed)"), "s", slots, step),
        "retries": Chart(_("Retries"), _("per point"), slots, step),
        "failures": Chart(_("Failures (dead letters)"), _("per point"), slots, step),
        "yielding": Chart(
            _("Claimed, and allowed while yielding (dashed)"), _("jobs/s"), slots, step
        ),
    }
    for number, (queue, by_slot) in enumerate(by_queue.items()):
        colour = COLOURS[number % len(COLOURS)]
        at = [by_slot.get(slot) for slot in slots]
        line = {"name": queue, "queue": queue, "colour": colour, "dashed": False}
        for name, values in (
            ("throughput", [None if f is None else (f[0] + f[2]) * 60 / step for f in at]),
            ("retries", [None if f is None else float(f[1]) for f in at]),
            ("failures", [None if f is None else float(f[2]) for f in at]),
        ):
            made[name].series.append({**line, "values": values})
        made["yielding"].series += [
            {**line, "values": [None if f is None else f[3] / step for f in at]},
            {
                **line, "name": f"{queue} allowed", "dashed": True,
                "values": [None if f is None or f[4] is None else f[4] / step for f in at],
            },
        ]  # fmt: skip
        for quantile, dashed in ((0.5, False), (0.95, True)):
            made["latency"].series.append({
                **line, "name": f"{queue} p{round(quantile * 100)}", "dashed": dashed,
                "values": [None if f is None else latency(f, quantile) for f in at],
            })  # fmt: skip
    return [chart.drawing() for chart in made.values()]


def busiest(by_queue: dict[str, dict[int, tuple[Any, ...]]]) -> dict[str, dict[int, Any]]:
    """The LINES - 1 queues that claimed most in the window, and the rest added up as one line
    ("other queues"): a chart stays readable, and its page small, whatever the number of queues."""
    if len(by_queue) <= LINES:
        return dict(sorted(by_queue.items()))
    ranked = sorted(by_queue, key=lambda q: (-sum(f[3] for f in by_queue[q].values()), q))
    shown = {queue: by_queue[queue] for queue in sorted(ranked[: LINES - 1])}
    rest = ranked[LINES - 1 :]
    other: dict[int, tuple[Any, ...]] = {}
    for queue in rest:
        for slot, figures in by_queue[queue].items():
            other[slot] = figures if slot not in other else added(other[slot], figures)
    shown[_("%d other queues") % len(rest)] = other
    return shown


def added(a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
    """Two points' figures (succeeded, retried, failed, claimed, allowed, latency) as one."""
    allowed = None if a[4] is None and b[4] is None else (a[4] or 0) + (b[4] or 0)
    latency = [x + y for x, y in zip_longest(a[5], b[5], fillvalue=0)]
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], allowed, latency)


def latency(figures: tuple[Any, ...], quantile: float) -> float | None:
    return latency_quantile([int(n) for n in figures[5]], quantile)
