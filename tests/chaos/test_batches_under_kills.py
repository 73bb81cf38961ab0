"""Batches under fire: 100 batches of 100 jobs (tests/chaos/tasks.py, member) run by four
workers while one is SIGKILLed every second, one or two worker sessions are terminated twice a
second, and sessions caught completing a batch (FINISH_BATCHES, after the commit that ended its
members) are terminated: their follow-ups are lost, and another's sweep must do them. Members
fail until they are dead letters; two in three of those, and half the members cancelled
meanwhile, are replayed while the workers run.

Then: every batch's on_complete was enqueued exactly once, and not before its members had all
ended; every on_success exactly once, only for the batches whose members all succeeded (some
only after replays), and not before the last of them did.

"Not before its members had all ended": a replay makes a member live again and forgets when it
ended (finished_at), so the driver notes, for each replay it makes, when the member had ended
(read before the replay) and when it was live again (read after the replay's commit). Each
member was then ended over known intervals, and a batch had first ended all its members at
the earliest moment inside an interval of each: its on_complete's created_at (the database's
clock at its insert) must not come before that moment.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
import pytest
from django.db.models import Max

import django_pgjobs
from django_pgjobs.models import Batch, Job
from django_pgjobs.status import Status
from tests import tasks
from tests.chaos import tasks as chaos_tasks
from tests.chaos.conftest import Workers, open_test_database, worker_args

pytestmark = pytest.mark.django_db(transaction=True)

BATCHES, SIZE = 100, 100
WORKERS, CONCURRENCY, LEASE = 4, 8, 2.0
#: Seconds between the faults, while members are live.
KILL_EVERY, TERMINATE_EVERY = 1.0, 0.5
#: How many times follow-ups completing batches are cut off (a sweep must do their work).
HOLDS = 4
#: How long the whole run may take (the chaos tier's budget is tight).
TIMEOUT = 50.0
#: One sweep (each worker's, every 5 s: runtime/lifecycle.py reap_interval) and some slack.
SWEEP_WAIT = 6.0

FINISHED = ("succeeded", "failed", "cancelled")
MEMBER = chaos_tasks.member.name


@dataclass
class Replayed:
    """A replay the driver made: the member had ended at `ended`, live again by `live`."""

    member: UUID
    ended: datetime
    live: datetime


def payloads(rng: random.Random) -> list[dict[str, Any]]:
    """A batch's members: a tenth take a little while; in a third of the batches one to three
    members die (fail until dead letters)."""
    dying = set(rng.sample(range(SIZE), rng.randint(1, 3))) if rng.random() < 1 / 3 else set()
    return [
        {
            "n": n,
            **({"dies": True} if n in dying else {}),
            **({"seconds": round(rng.uniform(0.02, 0.15), 3)} if rng.random() < 0.1 else {}),
        }
        for n in range(SIZE)
    ]


def database_now(db: psycopg.Connection[Any]) -> datetime:
    row = db.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def replay(db: psycopg.Connection[Any], member: UUID, replays: list[Replayed]) -> None:
    """Replay a dead or cancelled member, noting when it had ended and when it was live again
    (the driver alone replays, so the end it reads is the one the replay undoes)."""
    row = db.execute(
        "SELECT finished_at FROM pgjobs_job WHERE id = %s AND status IN ('failed', 'cancelled')",
        [member],
    ).fetchone()
    if row is None:
        return
    assert Job.objects.filter(pk=member).replay(by="chaos") == [member]
    replays.append(Replayed(member, row[0], database_now(db)))


def terminate_some(db: psycopg.Connection[Any], rng: random.Random) -> int:
    """Terminate one or two of the workers' sessions (named chaos:<pid>)."""
    pids = [pid for (pid,) in db.execute(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name LIKE 'chaos:%%'"
    ).fetchall()]  # fmt: skip
    chosen = rng.sample(pids, min(len(pids), rng.randint(1, 2)))
    for pid in chosen:
        db.execute("SELECT pg_terminate_backend(%s)", [pid])
    return len(chosen)


@dataclass
class Hold:
    """A round of cut_follow_ups: the batches it held locked, from when to when (the
    database's clock), and how many sessions it caught moving them."""

    batches: list[UUID]
    began: datetime
    ended: datetime | None = None
    cut: int = 0


def cut_follow_ups(stop: threading.Event, holds: list[Hold]) -> None:
    """Cut off follow-ups that were completing batches. A few times, hold the rows of the ten
    open batches with the fewest live members locked for a second: FINISH_BATCHES waits for
    one only when it is moving that batch (it updates no other). Every worker's session caught
    waiting so is terminated: its follow-up (or sweep) rolls back, after the commit that ended
    the members, and a later sweep must complete the batch."""
    with open_test_database() as db, open_test_database() as locker:
        # HOLDS rounds, and more until one has caught a session (a loaded machine's workers
        # may move no held batch within a round's second).
        while not stop.wait(0.5) and (len(holds) < HOLDS or not any(h.cut for h in holds)):
            with locker.transaction():
                held = [batch for (batch,) in locker.execute(
                    "SELECT id FROM pgjobs_batch WHERE id = ANY (ARRAY("
                    "  SELECT batch_id FROM pgjobs_job WHERE status IN ('ready', 'running') "
                    "  AND batch_id IS NOT NULL GROUP BY batch_id ORDER BY count(*) LIMIT 10"
                    ")) AND completed_at IS NULL FOR UPDATE"
                ).fetchall()]  # fmt: skip
                if not held:
                    continue
                hold = Hold(held, database_now(locker))
                holds.append(hold)
                until = time.monotonic() + 1.0
                while True:
                    for (pid,) in db.execute(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name LIKE 'chaos:%%' "
                        "AND wait_event_type = 'Lock' AND query LIKE '%%FROM pgjobs_batch AS b%%'"
                    ).fetchall():  # fmt: skip
                        row = db.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()
                        hold.cut += bool(row and row[0])
                    if time.monotonic() > until:
                        break
                    time.sleep(0.01)
                hold.ended = database_now(locker)


def first_all_ended(ended: list[list[tuple[datetime, datetime | None]]]) -> datetime | None:
    """The earliest moment at which each member was inside one of its ended intervals
    ((from, to), `to` None: to the end), or None."""
    starts = sorted(start for intervals in ended for start, _ in intervals)
    for moment in starts:
        if all(
            any(start <= moment and (end is None or moment < end) for start, end in intervals)
            for intervals in ended
        ):
            return moment
    return None


def test_batches_keep_their_callbacks_exact_through_kills_terminations_and_replays(
    workers: Callable[..., Workers],
) -> None:
    rng = random.Random(20240611)
    plans = [payloads(rng) for _ in range(BATCHES)]
    pool = workers(worker_args(CONCURRENCY, LEASE, "--queue", "batches"))
    pool.start(WORKERS)
    made: list[UUID] = []
    replays: list[Replayed] = []
    replayed: set[UUID] = set()
    cancelled: set[UUID] = set()
    kills = terminations = 0
    stop, holds = threading.Event(), []
    cutter = threading.Thread(target=cut_follow_ups, args=(stop, holds), daemon=True)
    cutter.start()
    began = time.monotonic()
    deadline = began + TIMEOUT
    next_kill, next_termination = began + KILL_EVERY, began + TERMINATE_EVERY
    try:
        with open_test_database() as db:
            while True:
                now = time.monotonic()
                assert now < deadline, Counter(
                    Job.objects.filter(task=MEMBER).values_list("status", flat=True)
                )
                for plan in plans[len(made) : len(made) + 10]:  # ten batches a tick, in 1 s
                    with django_pgjobs.batch(
                        on_complete=tasks.batch_done, on_success=tasks.mail, name="chaos"
                    ) as b:
                        Job.objects.bulk_enqueue(chaos_tasks.member, plan)
                    made.append(b.id)
                ended = dict(
                    db.execute(
                        "SELECT id, status FROM pgjobs_job WHERE task = %s "
                        "AND status IN ('failed', 'cancelled')",
                        [MEMBER],
                    ).fetchall()
                )
                # Two dead letters in three are replayed (once), and half the cancelled.
                for member, status in sorted(ended.items()):
                    if member in replayed:
                        continue
                    replayed.add(member)
                    if rng.random() < (2 / 3 if status == "failed" else 1 / 2):
                        replay(db, member, replays)
                live = db.execute(
                    "SELECT id, status FROM pgjobs_job WHERE task = %s AND status IN "
                    "('ready', 'running') ORDER BY id LIMIT 2000",
                    [MEMBER],
                ).fetchall()
                if live and len(cancelled) < 30 and rng.random() < 0.3:
                    member = rng.choice(live)[0]
                    cancelled.update(Job.objects.filter(pk=member).cancel())
                if len(made) == BATCHES and not live and not ended.keys() - replayed:
                    break
                if now >= next_kill:
                    pool.kill_random()
                    kills, next_kill = kills + 1, now + KILL_EVERY
                if now >= next_termination:
                    terminations += terminate_some(db, rng)
                    next_termination = now + TERMINATE_EVERY
                time.sleep(0.1)
            stop.set()
            # Every member has ended: the callbacks come by the follow-ups, or by the next
            # sweep for those lost; then one more sweep, which must add none.
            members = Job.objects.filter(task=MEMBER)
            every_succeeded = set(made) - set(
                members.exclude(status=Status.SUCCEEDED).values_list("batch_id", flat=True)
            )

            def called_back() -> bool:
                completes = callbacks(tasks.batch_done)
                successes = callbacks(tasks.mail)
                return set(completes) == {str(b) for b in made} and set(successes) >= {
                    str(b) for b in every_succeeded
                }

            ended_members = time.monotonic() - began
            while not called_back():
                assert time.monotonic() < deadline, missing(made, every_succeeded)
                time.sleep(0.2)
            time.sleep(SWEEP_WAIT)
    finally:
        stop.set()
        cutter.join(5)
    elapsed = time.monotonic() - began
    assert pool.stop() == [0] * WORKERS

    # ---- what the run did -----------------------------------------------------------------
    statuses = Counter(members.values_list("status", flat=True))
    assert set(statuses) <= set(FINISHED), statuses
    assert kills >= 4 and terminations >= 8, (kills, terminations)
    assert len(replays) >= 10, len(replays)
    cut = sum(hold.cut for hold in holds)
    assert cut >= 1, "no follow-up completing a batch was cut off"

    # ---- on_complete: once per batch, after its members had all ended ---------------------
    completes = callbacks(tasks.batch_done)
    assert Counter({b: len(jobs) for b, jobs in completes.items()}) == Counter(
        {str(b): 1 for b in made}
    )
    ended_over: dict[UUID, list[tuple[datetime, datetime | None]]] = defaultdict(list)
    for each in replays:
        ended_over[each.member].append((each.ended, each.live))
    for member, finished_at in members.values_list("pk", "finished_at"):
        ended_over[member].append((finished_at, None))
    by_batch: dict[UUID, list[UUID]] = defaultdict(list)
    for member, batch in members.values_list("pk", "batch_id"):
        by_batch[batch].append(member)
    late = []
    first_ended: dict[UUID, datetime | None] = {}
    for batch in made:
        ((created_at, counts),) = completes[str(batch)]
        assert len(by_batch[batch]) == SIZE
        first = first_ended[batch] = first_all_ended([ended_over[m] for m in by_batch[batch]])
        assert first is not None and created_at >= first, (batch, created_at, first)
        assert sum(counts[k] for k in ("succeeded", "failed", "cancelled")) == SIZE, counts
        late.append((created_at - first).total_seconds())
    # The batches whose members had all ended while held, whose follow-ups were cut: completed
    # by a statement begun after the hold, a sweep's (or a later replay's follow-up).
    recovered = {
        batch
        for hold in holds
        if hold.cut and hold.ended is not None
        for batch in hold.batches
        if first_ended[batch] < hold.ended < completes[str(batch)][0][0]
    }
    assert recovered, holds

    # ---- on_success: once, for exactly the batches that all succeeded, after the last ------
    successes = callbacks(tasks.mail)
    assert set(successes) == {str(b) for b in every_succeeded}
    assert {len(jobs) for jobs in successes.values()} <= {1}
    last_success = dict(
        members.values("batch_id").annotate(last=Max("finished_at")).values_list("batch_id", "last")
    )
    for batch in every_succeeded:
        ((created_at, counts),) = successes[str(batch)]
        assert counts == {"id": str(batch), "succeeded": SIZE, "failed": 0, "cancelled": 0}
        assert created_at >= last_success[batch]
    after_replays = {each.member for each in replays}
    healed = {b for b in every_succeeded if set(by_batch[b]) & after_replays}
    assert healed, "no batch succeeded after replays"
    stored = Batch.objects.filter(pk__in=made)
    assert stored.filter(completed_at__isnull=True).count() == 0
    assert set(stored.filter(succeeded_at__isnull=False).values_list("pk", flat=True)) == (
        every_succeeded
    )
    print(
        f"\nbatches under kills: {elapsed:.1f}s (members ended at {ended_members:.1f}s), "
        f"{kills} kills, {terminations} sessions terminated, {cut} follow-ups cut off "
        f"({len(recovered)} batches completed later by another), {len(replays)} replays, "
        f"{len(cancelled)} cancels; {len(every_succeeded)} batches succeeded "
        f"({len(healed)} after replays); on_complete after the last end: median "
        f"{sorted(late)[len(late) // 2]:.3f}s, most {max(late):.3f}s; final {dict(statuses)}"
    )


def callbacks(task: Any) -> dict[str, list[tuple[datetime, dict[str, Any]]]]:
    """Batch id → the (created_at, batch counts) of each callback of `task` naming it."""
    found: dict[str, list[tuple[datetime, dict[str, Any]]]] = defaultdict(list)
    for created_at, payload in Job.objects.filter(task=task.name).values_list(
        "created_at", "payload"
    ):
        found[payload["batch"]["id"]].append((created_at, payload["batch"]))
    return found


def missing(made: list[UUID], every_succeeded: set[UUID]) -> str:
    """What is missing, for the failure's message."""
    completes, successes = callbacks(tasks.batch_done), callbacks(tasks.mail)
    lines = []
    for batch in made:
        lacks = [name for name, found, due in (
            ("on_complete", completes, True), ("on_success", successes, batch in every_succeeded)
        ) if due and str(batch) not in found]  # fmt: skip
        if lacks:
            row = (
                Batch.objects.filter(pk=batch)
                .values("completed_at", "succeeded_at", "succeeded", "failed", "cancelled")
                .first()
            )
            statuses = Counter(Job.objects.filter(batch_id=batch).values_list("status", flat=True))
            lines.append(f"{batch}: no {', '.join(lacks)}; {row}; members {dict(statuses)}")
    return "\n".join(lines)
