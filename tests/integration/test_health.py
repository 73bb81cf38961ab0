"""The health report's figures and verdict against a real database in a known state."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models.functions import Now
from django.urls import reverse
from django.utils import timezone

from django_pgjobs.models import Queue, QueueStat
from django_pgjobs.observability import report as reports
from django_pgjobs.observability import stats
from tests import plans
from tests.conftest import connection_kwargs, wait_until
from tests.factories import JobFactory, backlog

# The report's now() is the start of its transaction: inside a test's transaction it would be
# earlier than the rows the test wrote (their times are each statement's), and statistics count
# committed rows only.
pytestmark = pytest.mark.django_db(transaction=True)


def worker_row(
    queue: str = "default", ago: float = 0, worker: str = "host:1:aa", seconds=10, **counts
):
    """A QueueStat row as a worker writes it every `seconds`, `ago` seconds in the past."""
    return QueueStat.objects.create(
        at=Now() - timedelta(seconds=ago), seconds=seconds, worker=worker, queue=queue, **counts
    )


def due_jobs(count: int, waited: float, queue: str = "default") -> None:
    """`count` due jobs, the oldest due for `waited` seconds."""
    JobFactory.create_batch(count, queue=queue)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE pgjobs_job SET run_at = now() - make_interval(secs => %s) WHERE queue = %s",
            [waited, queue],
        )


def codes(report: reports.Report) -> set[str]:
    return {reason.code for reason in report.verdict.reasons}


def jobstats(*args: str) -> tuple[int, str]:
    out = StringIO()
    try:
        call_command("jobstats", *args, stdout=out)
    except SystemExit as exit:
        return int(exit.code or 0), out.getvalue()
    return 0, out.getvalue()


# ---- figures -------------------------------------------------------------------------------


def test_queue_figures_count_each_status_and_include_paused_and_served_queues():
    JobFactory.create_batch(3)
    JobFactory(retrying=True)  # scheduled (its backoff) and retrying
    JobFactory(running=True)
    JobFactory(dead=True, queue="emails")
    JobFactory(succeeded=True, queue="done")  # finished history is not counted
    Queue.objects.create(name="reports", paused=True, max_running=2)
    worker_row(queue="idle")
    queues = {q.queue: q for q in reports.collect().queues}
    assert set(queues) == {"default", "emails", "reports", "idle"}
    default = queues["default"]
    assert (default.due, default.scheduled, default.retrying, default.running) == (3, 1, 1, 1)
    assert queues["emails"].failed == 1
    assert queues["reports"].paused and queues["reports"].max_running == 2


def test_activity_sums_worker_rows_per_window_with_latency_percentiles():
    # 90 claims within 1 ms, 10 between 0.5 s and 1 s; one row 10 minutes old.
    worker_row(claimed=100, succeeded=90, retried=10, latency_buckets=[90, *[0] * 8, 10])
    worker_row(ago=600, worker="host:2:bb", claimed=50, succeeded=50, latency_buckets=[50])
    activity = {(a.queue, a.window): a for a in stats.activity_stats()}
    minute, quarter = activity["default", 60], activity["default", 900]
    assert (minute.claimed, minute.succeeded, minute.retried) == (100, 90, 10)
    assert (quarter.claimed, quarter.succeeded) == (150, 140)
    assert minute.retry_rate == pytest.approx(0.1)
    # Rates are over the time the rows cover: 10 s for the minute, 610 s for the quarter.
    assert minute.covered == pytest.approx(10, abs=1)
    assert minute.throughput == pytest.approx(90 / 10, rel=0.1)
    assert quarter.throughput == pytest.approx(140 / 610, rel=0.01)
    assert minute.latency(0.5) == pytest.approx(0.5 * 100 / 90 * 0.001)
    assert 0.5 < minute.latency(0.95) <= 1.0


def test_workers_alive_are_those_with_a_recent_row_and_list_their_queues():
    worker_row(queue="default", worker="host:1:aa")
    worker_row(queue="emails", worker="host:1:aa")
    worker_row(queue="default", worker="host:2:bb", ago=120)  # missed 12 intervals
    workers = {w.worker: w for w in stats.worker_stats()}
    assert workers["host:1:aa"].alive and workers["host:1:aa"].queues == ["default", "emails"]
    assert not workers["host:2:bb"].alive
    assert 119 < workers["host:2:bb"].last_seen_seconds < 200


def test_table_figures_count_dead_tuples_and_list_every_index():
    jobs = JobFactory.create_batch(50)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM pgjobs_job WHERE id = ANY(%s)", [[j.pk for j in jobs[:30]]])
        cursor.execute("SELECT pg_stat_force_next_flush()")
    table = wait_until(lambda: (t := reports.collect().table).dead_tuples >= 30 and t, 10)
    assert table.live_tuples >= 20
    assert {"pgjobs_job_claim_idx", "pgjobs_job_pkey"} <= set(table.indexes)
    assert table.index_bytes >= sum(table.indexes.values()) > 0


# ---- the verdict ---------------------------------------------------------------------------


def test_an_empty_queue_with_a_live_worker_is_healthy_and_exits_zero():
    worker_row()
    code, out = jobstats()
    assert code == 0
    assert "verdict: HEALTHY" in out


def test_a_backlog_older_than_the_threshold_means_workers_are_behind(settings):
    worker_row()
    due_jobs(5, waited=400)
    Queue.objects.create(name="default", max_running=2)
    report = reports.collect()
    assert codes(report) == {"workers_behind"}
    (reason,) = report.verdict.reasons
    assert "5 due" in reason.detail and "OLDEST_DUE_SECONDS = 300" in reason.threshold
    assert "at most 2 may run at once" in reason.detail
    assert reason.doc == "docs/howto/monitoring.md#workers-behind"
    code, out = jobstats()
    assert code == 1 and "workers are behind" in out
    settings.PGJOBS = {"HEALTH": {"OLDEST_DUE_SECONDS": 600}}
    assert codes(reports.collect()) == set()


def test_a_growing_backlog_is_described_against_the_previous_sample():
    worker_row()
    due_jobs(2, waited=400)
    first = reports.collect()
    JobFactory.create_batch(3)
    second = reports.collect(previous=first)
    (reason,) = second.verdict.reasons
    assert "depth 2 → 5" in reason.detail


def test_due_jobs_in_a_queue_no_live_worker_serves_are_critical():
    worker_row(queue="other")
    worker_row(queue="default", worker="host:9:zz", ago=600)  # gone
    due_jobs(3, waited=120)
    due_jobs(2, waited=120, queue="paused")
    Queue.objects.create(name="paused", paused=True)
    report = reports.collect()
    assert codes(report) == {"no_worker_serves_a_queue"}
    assert "'default'" in report.verdict.reasons[0].summary
    assert jobstats()[0] == 2


def test_jobs_left_running_by_a_worker_that_is_gone_are_critical_once_their_leases_ran_out(
    admin_client,
):
    # Every worker of the queue died holding jobs, the queue otherwise quiet: nothing reaps
    # them, and the report said HEALTHY for ever.
    worker_row(queue="default", worker="host:9:zz", ago=600)  # gone
    JobFactory.create_batch(
        2, status="running", worker="host:9:zz", attempts=1, claims=1, leased_until=timezone.now()
    )
    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET leased_until = now() - interval '30 seconds'")
    report = reports.collect()
    [depth] = [q for q in report.queues if q.queue == "default"]
    assert depth.expired == 2 and 30 <= depth.oldest_expired_seconds < 60
    assert codes(report) == set()  # a lease may run out just before a live reaper takes it

    with connection.cursor() as cursor:
        cursor.execute("UPDATE pgjobs_job SET leased_until = now() - interval '5 minutes'")
    report = reports.collect()
    assert codes(report) == {"no_worker_serves_a_queue"}
    assert "2 running whose leases ran out 300s ago" in report.verdict.reasons[0].detail
    code, out = jobstats()
    assert code == 2
    # The figures themselves, not only the verdict, where operators look: each queue's line
    # in jobstats, the report page and Prometheus.
    assert "2 of them running with a lease that ran out 300s ago" in out
    page = admin_client.get(reverse("admin:pgjobs_queue_report")).content.decode()
    assert "2 with their leases run out, the first 300 s ago" in page
    pytest.importorskip("prometheus_client")
    from django_pgjobs import metrics

    found = {
        (f.name, tuple(s.labels.values())): s.value
        for f in metrics.families(reports.collect())
        for s in f.samples
    }
    assert found["pgjobs_queue_expired_leases", ("default",)] == 2
    assert 300 <= found["pgjobs_queue_oldest_expired_seconds", ("default",)] < 330


def test_a_row_stamped_later_than_the_databases_clock_counts_nobody_alive_and_no_rate():
    # The database's clock stepped back (an NTP step, a failover to a host behind): a dead
    # worker's row from "the future" kept it alive (CRITICAL "no worker serves" read as
    # WARNING), "last seen -600s ago", and 600 jobs/s for 600 jobs in 10 s (attack 23, F4).
    due_jobs(100, waited=600)
    worker_row(worker="ghost:1", ago=-600, claimed=600, succeeded=600)
    report = reports.collect()
    assert codes(report) == {"no_worker_serves_a_queue"}
    assert not report.workers and not report.activity


def test_many_retries_over_five_minutes_are_a_retry_storm(settings):
    worker_row()
    worker_row(queue="emails", claimed=150, succeeded=40, retried=110)
    worker_row(queue="quiet", claimed=10, succeeded=2, retried=8)  # too few attempts to judge
    report = reports.collect()
    assert codes(report) == {"retry_storm"}
    assert "110 of 150 attempts" in report.verdict.reasons[0].detail
    settings.PGJOBS = {"HEALTH": {"RETRY_MIN_ATTEMPTS": 5}}
    assert len(reports.collect().verdict.reasons) == 2


def test_a_held_snapshot_is_a_long_transaction_blocking_vacuum(settings, other_connection):
    settings.PGJOBS = {"HEALTH": {"SNAPSHOT_SECONDS": 0.5}}
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT count(*) FROM pgjobs_job")
    report = wait_until(
        lambda: (r := reports.collect()) and "long_transaction" in codes(r) and r, timeout=10
    )
    reason = next(r for r in report.verdict.reasons if r.code == "long_transaction")
    assert f"pid {other_connection.info.backend_pid}" in reason.detail
    assert "SELECT count(*) FROM pgjobs_job" in reason.detail
    assert report.database.idle_in_transaction == 1
    other_connection.execute("ROLLBACK")
    assert "long_transaction" not in codes(reports.collect())


def test_dead_tuples_vacuum_has_not_removed_mean_tune_autovacuum(settings, other_connection):
    settings.PGJOBS = {"HEALTH": {"DEAD_TUPLES": 100, "DEAD_RATIO": 1, "SNAPSHOT_SECONDS": 60}}
    JobFactory.create_batch(300)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM pgjobs_job")  # below autovacuum's threshold for the table
        cursor.execute("SELECT pg_stat_force_next_flush()")
    report = wait_until(lambda: (r := reports.collect()) and codes(r) and r, timeout=10)
    assert codes(report) == {"tune_autovacuum"}
    # With a snapshot holding the horizon, vacuum could not help: that is the reason given.
    settings.PGJOBS = {"HEALTH": {"DEAD_TUPLES": 100, "DEAD_RATIO": 1, "SNAPSHOT_SECONDS": 0}}
    other_connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    other_connection.execute("SELECT 1")
    assert codes(reports.collect()) == {"long_transaction"}
    other_connection.execute("ROLLBACK")


def test_connections_over_the_ratio_are_near_the_limit(settings, other_connection):
    used = reports.collect().database
    assert 2 <= used.connections_used <= used.connections_max
    settings.PGJOBS = {"HEALTH": {"CONNECTIONS_RATIO": 1.5 / used.connections_max}}
    assert codes(reports.collect()) == {"connections_near_the_limit"}


def test_a_listener_stuck_in_a_transaction_fills_the_notify_queue(settings, other_connection):
    settings.PGJOBS = {"HEALTH": {"NOTIFY_QUEUE_USAGE": 1e-4, "SNAPSHOT_SECONDS": 3600}}
    other_connection.execute("LISTEN pgjobs_health_test")
    other_connection.execute("BEGIN")  # a listener reads notifications only between transactions
    other_connection.execute("SELECT 1")
    with connection.cursor() as cursor:
        for _ in range(200):
            cursor.execute("SELECT pg_notify('pgjobs_health_test', repeat('x', 7000))")
    report = reports.collect()
    other_connection.execute("ROLLBACK")
    assert report.database.notify_queue_usage > 1e-4
    assert codes(report) == {"notify_queue_filling"}


def test_a_database_that_refuses_writes_is_critical_and_says_why():
    # Before: on a standby after a failover, or an old primary fenced with
    # default_transaction_read_only, jobstats said HEALTHY, exit 0, while workers could
    # record nothing (attack 15).
    worker_row()
    name = connection.settings_dict["NAME"]
    with psycopg.connect(**connection_kwargs(), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    connection.close()  # the next session has it
    try:
        report = reports.collect()
        code, out = jobstats()
    finally:
        connection.close()
        writable = {**connection_kwargs(), "options": "-c default_transaction_read_only=off"}
        with psycopg.connect(**writable, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    assert report.database.refuses_writes == "read-only"
    assert codes(report) == {"database_refuses_writes"}
    assert code == 2
    assert (
        "the database refuses writes: default_transaction_read_only is on for the database; " in out
    )
    assert "threshold ;" not in out  # it has none


def test_a_read_only_monitoring_role_is_not_a_database_that_refuses_writes():
    # A read-only role for the probe is good practice: its own sessions refuse writes, the
    # database does not (attack 16: CRITICAL, exit 2, for ever).
    worker_row()
    with connection.cursor() as cursor:
        cursor.execute("SET default_transaction_read_only = on")  # as ALTER ROLE monitor SET ...
    try:
        report = reports.collect()
    finally:
        connection.close()
    assert report.database.refuses_writes == ""
    assert codes(report) == set()


def test_strain_at_high_throughput_is_past_the_design_envelope(settings):
    settings.PGJOBS = {"HEALTH": {"ENVELOPE_JOBS_PER_SECOND": 9}}
    # 10 jobs/s over 15 minutes (a little less by the time the report reads it)
    worker_row(claimed=9000, succeeded=9000, seconds=900)
    due_jobs(5, waited=400)
    assert codes(reports.collect()) == {"workers_behind", "past_the_design_envelope"}
    settings.PGJOBS = {"HEALTH": {"ENVELOPE_JOBS_PER_SECOND": 11}}
    assert codes(reports.collect()) == {"workers_behind"}


def test_jobstats_json_has_the_verdict_reasons_and_every_section():
    worker_row(claimed=10, succeeded=10, latency_buckets=[10])
    due_jobs(1, waited=400)
    code, out = jobstats("--json")
    document = json.loads(out)
    assert code == 1 and document["status"] == "warning"
    assert document["reasons"][0]["code"] == "workers_behind"
    (default,) = document["queues"]
    assert default["workers"] == 1 and default["windows"]["60s"]["succeeded"] == 10
    assert {"table", "database", "workers"} <= set(document)


# ---- cost ----------------------------------------------------------------------------------


def test_the_report_reads_the_partial_indexes_and_recent_rows_not_the_history():
    backlog(finished=50_000)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO pgjobs_queuestat (at, seconds, worker, queue, claimed, succeeded,
                                          retried, failed, latency_buckets)
            SELECT now() - interval '2 hours' - make_interval(secs => n), 10, 'w' || n % 5000,
                   'default', 0, 0, 0, 0, '[]'
            FROM generate_series(1, 50000) AS n
            """
        )
        cursor.execute("ANALYZE pgjobs_rollup")
        cursor.execute("ANALYZE pgjobs_worker")
    JobFactory.create_batch(5)
    JobFactory(running=True)
    JobFactory(dead=True)
    JobFactory(limit_key="c1")
    plan = plans.explain(stats.QUEUES_SQL)
    assert not plans.of_type(plan, "Seq Scan"), plans.shown(plan)
    indexes = ("claim", "keyed", "running", "dead")
    for index in [f"pgjobs_job_{name}_idx" for name in indexes]:
        assert plans.index_scans(plan, index), plans.shown(plan)
    params = {"windows": list(stats.WINDOWS), "longest": max(stats.WINDOWS), "intervals": 2,
              "slack": 5}  # fmt: skip
    # The statistics: their rollup's recent minutes and the workers seen recently.
    for sql, index in ((stats.ACTIVITY_SQL, "pgjobs_rollup_unique"),
                       (stats.WORKERS_SQL, "pgjobs_worker_seen_idx")):  # fmt: skip
        plan = plans.explain(sql, params)
        assert plans.index_scans(plan, index), plans.shown(plan)
        assert not plans.of_type(plan, "Seq Scan"), plans.shown(plan)


def test_jobstats_watch_prints_a_sample_per_interval_until_interrupted(monkeypatch):
    worker_row()
    due_jobs(2, waited=400)
    sleeps = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second wait

    monkeypatch.setattr("time.sleep", sleep)
    code, out = jobstats("--watch", "0.5", "--json")
    first, second = (json.loads(line) for line in out.splitlines())
    assert sleeps == [0.5, 0.5]
    assert code == 1  # the last sample's verdict: workers are behind
    assert "since the previous sample" not in first["reasons"][0]["detail"]
    assert "since the previous sample depth 2 → 2" in second["reasons"][0]["detail"]
