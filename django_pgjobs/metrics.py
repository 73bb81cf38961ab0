"""Prometheus metrics, with the optional prometheus-client package (the `prometheus` extra).

Two kinds: each worker's own job outcomes and handler durations, counted from the lifecycle
signals (`runjobs --metrics-port` serves them); and the health report's figures, one set for the
whole database, from `ReportCollector` (`report_view` serves them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db import DatabaseError, transaction
from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from django_pgjobs import signals
from django_pgjobs.observability import report as reports
from django_pgjobs.observability.stats import window_label

#: Handler durations from 5 ms to 15 minutes.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)

JOBS = Counter("pgjobs_jobs", "Job outcomes this process recorded.", ["queue", "task", "outcome"])
STARTED = Counter("pgjobs_jobs_started", "Handlers this process started.", ["queue", "task"])
DURATION = Histogram(
    "pgjobs_job_duration_seconds",
    "Wall time of handlers whose outcome this process recorded.",
    ["queue", "task"],
    buckets=DURATION_BUCKETS,
)

_OUTCOMES = signals.SIGNAL_OF_OUTCOME


def _counter(outcome: str) -> Any:
    def receiver(sender: Any, job: Any, duration: float | None = None, **kwargs: Any) -> None:
        JOBS.labels(job.queue, job.task, outcome).inc()
        if duration is not None:
            DURATION.labels(job.queue, job.task).observe(duration)

    return receiver


def _started(sender: Any, job: Any, **kwargs: Any) -> None:
    STARTED.labels(job.queue, job.task).inc()


# Module-level, so that the signals' weak references keep them.
_RECEIVERS = {outcome: _counter(outcome) for outcome in _OUTCOMES}


def connect() -> None:
    """Count this process's job outcomes and durations (idempotent). `serve()` calls it; call
    it yourself (e.g. in an AppConfig.ready) to export through your own exporter."""
    for outcome, signal in _OUTCOMES.items():
        signal.connect(_RECEIVERS[outcome], dispatch_uid=f"pgjobs.metrics.{outcome}")
    signals.job_started.connect(_started, dispatch_uid="pgjobs.metrics.started")


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve this process's metrics (the default registry) over HTTP on a daemon thread."""
    connect()
    start_http_server(port, addr)


class ReportCollector(Collector):
    """The health report's figures, taken afresh at each scrape. When the report cannot be
    taken, the verdict alone, as jobstats gives it: the scrape still answers, so alerts on
    pgjobs_health fire when they are needed most."""

    def __init__(self, db: str | None = None) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        try:
            report = reports.collect(self.db)
        except DatabaseError as error:
            return iter(unreported(reports.no_report(error, self.db)))
        return iter(families(report))


@transaction.non_atomic_requests  # under ATOMIC_REQUESTS, an outage failed before the view ran
def report_view(request: HttpRequest) -> HttpResponse:
    """The report's figures in Prometheus's text format. It authenticates nobody: route it
    where only your Prometheus can reach it."""
    registry = CollectorRegistry()
    registry.register(ReportCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _gauge(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


def families(report: reports.Report) -> list[Metric]:
    """The report as gauges."""
    jobs = _gauge("pgjobs_queue_jobs", "Jobs per queue and state, now.", ["queue", "state"])
    oldest = _gauge("pgjobs_queue_oldest_due_seconds", "Age of the oldest due job.", ["queue"])
    workers = _gauge("pgjobs_queue_workers", "Live workers serving the queue.", ["queue"])
    paused = _gauge("pgjobs_queue_paused", "1 when the queue is paused.", ["queue"])
    expired = _gauge(
        "pgjobs_queue_expired_leases", "Running jobs whose lease ran out (their worker gone).",
        ["queue"],
    )  # fmt: skip
    oldest_expired = _gauge(
        "pgjobs_queue_oldest_expired_seconds", "Since the first of those leases ran out.",
        ["queue"],
    )  # fmt: skip
    for q in report.queues:
        for state in ("due", "scheduled", "retrying", "running", "failed"):
            jobs.add_metric([q.queue, state], getattr(q, state))
        oldest.add_metric([q.queue], q.oldest_due_seconds)
        expired.add_metric([q.queue], q.expired)
        oldest_expired.add_metric([q.queue], q.oldest_expired_seconds)
        workers.add_metric([q.queue], len(report.serving(q.queue)))
        paused.add_metric([q.queue], int(q.paused))
    window = ["queue", "window"]
    throughput = _gauge("pgjobs_queue_throughput", "Jobs finished per second.", window)
    retry_rate = _gauge("pgjobs_queue_retry_rate", "Share of attempts retried.", window)
    latency = _gauge(
        "pgjobs_claim_latency_seconds", "Claim latency quantile.", [*window, "quantile"]
    )
    for a in report.activity:
        labels = [a.queue, window_label(a.window)]
        throughput.add_metric(labels, a.throughput)
        retry_rate.add_metric(labels, a.retry_rate)
        for quantile in (0.5, 0.95):
            value = a.latency(quantile)
            if value is not None:
                latency.add_metric([*labels, str(quantile)], value)
    t, d = report.table, report.database
    tuples = _gauge("pgjobs_table_tuples", "The job table's tuples.", ["kind"])
    tuples.add_metric(["live"], t.live_tuples)
    tuples.add_metric(["dead"], t.dead_tuples)
    sizes = _gauge("pgjobs_table_bytes", "The job table's heap and indexes.", ["relation"])
    sizes.add_metric(["heap"], t.table_bytes)
    for index, size in t.indexes.items():
        sizes.add_metric([index], size)
    connections = _gauge("pgjobs_connections", "Client connections and the limit.", ["kind"])
    connections.add_metric(["used"], d.connections_used)
    connections.add_metric(["max"], d.connections_max)
    health, reasons = _verdict(
        report.verdict.exit_code, {reason.code for reason in report.verdict.reasons}
    )
    stream = _gauge(
        "pgjobs_nats_messages", "A NATS queue's messages by state (stream, pending, "
        "ack_pending, redelivered); -1 when NATS is unreachable.", ["queue", "state"],
    )  # fmt: skip
    for s in report.streams:
        for state, value in (
            ("stream", s.messages),
            ("pending", s.pending),
            ("ack_pending", s.ack_pending),
            ("redelivered", s.redelivered),
        ):
            stream.add_metric([s.queue, state], value if s.reachable else -1)  # fmt: skip
    waited = _gauge(
        "pgjobs_nats_oldest_seconds", "How long a NATS queue's oldest message not yet delivered "
        "(pending), or delivered and not acknowledged (ack_pending), has been due (0 when there "
        "is none; absent while it cannot be read).", ["queue", "state"],
    )  # fmt: skip
    for s in report.streams:
        for state, count, age in (
            ("pending", s.pending, s.oldest_pending_seconds),
            ("ack_pending", s.ack_pending, s.oldest_unacked_seconds),
        ):
            if s.reachable and (age is not None or not count):
                waited.add_metric([s.queue, state], age or 0.0)
    yielding = _gauge(
        "pgjobs_queue_yielding", "Workers of the queue yielding to the application, at their "
        "last report.", ["queue"],
    )  # fmt: skip
    allowed = _gauge(
        "pgjobs_queue_allowed_rate", "Jobs/s the queue's yielding workers may claim, together "
        "(absent while none yields).", ["queue"],
    )  # fmt: skip
    claimed = _gauge("pgjobs_queue_claim_rate", "Jobs/s the queue's workers claim.", ["queue"])
    signal = _gauge(
        "pgjobs_app_open_transaction_seconds", "The application's open transactions' ages added "
        "up, smoothed (value), and its baseline (baseline), as the queue's workers read them.",
        ["queue", "kind"],
    )  # fmt: skip
    for y in report.yielding:
        yielding.add_metric([y.queue], y.yielding)
        claimed.add_metric([y.queue], y.claimed)
        if y.allowed is not None:
            allowed.add_metric([y.queue], y.allowed)
        for kind, ms in (("value", y.open_ms), ("baseline", y.baseline_ms)):
            if ms is not None:
                signal.add_metric([y.queue, kind], ms / 1000)
    return [
        jobs, oldest, workers, paused, expired, oldest_expired, throughput, retry_rate, latency,
        tuples, sizes, connections, stream, waited, yielding, allowed, claimed, signal,
        _single("pgjobs_idle_in_transaction", "Sessions idle in a transaction.",
                d.idle_in_transaction),
        _single("pgjobs_oldest_snapshot_seconds", "Age of the transaction holding vacuum back.",
                d.oldest_snapshot_seconds),
        _single("pgjobs_notify_queue_usage", "pg_notification_queue_usage().",
                d.notify_queue_usage),
        health, reasons,
    ]  # fmt: skip


def unreported(sample: reports.NoReport) -> list[Metric]:
    """The verdict on a report that could not be taken: its level and its reason's code."""
    return list(_verdict(int(sample.level), {sample.code}))


def _verdict(level: int, codes: set[str]) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    health = _gauge(
        "pgjobs_health",
        "The verdict: 0 healthy, 1 warning, 2 critical, 3 unknown (no report could be taken).",
        [],
    )
    health.add_metric([], level)
    reasons = _gauge("pgjobs_health_reason", "1 for each reason of the verdict.", ["code"])
    for code in sorted(codes):
        reasons.add_metric([code], 1)
    return health, reasons


def _single(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
