"""Periodic schedules against PostgreSQL: rows, compare-and-set, one job per tick, the admin."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import OperationalError, connection
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from django_pgjobs.models import Job, Schedule
from django_pgjobs.periodic import MAX_WAIT, Periodic
from django_pgjobs.runtime.chores import Scheduler
from tests.conftest import run_together, wait_until

pytestmark = pytest.mark.django_db

YEARLY = "0 0 1 1 *"  # one tick a year: every "worker" of a test computes the same due tick


def schedule(cron: str = YEARLY, name: str = "report", **options: object) -> Periodic:
    return Periodic(name=name, task="tests.tasks.periodic_tick", cron=cron,
                    timezone=ZoneInfo("UTC"), pass_tick=True, **options)  # type: ignore[arg-type]  # fmt: skip


def rewind(name: str, by: timedelta) -> None:
    """Move the schedule's last tick back, as if no worker had run for that long."""
    Schedule.objects.filter(name=name).update(last_tick=Now() - by)


def ticks() -> list[str]:
    return sorted(Job.objects.values_list("payload__tick", flat=True))


def this_years_tick() -> str:
    return datetime(datetime.now(UTC).year, 1, 1, tzinfo=UTC).isoformat()


def test_a_new_schedule_starts_counting_from_now_and_enqueues_nothing_yet():
    wait = Scheduler("default", [schedule()]).enqueue_due()
    row = Schedule.objects.annotate(now=Now()).get()
    assert (row.name, row.task, row.cron, row.timezone) == (
        "report", "tests.tasks.periodic_tick", YEARLY, "UTC",
    )  # fmt: skip
    assert timedelta(0) <= row.now - row.last_tick < timedelta(seconds=5)
    assert wait == MAX_WAIT
    assert not Job.objects.exists()


def test_a_due_tick_is_enqueued_once_with_its_time():
    Scheduler("default", [schedule()]).enqueue_due()
    rewind("report", timedelta(days=400))
    Scheduler("default", [schedule()]).enqueue_due()
    assert ticks() == [this_years_tick()]
    job = Job.objects.get()
    assert (job.task, job.queue) == ("tests.tasks.periodic_tick", "default")
    assert Schedule.objects.get().last_tick.isoformat() == this_years_tick()
    Scheduler("default", [schedule()]).enqueue_due()  # a worker started later: nothing is due
    assert Job.objects.count() == 1


def test_looking_when_nothing_is_due_makes_no_query(django_assert_num_queries):
    scheduler = Scheduler("default", [schedule()])
    scheduler.enqueue_due()
    with django_assert_num_queries(0):
        assert scheduler.enqueue_due() == MAX_WAIT
    with django_assert_num_queries(0):
        assert Scheduler("default", []).enqueue_due() == MAX_WAIT


@pytest.mark.django_db(transaction=True)  # threads, each on its own connection
def test_workers_looking_at_the_same_due_tick_at_once_enqueue_it_once():
    Scheduler("default", [schedule()]).enqueue_due()
    for round in range(1, 11):
        rewind("report", timedelta(days=400))
        results = run_together(4, lambda n: Scheduler("default", [schedule()]).enqueue_due())
        assert not [result for result in results if isinstance(result, BaseException)]
        assert Job.objects.count() == round
    assert set(ticks()) == {this_years_tick()}


def test_a_tick_and_its_job_commit_together(other_connection):
    Scheduler("default", [schedule()]).enqueue_due()
    rewind("report", timedelta(days=400))
    before = Schedule.objects.get().last_tick
    scheduler = Scheduler("default", [schedule()])
    # The job's INSERT fails (here: its table is locked and we stop waiting) after the
    # compare-and-set UPDATE succeeded: both roll back, and the tick stays due.
    other_connection.execute("BEGIN")
    other_connection.execute("LOCK TABLE pgjobs_job IN ACCESS EXCLUSIVE MODE")
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '300ms'")
    try:
        with pytest.raises(OperationalError, match="lock timeout"):
            scheduler.enqueue_due()
    finally:
        other_connection.execute("ROLLBACK")
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert Schedule.objects.get().last_tick == before
    assert not Job.objects.exists()
    scheduler.enqueue_due()  # the worker's next look, after its reconnect
    assert ticks() == [this_years_tick()]


def test_a_changed_cron_counts_from_the_change_and_catches_nothing_up():
    Scheduler("default", [schedule()]).enqueue_due()
    rewind("report", timedelta(days=400))
    monthly = schedule("0 0 1 * *")
    Scheduler("default", [monthly]).enqueue_due()
    assert not Job.objects.exists()
    assert Schedule.objects.get().cron == "0 0 1 * *"


def test_missed_skip_passes_the_missed_tick_without_a_job():
    Scheduler("default", [schedule(missed="skip")]).enqueue_due()
    rewind("report", timedelta(days=400))
    Scheduler("default", [schedule(missed="skip")]).enqueue_due()
    assert not Job.objects.exists()
    assert Schedule.objects.get().last_tick.isoformat() == this_years_tick()


def test_a_deleted_row_is_created_again_at_the_next_tick():
    scheduler = Scheduler("default", [schedule("* * * * * *")])
    scheduler.enqueue_due()
    Schedule.objects.all().delete()
    wait_until(lambda: scheduler.enqueue_due() and Schedule.objects.exists(), timeout=5)


def test_before_its_migration_a_worker_runs_without_schedules_and_looks_again(caplog):
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE pgjobs_schedule RENAME TO pgjobs_schedule_away")
    try:
        scheduler = Scheduler("default", [schedule()])
        assert scheduler.enqueue_due() == MAX_WAIT
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE pgjobs_schedule_away RENAME TO pgjobs_schedule")
    assert "periodic schedules are off until the pgjobs migrations are applied" in caplog.text
    Job.objects.count()  # the connection is still usable
    scheduler.enqueue_due()
    assert Schedule.objects.filter(name="report").exists()


def test_schedules_in_the_admin_are_read_only_with_their_next_tick(admin_client, settings):
    settings.PGJOBS = {"PERIODIC": {"report": {"task": "tests.tasks.periodic_tick",
                                               "cron": YEARLY, "pass_tick": True}}}  # fmt: skip
    Scheduler("default").enqueue_due()
    Schedule.objects.create(name="retired", task="tests.tasks.noop", cron="0 * * * *",
                            timezone="UTC")  # fmt: skip
    response = admin_client.get(reverse("admin:pgjobs_schedule_changelist"))
    assert response.status_code == 200
    page = response.content.decode()
    assert "report" in page and "retired" in page and YEARLY in page
    next_year = datetime.now(UTC).year + 1
    assert f"Jan. 1, {next_year}" in page  # the next tick of the declared one
    # A declaration no worker can schedule (its task is gone) is not declared, has no next tick.
    settings.PGJOBS = {"PERIODIC": {"report": {"task": "tests.tasks.no_such_task",
                                               "cron": YEARLY}}}  # fmt: skip
    gone = admin_client.get(reverse("admin:pgjobs_schedule_changelist")).content.decode()
    assert f"Jan. 1, {next_year}" not in gone
    assert reverse("admin:pgjobs_schedule_add") not in page
    detail = admin_client.get(reverse("admin:pgjobs_schedule_change", args=["report"]))
    assert detail.status_code == 200 and 'name="_save"' not in detail.content.decode()


def test_a_schedule_whose_next_tick_passed_on_the_database_clock_is_flagged_overdue(
    admin_client, settings, monkeypatch
):
    # A next tick in the past (no worker running them) read as any other next tick.
    settings.PGJOBS = {"PERIODIC": {
        "hourly": {"task": "tests.tasks.periodic_tick", "cron": "0 * * * *", "pass_tick": True},
        "report": {"task": "tests.tasks.periodic_tick", "cron": YEARLY, "pass_tick": True},
    }}  # fmt: skip
    Scheduler("default").enqueue_due()
    rewind("hourly", timedelta(hours=3))  # as if no worker had run since
    last_tick = Schedule.objects.get(name="hourly").last_tick
    tick = (last_tick + timedelta(hours=1)).replace(minute=0, second=0, microsecond=0)
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() - timedelta(days=1))  # app behind
    page = admin_client.get(reverse("admin:pgjobs_schedule_changelist")).content.decode()
    hourly, report = page.split('<td class="field-next">')[1:]
    overdue = f'<strong>Overdue</strong> since <time datetime="{tick.isoformat()}">'
    assert hourly.startswith(overdue) and "no worker has enqueued it." in hourly.split("</td>")[0]
    assert "Overdue" not in report


def test_a_step_back_of_the_machines_wall_clock_does_not_move_the_schedulers_now(monkeypatch):
    # The scheduler's "now" was the wall clock plus the database's offset, read again only when
    # it thought a tick was due: a step back (NTP after a VM's resume) made every tick look
    # that much further away: 40 s of per-second ticks enqueued late, or dropped.
    scheduler = Scheduler("default", [schedule()])
    scheduler.enqueue_due()  # it has read the database's clock
    before = scheduler._now()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3 * 365 * 86400)  # three years back
    assert abs((scheduler._now() - before).total_seconds()) < 60


@pytest.mark.django_db(transaction=True)
def test_a_schedule_row_locked_elsewhere_is_looked_at_again_not_waited_for(other_connection):
    # The tick's compare-and-set waited its lock_timeout (5 s) on the worker's main loop, every
    # look, for as long as an operator's transaction held the row: claims and outcomes waited.
    scheduler = Scheduler("default", [schedule()])
    scheduler.enqueue_due()  # in sync with the row
    rewind("report", timedelta(days=400))
    scheduler._next["report"] = scheduler._now()  # this year's tick is due: it looks
    with connection.cursor() as cursor:  # this session's wait, should there be one, fails
        cursor.execute("SET lock_timeout = '2s'")
    try:
        with other_connection.transaction():
            other_connection.execute("SELECT FROM pgjobs_schedule WHERE name = 'report' FOR UPDATE")
            assert scheduler.enqueue_due() <= 1.0  # looked at again within a second
            assert ticks() == []
        scheduler._next["report"] = scheduler._now()  # that second has passed
        scheduler.enqueue_due()
        assert ticks() == [this_years_tick()]
    finally:
        connection.close()


def test_a_schedule_row_deleted_while_workers_run_loses_no_tick():
    # Made again "from now" by the worker that found the tick due, the row's new last tick was
    # past that tick: it was never enqueued, and nothing said so (a daily 03:00 job: that day's).
    scheduler = Scheduler("default", [schedule()])
    scheduler.enqueue_due()  # knows the row's last tick
    Schedule.objects.filter(name="report").update(last_tick=Now() - timedelta(days=400))
    scheduler._sync()  # ... as a year ago: this year's tick is due next
    Schedule.objects.filter(name="report").delete()
    scheduler._next["report"] = scheduler._now()
    scheduler.enqueue_due()
    assert ticks() == [this_years_tick()]
    assert Schedule.objects.get().last_tick.isoformat() == this_years_tick()
