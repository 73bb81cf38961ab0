"""Scenario 8: bad input. At enqueue each is a clear error and nothing is written; rows written
behind enqueue's back with SQL are dead-lettered with a clear error while the worker carries on."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Job
from tests.chaos.checker import Checker, Driver, drive
from tests.chaos.conftest import Size, Workers, worker_args

pytestmark = pytest.mark.django_db(transaction=True)

BIG = 50 * 1024 * 1024

# (what is wrong, enqueue's keyword arguments, words the error must contain)
BAD_ENQUEUES: list[tuple[str, dict[str, Any], str]] = [
    ("NUL in a value", {"payload": {"n": "a\x00b"}}, "NUL character"),
    ("NUL in a key", {"payload": {"a\x00": 1}}, "NUL character"),
    ("lone surrogate", {"payload": {"n": "\ud800"}}, "lone surrogate"),
    ("NaN", {"payload": {"n": math.nan}}, "JSON cannot represent"),
    ("Infinity", {"payload": {"n": [1, -math.inf]}}, "JSON cannot represent"),
    ("datetime value", {"payload": {"n": datetime(2024, 1, 1)}}, "does not survive JSON"),
    ("set value", {"payload": {"n": {1, 2}}}, "does not survive JSON"),
    ("bytes value", {"payload": {"n": b"x"}}, "does not survive JSON"),
    ("Decimal value", {"payload": {"n": Decimal("1.5")}}, "does not survive JSON"),
    ("non-string key", {"payload": {1: "x"}}, "keys must be strings"),
    ("payload a list", {"payload": [1, 2]}, "must be a JSON object"),
    ("payload a string", {"payload": "n=1"}, "must be a JSON object"),
    ("50 MB payload", {"payload": {"n": "x" * BIG}}, "over the limit"),
    ("unknown task", {"task": "os.system", "payload": {"command": "id"}}, "No task is registered"),
    ("SQL in a queue name", {"queue": "x'; DROP TABLE pgjobs_job; --"}, "not a valid queue name"),
    ("empty queue name", {"queue": ""}, "not a valid queue name"),
    ("over-long queue name", {"queue": "q" * 101}, "not a valid queue name"),
    ("NUL in a queue name", {"queue": "emails\x00"}, "not a valid queue name"),
    ("path in a queue name", {"queue": "../etc/passwd"}, "not a valid queue name"),
    ("space in a queue name", {"queue": "my queue"}, "not a valid queue name"),
    ("non-ASCII queue name", {"queue": "fila-ação"}, "not a valid queue name"),
    ("queue name not a string", {"queue": 7}, "not a valid queue name"),
    ("naive run_at", {"run_at": datetime(2030, 1, 1)}, "naive datetime"),
    ("negative delay", {"delay": -1}, "non-negative"),
    ("negative timedelta", {"delay": timedelta(seconds=-5)}, "non-negative"),
    ("NaN delay", {"delay": math.nan}, "finite"),
    ("infinite delay", {"delay": math.inf}, "finite"),
    ("run_at and delay", {"delay": 1, "run_at": datetime(2030, 1, 1)}, "not both"),
    ("priority out of range", {"priority": 1000}, "out of range"),
    ("priority not an integer", {"priority": "high"}, "must be an integer"),
    ("max_attempts zero", {"max_attempts": 0}, "from 1 to 2147483647"),
]


@pytest.mark.parametrize(
    ("options", "words"),
    [pytest.param(options, words, id=what) for what, options, words in BAD_ENQUEUES],
)
def test_bad_input_at_enqueue_is_a_clear_error_and_writes_nothing(options, words):
    options = dict(options)
    task, payload = options.pop("task", "chaos.work"), options.pop("payload", {"n": 1})
    with pytest.raises(EnqueueError, match=words):
        Job.objects.enqueue(task, payload, **options)
    with pytest.raises(EnqueueError, match=words):  # one bad payload among good ones
        Job.objects.bulk_enqueue(task, [{"n": 0}, payload], **options)
    assert not Job.objects.exists()


# Rows no enqueue would write: (task, payload JSON, words the dead letter's error must contain)
BAD_ROWS = [
    ("os.system", '{"command": "touch %(marker)s"}', "No task is registered as 'os.system'"),
    ("builtins.eval", '{"source": "1"}', "No task is registered"),
    ("chaos.work", "[1, 2]", "payload must be a JSON object of keyword arguments, got list"),
    ("chaos.work", '"n=1"', "payload must be a JSON object of keyword arguments, got str"),
    ("chaos.work", "null", "payload must be a JSON object of keyword arguments, got NoneType"),
    ("chaos.work", "{}", "missing the required argument 'n'"),
    ("chaos.work", '{"n": 1, "rm": "-rf"}', "unexpected argument 'rm'"),
]


def test_rows_written_with_sql_that_cannot_run_are_dead_lettered_and_the_worker_carries_on(
    size: Size,
    workers: Callable[..., Workers],
    checker: Callable[..., Checker],
    publish,
    tmp_path: Path,
):
    marker = tmp_path / "pwned"
    check, driver = checker("8. bad rows"), Driver()
    pool = workers(worker_args(4, 5))
    pool.start(1)
    feed = driver.feeder("chaos.work", size(200, 1_000), size(20, 50))
    feed()
    bad = {}
    with connection.cursor() as cursor:
        for task, payload, words in BAD_ROWS:
            cursor.execute(
                "INSERT INTO pgjobs_job (id, queue, task, payload, max_attempts) "
                "VALUES (gen_random_uuid(), 'default', %s, %s::jsonb, 5) RETURNING id",
                [task, payload % {"marker": marker}],
            )
            ((job_id,),) = cursor.fetchall()
            bad[job_id] = words
    driver.accept(bad)
    drive(check, feed=feed, timeout=size(60, 120))
    assert pool.slots[0].alive()
    assert pool.stop() == [0]

    for job in Job.objects.filter(pk__in=bad):
        assert (job.status, job.attempts) == ("failed", 1), job
        assert bad[job.pk] in job.last_error
        assert json.dumps(job.errors)  # the history is intact JSON
    assert not marker.exists()
    report = check.check(driver)
    check.assert_sound(report)
    assert report.duplicates == 0
    assert check.statuses() == {"succeeded": report.jobs - len(bad), "failed": len(bad)}
    report.details["dead_lettered"] = len(bad)
    report.details["refused_at_enqueue"] = len(BAD_ENQUEUES)
    publish(report)
