"""Flow control in the claim, in process against the real database: limited tasks' jobs are
claimed a limit key at a time, under their rate and concurrency limits, the keys taking turns,
and never by the claim of the other jobs (data/sql.py, LOCK_KEYS and CLAIM_KEYED)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from io import StringIO
from typing import Any

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.urls import reverse

from django_pgjobs.data.jobs import JobManager
from django_pgjobs.errors import EnqueueError
from django_pgjobs.limits import TaskLimits
from django_pgjobs.models import Bucket, Job, Queue
from django_pgjobs.registry import all_tasks, task
from django_pgjobs.runtime import postgres
from django_pgjobs.runtime.controls import QueueControls
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import tasks
from tests.conftest import connection_kwargs, wait_until

pytestmark = pytest.mark.django_db

LIMITS = TaskLimits.of(all_tasks())


def open_session() -> psycopg.Connection[Any]:
    return psycopg.connect(**connection_kwargs(), autocommit=True)


def keyed(limit: int = 10, worker: str = "w1", after: tuple[str, str] = ("", "")) -> Any:
    return Job.objects.claim_keyed("limited", LIMITS, worker=worker, limit=limit, after=after)


def test_a_limited_tasks_job_has_its_key_and_the_others_none() -> None:
    plain = tasks.noop.enqueue()
    rated = tasks.rated.enqueue(n=1)
    export = tasks.export.enqueue(customer_id="acme", n=1)
    (bulk,) = Job.objects.bulk_enqueue(tasks.export, [{"customer_id": 7, "n": 2}])
    assert [job.limit_key for job in (plain, rated, export, bulk)] == [None, "", "acme", "7"]
    stored = dict(Job.objects.values_list("pk", "limit_key"))
    assert stored == {plain.pk: None, rated.pk: "", export.pk: "acme", bulk.pk: "7"}


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        ({"n": 1}, "missing the required argument 'customer_id'"),
        ({"customer_id": ["a"], "n": 1}, "a key must be a string or a whole number"),
        ({"customer_id": "x" * 201, "n": 1}, "200 at most"),
    ],
)
def test_an_enqueue_without_a_usable_key_says_why_and_writes_nothing(
    payload: dict[str, Any], says: str
) -> None:
    with pytest.raises(EnqueueError, match=says):
        Job.objects.enqueue(tasks.export, payload)
    with pytest.raises(EnqueueError, match=r"payloads\[1\]: "):
        Job.objects.bulk_enqueue(tasks.export, [{"customer_id": "a", "n": 1}, payload])
    assert not Job.objects.exists()


def test_the_open_claim_never_takes_a_limited_tasks_job() -> None:
    tasks.per_customer.enqueue(customer_id="a", n=1)
    plain = Job.objects.enqueue(tasks.noop, queue="limited")
    assert Job.objects.claim(["limited"], worker="w1", limit=10) == [plain]
    claimed = keyed().claimed
    assert [job.limit_key for job in claimed] == ["a"]


def test_keys_take_turns_so_a_small_key_is_not_behind_a_backlog() -> None:
    Job.objects.bulk_enqueue(
        tasks.per_customer, [{"customer_id": "big", "n": n} for n in range(500)]
    )
    Job.objects.bulk_enqueue(
        tasks.per_customer, [{"customer_id": "small", "n": n} for n in range(5)]
    )
    claimed = keyed(limit=10).claimed
    assert sorted(job.limit_key for job in claimed) == ["big"] * 5 + ["small"] * 5
    assert keyed(limit=10, worker="w2").claimed  # the rest of big's, with the cursor anywhere


def test_the_cursor_moves_round_the_keys() -> None:
    Job.objects.bulk_enqueue(
        tasks.per_customer, [{"customer_id": c, "n": n} for c in "abcd" for n in range(3)]
    )
    first = keyed(limit=2)
    assert {job.limit_key for job in first.claimed} == {"a", "b"}
    second = keyed(limit=2, after=first.cursor)
    assert {job.limit_key for job in second.claimed} == {"c", "d"}
    third = keyed(limit=2, after=second.cursor)
    assert {job.limit_key for job in third.claimed} == {"a", "b"}


def test_a_concurrency_limit_holds_per_key_and_a_finished_job_frees_its_slot() -> None:
    Job.objects.bulk_enqueue(
        tasks.export, [{"customer_id": c, "n": n} for c in ("a", "b") for n in range(5)]
    )
    claimed = keyed(limit=10).claimed
    assert sorted(job.limit_key for job in claimed) == ["a", "a", "b", "b"]
    assert keyed(limit=10).claimed == []
    done = next(job for job in claimed if job.limit_key == "a")
    Job.objects.settle_and_claim([done], [], [], worker="w1", limit=0)
    assert [job.limit_key for job in keyed(limit=10).claimed] == ["a"]


def test_a_rate_limit_starts_its_burst_then_one_per_interval_on_the_databases_clock() -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(50)])
    rate = tasks.rated.rate_limit
    assert rate is not None and rate.burst == 4 and rate.interval == 0.05
    first = keyed(limit=50)
    assert len(first.claimed) == 4
    held = keyed(limit=50)
    assert held.claimed == [] and held.wait is not None and 0 < held.wait <= 0.05
    time.sleep(0.26)
    assert 4 <= len(keyed(limit=50).claimed) <= 5
    assert Bucket.objects.filter(task=tasks.rated.name, key="").count() == 1


def test_a_key_another_worker_claims_from_is_skipped_not_waited_for() -> None:
    Job.objects.bulk_enqueue(tasks.export, [{"customer_id": "a", "n": n} for n in range(3)])
    Job.objects.bulk_enqueue(tasks.export, [{"customer_id": "b", "n": n} for n in range(3)])
    holding, held = threading.Event(), threading.Event()

    def hold_a() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(%s, hashtext(%s || chr(31) || %s))",
                        [0x706A6C, tasks.export.name, "a"],
                    )
                holding.set()
                held.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=hold_a)
    thread.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        claimed = keyed(limit=10).claimed
        assert time.monotonic() - started < 1
        assert [job.limit_key for job in claimed] == ["b", "b"]
    finally:
        held.set()
        thread.join(10)


def test_a_tasks_limits_are_checked_when_it_is_declared() -> None:
    with pytest.raises(ValueError, match=r"@task\(rate_limit=...\): \'10 per second\' is not"):
        task(rate_limit="10 per second")(lambda: None)
    with pytest.raises(ValueError, match=r"concurrency_limit=0\) must be a whole number"):
        task(concurrency_limit=0)(lambda: None)
    with pytest.raises(ValueError, match=r"from 1 to 1,000,000 \(None: no limit\)"):
        task(concurrency_limit=10**10)(lambda: None)
    with pytest.raises(ValueError, match=r"limit_by='customer-id'\) must name"):
        task(limit_by="customer-id")(lambda: None)

    def export(order_id: int) -> None: ...

    with pytest.raises(ValueError, match=r"limit_by='customer_id'\): export\(\) takes no "):
        task(limit_by="customer_id")(export)


def test_a_queues_rate_limit_holds_for_every_claim_of_it() -> None:
    Queue.objects.create(name="default", rate_limit="10/s")
    for _ in range(20):
        tasks.noop.enqueue()
    first = Job.objects.claim_limited("default", worker="w1", limit=20).claimed
    assert len(first) == 2  # a burst of a fifth of a second's
    assert Job.objects.claim_limited("default", worker="w1", limit=20).claimed == []
    time.sleep(0.25)
    assert 2 <= len(Job.objects.claim_limited("default", worker="w1", limit=20).claimed) <= 3


@pytest.mark.django_db(transaction=True)  # now() in the report: after the enqueue's
def test_jobstats_and_the_report_say_how_many_limited_jobs_wait_and_run() -> None:
    Job.objects.bulk_enqueue(
        tasks.export, [{"customer_id": c, "n": n} for c in ("a", "b", "c") for n in range(4)]
    )
    keyed(limit=10)  # two of each customer's run, the others wait
    Queue.objects.create(name="limited", rate_limit="5/s")
    out = StringIO()
    with contextlib.suppress(SystemExit):
        call_command("jobstats", stdout=out)
    assert (
        "tests.tasks.export: 2 at once, per customer_id; 6 running over 3 keys, "
        "6 waiting over 3 keys"
    ) in out.getvalue()
    out = StringIO()
    with contextlib.suppress(SystemExit):
        call_command("jobstats", "--json", stdout=out)
    document = json.loads(out.getvalue())
    assert document["limits"] == [{
        "task": "tests.tasks.export", "limits": "2 at once, per customer_id", "waiting": 6,
        "waiting_keys": 3, "running": 6, "running_keys": 3,
    }]  # fmt: skip
    (limited,) = [q for q in document["queues"] if q["queue"] == "limited"]
    assert limited["rate_limit"] == "5/s" and limited["due"] == 6


def test_the_queues_list_edits_a_rate_limit_and_refuses_one_it_cannot_read(admin_client) -> None:
    Queue.objects.create(name="webhooks")
    form = {
        "form-TOTAL_FORMS": "1", "form-INITIAL_FORMS": "1", "form-0-name": "webhooks",
        "form-0-rate_limit": "100/m", "_save": "Save",
    }  # fmt: skip
    queues = reverse("admin:pgjobs_queue_changelist")
    assert admin_client.post(queues, form).status_code == 302
    assert Queue.objects.get().rate_limit == "100/m"
    refused = admin_client.post(queues, form | {"form-0-rate_limit": "100 a minute"})
    assert refused.status_code == 200
    assert "is not a rate; write a whole number" in refused.content.decode()
    assert Queue.objects.get().rate_limit == "100/m"
    cleared = admin_client.post(queues, form | {"form-0-rate_limit": ""})
    assert cleared.status_code == 302 and Queue.objects.get().rate_limit is None


@pytest.mark.django_db(transaction=True)
def test_the_report_page_shows_the_limited_tasks_and_a_queues_rate(admin_client) -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(10)])
    keyed(limit=10)
    Queue.objects.create(name="limited", rate_limit="5/s")
    page = admin_client.get(reverse("admin:pgjobs_queue_report")).content.decode()
    assert '<table id="limits">' in page
    assert "<td>tests.tasks.rated</td><td>20/s</td>" in page
    assert "(5/s)" in page


def test_run_jobs_in_a_test_runs_limited_tasks_jobs_without_their_limits() -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(10)])
    Job.objects.bulk_enqueue(tasks.export, [{"customer_id": "a", "n": n} for n in range(5)])
    run = run_jobs()
    assert len(run) == 15
    assert set(Job.objects.values_list("status", flat=True)) == {Status.SUCCEEDED}


@pytest.mark.django_db(transaction=True)
def test_runjobs_once_waits_out_a_rate_limit_and_drains_every_job() -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(30)])  # 20/s: over a second
    started = time.monotonic()
    with contextlib.suppress(SystemExit):
        call_command("runjobs", "--once", "--queue", "limited", "--no-listen")
    assert not Job.objects.exclude(status=Status.SUCCEEDED).exists()
    assert time.monotonic() - started > (30 - 4) / 20


@pytest.mark.django_db(transaction=True)
def test_one_slot_goes_to_limited_and_other_jobs_in_turns_so_neither_starves() -> None:
    Job.objects.bulk_enqueue(tasks.per_customer, [{"customer_id": "a", "n": n} for n in range(20)])
    plain = [Job.objects.enqueue(tasks.noop, queue="limited") for _ in range(5)]
    with contextlib.suppress(SystemExit):
        call_command("runjobs", "--once", "--queue", "limited", "--concurrency", "1",
                     "--batch-size", "1", "--no-listen")  # fmt: skip
    assert not Job.objects.exclude(status=Status.SUCCEEDED).exists()
    last_limited = max(
        Job.objects.filter(task=tasks.per_customer.name).values_list("started_at", flat=True)
    )
    first_plain = min(
        Job.objects.filter(pk__in=[job.pk for job in plain]).values_list("started_at", flat=True)
    )
    assert first_plain < last_limited


@pytest.mark.django_db(transaction=True)
def test_a_queue_without_limited_jobs_costs_no_claim_of_them_a_turn(monkeypatch) -> None:
    looked: list[str] = []
    claim_keyed = JobManager.claim_keyed

    def counted(self: JobManager, queue: str, *args: Any, **kwargs: Any) -> Any:
        looked.append(queue)
        return claim_keyed(self, queue, *args, **kwargs)

    monkeypatch.setattr(JobManager, "claim_keyed", counted)
    Job.objects.bulk_enqueue(tasks.noop, [None] * 300, queue="limited")
    worker = Worker(Options(queues=["limited"], concurrency=2, batch_size=2, once=True,
                            listen=False, poll_interval=0.1))  # fmt: skip
    started = time.monotonic()
    worker.run()
    assert not Job.objects.exclude(status=Status.SUCCEEDED).exists()
    # 150 turns or more; a look at the start, and again once a second at most.
    assert 1 <= len(looked) <= 2 + int(time.monotonic() - started)


@pytest.mark.django_db(transaction=True)
def test_jobs_of_a_task_whose_limits_were_dropped_still_run(monkeypatch) -> None:
    # Enqueued while it had limits; no task this worker knows has any now.
    jobs = Job.objects.bulk_enqueue(tasks.per_customer, [{"customer_id": "a", "n": n}
                                                         for n in range(5)])  # fmt: skip
    monkeypatch.setattr(postgres, "all_tasks", lambda: {tasks.noop.name: tasks.noop})
    Worker(Options(queues=["limited"], once=True, listen=False, poll_interval=0.1)).run()
    assert {job.status for job in Job.objects.filter(pk__in=[j.pk for j in jobs])} == {
        Status.SUCCEEDED
    }


@pytest.mark.django_db(transaction=True)
def test_a_locked_bucket_holds_back_its_keys_only_never_the_workers_other_claims() -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(20)])
    keyed(limit=1)  # the bucket's row exists
    plain = Job.objects.bulk_enqueue(tasks.noop, [None] * 50)
    holding, release = threading.Event(), threading.Event()

    def lock_the_buckets() -> None:
        with open_session() as other, other.transaction():
            other.execute("LOCK TABLE pgjobs_bucket IN ACCESS EXCLUSIVE MODE")
            holding.set()
            release.wait(20)

    holder = threading.Thread(target=lock_the_buckets)
    holder.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        worker = Worker(Options(queues=["default", "limited"], once=True, listen=False,
                                poll_interval=0.1))  # fmt: skip
        worker.run()
        assert time.monotonic() - started < 5
        done = Job.objects.filter(pk__in=[job.pk for job in plain], status=Status.SUCCEEDED)
        assert done.count() == 50
    finally:
        release.set()
        holder.join(10)


@pytest.mark.django_db(transaction=True)
def test_run_jobs_runs_a_limited_job_that_waited_for_its_run_at() -> None:
    tasks.per_customer.using(delay=0.2).enqueue(customer_id="a", n=1)
    time.sleep(0.3)
    assert len(run_jobs()) == 1


def test_a_raised_rate_holds_from_the_next_claim_not_once_the_old_bucket_fills() -> None:
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(50)])
    name = tasks.rated.name
    slow = TaskLimits((name,), (None,), (60.0,), (1,))  # 1/m
    fast = TaskLimits((name,), (None,), (0.01,), (20,))  # 100/s
    claim = Job.objects.claim_keyed
    assert len(claim("limited", slow, worker="w1", limit=50).claimed) == 1  # a minute spent
    assert claim("limited", fast, worker="w1", limit=50).claimed == []  # as all spent at 100/s
    time.sleep(0.25)
    assert len(claim("limited", fast, worker="w1", limit=50).claimed) == 20
    Queue.objects.create(name="default", rate_limit="1/m")
    for _ in range(30):
        tasks.noop.enqueue()
    assert len(Job.objects.claim_limited("default", worker="w1", limit=30).claimed) == 1
    Queue.objects.filter(name="default").update(rate_limit="100/s")
    assert Job.objects.claim_limited("default", worker="w1", limit=30).claimed == []
    time.sleep(0.25)
    assert len(Job.objects.claim_limited("default", worker="w1", limit=30).claimed) == 20


def test_a_queues_rate_written_unreadable_is_said_once_and_the_queue_runs(caplog) -> None:
    Queue.objects.create(name="default", rate_limit="10 a second")  # past the form's check
    controls = QueueControls(["default"], interval=0.0)
    for _ in range(3):
        controls.read_if_due("default")
    assert controls.open == ["default"]
    said = [r.getMessage() for r in caplog.records if "is not a rate" in r.getMessage()]
    assert said == [
        'queue default: its rate_limit \'10 a second\' is not a rate (as "10/s", "100/m"): it '
        "runs without one"
    ]


def test_a_controlled_queues_single_slot_goes_to_limited_and_other_jobs_in_turns() -> None:
    Queue.objects.create(name="limited", max_running=1)
    tasks.per_customer.enqueue(customer_id="a", n=1)
    plain = Job.objects.enqueue(tasks.noop, queue="limited")
    claim = Job.objects.claim_limited
    first = claim("limited", worker="w1", limit=1, limits=LIMITS, round_up=False).claimed
    assert first == [plain]  # rounded down: none of the one slot for limited jobs
    Job.objects.settle_and_claim(first, [], [], worker="w1", limit=0)
    second = claim("limited", worker="w1", limit=1, limits=LIMITS, round_up=True).claimed
    assert [job.task for job in second] == [tasks.per_customer.name]


def test_keys_at_their_limit_hold_back_no_key_behind_them() -> None:
    Job.objects.bulk_enqueue(
        tasks.export, [{"customer_id": f"c{c:03}", "n": n} for c in range(150) for n in range(3)]
    )
    free = Job.objects.bulk_enqueue(tasks.export, [{"customer_id": "z", "n": n} for n in range(2)])
    with connection.cursor() as cursor:  # two of each c… customer's run elsewhere
        cursor.execute(
            """
            UPDATE pgjobs_job SET status = 'running', worker = 'w0', attempts = 1, claims = 1,
                                  leased_until = now() + interval '1 hour'
            WHERE id IN (SELECT id FROM (
                SELECT id, row_number() OVER (PARTITION BY limit_key ORDER BY id) AS n
                FROM pgjobs_job WHERE limit_key LIKE 'c%%') AS each WHERE n <= 2)
            """
        )
    claimed = keyed(limit=2).claimed
    assert sorted(job.pk for job in claimed) == sorted(job.pk for job in free)


@pytest.mark.django_db(transaction=True)
def test_a_rate_held_queue_once_paused_is_not_polled_without_end(monkeypatch) -> None:
    turns: list[float] = []
    exchange = postgres.PostgresSource._exchange

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        turns.append(time.monotonic())
        return exchange(self, *args, **kwargs)

    monkeypatch.setattr(postgres.PostgresSource, "_exchange", counted)
    Job.objects.bulk_enqueue(tasks.rated, [{"n": n} for n in range(200)])
    worker = Worker(Options(queues=["limited", "default"], listen=False, poll_interval=0.5))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert wait_until(lambda: Job.objects.filter(status=Status.SUCCEEDED).count() > 10, 10)
        Queue.objects.create(name="limited", paused=True)
        time.sleep(1.5)  # the controls are read every second
        since = time.monotonic()
        time.sleep(1.0)
        assert len([t for t in turns if t > since]) < 20  # its poll, not a loop
    finally:
        worker.stop()
        thread.join(15)
