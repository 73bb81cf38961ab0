"""A worker's claim starts after the last job it claimed in each queue (its position), so that
it does not read again the index entries of every job claimed before, which a long-held
snapshot keeps from being cleaned up; sweeps from the start find the jobs behind it."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_pgjobs.data import sql
from django_pgjobs.data.jobs import turn_params
from django_pgjobs.data.records import FailedAttempt, Failure, Position
from django_pgjobs.models import Job
from django_pgjobs.runtime import postgres as positions
from django_pgjobs.runtime.postgres import Positions
from tests import plans
from tests.factories import JobFactory, backlog

pytestmark = pytest.mark.django_db

NOW = timezone.now().replace(microsecond=0)


def _key(job: Job) -> tuple[int, object, uuid.UUID]:
    return (-job.priority, job.run_at, job.pk)


def _claim(after: dict[str, Position], limit: int) -> list[Job]:
    return Job.objects.settle_and_claim([], [], ["default"], worker="w1", limit=limit, after=after)[
        2
    ]


def test_a_claim_after_a_position_takes_higher_priorities_then_what_follows_then_lower():
    def job(priority: int, minutes_ago: int) -> Job:
        return JobFactory(priority=priority, run_at=NOW - timedelta(minutes=minutes_ago))

    behind = job(0, 9)
    at = job(0, 5)
    after = [job(0, 3), job(0, 1)]
    higher = job(7, 30)
    lower = job(-3, 60)

    claimed = _claim({"default": Position.of(at)}, limit=10)

    # The position's own job and the one before it at its priority are passed over.
    assert [j.pk for j in claimed] == [higher.pk, *(j.pk for j in after), lower.pk]
    # A sweep (no position) takes them, in claim order.
    assert [j.pk for j in _claim({}, limit=10)] == [behind.pk, at.pk]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    jobs=st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 4)), min_size=1, max_size=14),
    at=st.integers(0, 13),
    limit=st.integers(1, 15),
)
def test_a_claim_after_a_position_is_the_claim_order_without_what_lies_behind_it(
    jobs: list[tuple[int, int]], at: int, limit: int
) -> None:
    """Against a plain model: the claim takes, in claim order, every ready job except those of
    the position's priority at or before it; a sweep then takes exactly those."""
    Job.objects.all().delete()
    made = [
        JobFactory(priority=priority, run_at=NOW - timedelta(seconds=seconds))
        for priority, seconds in jobs
    ]
    position = Position.of(made[at % len(made)])
    behind = [
        j for j in made
        if j.priority == position.priority and (j.run_at, j.pk) <= (position.run_at, position.id)
    ]  # fmt: skip
    expected = sorted((j for j in made if j not in behind), key=_key)

    claimed = _claim({"default": position}, limit=limit)
    assert [j.pk for j in claimed] == [j.pk for j in expected[:limit]]

    rest = _claim({"default": position}, limit=len(made))
    assert [j.pk for j in rest] == [j.pk for j in expected[limit:]]
    swept = _claim({}, limit=len(made))
    assert [j.pk for j in swept] == [j.pk for j in sorted(behind, key=_key)]


def _claim_buffers(after: dict[str, Position]) -> int:
    """Buffers read by the claim index's scans of one claim of 100 (EXPLAIN ANALYZE, rolled
    back)."""
    params = turn_params(
        [], [], ["default"], worker="w1", limit=100, lease=60.0, results={}, after=after
    )
    plan = plans.explain(sql.SETTLE_AND_CLAIM, params, analyze=True, buffers=True)
    scans = plans.index_scans(plan, "pgjobs_job_claim_idx")
    assert scans, plans.shown(plan)
    return sum(s.get("Shared Hit Blocks", 0) + s.get("Shared Read Blocks", 0) for s in scans)


@pytest.mark.django_db(transaction=True)  # a snapshot held by another session
def test_under_a_held_snapshot_a_claim_after_its_position_reads_no_more_than_a_fresh_one(
    other_connection,
):
    with connection.cursor() as cursor:
        cursor.execute("VACUUM pgjobs_job")  # no entries left by earlier tests' rollbacks
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 6_000)
    fresh = _claim_buffers({})
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT count(*) FROM pgjobs_job")  # takes the snapshot
    try:
        # A worker's turns: each completes the previous batch and claims the next 100.
        held: list[Job] = []
        at: dict[str, Position] = {}
        for _ in range(50):
            held = Job.objects.settle_and_claim(held, [], ["default"], worker="w1", limit=100,
                                                after=at)[2]  # fmt: skip
            at = {"default": Position.of(held[-1])}
        Job.objects.complete_many(held)
        after_position = _claim_buffers(at)
        from_start = _claim_buffers({})
    finally:
        other_connection.execute("COMMIT")
    # The 5,000 claimed jobs' entries are still in the claim index (the snapshot keeps their
    # old row versions): a claim from the start reads them all...
    assert from_start > 10 * fresh, (fresh, from_start)
    # ...and one after the position reads as little as a claim on a fresh table.
    assert after_position <= 2 * fresh, (fresh, after_position)


def test_a_worker_sweeps_from_the_start_then_claims_after_its_positions_until_the_next_sweep(
    monkeypatch,
):
    clock = [100.0]
    monkeypatch.setattr(positions.time, "monotonic", lambda: clock[0])
    first = Job(queue="a", priority=0, run_at=NOW, id=uuid.uuid4())
    last = Job(queue="a", priority=0, run_at=NOW + timedelta(seconds=1), id=uuid.uuid4())
    other = Job(queue="b", priority=5, run_at=NOW, id=uuid.uuid4())
    seen = Positions()

    assert seen.for_turn() == {}  # the first turn sweeps
    seen.turned([other, first, last], seconds=0.001)  # in claim order
    assert seen.for_turn() == {"a": Position.of(last), "b": Position.of(other)}

    # Quick sweeps come every SWEEP_EVERY seconds...
    clock[0] += positions.SWEEP_EVERY + 1e-6
    assert seen.for_turn() == {}
    # ...a slow one (a snapshot held) only after SWEEP_FACTOR times its own time.
    seen.turned([], seconds=2.0)
    clock[0] += 2.0 * positions.SWEEP_FACTOR - 0.5
    assert seen.for_turn() != {}
    seen.turned([], seconds=0.001)  # a turn after the positions does not move the sweep
    clock[0] += 0.5 + 1e-6
    assert seen.for_turn() == {}


def test_a_worker_finds_its_own_jobs_by_primary_key_never_through_the_running_index():
    """Under a held snapshot the running jobs' partial index keeps an entry for every running
    row version since: a statement reading a worker's jobs through it reads them all. On this
    table (110 running, 100,000 finished, analyzed) the planner would pick that index for the
    plain `status = 'running' AND worker = …` guard (checked: a hash join over it)."""
    backlog(finished=100_000)
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 110)
    claimed = Job.objects.claim(["default"], worker="w1", limit=110)
    failed = [FailedAttempt(job, Failure("RuntimeError", "boom"), False, 0.0) for job in claimed]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE pgjobs_job")
    own = {
        "ids": [job.pk for job in claimed],
        "claims": [job.claims for job in claimed],
        "worker": "w1",
        "progress": [None] * len(claimed),
        "lease": 60.0,
        "delay": None,
    }
    statements = {
        "outcomes (succeeded)": (sql.SETTLE_AND_CLAIM, turn_params(
            claimed, [], [], worker="w1", limit=0, lease=60.0, results={})),
        "outcomes (failed)": (sql.SETTLE_AND_CLAIM, turn_params(
            [], failed, [], worker="w1", limit=0, lease=60.0, results={})),
        "heartbeat": (sql.HEARTBEAT, own),
        "owned": (sql.OWNED, own),
        "release": (sql.RELEASE, own),
    }  # fmt: skip
    for name, (statement, params) in statements.items():
        plan = plans.explain(statement, params, analyze=True)
        assert not plans.index_scans(plan, "pgjobs_job_running_idx"), (name, plans.shown(plan))
        assert plans.index_scans(plan, "pgjobs_job_pkey"), (name, plans.shown(plan))


def test_a_short_claim_after_the_positions_is_followed_by_a_sweep_whatever_the_poll_delay(
    monkeypatch,
):
    """A wake-up's turn that started after the positions and found too few: the job that woke
    the worker may be behind them (committed after a later job was claimed), so the worker must
    claim again at the next sweep, not after its poll delay (up to --poll-interval)."""
    clock = [100.0]
    monkeypatch.setattr(positions.time, "monotonic", lambda: clock[0])
    seen = Positions()
    job = Job(queue="a", priority=0, run_at=NOW, id=uuid.uuid4())

    seen.for_turn()  # a sweep
    assert seen.poll_by(claimed=0, wanted=10) == float("inf")  # a sweep found all there is
    seen.turned([job], seconds=0.001)
    clock[0] += 0.01
    assert seen.for_turn() != {}  # after the positions
    assert seen.poll_by(claimed=10, wanted=10) == float("inf")  # a full claim: more follow
    assert seen.poll_by(claimed=3, wanted=10) == 100.0 + positions.SWEEP_EVERY
