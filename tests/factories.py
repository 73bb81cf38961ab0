"""factory_boy factories for jobs, with traits for each state, and `backlog` for the tens of
thousands of rows a query plan test needs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import timedelta

import factory
from django.db import connection
from django.utils import timezone

from django_pgjobs.ids import uuid7
from django_pgjobs.models import Job
from django_pgjobs.status import Status


def first_failure() -> dict[str, object]:
    """The error history entry of a first attempt that raised RuntimeError("boom")."""
    return {
        "attempt": 1, "at": timezone.now().isoformat(), "worker": "factory-worker",
        "type": "RuntimeError", "message": "boom", "traceback": "",
    }  # fmt: skip


class JobFactory(factory.django.DjangoModelFactory):
    """A ready job, due now; a trait puts it in another state, as the worker would have left it:
    JobFactory(running=True), JobFactory(dead=True), ..."""

    class Meta:
        model = Job

    queue = "default"
    task = "tests.tasks.noop"
    payload = factory.LazyFunction(dict)
    max_attempts = 3
    priority = 0
    attempts = 0
    # Every attempt began with a claim, and a fresh job was never replayed: as many claims as
    # attempts (the claim count is the fencing token the worker's writes are guarded on).
    claims = factory.SelfAttribute("attempts")
    # Ids are UUIDv7s whose leading bits are the enqueue time; a test of old jobs (pruning)
    # passes enqueued_ago=<seconds> so that its ids are as old as the jobs pretend to be.
    id = factory.LazyAttribute(
        lambda o: uuid7(None if o.enqueued_ago is None else time.time() - o.enqueued_ago)
    )

    class Params:
        enqueued_ago = None
        # Claimed by a live worker: the lease runs for five more minutes.
        running = factory.Trait(
            status=Status.RUNNING,
            attempts=1,
            worker="factory-worker",
            started_at=factory.LazyFunction(timezone.now),
            leased_until=factory.LazyFunction(lambda: timezone.now() + timedelta(minutes=5)),
        )
        # Claimed by a worker that died: the lease ran out a minute ago, the reaper may take it.
        expired = factory.Trait(
            status=Status.RUNNING,
            attempts=1,
            worker="lost-worker",
            started_at=factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=2)),
            leased_until=factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=1)),
        )
        # An attempt failed; back to ready, waiting out its backoff.
        retrying = factory.Trait(
            status=Status.READY,
            attempts=1,
            last_error="RuntimeError: boom",
            errors=factory.LazyFunction(lambda: [first_failure()]),
            run_at=factory.LazyFunction(lambda: timezone.now() + timedelta(minutes=1)),
        )
        # The dead letter: every attempt failed.
        dead = factory.Trait(
            status=Status.FAILED,
            attempts=3,
            last_error="RuntimeError: boom",
            finished_at=factory.LazyFunction(timezone.now),
        )
        # Cancelled while ready: it never ran.
        cancelled = factory.Trait(
            status=Status.CANCELLED, finished_at=factory.LazyFunction(timezone.now)
        )
        succeeded = factory.Trait(
            status=Status.SUCCEEDED, attempts=1, finished_at=factory.LazyFunction(timezone.now)
        )
        future = factory.Trait(
            run_at=factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1))
        )


# A UUIDv7 of now on the database's clock, as django_pgjobs.ids.uuid7 makes one in Python:
# the time in the first 48 bits, then a random UUID's bits with the version set to 7.
_UUID7 = (
    "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) placing "
    "substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3) "
    "FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"
)


def backlog(ready: Mapping[str, int] | None = None, *, finished: int = 0) -> None:
    """Fill the job table by SQL (the factory would take minutes) the way a busy queue's looks,
    then ANALYZE it so the planner knows: `ready[queue]` due jobs in each queue, with priorities
    -2..2 and run_at a millisecond apart (the claim order has work to do), and `finished`
    succeeded jobs in 'default' (the history a queue keeps until it is pruned). Ids are
    UUIDv7s of now, as enqueue makes them."""
    with connection.cursor() as cursor:
        if finished:
            cursor.execute(
                "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, status, "
                "attempts, claims, finished_at) "
                f"SELECT {_UUID7}, 'default', 'tests.tasks.noop', '{{}}', 3, 'succeeded', 1, 1, "
                "now() FROM generate_series(1, %s)",
                [finished],
            )
        for queue, count in (ready or {}).items():
            cursor.execute(
                "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts, priority, run_at) "
                f"SELECT {_UUID7}, %s, 'tests.tasks.noop', '{{}}', 3, (g %% 5) - 2, "
                "now() - g * interval '1 ms' FROM generate_series(1, %s) AS g",
                [queue, count],
            )
        cursor.execute("ANALYZE pgjobs_job")
