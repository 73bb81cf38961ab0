from __future__ import annotations

import re
import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from psycopg import sql as psql

from django_pgjobs.data import sql
from django_pgjobs.data.jobs import turn_params
from django_pgjobs.data.records import FailedAttempt, Failure
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests import plans
from tests.factories import JobFactory, backlog

pytestmark = pytest.mark.django_db


def test_claim_skips_a_job_locked_by_another_connection(other_connection):
    locked, free = JobFactory.create_batch(2)
    with other_connection.transaction():
        other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        claimed = Job.objects.claim(["default"], worker="w1", limit=2)
    assert [job.pk for job in claimed] == [free.pk]


def test_claim_marks_jobs_running_leased_to_the_worker_and_counts_the_attempt():
    JobFactory()
    (job,) = Job.objects.claim(["default"], worker="w1", limit=5, lease=120)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.worker, row.attempts) == (Status.RUNNING, "w1", 1)
    assert (job.status, job.worker, job.attempts) == (Status.RUNNING, "w1", 1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT leased_until - statement_timestamp() FROM pgjobs_job")
        (remaining,) = cursor.fetchone()
    assert timedelta(seconds=115) < remaining <= timedelta(seconds=120)


def test_claim_order_is_priority_then_run_at_then_id():
    now = timezone.now()
    low = JobFactory(priority=-5, run_at=now - timedelta(hours=2))
    old = JobFactory(priority=5, run_at=now - timedelta(hours=1))
    new = JobFactory(priority=5, run_at=now - timedelta(minutes=1))
    tie_a, tie_b = JobFactory.create_batch(2, priority=5, run_at=now - timedelta(minutes=1))
    claimed = []
    while batch := Job.objects.claim(["default"], worker="w1", limit=1):
        claimed.extend(batch)
    expected = [old, *sorted([new, tie_a, tie_b], key=lambda j: j.pk), low]
    assert [job.pk for job in claimed] == [job.pk for job in expected]


def test_a_batch_comes_back_in_claim_order_across_queues():
    now = timezone.now()
    a = JobFactory(queue="a", priority=1, run_at=now - timedelta(minutes=5))
    b = JobFactory(queue="b", priority=9, run_at=now - timedelta(minutes=1))
    c = JobFactory(queue="b", priority=1, run_at=now - timedelta(minutes=9))
    JobFactory(queue="other")
    claimed = Job.objects.claim(["a", "b"], worker="w1", limit=10)
    assert [job.pk for job in claimed] == [b.pk, c.pk, a.pk]


def test_claims_across_queues_take_turns_so_no_queue_starves():
    now = timezone.now()
    backlog = [JobFactory(queue="a", run_at=now - timedelta(hours=1, seconds=n)) for n in range(20)]
    newer = JobFactory.create_batch(2, queue="b")
    claimed = Job.objects.claim(["a", "b"], worker="w1", limit=6)
    # Turn by turn: each queue's best job, then each queue's second best, then the rest of a.
    assert {job.pk for job in claimed} == {
        *(job.pk for job in newer),
        *(job.pk for job in backlog[-4:]),
    }
    assert Job.objects.filter(status=Status.RUNNING).count() == 6


def test_within_a_turn_across_queues_higher_priority_goes_first():
    JobFactory.create_batch(3, queue="a", priority=0)
    best = JobFactory(queue="b", priority=50)
    claimed = Job.objects.claim(["a", "b"], worker="w1", limit=1)
    assert [job.pk for job in claimed] == [best.pk]


def test_future_jobs_are_not_claimed():
    JobFactory(future=True)
    assert Job.objects.claim(["default"], worker="w1", limit=10) == []


def test_jobs_of_other_queues_and_statuses_are_not_claimed():
    JobFactory(queue="elsewhere")
    JobFactory(running=True)
    JobFactory(dead=True)
    JobFactory(succeeded=True)
    assert Job.objects.claim(["default"], worker="w1", limit=10) == []


@pytest.mark.django_db(transaction=True)  # threads: each claims on its own connection
def test_eight_threads_claiming_2000_jobs_at_once_claim_each_exactly_once():
    Job.objects.bulk_enqueue("tests.tasks.noop", [{}] * 2000)
    claimed: list[list[object]] = [[] for _ in range(8)]
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            start.wait()
            while jobs := Job.objects.claim(["default"], worker=f"w{n}", limit=7):
                claimed[n].extend(job.pk for job in jobs)
        except BaseException as error:
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    claims = Counter(pk for pks in claimed for pk in pks)
    assert len(claims) == 2000
    assert set(claims.values()) == {1}
    assert Job.objects.filter(status=Status.RUNNING).count() == 2000


def _claim_params(queues: list[str], limit: int) -> dict:
    """The parameters of the worker's turn statement for a claim that settles nothing."""
    return turn_params([], [], queues, worker="w1", limit=limit, lease=60.0, results={})


def _claim_plan(queues: list[str], limit: int) -> plans.Plan:
    """The worker's claim statement, run by EXPLAIN ANALYZE and rolled back."""
    return plans.explain(sql.SETTLE_AND_CLAIM, _claim_params(queues, limit), analyze=True)


def test_claim_uses_the_partial_claim_index_on_an_analyzed_table_of_mostly_finished_jobs():
    backlog({"default": 2_000}, finished=50_000)
    plan = _claim_plan(["default"], limit=10)
    scans = plans.index_scans(plan, "pgjobs_job_claim_idx")
    assert scans, plans.shown(plan)
    # Index range scans (one per branch of the claim: higher priorities, after the position,
    # lower priorities) that stop at the limit: together they read 10 rows of the 2,000 ready,
    # and the only sort is of those few candidates (their turns), never of the backlog.
    assert sum(scan["Actual Rows"] for scan in scans) == 10, plans.shown(plan)
    assert all(node["Actual Rows"] <= 10 for node in plans.of_type(plan, "Sort"))


def test_a_claim_across_several_queues_never_sorts_the_backlog():
    backlog({"a": 20_000, "b": 20_000, "c": 20_000}, finished=1_000)
    plan = _claim_plan(["a", "b", "c"], limit=10)
    scans = plans.index_scans(plan, "pgjobs_job_claim_idx")
    # Index range scans per queue (a lateral join: each branch's scan node looped once per
    # queue), each stopping at the limit.
    assert all(scan["Actual Loops"] == 3 for scan in scans), plans.shown(plan)
    assert all(scan["Actual Rows"] <= 10 for scan in scans)
    sorts = plans.of_type(plan, "Sort")
    assert all(node["Actual Rows"] <= 30 for node in sorts)  # only the 3 × 10 candidates


@pytest.mark.django_db(transaction=True)  # session settings, and the connection is closed
def test_the_claim_binds_on_the_server_and_keeps_its_index_as_a_generic_prepared_plan():
    # A generic plan knows no parameter values: it can use the partial claim index only if
    # status = 'ready' is a literal in the statement, not a bound parameter.
    backlog({"default": 2_000}, finished=20_000)
    connection.ensure_connection()
    connection.connection.prepare_threshold = 0  # psycopg prepares on the first execution
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET plan_cache_mode = force_generic_plan")
        assert len(Job.objects.claim(["default"], worker="w1", limit=10)) == 10
        with connection.cursor() as cursor:
            # A client-side binding cursor never prepares: the claim must have bound its
            # parameters on the server to be here.
            cursor.execute(
                "SELECT name FROM pg_prepared_statements WHERE statement LIKE %s",
                ["%SKIP LOCKED%"],
            )
            (name,) = cursor.fetchone()
        arguments = _claim_params(["default"], limit=10)
        order = dict.fromkeys(re.findall(r"%\((\w+)\)s", sql.CLAIM))
        values = psql.SQL(", ").join(psql.Literal(arguments[key]) for key in order)
        execute = psql.SQL("EXECUTE {}({})").format(psql.Identifier(name), values)
        plan = plans.explain(execute.as_string(connection.connection))
        with connection.cursor() as cursor:
            cursor.execute("RESET plan_cache_mode")
    finally:
        connection.close()
    assert plans.index_scans(plan, "pgjobs_job_claim_idx"), plans.shown(plan)


def test_a_turn_with_no_outcome_to_record_runs_the_claim_alone():
    """Its plan starts none of the settling statements' parts: an idle worker's wake-up pays
    for every part its plan starts, on a backend that slept."""
    JobFactory.create_batch(3)
    with CaptureQueriesContext(connection) as queries:
        (first,) = Job.objects.settle_and_claim([], [], ["default"], worker="w1", limit=1)[2]
        Job.objects.settle_and_claim([first], [], ["default"], worker="w1", limit=1)
    claim_only, with_outcome = (query["sql"] for query in queries.captured_queries)
    assert "UPDATE" in claim_only and "succeeded AS" not in claim_only
    assert "succeeded AS" in with_outcome
    assert Job.objects.get(pk=first.pk).status == Status.SUCCEEDED


def test_settle_and_claim_records_outcomes_of_owned_jobs_and_claims_in_one_statement():
    JobFactory.create_batch(4, max_attempts=3)
    first = Job.objects.claim(["default"], worker="w1", limit=3)
    stale = Job.objects.get(pk=first[1].pk)
    stale.claims += 1  # a claim this worker does not hold: the guard must refuse it
    boom = Failure("RuntimeError", "boom")
    with CaptureQueriesContext(connection) as queries:
        done, failed, claimed, *_ = Job.objects.settle_and_claim(
            [first[0], stale],
            [FailedAttempt(first[2], boom, False, 60.0)],
            ["default"],
            worker="w1",
            limit=5,
        )
    assert len(queries) == 1
    assert done == {first[0].pk}
    assert failed == {first[2].pk: Status.READY}
    assert len(claimed) == 1 and claimed[0].status == Status.RUNNING
    assert claimed[0].pk not in {job.pk for job in first}
    assert Job.objects.get(pk=first[0].pk).status == Status.SUCCEEDED
    assert Job.objects.get(pk=first[1].pk).status == Status.RUNNING
    retried = Job.objects.get(pk=first[2].pk)
    assert retried.last_error == "RuntimeError: boom"
    assert retried.errors[-1]["attempt"] == 1 and retried.errors[-1]["worker"] == "w1"
    assert retried.run_at > retried.created_at + timedelta(seconds=59)


def test_settle_and_claim_without_a_claim_only_records_outcomes():
    JobFactory.create_batch(2, max_attempts=1)
    first, second = Job.objects.claim(["default"], worker="w1", limit=2)
    done, failed, claimed, *_ = Job.objects.settle_and_claim(
        [first], [FailedAttempt(second, Failure("E", "x"), False, 0.0)], [], worker="w1", limit=0
    )
    assert (done, failed, claimed) == ({first.pk}, {second.pk: Status.FAILED}, [])


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("run_at", ["-infinity", "0100-01-01 BC"])
def test_a_run_at_set_by_hand_before_what_python_holds_is_claimed_with_the_others(run_at):
    # An operator's UPDATE ... SET run_at = '-infinity' (to the front of the queue): the claim
    # committed, then failed reading its rows, and the claimed jobs, unknown to the worker, ran
    # out their leases with an attempt spent.
    odd, *others = JobFactory.create_batch(4)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET run_at = %s::timestamptz WHERE id = %s", [run_at, odd.pk]
        )
    claimed = Job.objects.settle_and_claim([], [], ["default"], worker="w1", limit=10).claimed
    assert {job.pk for job in claimed} == {odd.pk, *(job.pk for job in others)}
    assert claimed[0].pk == odd.pk  # first, as asked


@pytest.mark.django_db
def test_claims_the_caller_never_sees_are_given_back_at_once():
    """A Job model signal's receiver that raises while claimed rows become Job objects: the
    claims were committed; they go back to ready at once, the attempt not spent."""
    from django.db.models.signals import post_init

    from tests.factories import JobFactory

    def broken(sender: Any, instance: Job, **kwargs: Any) -> None:
        if instance.payload == {"poison": 1}:
            raise RuntimeError("post_init receiver bug")

    job = JobFactory(payload={"poison": 1})
    post_init.connect(broken, sender=Job)
    try:
        with pytest.raises(RuntimeError, match="post_init receiver bug"):
            Job.objects.claim(["default"], worker="w1", limit=5)
    finally:
        post_init.disconnect(broken, sender=Job)
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.attempts, row.claims) == (Status.READY, 0, 1)
