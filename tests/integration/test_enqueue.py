from __future__ import annotations

import datetime as dt
import gc
import threading
import time
from collections.abc import Iterator

import pytest
from django.db import connection, transaction
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_pgjobs.data import enqueue
from django_pgjobs.data import wakeups as notify
from django_pgjobs.errors import EnqueueError, UnknownTask
from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import framework_tasks, tasks

pytestmark = pytest.mark.django_db


class Boom(Exception):
    pass


@pytest.mark.django_db(transaction=True)  # a real ROLLBACK, not a savepoint's
def test_enqueue_in_a_rolled_back_transaction_leaves_no_row():
    with pytest.raises(Boom), transaction.atomic():
        Job.objects.enqueue("tests.tasks.noop")
        raise Boom
    assert Job.objects.count() == 0


@pytest.mark.django_db(transaction=True)  # a real COMMIT, not a savepoint's
def test_enqueue_in_a_committed_transaction_leaves_exactly_one_row():
    with transaction.atomic():
        job = Job.objects.enqueue("tests.tasks.send_email", {"to": "a@example.com"})
    row = Job.objects.get()
    assert row.pk == job.pk
    assert (row.task, row.queue, row.priority, row.max_attempts) == (
        "tests.tasks.send_email", "emails", 10, 7
    )  # fmt: skip
    assert (row.status, row.attempts, row.payload) == (Status.READY, 0, {"to": "a@example.com"})


@pytest.mark.django_db(transaction=True)  # BEGIN and COMMIT, no savepoints
@pytest.mark.parametrize("wake_ups", [True, False])
def test_enqueue_is_one_statement_on_the_callers_connection(settings, wake_ups):
    settings.PGJOBS = {**settings.PGJOBS, "NOTIFY": wake_ups}
    time.sleep(notify.COALESCE_SECONDS)  # so that this enqueue does announce its queue
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        Job.objects.enqueue("tests.tasks.noop")
    statements = [q["sql"] for q in queries if q["sql"] not in ("BEGIN", "COMMIT")]
    assert len(statements) == 1
    assert "INSERT INTO pgjobs_job" in statements[0]
    # Whether it announced the queue is the wake-up tests' business (below), by LISTEN.


def test_a_wake_up_is_sent_once_per_queue_after_commit_and_never_on_rollback(other_connection):
    other_connection.execute("LISTEN pgjobs")
    with transaction.atomic():
        for _ in range(3):
            Job.objects.enqueue("tests.tasks.noop")
            Job.objects.enqueue("tests.tasks.send_email", {"to": "x"})
        assert list(other_connection.notifies(timeout=0.2)) == []  # nothing before commit
    received = sorted(n.payload for n in other_connection.notifies(timeout=0.5))
    assert received == ["default", "emails"]
    with pytest.raises(Boom), transaction.atomic():
        Job.objects.enqueue("tests.tasks.noop")
        raise Boom
    time.sleep(0.01)  # past the coalescing window, so only the rollback can explain silence
    assert list(other_connection.notifies(timeout=0.3)) == []


def test_wake_ups_can_be_switched_off(settings, other_connection):
    settings.PGJOBS = {**settings.PGJOBS, "NOTIFY": False}
    other_connection.execute("LISTEN pgjobs")
    Job.objects.enqueue("tests.tasks.noop")
    assert list(other_connection.notifies(timeout=0.3)) == []


def test_enqueue_returns_the_row_as_written_with_database_times():
    job = Job.objects.enqueue(tasks.noop)
    assert job.run_at == job.created_at
    assert Job.objects.get(pk=job.pk).run_at == job.run_at


@pytest.mark.parametrize("bulk", [False, True])
def test_the_returned_job_has_every_field_as_read_back_from_the_table(bulk):
    if bulk:
        (job,) = Job.objects.bulk_enqueue(tasks.send_email, [{"to": "a@x"}], delay=5)
    else:
        job = Job.objects.enqueue(tasks.send_email, {"to": "a@x"}, unique_key="k1")
    assert not job.get_deferred_fields()  # every column has its value, none is loaded later
    row = Job.objects.get(pk=job.pk)
    for field in Job._meta.concrete_fields:
        assert getattr(job, field.attname) == getattr(row, field.attname), field.name
    assert (job._state.adding, job._state.db) == (False, "default")


def test_jobs_returned_by_one_enqueue_share_no_mutable_value():
    first, second = Job.objects.bulk_enqueue(tasks.noop, [{}, {}])
    first.errors.append({"type": "X"})
    assert (second.errors, Job.objects.enqueue(tasks.noop).errors) == ([], [])


def test_task_sugar_enqueues_with_kwargs_and_options():
    job = tasks.send_email.enqueue(to="b@example.com", subject="hi")
    assert job.payload == {"to": "b@example.com", "subject": "hi"}
    later = tasks.send_email.using(queue="bulk", priority=-5, delay=60).enqueue(to="c@example.com")
    row = Job.objects.get(pk=later.pk)
    assert (row.queue, row.priority) == ("bulk", -5)
    assert dt.timedelta(seconds=59) < row.run_at - row.created_at <= dt.timedelta(seconds=60)


@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize(
    "when",
    [{}, {"delay": 0}, {"delay": 1e-7}, {"delay": 2e-6}, {"delay": 30},
     {"run_at": dt.datetime(2000, 1, 1, tzinfo=dt.UTC)},
     {"run_at": dt.datetime(2100, 1, 1, tzinfo=dt.UTC)}],
)  # fmt: skip
def test_a_job_is_scheduled_exactly_when_it_is_not_yet_due_as_written(bulk, when):
    if bulk:
        (job,) = Job.objects.bulk_enqueue(tasks.noop, [{}], **when)
    else:
        job = Job.objects.enqueue(tasks.noop, **when)
    row = Job.objects.get(pk=job.pk)
    assert (row.run_at, row.scheduled) == (job.run_at, job.scheduled)
    assert row.scheduled == (row.run_at > row.created_at)


def test_run_at_schedules_at_that_time():
    when = timezone.now() + dt.timedelta(days=1)
    job = tasks.noop.using(run_at=when).enqueue()
    assert Job.objects.get(pk=job.pk).run_at == when


def test_bulk_enqueue_writes_every_job_in_few_statements():
    with CaptureQueriesContext(connection) as queries:
        jobs = Job.objects.bulk_enqueue(tasks.send_email, ({"to": f"{n}@x"} for n in range(12_000)))
    assert len(jobs) == Job.objects.filter(status=Status.READY).count() == 12_000
    first, *copies = [q["sql"] for q in queries]
    assert "pg_notify" in first  # one wake-up for the whole batch, with its times
    assert len(copies) == 3  # 5,000 rows per COPY, and nothing else
    assert all(sql.strip().startswith("COPY pgjobs_job") for sql in copies)
    assert {job.queue for job in jobs} == {"emails"}
    assert list(Job.objects.order_by("pk").values_list("payload__to", flat=True)) == [
        job.payload["to"] for job in jobs
    ]


@pytest.mark.django_db(transaction=True)  # a real ROLLBACK, not a savepoint's
def test_a_bulk_enqueue_that_fails_part_way_writes_nothing():
    copies = 0

    def fail_on_the_third_copy(execute, sql, params, many, context):
        nonlocal copies
        copies += sql.strip().startswith("COPY")
        if copies == 3:
            raise Boom
        return execute(sql, params, many, context)

    with connection.execute_wrapper(fail_on_the_third_copy), pytest.raises(Boom):
        Job.objects.bulk_enqueue(tasks.noop, [{}] * 12_000)
    assert Job.objects.count() == 0


def test_enqueued_jobs_are_built_like_loaded_ones_for_post_init_receivers():
    seen = []

    def receiver(sender, instance, **kwargs):
        seen.append(instance.payload)

    post_init.connect(receiver, sender=Job)
    try:
        Job.objects.enqueue(tasks.send_email, {"to": "a@x"})
        Job.objects.bulk_enqueue(tasks.send_email, [{"to": "b@x"}, {"to": "c@x"}])
    finally:
        post_init.disconnect(receiver, sender=Job)
    assert seen == [{"to": "a@x"}, {"to": "b@x"}, {"to": "c@x"}]


@pytest.fixture
def collector_seen() -> Iterator[list[bool]]:
    """Whether the garbage collector was on as each enqueued Job was made (a post_init
    receiver sees them made); the collector as it was before, afterwards."""
    seen: list[bool] = []

    def receiver(sender, instance, **kwargs):
        seen.append(gc.isenabled())

    was = gc.isenabled()
    post_init.connect(receiver, sender=Job)
    try:
        yield seen
    finally:
        post_init.disconnect(receiver, sender=Job)
        (gc.enable if was else gc.disable)()


def test_a_large_bulk_enqueue_pauses_the_collector_and_switches_it_back_on(collector_seen):
    many = [{}] * enqueue.PAUSE_COLLECTOR_FROM
    Job.objects.bulk_enqueue(tasks.noop, many)
    assert set(collector_seen) == {False} and gc.isenabled()
    collector_seen.clear()
    Job.objects.bulk_enqueue(tasks.noop, many[:-1])  # below the threshold: left alone
    assert set(collector_seen) == {True}
    with pytest.raises(EnqueueError, match=r"payloads\[999\]"):
        Job.objects.bulk_enqueue(tasks.noop, [*many[:-1], {"a": float("nan")}])
    assert gc.isenabled()  # on again after a refusal too


def test_a_bulk_enqueue_leaves_a_collector_switched_off_by_someone_else_off(collector_seen):
    gc.disable()
    Job.objects.bulk_enqueue(tasks.noop, [{}] * enqueue.PAUSE_COLLECTOR_FROM)
    assert set(collector_seen) == {False} and not gc.isenabled()


@pytest.mark.django_db(transaction=True)  # each thread commits on its own connection
def test_bulk_enqueues_in_threads_at_once_leave_the_collector_on():
    many = [{}] * enqueue.PAUSE_COLLECTOR_FROM
    start = threading.Barrier(4)

    def enqueue_many() -> None:
        start.wait()
        try:
            for _ in range(3):
                Job.objects.bulk_enqueue(tasks.noop, many)
        finally:
            connection.close()

    threads = [threading.Thread(target=enqueue_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gc.isenabled()
    assert Job.objects.count() == 12 * len(many)


def test_a_live_unique_key_is_not_enqueued_twice_and_the_existing_job_is_returned():
    first = Job.objects.enqueue(tasks.noop, unique_key="report:2026-11")
    second = Job.objects.enqueue(tasks.noop, unique_key="report:2026-11")
    assert second.pk == first.pk
    assert Job.objects.count() == 1
    Job.objects.filter(pk=first.pk).cancel()
    third = Job.objects.enqueue(tasks.noop, unique_key="report:2026-11")
    assert third.pk != first.pk  # only live jobs hold the key


WHEN = {
    "now": {},
    "run_at": {"run_at": dt.datetime(2100, 1, 1, tzinfo=dt.UTC)},
    "delay": {"delay": 30},
}


@pytest.mark.parametrize("wake_up", [True, False])
@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize("due", list(WHEN))
def test_every_case_of_the_enqueue_statement_writes_its_job_and_no_more(
    settings, other_connection, due, unique, wake_up
):
    # Each case has a statement of its own (sql.INSERT_JOBS): each must write the job as asked,
    # keep its key unique, and announce the queue exactly when a wake-up is due.
    settings.PGJOBS = {**settings.PGJOBS, "NOTIFY": wake_up}
    other_connection.execute("LISTEN pgjobs")
    options = WHEN[due] | ({"unique_key": f"{due}:{wake_up}"} if unique else {})
    time.sleep(notify.COALESCE_SECONDS)  # a wake-up is due again when NOTIFY is on
    with transaction.atomic():
        job = Job.objects.enqueue(tasks.noop, **options)
        again = Job.objects.enqueue(tasks.noop, **options)
    row = Job.objects.get(pk=job.pk)
    assert (row.run_at, row.scheduled, row.unique_key) == (job.run_at, due != "now", job.unique_key)
    if due == "delay":
        assert row.run_at - row.created_at == dt.timedelta(seconds=30)
    elif due == "run_at":
        assert row.run_at == WHEN["run_at"]["run_at"]
    else:
        assert row.run_at == row.created_at
    assert (again.pk == job.pk) is unique
    assert Job.objects.count() == (1 if unique else 2)
    received = [n.payload for n in other_connection.notifies(timeout=0.3)]
    assert received == (["default"] if wake_up else [])


BAD_INPUTS = [
    ({"task": "no.such.task"}, UnknownTask, "No task is registered as 'no.such.task'"),
    ({"payload": [1]}, EnqueueError, "must be a JSON object"),
    ({"payload": {"a": float("nan")}}, EnqueueError, "is nan"),
    ({"payload": {"a": "\x00"}}, EnqueueError, "NUL"),
    ({"payload": {"a": "\udc80"}}, EnqueueError, "surrogate"),
    ({"payload": {"a": object()}}, EnqueueError, "does not survive JSON"),
    ({"payload": {"a": "x" * 1_100_000}}, EnqueueError, "over the limit"),
    ({"queue": "a b; DROP TABLE pgjobs_job"}, EnqueueError, "not a valid queue name"),
    ({"priority": 500}, EnqueueError, "out of range"),
    ({"run_at": dt.datetime(2030, 1, 1)}, EnqueueError, "naive"),
    ({"delay": -3}, EnqueueError, "non-negative"),
    ({"delay": 1, "run_at": timezone.now()}, EnqueueError, "not both"),
    ({"max_attempts": 0}, EnqueueError, "max_attempts"),
    ({"unique_key": ""}, EnqueueError, "unique_key"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_INPUTS)
def test_bad_input_raises_a_clear_error_and_writes_nothing(options, error, message):
    options = dict(options)
    task = options.pop("task", "tests.tasks.noop")
    payload = options.pop("payload", {})
    with CaptureQueriesContext(connection) as queries, pytest.raises(error, match=message):
        Job.objects.enqueue(task, payload, **options)
    assert len(queries) == 0
    assert Job.objects.count() == 0


def test_a_task_registered_after_start_up_is_enqueued_with_a_warning_once(caplog):
    # A @task in app/jobs.py imported by a view: enqueued fine, then dead-lettered by every
    # worker (UnknownTask), which imports only what start-up imports.
    from django_pgjobs import task

    def late_job() -> None: ...

    late = task(name="tests.registered_late")(late_job)
    Job.objects.enqueue(late)
    Job.objects.enqueue("tests.registered_late")
    Job.objects.enqueue("tests.tasks.noop")  # discovered at start-up: nothing said
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1, said
    assert said[0].startswith("task tests.registered_late was registered after start-up")
    assert Job.objects.count() == 3


def test_a_task_the_urlconf_imports_is_known_to_workers_and_enqueued_without_a_warning(
    tmp_path, monkeypatch, settings, caplog
):
    # A web process imports its URLconf (and the views' modules, and their tasks) after start-up,
    # but runjobs imports it too, for its system checks: no warning for those.
    (tmp_path / "urlconf_views.py").write_text(
        "from django_pgjobs import task\n\n\n"
        "@task(name='tests.from_a_view_module')\ndef from_a_view_module() -> None:\n    pass\n"
    )
    (tmp_path / "urlconf_of_views.py").write_text(
        "import urlconf_views  # noqa\n\nurlpatterns = []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    settings.ROOT_URLCONF = "urlconf_of_views"
    import urlconf_of_views  # type: ignore[import-not-found]  # noqa: F401

    Job.objects.enqueue("tests.from_a_view_module")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_one_bad_payload_in_a_bulk_enqueue_writes_nothing():
    payloads = [{"to": "ok"}] * 10 + [{"to": float("inf")}]
    with pytest.raises(EnqueueError, match=r"payload\['to'\] is inf"):
        Job.objects.bulk_enqueue(tasks.send_email, payloads)
    assert Job.objects.count() == 0


# ---- the payload against the handler's signature -------------------------------------------


@pytest.mark.parametrize(
    "enqueue",
    [
        lambda: tasks.send_email.enqueue(recipient="a@example.com"),
        lambda: tasks.send_email.using(priority=1).enqueue(recipient="a@example.com"),
        lambda: Job.objects.enqueue(tasks.send_email, {"recipient": "a@example.com"}),
        # By name, for a task registered in this process: checked as well.
        lambda: Job.objects.enqueue("tests.tasks.send_email", {"recipient": "a@example.com"}),
    ],
    ids=["task.enqueue", "task.using().enqueue", "Job.objects.enqueue", "by name"],
)
def test_a_payload_that_does_not_fit_the_handler_is_refused_at_enqueue(enqueue):
    with CaptureQueriesContext(connection) as queries, pytest.raises(EnqueueError) as raised:
        enqueue()
    assert str(raised.value) == (
        "the payload does not fit tests.tasks.send_email(to, subject=''): unexpected argument "
        "'recipient'; missing the required argument 'to'."
    )
    assert len(queries) == 0
    assert Job.objects.count() == 0


def test_celerys_countdown_is_refused_and_told_where_a_delay_goes():
    with pytest.raises(EnqueueError, match=r"pass delay=\.\.\. with task\.using\(delay=\.\.\.\)"):
        tasks.send_email.enqueue(to="a@example.com", countdown=10)
    assert Job.objects.count() == 0


@pytest.mark.parametrize(
    ("handler", "payload"),
    [
        (tasks.keyword_only, {"order_id": 1}),
        (tasks.takes_varargs, {"order_id": 1}),
        (tasks.takes_anything, {"order_id": 1, "anything": "else"}),
        (tasks.decorated, {"order_id": 1}),
        (tasks.greet, {"name": "Ada"}),
    ],
    ids=["keyword-only", "*args", "**kwargs", "functools.wraps", "callable object"],
)
def test_every_shape_of_handler_is_enqueued_and_run_with_a_payload_that_fits(handler, payload):
    job = Job.objects.enqueue(handler, payload)
    run = run_jobs()
    assert [(ran.pk, ran.status) for ran in run.jobs] == [(job.pk, Status.SUCCEEDED)], run


def test_bulk_enqueue_checks_each_payload_and_names_the_one_that_does_not_fit():
    payloads = [{"to": "a"}, {"to": "b"}, {"subject": "no recipient"}]
    with pytest.raises(EnqueueError, match=r"^payloads\[2\]: the payload does not fit"):
        Job.objects.bulk_enqueue(tasks.send_email, payloads)
    assert Job.objects.count() == 0


def test_a_django_task_whose_arguments_do_not_fit_is_refused_at_enqueue():
    with pytest.raises(EnqueueError, match=r"add_async\(a, b\): missing the required argument 'b'"):
        framework_tasks.add_async.enqueue(1)
    # A Task that takes its context gets it first: the payload fills the rest.
    framework_tasks.sees_its_context.enqueue("x")
    with pytest.raises(EnqueueError, match="unexpected argument 'values'"):
        framework_tasks.sees_its_context.enqueue(values="x")
    assert Job.objects.count() == 1
