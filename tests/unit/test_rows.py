"""Claimed jobs built from result rows (data/rows.load_jobs) are the Jobs Django would build."""

from __future__ import annotations

from datetime import UTC, datetime

from django.db.models.signals import post_init

from django_pgjobs.data import rows, sql
from django_pgjobs.ids import uuid7
from django_pgjobs.models import Job

AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def a_row() -> list[object]:
    columns = {name: None for name in sql.JOB_COLUMNS} | {
        "id": uuid7(), "queue": "default", "task": "tests.tasks.noop", "payload": {"n": 1},
        "status": "running", "priority": 3, "run_at": AT, "attempts": 1, "max_attempts": 5,
        "leased_until": AT, "worker": "host:1:ab", "last_error": "", "errors": [],
        "created_at": AT, "cancel_requested": False, "claims": 1, "scheduled": False,
    }  # fmt: skip
    return [columns[name] for name in sql.JOB_COLUMNS]


def fields_of(job: Job) -> dict[str, object]:
    return {field.attname: getattr(job, field.attname) for field in Job._meta.concrete_fields}


def test_a_claimed_job_built_from_its_row_equals_the_one_django_builds():
    row = a_row()
    (ours,) = rows.load_jobs(Job, "default", [row])
    django = Job.from_db("default", [f.attname for f in Job._meta.concrete_fields], row)
    assert fields_of(ours) == fields_of(django)
    assert (ours._state.adding, ours._state.db) == (False, "default")
    assert ours == django and ours.pk == row[0]


def test_receivers_of_the_models_init_signals_still_see_every_claimed_job():
    seen: list[Job] = []

    def receiver(sender: type[Job], instance: Job, **kwargs: object) -> None:
        seen.append(instance)

    post_init.connect(receiver, sender=Job)
    try:
        jobs = rows.load_jobs(Job, "default", [a_row(), a_row()])
    finally:
        post_init.disconnect(receiver, sender=Job)
    assert seen == jobs
