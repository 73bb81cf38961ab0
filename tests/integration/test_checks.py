from __future__ import annotations

import math
from datetime import timedelta
from unittest import mock

import pytest
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.db import connection

from django_pgjobs.models import QueueStat


def test_a_database_that_is_not_postgresql_is_an_error():
    with mock.patch.object(connection, "vendor", "sqlite"):
        ids = [message.id for message in run_checks()]
    assert "pgjobs.E001" in ids


def test_postgresql_passes_the_check():
    assert "pgjobs.E001" not in [message.id for message in run_checks()]


def test_unknown_settings_keys_are_warned_about(settings):
    settings.PGJOBS = {"LEASE": 10, "LAESE": 10}
    messages = [m for m in run_checks() if m.id == "pgjobs.W001"]
    assert len(messages) == 1 and "'LAESE'" in messages[0].msg


def ids_of(**kwargs) -> list[str]:
    return [message.id for message in run_checks(**kwargs) if message.id.startswith("pgjobs.")]


def messages_with(check_id: str, **kwargs) -> list[str]:
    return [m.msg for m in run_checks(**kwargs) if m.id == check_id]


@pytest.mark.django_db
def test_the_default_settings_pass_every_check():
    assert ids_of(databases=["default"]) == []


@pytest.mark.parametrize(
    ("pgjobs", "message"),
    [
        (
            {"LEASE": 0},
            "PGJOBS['LEASE'] must be a number greater than 0 and at most 1000000000, not 0.",
        ),
        ({"LEASE": float("inf")}, "PGJOBS['LEASE'] must be a number greater than 0 and at most"),
        ({"MAX_ATTEMPTS": 2**31}, "at most 2147483647, not 2147483648."),
        ({"PRUNE_BATCH": 10.5}, "PGJOBS['PRUNE_BATCH'] must be a whole number greater than 0"),
        ({"RETENTION": 3600}, "PGJOBS['RETENTION'] must be a timedelta or a dict by status"),
        ({"RETENTION": {"ready": timedelta(1)}}, "has the key 'ready'; the final statuses"),
        ({"RETENTION": {"failed": -timedelta(1)}}, "['failed'] must be a timedelta of 0 or more"),
        ({"HEALTH": {"RETRY_RATE": "half"}}, "PGJOBS['HEALTH']['RETRY_RATE'] must be a number"),
        ({"HEALTH": {"REPORT_STATEMENT_SECONDS": math.nan}}, "must be a number of 0 or more"),
        ({"NOTIFY": True, "LEASE": "30"}, "PGJOBS['LEASE'] must be a number greater than 0"),
    ],
)
def test_a_settings_value_of_the_wrong_kind_is_an_error_naming_the_key(settings, pgjobs, message):
    settings.PGJOBS = pgjobs
    (found,) = messages_with("pgjobs.E020")
    assert message in found


def test_an_unknown_health_threshold_is_warned_about(settings):
    settings.PGJOBS = {"HEALTH": {"OLDEST_DUE": 60}}
    (found,) = messages_with("pgjobs.W020")
    assert "'OLDEST_DUE'" in found


def test_a_lease_shorter_than_ten_seconds_is_warned_about(settings):
    settings.PGJOBS = {"LEASE": 3}
    (found,) = messages_with("pgjobs.W021")
    assert "The lease of PGJOBS['LEASE'] is 3s" in found


def test_notify_and_prepared_statements_through_a_transaction_pooler_are_warned_about(settings):
    database = {**settings.DATABASES["default"], "DISABLE_SERVER_SIDE_CURSORS": True}
    database["OPTIONS"] = {**database.get("OPTIONS", {}), "prepare_threshold": 5}
    with mock.patch.dict(connection.settings_dict, database):
        assert {"pgjobs.W022", "pgjobs.W023"} <= set(ids_of())
        settings.PGJOBS = {"NOTIFY": False}
        assert "pgjobs.W022" not in ids_of()


@pytest.mark.django_db
def test_a_missing_or_invalid_claim_index_is_an_error():
    assert ids_of(databases=["default"]) == []
    with connection.cursor() as cursor:  # undone when the test's transaction rolls back
        cursor.execute("DROP INDEX pgjobs_job_claim_idx")
        cursor.execute(
            "UPDATE pg_index SET indisvalid = false "
            "WHERE indexrelid = 'pgjobs_job_dead_idx'::regclass"
        )
    errors = messages_with("pgjobs.E021", databases=["default"])
    assert len(errors) == 2
    assert "pgjobs_job_claim_idx of pgjobs_job is missing" in errors[0]
    assert "pgjobs_job_dead_idx of pgjobs_job is invalid" in errors[1]
    assert messages_with("pgjobs.E021") == []  # without --database it does not look


@pytest.mark.django_db
def test_a_deploy_check_names_the_tasks_whose_queue_no_running_worker_serves():
    assert messages_with("pgjobs.W024", databases=["default"], include_deployment_checks=True) == []
    QueueStat.objects.create(seconds=10, worker="host:1:aa", queue="default")
    warnings = messages_with("pgjobs.W024", databases=["default"], include_deployment_checks=True)
    emails = next(w for w in warnings if "'emails'" in w)
    assert "tests.tasks.send_email" in emails
    assert not any("'default'" in w for w in warnings)


def test_use_tz_false_is_an_error_saying_what_to_set(settings):
    # Before: nothing said so; the admin's job list answered 500, every periodic tick failed
    # (naive and aware datetimes compared), run_at=timezone.now() + ... was refused (attack 14).
    settings.USE_TZ = False
    (found,) = messages_with("pgjobs.E003")
    assert found.startswith("django-pgjobs needs USE_TZ = True")


def test_jobstats_failing_a_system_check_is_unknown_not_a_warning(settings):
    # Django exits 1 for a failed check, which a monitoring probe reads as a warning; with
    # USE_TZ = False (or a broken PGJOBS setting) the report cannot be taken (attack 16).
    settings.USE_TZ = False
    with pytest.raises(CommandError) as raised:
        call_command("jobstats", skip_checks=False)
    assert raised.value.returncode == 3
    assert "pgjobs.E003" in str(raised.value)
