"""Periodic schedules without a database: due ticks, time zones, missed ticks, declarations."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_pgjobs import registry, task
from django_pgjobs.periodic import (
    DeclarationError,
    Periodic,
    check_periodic,
    declared,
    declared_names,
    parse,
)

PARIS = ZoneInfo("Europe/Paris")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def every(cron: str, zone: str = "UTC", **options: object) -> Periodic:
    return Periodic(name="p", task="tests.tasks.noop", cron=cron, timezone=ZoneInfo(zone),
                    **options)  # type: ignore[arg-type]  # fmt: skip


def periodic_settings(**schedules: object) -> override_settings:
    return override_settings(PGJOBS={"PERIODIC": schedules})


# ---- due ticks -------------------------------------------------------------------------------


def test_nothing_is_due_before_the_next_tick():
    last = utc(2026, 1, 5, 10, 0)
    assert every("* * * * *").due(last, utc(2026, 1, 5, 10, 0, 59, 999999)) == ([], last)


def test_the_tick_is_due_at_its_exact_time():
    tick = utc(2026, 1, 5, 10, 1)
    assert every("* * * * *").due(utc(2026, 1, 5, 10, 0), tick) == ([tick], tick)


def test_each_tick_within_the_grace_gets_its_own_job():
    # Every worker paused for 3.2 s: the three seconds' ticks are all enqueued, none lost.
    ticks, latest = every("* * * * * *").due(
        utc(2026, 1, 5, 10, 0, 5), utc(2026, 1, 5, 10, 0, 8, 200000)
    )
    assert ticks == [utc(2026, 1, 5, 10, 0, s) for s in (6, 7, 8)]
    assert latest == utc(2026, 1, 5, 10, 0, 8)


def test_after_downtime_the_most_recent_missed_tick_gets_one_job():
    daily = every("0 3 * * *")
    down_since = utc(2026, 1, 1, 3, 0)
    ticks, latest = daily.due(down_since, utc(2026, 1, 4, 17, 45))
    assert ticks == [utc(2026, 1, 4, 3, 0)] == [latest]


def test_with_missed_skip_ticks_older_than_the_grace_get_no_job_but_are_passed():
    daily = every("0 3 * * *", missed="skip")
    assert daily.due(utc(2026, 1, 1, 3, 0), utc(2026, 1, 4, 17, 45)) == ([], utc(2026, 1, 4, 3, 0))
    # A tick still within its grace is on time, whatever the policy.
    tick = utc(2026, 1, 4, 3, 0)
    assert daily.due(utc(2026, 1, 3, 3, 0), tick + timedelta(seconds=30)) == ([tick], tick)


def test_a_long_downtime_of_a_per_second_schedule_enqueues_at_most_the_grace_worth():
    ticks, _ = every("* * * * * *", grace=5).due(utc(2026, 1, 1), utc(2026, 1, 2, 0, 0, 0, 500))
    assert ticks == [utc(2026, 1, 1, 23, 59, s) for s in range(56, 60)] + [utc(2026, 1, 2)]


def test_ticks_follow_the_schedules_wall_clock_across_daylight_saving_time():
    at_three = every("0 3 * * *", "Europe/Paris")
    # 03:00 in Paris is 02:00 UTC in winter and 01:00 UTC in summer.
    assert at_three.next_tick(utc(2026, 3, 28, 12)) == utc(2026, 3, 29, 1)
    assert at_three.next_tick(utc(2026, 3, 27, 12)) == utc(2026, 3, 28, 2)
    assert at_three.next_tick(utc(2026, 3, 29, 1)).astimezone(PARIS).hour == 3


def test_a_tick_in_the_skipped_spring_hour_runs_at_the_end_of_the_gap():
    # 2026-03-29 02:00 → 03:00 in Paris: 02:30 does not exist and croniter runs it at 03:00.
    at_half_two = every("30 2 * * *", "Europe/Paris")
    tick = at_half_two.next_tick(utc(2026, 3, 28, 12))
    assert tick == utc(2026, 3, 29, 1) and tick.astimezone(PARIS).hour == 3


def test_a_tick_in_the_repeated_autumn_hour_runs_twice_as_croniter_does():
    # 2026-10-25 03:00 → 02:00 in Paris: 02:30 happens at 00:30 UTC and again at 01:30 UTC.
    at_half_two = every("30 2 * * *", "Europe/Paris")
    first = at_half_two.next_tick(utc(2026, 10, 24, 12))
    second = at_half_two.next_tick(first)
    assert (first, second) == (utc(2026, 10, 25, 0, 30), utc(2026, 10, 25, 1, 30))
    assert at_half_two.next_tick(second) == utc(2026, 10, 26, 1, 30)


def test_pass_tick_adds_the_tick_in_the_schedules_time_zone():
    periodic = every("0 3 * * *", "Europe/Paris", payload={"kind": "daily"}, pass_tick=True)
    tick = periodic.next_tick(utc(2026, 1, 1))
    assert periodic.payload_for(tick) == {"kind": "daily", "tick": "2026-01-01T03:00:00+01:00"}
    assert every("0 3 * * *", payload={"kind": "daily"}).payload_for(tick) == {"kind": "daily"}


# ---- declarations ----------------------------------------------------------------------------


@pytest.fixture
def cron_task() -> Iterator[registry.Task]:
    """A task declared with @task(cron=...), unregistered again afterwards."""

    def every_five_minutes() -> None: ...

    yield task(name="tests.every_five_minutes", cron="*/5 * * * *")(every_five_minutes)
    registry._registry.pop("tests.every_five_minutes")


def test_a_task_with_cron_is_a_schedule_named_after_it_in_time_zone(cron_task):
    with override_settings(TIME_ZONE="Europe/Paris"):
        schedules, errors = declared()
    assert errors == []
    assert [(s.name, s.task, s.cron, s.timezone.key, s.payload) for s in schedules] == [
        ("tests.every_five_minutes", "tests.every_five_minutes", "*/5 * * * *",
         "Europe/Paris", {})
    ]  # fmt: skip


def test_settings_override_a_tasks_schedule_or_switch_it_off(cron_task):
    with periodic_settings(**{"tests.every_five_minutes": None}):
        assert declared() == ([], [])
        assert declared_names() == set()
    with periodic_settings(
        **{"tests.every_five_minutes": {"task": cron_task.name, "cron": "0 * * * *"}}
    ):
        assert [s.cron for s in declared()[0]] == ["0 * * * *"]


def test_a_settings_declaration_with_every_option():
    periodic = parse(
        "nightly-report",
        {"task": "tests.tasks.send_email", "cron": "0 3 * * *", "timezone": "Europe/Paris",
         "payload": {"to": "ops@example.com"}, "queue": "reports", "priority": 5,
         "missed": "skip", "grace": 600, "pass_tick": False},
    )  # fmt: skip
    assert periodic == Periodic(
        name="nightly-report", task="tests.tasks.send_email", cron="0 3 * * *", timezone=PARIS,
        payload={"to": "ops@example.com"}, queue="reports", priority=5, missed="skip", grace=600,
    )  # fmt: skip


def test_a_bad_cron_expression_on_a_task_is_refused_at_import():
    with pytest.raises(ValueError, match=r"@task\(cron=...\): '0 3 \* \*' is not a valid cron"):
        task(cron="0 3 * *")(lambda: None)


NOOP = {"task": "tests.tasks.noop", "cron": "* * * * *"}


@pytest.mark.parametrize(
    ("declaration", "check_id", "message"),
    [
        ({**NOOP, "cron": "61 * * * *"}, "E011", "'61 \\* \\* \\* \\*' is not a valid cron"),
        ({**NOOP, "cron": "0 0 31 2 *"}, "E011", "not a valid cron"),
        ({**NOOP, "cron": 5}, "E011", "must be a cron expression"),
        ({**NOOP, "task": "shop.tasks.nope"}, "E012", "No task is registered as 'shop.tasks.nope'"),
        ({**NOOP, "timezone": "Mars/Olympus"}, "E013", "unknown time zone 'Mars/Olympus'"),
        ({**NOOP, "every": 5}, "E010", "unknown keys 'every'"),
        ({"task": "tests.tasks.noop"}, "E010", "'cron' must be given"),
        ({**NOOP, "payload": {"x": 1}}, "E010", "the payload does not fit tests.tasks.noop()"),
        ({**NOOP, "pass_tick": True}, "E010", "unexpected argument 'tick'"),
        ({**NOOP, "task": "tests.tasks.send_email", "payload": {"to": float("nan")}}, "E010",
         "payload\\['to'\\]"),
        ({**NOOP, "queue": "no spaces"}, "E010", "queue"),
        ({**NOOP, "missed": "all"}, "E010", "missed='all' must be one of 'latest', 'skip'"),
        ({**NOOP, "grace": -1}, "E010", "grace=-1 must be zero or more"),
        ("0 3 * * *", "E010", "must be a dict, got str"),
    ],
)  # fmt: skip
def test_a_bad_declaration_is_a_system_check_error_naming_the_schedule(
    declaration, check_id, message
):
    with pytest.raises(DeclarationError, match=message) as raised:
        parse("broken", declaration)
    assert raised.value.id == f"pgjobs.{check_id}"
    assert str(raised.value).startswith("Periodic schedule 'broken': ")
    with periodic_settings(broken=declaration):
        [error] = check_periodic()
    assert error.id == f"pgjobs.{check_id}" and "'broken'" in error.msg and error.hint


def test_manage_py_check_reports_a_bad_schedule():
    with (
        periodic_settings(nightly={**NOOP, "cron": "0 25 * * *"}),
        pytest.raises(SystemCheckError, match=r"pgjobs\.E011.*'nightly'"),
    ):
        call_command("check")


def test_periodic_that_is_not_a_dict_is_an_error():
    with override_settings(PGJOBS={"PERIODIC": [("nightly", "0 3 * * *")]}):
        [error] = check_periodic()
    assert error.id == "pgjobs.E010" and "must be a dict of schedules by name" in error.msg
