"""Random runs of limited tasks' claims on the real database (data/sql.py, CLAIM_KEYED).

A Hypothesis state machine enqueues jobs of two limited tasks (tests/tasks.py: `export`, at
most 2 running per customer; `per_customer`, turns only) for a few customers, and claims them
as two workers do (each with its own cursor), finishes them, and lets leases run out and be
reaped. After every step: no customer has more than 2 exports running, and a claim that came
back short left no customer with room and jobs waiting (no key at its limit held back another,
whatever the cursor).
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import hypothesis
import pytest
from django.db import connection
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from django_pgjobs.data.jobs import SCAN_KEYS
from django_pgjobs.limits import TaskLimits
from django_pgjobs.models import Job
from django_pgjobs.registry import all_tasks
from django_pgjobs.status import Status
from tests import tasks

pytestmark = pytest.mark.django_db(transaction=True)

LIMITS = TaskLimits.of(all_tasks())
CUSTOMERS = ("a", "b", "c")
TASKS = {"export": tasks.export, "per_customer": tasks.per_customer}
WORKERS = ("w1", "w2")
RUNS = hypothesis.settings(
    max_examples=60,
    stateful_step_count=25,
    derandomize=not os.environ.get("PGJOBS_HYPOTHESIS_RANDOM"),
    database=None,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
    phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
)


@pytest.fixture(autouse=True)
def reaped_jobs_are_due_at_once(settings: Any) -> None:
    settings.PGJOBS = {**settings.PGJOBS, "BACKOFF_BASE": 0}


def counts(status: Status) -> Counter[tuple[str, str]]:
    """(task, limit key) → how many of its jobs have `status`."""
    return Counter(
        Job.objects.filter(status=status, limit_key__isnull=False).values_list("task", "limit_key")
    )


class LimitedClaims(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE pgjobs_job, pgjobs_bucket")
        self.cursors = dict.fromkeys(WORKERS, ("", ""))

    @rule(task=st.sampled_from(sorted(TASKS)), customer=st.sampled_from(CUSTOMERS),
          count=st.integers(1, 3))  # fmt: skip
    def enqueue(self, task: str, customer: str, count: int) -> None:
        Job.objects.bulk_enqueue(
            TASKS[task], [{"customer_id": customer, "n": n} for n in range(count)]
        )

    @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, 6))
    def claim(self, worker: str, limit: int) -> None:
        keyed = Job.objects.claim_keyed(
            "limited", LIMITS, worker=worker, limit=limit, after=self.cursors[worker]
        )
        self.cursors[worker] = keyed.cursor
        assert len(keyed.claimed) <= limit
        assert all(job.status == Status.RUNNING and job.worker == worker for job in keyed.claimed)
        if len(keyed.claimed) == limit:
            return
        ready, running = counts(Status.READY), counts(Status.RUNNING)
        assert len(ready) <= SCAN_KEYS  # a claim looks at every key: none may be left behind
        for (task, key), waiting in ready.items():
            assert waiting and task == tasks.export.name and running[(task, key)] == 2, (
                f"{task} [{key}] has {waiting} waiting and {running[(task, key)]} running, "
                f"yet the claim took {len(keyed.claimed)} of {limit}"
            )

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        running = list(Job.objects.filter(status=Status.RUNNING).order_by("id"))
        if running:
            job = data.draw(st.sampled_from(running))
            Job.objects.settle_and_claim([job], [], [], worker=job.worker, limit=0)

    @rule(data=st.data())
    def lease_runs_out(self, data: st.DataObject) -> None:
        running = list(Job.objects.filter(status=Status.RUNNING).order_by("id"))
        if running:
            job = data.draw(st.sampled_from(running))
            Job.objects.filter(pk=job.pk).update(leased_until="2000-01-01T00:00:00Z")
            Job.objects.reap()

    @invariant()
    def no_customer_runs_more_than_two_exports(self) -> None:
        running = counts(Status.RUNNING)
        over = {key: n for (task, key), n in running.items() if task == tasks.export.name and n > 2}
        assert not over, over


def test_limited_claims_hold_their_limits_and_leave_no_key_behind() -> None:
    run_state_machine_as_test(LimitedClaims, settings=RUNS)
