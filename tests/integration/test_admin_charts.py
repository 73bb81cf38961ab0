"""The health report's charts, drawn from the workers' QueueStat rows as inline SVG."""

from __future__ import annotations

import html
from datetime import timedelta
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from django_pgjobs.admin import charts
from django_pgjobs.models import QueueStat

pytestmark = pytest.mark.django_db

REPORT = reverse("admin:pgjobs_queue_report")


def stat(minutes_ago: float, queue: str = "emails", **figures: Any) -> QueueStat:
    at = timezone.now() - timedelta(minutes=minutes_ago)
    return QueueStat.objects.create(at=at, seconds=60, worker="web-1:7", queue=queue, **figures)


def test_the_report_draws_throughput_latency_retries_and_failures_per_queue(admin_client):
    # 120 jobs finished in a minute: 2/s, i.e. 120 jobs/min; claims waited 1–2 ms and 1–2 s.
    stat(3, succeeded=118, failed=2, retried=5, claimed=125,
         latency_buckets=[0, 100, 0, 0, 0, 0, 0, 0, 0, 0, 25])  # fmt: skip
    stat(2, queue="reports", succeeded=6, claimed=6, latency_buckets=[6])
    stat(60 * 5, succeeded=30, claimed=30, latency_buckets=[30])  # in the day's window only
    content = admin_client.get(REPORT).content.decode()
    text = html.unescape(content)

    hour, day = admin_client.get(REPORT).context["charts"]
    assert [d["chart"].title for d in hour["charts"]] == [
        "Throughput", "Claim latency, p50 and p95 (dashed)", "Retries", "Failures (dead letters)",
        "Claimed, and allowed while yielding (dashed)",
    ]  # fmt: skip
    throughput = hour["charts"][0]["chart"]
    assert [s["name"] for s in throughput.series] == ["emails", "reports"]
    assert max(v for v in throughput.series[0]["values"] if v is not None) == 120
    assert content.count("<svg viewBox") == 10
    assert "<script" not in content.split('id="charts-1"')[1].split("Queues now")[0]
    # The numbers: on hover (<title>) and in a table.
    assert "emails 120 jobs/min</title>" in text
    assert "emails p95" in text and "emails 2 per point</title>" in text  # failures
    assert "<details><summary>The numbers</summary>" in content
    # The day has the older row; the hour has not.
    day_throughput = day["charts"][0]["chart"]
    assert sum(v or 0 for v in day_throughput.series[0]["values"]) == pytest.approx(
        (120 + 30) * 60 / 3600  # a point an hour
    )


def test_the_latency_chart_shows_p50_and_p95_from_the_summed_histograms(admin_client):
    stat(1, claimed=100, succeeded=100, latency_buckets=[0, 0, 0, 0, 0, 100])
    hour = admin_client.get(REPORT).context["charts"][0]
    latency = hour["charts"][1]["chart"]
    p50, p95 = (max(v for v in s["values"] if v is not None) for s in latency.series)
    assert p50 == pytest.approx(0.035)  # halfway through the 20–50 ms bucket
    assert p95 == pytest.approx(0.0485)
    assert [s["dashed"] for s in latency.series] == [False, True]


def test_without_worker_rows_the_report_says_so_instead_of_drawing_empty_charts(admin_client):
    content = admin_client.get(REPORT).content.decode()
    assert content.count("No worker recorded anything in this window.") == 2
    assert "<svg viewBox" not in content


def test_queue_names_in_the_charts_are_escaped(admin_client):
    stat(1, queue="<xss-queue>", succeeded=1, claimed=1, latency_buckets=[1])
    content = admin_client.get(REPORT).content.decode()
    assert "<xss-queue>" not in content and "&lt;xss-queue&gt;" in content


def test_axes_are_rounded_up_to_one_two_or_five_times_a_power_of_ten():
    assert [charts.nice(v) for v in (0, 0.03, 1, 1.2, 3, 7, 120)] == [1, 0.05, 1, 2, 5, 10, 200]


def test_the_yielding_chart_draws_the_rate_claimed_and_the_rate_allowed_while_yielding(
    admin_client,
):
    # Two workers in one minute: one claimed 6,000 jobs yielding at 100 jobs/s allowed for 60 s,
    # the other 1,200 without yielding.
    stat(1, claimed=6000, allowed=100.0, yielded=60.0, open_ms=4.0, baseline_ms=2.0)
    QueueStat.objects.create(
        at=timezone.now() - timedelta(minutes=1), seconds=60, worker="web-2:8", queue="emails",
        claimed=1200,
    )  # fmt: skip
    stat(1, queue="reports", claimed=60)
    hour = admin_client.get(REPORT).context["charts"][0]
    chart = hour["charts"][4]["chart"]
    named = {s["name"]: s for s in chart.series}
    assert set(named) == {"emails", "emails allowed", "reports", "reports allowed"}
    assert max(v for v in named["emails"]["values"] if v is not None) == 120  # 7,200 a minute
    assert max(v for v in named["emails allowed"]["values"] if v is not None) == 100
    assert named["emails allowed"]["dashed"] and not named["emails"]["dashed"]
    assert all(v is None for v in named["reports allowed"]["values"])  # never yielded


def test_each_chart_says_in_words_what_it_shows_and_names_the_time_zone(admin_client, settings):
    settings.TIME_ZONE = "Asia/Kolkata"  # +05:30: no hour of it reads as UTC
    stat(3, succeeded=118, failed=2, claimed=120, latency_buckets=[120])
    stat(2, queue="reports", succeeded=6, claimed=6, latency_buckets=[6])
    response = admin_client.get(REPORT)
    content = html.unescape(response.content.decode())
    throughput = response.context["charts"][0]["charts"][0]["chart"]
    at = {  # each queue's last point, as the axis labels it
        serie["name"]: throughput.label(max(i for i, v in enumerate(serie["values"]) if v))
        for serie in throughput.series
    }
    assert (
        '<svg viewBox="0 0 520 150" role="img" aria-labelledby="chart-1-1-title" '
        'aria-describedby="chart-1-1-desc">'
    ) in content
    assert '<title id="chart-1-1-title">Throughput (jobs/min), Last hour</title>' in content
    assert (
        '<desc id="chart-1-1-desc">Last hour. Queues emails, reports, times in Asia/Kolkata. '
        f"Highest: 120 jobs/min (emails, {at['emails']}). Latest: emails 120 jobs/min "
        f"({at['emails']}); reports 6 jobs/min ({at['reports']}).</desc>"
    ) in content
    # The axes' times are the zone's, and the caption and the table say which.
    three_minutes_ago = timezone.localtime(timezone.now() - timedelta(minutes=3))
    assert at["emails"] == three_minutes_ago.strftime("%H:%M")
    assert 'Throughput <span class="unit">(jobs/min; times in Asia/Kolkata)</span>' in content
    assert "<th>Time (Asia/Kolkata)</th>" in content


def test_past_eight_queues_the_quietest_are_drawn_added_up_as_one_line(admin_client):
    for n in range(12):
        stat(1, queue=f"q{n:02}", claimed=100 + n, succeeded=100 + n, latency_buckets=[n])
    hour = admin_client.get(REPORT).context["charts"][0]
    throughput = hour["charts"][0]["chart"]
    names = [s["name"] for s in throughput.series]
    assert names == ["q05", "q06", "q07", "q08", "q09", "q10", "q11", "5 other queues"]
    other = max(v for v in throughput.series[-1]["values"] if v is not None)
    assert other == sum(100 + n for n in range(5))  # q00–q04, a minute each
