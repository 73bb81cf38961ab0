"""Values no query could load again: refused where they are made (enqueue, bulk_enqueue,
Retry) before anything reaches the database; the earliest and latest run_at read back in any
time zone; a payload written past the checks fails its job alone."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import connection, transaction

from django_pgjobs import Retry, validation
from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Job
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"delay": 1e17}, "at most"),
        ({"delay": timedelta(days=100_000_000)}, "at most"),
        ({"run_at": datetime.max.replace(tzinfo=timezone(-timedelta(hours=23)))}, "out of range"),
        ({"payload": {"deep": _nested(100)}}, "levels deep"),
        ({"payload": {"n": 10**5000}}, "bits"),
        ({"run_at": datetime.min.replace(tzinfo=UTC)}, "out of range"),
        ({"run_at": datetime.max.replace(tzinfo=UTC)}, "out of range"),
        ({"max_attempts": 2**32 + 3}, "from 1 to 2147483647"),
        ({"max_attempts": 2**31}, "from 1 to 2147483647"),
    ],
    ids=[
        "delay 1e17 s",
        "delay 1e8 days",
        "run_at past 9999 in UTC",
        "nested 100 deep",
        "huge int",
        "run_at year 1 in UTC (year 0 in New York)",
        "run_at 9999-12-31 in UTC (year 10000 in Tokyo)",
        "max_attempts past an int4, wrapped by a COPY",
        "max_attempts just past an int4",
    ],
)
def test_input_no_query_could_load_again_is_refused_and_the_transaction_goes_on(options, words):
    with transaction.atomic():
        with pytest.raises(EnqueueError, match=words):
            Job.objects.enqueue("tests.tasks.noop", **options)
        # Refused before anything reached the database: the caller's transaction is intact.
        assert Job.objects.count() == 0
        Job.objects.enqueue("tests.tasks.noop")
    assert Job.objects.count() == 1


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, "100", True])
def test_bulk_enqueue_refuses_a_batch_size_that_is_not_a_count(batch_size):
    # -1 wrote nothing and returned []; 0 raised range()'s ValueError after a statement ran.
    with pytest.raises(EnqueueError, match=r"batch_size=.* must be an integer of 1 or more"):
        Job.objects.bulk_enqueue("tests.tasks.noop", [{}, {}], batch_size=batch_size)


@pytest.mark.django_db
def test_bulk_enqueue_refuses_max_attempts_a_copy_would_wrap():
    with pytest.raises(EnqueueError, match="from 1 to 2147483647"):
        Job.objects.bulk_enqueue("tests.tasks.noop", [{}], max_attempts=2**32 + 3)
    assert not Job.objects.exists()


@pytest.fixture
def zoned(request):
    """The test's connection, reading times in `request.param`'s zone (DATABASES' TIME_ZONE,
    which Django allows with USE_TZ)."""

    def reconnect(zone: str | None) -> None:
        connection.close()
        connection.settings_dict["TIME_ZONE"] = zone
        for cached in ("timezone", "timezone_name"):
            connection.__dict__.pop(cached, None)

    saved = connection.settings_dict.get("TIME_ZONE")
    reconnect(request.param)
    yield Job.objects
    reconnect(saved)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("zoned", ["America/New_York", "Asia/Tokyo"], indirect=True)
def test_the_earliest_and_latest_run_at_load_in_the_time_zone_a_connection_reads_them_in(zoned):
    # run_at=datetime.min in UTC passed the check, then its row could not be read in New York
    # (year 0): the enqueue raised after the INSERT committed, and a worker's claim that took
    # the job committed, failed reading its rows, and every job of that batch ran out its lease.
    for when in (validation.EARLIEST, validation.LATEST):
        assert zoned.enqueue("tests.tasks.noop", run_at=when).run_at == when
    early = zoned.enqueue("tests.tasks.noop")
    with connection.cursor() as cursor:  # to the front of the queue, by hand
        cursor.execute("UPDATE pgjobs_job SET run_at = '-infinity' WHERE id = %s", [early.pk])
    claimed = zoned.claim(["default"], worker="w1", limit=10)
    assert {job.run_at for job in claimed} == {validation.EARLIEST}
    assert len(claimed) == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "written",
    [
        "('{\"n\": ' || repeat('9', 5000) || '}')::jsonb",  # past Python's 4,300 digits
        "('{\"deep\": ' || repeat('[', 5000) || repeat(']', 5000) || '}')::jsonb",
    ],
    ids=["5000-digit integer", "nested 5000 deep"],
)
def test_a_payload_python_cannot_read_fails_its_job_alone(written):
    # Written by SQL (enqueue refuses both): the claim committed, then reading its rows failed,
    # and every job claimed with it ran out its lease, an attempt spent, claim after claim.
    poison = Job.objects.enqueue("tests.tasks.noop", priority=10)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE pgjobs_job SET payload = {written} WHERE id = %s", [poison.pk])
    others = [Job.objects.enqueue("tests.tasks.noop") for _ in range(3)]
    worker = Worker(Options(queues=["default"], concurrency=2, listen=False, once=True))
    worker.run()
    rows = Job.objects.values_list("pk", "status", "attempts", "last_error")  # not the payload
    outcomes = {pk: (status, attempts, error) for pk, status, attempts, error in rows}
    status, attempts, error = outcomes.pop(poison.pk)
    assert (status, attempts) == (Status.FAILED, 1)
    assert "its payload cannot be read in Python" in error
    assert {(status, attempts) for status, attempts, _ in outcomes.values()} == {
        (Status.SUCCEEDED, 1)
    }
    assert len(outcomes) == len(others)


def test_retry_refuses_a_delay_no_timestamp_can_hold():
    for delay in (math.inf, 1e17, timedelta(days=100_000_000), "soon"):
        with pytest.raises(ValueError, match="Retry"):
            Retry(delay)  # type: ignore[arg-type]
