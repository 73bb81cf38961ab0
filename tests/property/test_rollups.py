"""The rollup the database keeps of the workers' statistics (migration 0018's trigger) against
the rows themselves: random reports from a few workers, queues and tasks, at random minutes of
two hours, written in random groups of statements (a worker's report, several workers' at once,
rows of the same minute from several statements), goodbyes and rows that cover nothing among
them. Whatever the grouping, every minute's and hour's Rollup row holds exactly the sums of its
rows, histograms position by position, and each Worker row its worker's last report."""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import hypothesis
import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from django_pgjobs.models import QueueStat, Rollup, Worker

pytestmark = pytest.mark.django_db

SETTINGS = hypothesis.settings(
    max_examples=30,
    derandomize=not os.environ.get("PGJOBS_HYPOTHESIS_RANDOM"),
    database=None,
    deadline=None,
    suppress_health_check=[
        hypothesis.HealthCheck.too_slow,
        hypothesis.HealthCheck.function_scoped_fixture,
    ],
)
START = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)

histogram = st.lists(st.integers(0, 50), min_size=0, max_size=16)
tasks = st.dictionaries(
    st.sampled_from(["t.a", "t.b"]),
    st.fixed_dictionaries(
        {
            "succeeded": st.integers(0, 9),
            "retried": st.integers(0, 9),
            "failed": st.integers(0, 9),
            "durations": histogram,
        }
    ),
    max_size=2,
)
row = st.fixed_dictionaries({
    "worker": st.sampled_from(["w1", "w2", "w3"]),
    "queue": st.sampled_from(["q1", "q2"]),
    "second": st.integers(0, 2 * 3600 - 1),
    "seconds": st.sampled_from([0.0, 0.5, 10.0, 60.0]),
    "claimed": st.integers(0, 20), "succeeded": st.integers(0, 20),
    "retried": st.integers(0, 5), "failed": st.integers(0, 5),
    "latency_buckets": histogram, "tasks": st.none() | tasks,
})  # fmt: skip
statements = st.lists(st.lists(row, min_size=1, max_size=6), min_size=1, max_size=8)


def summed(lists: list[list[int]]) -> list[int]:
    width = max((len(values) for values in lists), default=0)
    return [sum(values[n] for values in lists if n < len(values)) for n in range(width)]


def expected(rows: list[dict[str, Any]]) -> dict[tuple[str, int, datetime, str], dict[str, Any]]:
    """What each Rollup row should hold, from the rows alone."""
    keys: dict[tuple[str, int, datetime, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["seconds"] <= 0:
            continue  # a goodbye covers nothing
        at = START + timedelta(seconds=r["second"])
        for step in (60, 3600):
            slot = datetime.fromtimestamp(at.timestamp() // step * step, UTC)
            keys["queue", step, slot, r["queue"]].append({**r, "counts": r["latency_buckets"]})
            for task, ran in (r["tasks"] or {}).items():
                keys["task", step, slot, task].append({**r, **ran, "claimed": 0,
                                                      "counts": ran["durations"]})  # fmt: skip
    return {
        key: {
            "claimed": sum(r["claimed"] for r in group),
            "succeeded": sum(r["succeeded"] for r in group),
            "retried": sum(r["retried"] for r in group),
            "failed": sum(r["failed"] for r in group),
            "counts": summed([r["counts"] for r in group]),
        }
        for key, group in keys.items()
    }


def padded(values: list[int]) -> list[int]:
    """A histogram as the rollup keeps it: every position, zeros included."""
    while values and values[-1] == 0:
        values = values[:-1]
    return values


@SETTINGS
@given(statements)
def test_the_rollup_holds_the_sums_of_its_rows_however_they_were_written(groups):
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE pgjobs_queuestat, pgjobs_rollup, pgjobs_worker")
    for group in groups:
        QueueStat.objects.bulk_create([
            QueueStat(
                at=START + timedelta(seconds=r["second"]), seconds=r["seconds"],
                worker=r["worker"], queue=r["queue"], claimed=r["claimed"],
                succeeded=r["succeeded"], retried=r["retried"], failed=r["failed"],
                latency_buckets=r["latency_buckets"], tasks=r["tasks"],
            )
            for r in group
        ])  # fmt: skip
    rows = [r for group in groups for r in group]
    found = {
        (r.kind, r.step, r.at, r.name): {
            "claimed": r.claimed, "succeeded": r.succeeded, "retried": r.retried,
            "failed": r.failed, "counts": padded(r.latency if r.kind == "queue" else r.durations),
        }
        for r in Rollup.objects.all()
    }  # fmt: skip
    want = {key: {**sums, "counts": padded(sums["counts"])} for key, sums in expected(rows).items()}
    assert found == want
    # Each worker: its latest row's time, the queues of all its rows, stopped once it said so.
    for name in {r["worker"] for r in rows}:
        mine = [r for r in rows if r["worker"] == name]
        worker = Worker.objects.get(name=name)
        assert worker.seen_at == START + timedelta(seconds=max(r["second"] for r in mine))
        assert worker.queues == sorted({r["queue"] for r in mine})
        assert worker.stopped == any(r["seconds"] == 0 for r in mine)
