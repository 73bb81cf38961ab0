"""A real worker under load: its connections say whose they are, and jobstats shows the queue's
share of the database's active time, with a verdict past the threshold."""

from __future__ import annotations

import io

from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from django_pgjobs.models import Job
from django_pgjobs.observability import report as reports
from django_pgjobs.observability.load import WORKER_APPLICATION
from tests.conftest import wait_until
from tests.models import Execution


def _worker_applications() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return {name for (name,) in cursor.fetchall()}


def _jobstats() -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("jobstats", stdout=out)
    except SystemExit as exit:
        return int(exit.code or 0), out.getvalue()
    return 0, out.getvalue()


def test_a_worker_names_its_main_loop_and_listener_connections_after_itself(start_worker):
    worker = start_worker("--concurrency", "2")
    wait_until(worker.started, timeout=20)
    worker_id = worker.log().split("worker ", 1)[1].split(" started", 1)[0]
    # Its main loop and its wake-up listener; the handler threads' connections are the jobs'.
    # The listener connects on its own thread, after the main loop may have: wait for both (the
    # first named session alone was once taken as the sign, and the listener was not there yet).

    def named() -> tuple[int, int]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FILTER (WHERE query LIKE 'LISTEN%%'), count(*) "
                "FROM pg_stat_activity WHERE application_name = %s",
                [f"{WORKER_APPLICATION} {worker_id}"],
            )
            listening, count = cursor.fetchone()
        return int(listening), int(count)

    wait_until(lambda: named()[0] == 1 and named()[1] >= 2, timeout=20)
    assert f"{WORKER_APPLICATION} {worker_id}" in _worker_applications()


def test_jobstats_and_the_admin_show_the_queues_share_of_active_time_and_warn_past_a_threshold(
    start_worker, settings, admin_client
):
    # Handlers that write rows of their own: active backends that are not the queue's.
    Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n} for n in range(30_000)))
    start_worker("--concurrency", "4")
    wait_until(lambda: Execution.objects.count() > 100, timeout=30)
    settings.PGJOBS = {**settings.PGJOBS, "HEALTH": {"QUEUE_SHARE": 0.01}}

    def warned() -> tuple[int, str] | None:
        report = reports.collect()
        if report.load is None or not report.load.share:
            return None
        code, text = _jobstats()
        return (code, text) if "the queue takes much" in text else None

    code, text = wait_until(warned, timeout=60, interval=0.2)
    assert code == 1  # a warning
    line = next(line for line in text.splitlines() if line.startswith("the queue's share"))
    assert "of the active backends (pg_stat_activity" in line
    share = int(line.split(": ", 1)[1].split("%", 1)[0])
    assert 0 < share <= 100
    assert "threshold QUEUE_SHARE = 0.01" in text

    def page_warned() -> str | None:
        page = admin_client.get(reverse("admin:pgjobs_queue_report")).content.decode()
        return page if "the queue takes much" in page else None

    page = wait_until(page_warned, timeout=60, interval=0.2)
    assert '<td id="queue-share">' in page and "of the active backends" in page

    settings.PGJOBS = {**settings.PGJOBS, "HEALTH": {"QUEUE_SHARE": 1.01}}
    code, text = _jobstats()
    assert "the queue takes much" not in text
