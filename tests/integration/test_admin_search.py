"""The job lists' search box: each way a term names a job, and the plan of each search (no
sequential scan of the job table: bench/admin_changelist.py shows the plans at 1,000,000 jobs)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.factories import JobFactory
from tests.integration.test_admin import DEAD, JOBS

pytestmark = pytest.mark.django_db


def found(client: Any, url: str, term: str) -> list[Any]:
    response = client.get(url, {"q": term})
    assert response.status_code == 200
    return [job.pk for job in response.context["cl"].result_list]


def test_both_lists_show_a_search_box_with_what_it_takes(admin_client):
    for url in (JOBS, DEAD):
        content = admin_client.get(url).content.decode()
        assert 'id="searchbar"' in content
        assert "the short id shown in the list" in content


def test_search_finds_a_job_by_full_id_id_prefix_and_short_id(admin_client):
    job, other = JobFactory(dead=True), JobFactory(dead=True)
    text = str(job.pk)
    for url in (JOBS, DEAD):
        assert found(admin_client, url, text) == [job.pk]
        assert found(admin_client, url, text.upper()) == [job.pk]
        assert found(admin_client, url, job.short_id) == [job.pk]
        assert found(admin_client, url, f"  {job.short_id.upper()} ") == [job.pk]
    # The start of an id, as far as it tells them apart (ids of one millisecond share 12 digits).
    shared = 0
    while text[shared] == str(other.pk)[shared]:
        shared += 1
    assert found(admin_client, JOBS, text[: shared + 1]) == [job.pk]
    assert found(admin_client, JOBS, text[: shared + 1].replace("-", "")) == [job.pk]
    assert set(found(admin_client, JOBS, text[:shared])) >= {job.pk, other.pk}


def test_search_by_part_of_a_task_name_finds_its_jobs_on_both_lists(admin_client):
    sent = JobFactory(task="tests.tasks.send_email", dead=True)
    JobFactory(task="tests.tasks.noop", dead=True)
    live = JobFactory(task="tests.tasks.send_email")
    assert found(admin_client, JOBS, "send_email") == [live.pk, sent.pk]
    assert found(admin_client, JOBS, "tests.tasks.SEND") == [live.pk, sent.pk]
    assert found(admin_client, DEAD, "send_email") == [sent.pk]


def test_search_finds_a_job_of_a_task_no_longer_registered_by_its_full_name(admin_client):
    gone = JobFactory(task="shop.tasks.retired", dead=True)
    assert found(admin_client, JOBS, "shop.tasks.retired") == [gone.pk]
    assert found(admin_client, JOBS, "retired") == []  # parts match registered names only


def test_search_finds_a_live_job_by_its_unique_key(admin_client):
    live = JobFactory(unique_key="order-42")
    JobFactory(succeeded=True, unique_key="order-42")
    assert found(admin_client, JOBS, "order-42") == [live.pk]


def test_search_finds_dead_letters_by_text_in_their_last_error(admin_client):
    refused = JobFactory(dead=True, last_error="OSError: [Errno 111] Connection refused")
    JobFactory(dead=True, last_error="KeyError: 'to'")
    JobFactory(retrying=True, last_error="OSError: Connection refused")  # not a dead letter
    for url in (JOBS, DEAD):
        assert found(admin_client, url, "Connection refused") == [refused.pk]
        assert found(admin_client, url, "connection REFUSED") == [refused.pk]
    assert found(admin_client, JOBS, "100%") == []  # a LIKE pattern's characters are text


def test_error_search_reads_only_the_newest_dead_letters(admin_client, monkeypatch):
    from django_pgjobs.admin import search

    monkeypatch.setattr(search, "ERROR_SCAN", 2)
    older = JobFactory(dead=True, last_error="OSError: Connection refused")
    newer = JobFactory.create_batch(2, dead=True, last_error="OSError: Connection refused")
    assert found(admin_client, DEAD, "refused") == [job.pk for job in reversed(newer)]
    assert older.pk not in found(admin_client, JOBS, "refused")


def test_a_term_that_names_nothing_finds_nothing(admin_client):
    JobFactory.create_batch(2)
    for term in ("nothing-here", "abcdefabcdef", "0" * 31, "ffff"):
        assert found(admin_client, JOBS, term) == [], term


# ---- the plans ------------------------------------------------------------------------------

ROWS = 20_000


def fill(rows: int) -> None:
    """`rows` jobs in a few statements: time-ordered ids (UUIDv7-like), three tasks, mostly
    succeeded, some failed, ready and running; and one rare task."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO pgjobs_job (id, queue, task, payload, status, priority, run_at,
                                    attempts, max_attempts, leased_until, worker, last_error,
                                    errors, created_at, finished_at)
            SELECT encode(overlay(uuid_send(gen_random_uuid()) placing
                          substring(int8send(1700000000000 + n) from 3) from 1 for 6),
                          'hex')::uuid,
                   'default',
                   'tests.tasks.' || (ARRAY['noop', 'send_email', 'always_fails'])[n %% 3 + 1],
                   '{}', s.status, 0, now(), 1, 3,
                   CASE WHEN s.status = 'running' THEN now() + interval '1 hour' END,
                   CASE WHEN s.status = 'running' THEN 'w1' END,
                   CASE WHEN s.status = 'failed' THEN 'RuntimeError: boom' ELSE '' END,
                   '[]', now(),
                   CASE WHEN s.status IN ('succeeded', 'failed') THEN now() END
            FROM generate_series(1, %s) AS n,
                 LATERAL (SELECT CASE WHEN n %% 50 = 0 THEN 'failed'
                                      WHEN n %% 20 = 1 THEN 'ready'
                                      WHEN n %% 100 = 2 THEN 'running'
                                      ELSE 'succeeded' END AS status) AS s
            """,
            [rows],
        )
        cursor.execute("ANALYZE pgjobs_job")


def plans_of_the_page(client: Any, url: str, term: str) -> list[tuple[str, str]]:
    """Every query of the job table a search page ran, with its plan, planned with sequential
    scans priced out: a query still planned with one has no index to use."""
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url, {"q": term}).status_code == 200
    sqls = [
        q["sql"]
        for q in queries
        if '"pgjobs_job"' in q["sql"] and not q["sql"].startswith("EXPLAIN")
    ]
    assert sqls
    plans = []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        for sql in sqls:
            cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
            plans.append((sql, json.dumps(cursor.fetchone()[0])))
    return plans


# Committed, so that the table is truncated afterwards: rolled back, the rows would leave dead
# index entries that the next tests' scans (e.g. of the claim index) would have to step over.
@pytest.mark.django_db(transaction=True)
def test_every_search_is_planned_through_indexes_without_a_scan_of_the_table(admin_client):
    fill(ROWS)
    job = Job.objects.dead().order_by("id")[ROWS // 100]
    JobFactory(task="tests.tasks.send_receipt")  # a rare task
    JobFactory(unique_key="order-42")
    JobFactory(dead=True, last_error="OSError: [Errno 111] Connection refused")
    searches = {
        "full id": (str(job.pk), ["pgjobs_job_pkey"]),
        "id prefix": (str(job.pk)[:13], ["pgjobs_job_pkey"]),
        "short id": (job.short_id, ["pgjobs_job_pkey"]),
        "task": ("send_receipt", ["pgjobs_job_task_idx"]),
        "unique key": ("order-42", ["pgjobs_job_unique_key_live"]),
        "error text": ("connection refused", ["pgjobs_job_dead_idx"]),
    }
    for url in (JOBS, DEAD):
        for label, (term, indexes) in searches.items():
            plans = plans_of_the_page(admin_client, url, term)
            for sql, plan in plans:
                assert '"Seq Scan"' not in plan, (label, url, sql, plan)
            used = " ".join(plan for _, plan in plans)
            # On dead letters the planner may as well read the few of them by their index.
            for index in indexes if url == JOBS else []:
                assert index in used, (label, url, used)
    assert Job.objects.filter(status=Status.FAILED).count() == ROWS // 50 + 1
