"""factory_boy factories for jobs, with traits for each state."""

from __future__ import annotations

import time
from datetime import timedelta

import factory
from django.utils import timezone

from django_pgjobs.ids import uuid7
from django_pgjobs.models import Job
from django_pgjobs.status import Status


class JobFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Job

    queue = "default"
    task = "tests.tasks.noop"
    payload = factory.LazyFunction(dict)
    max_attempts = 3
    priority = 0
    # Ids are UUIDv7s whose leading bits are the enqueue time; a test of old jobs (pruning)
    # passes enqueued_ago=<seconds> so that its ids are as old as the jobs pretend to be.
    id = factory.LazyAttribute(
        lambda o: uuid7(None if o.enqueued_ago is None else time.time() - o.enqueued_ago)
    )

    class Params:
        enqueued_ago = None
        running = factory.Trait(
            status=Status.RUNNING,
            attempts=1,
            worker="factory-worker",
            leased_until=factory.LazyFunction(lambda: timezone.now() + timedelta(minutes=5)),
        )
        expired = factory.Trait(
            status=Status.RUNNING,
            attempts=1,
            worker="lost-worker",
            leased_until=factory.LazyFunction(lambda: timezone.now() - timedelta(minutes=1)),
        )
        dead = factory.Trait(
            status=Status.FAILED,
            attempts=3,
            last_error="RuntimeError: boom",
            finished_at=factory.LazyFunction(timezone.now),
        )
        succeeded = factory.Trait(
            status=Status.SUCCEEDED, attempts=1, finished_at=factory.LazyFunction(timezone.now)
        )
        future = factory.Trait(
            run_at=factory.LazyFunction(lambda: timezone.now() + timedelta(hours=1))
        )
