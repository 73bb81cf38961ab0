"""Per-queue transports: the settings' checks, and a PostgreSQL-only project never importing
nats."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from django_pgjobs import transports

ROOT = Path(__file__).resolve().parents[2]


def test_a_project_without_nats_queues_never_imports_nats() -> None:
    script = (
        "import sys, django; django.setup()\n"
        "from django.core import management\n"
        "from django.core.checks import run_checks\n"
        "from django_pgjobs.management.commands import runjobs, jobstats, relayjobs\n"
        "from django_pgjobs.runtime.lifecycle import Options\n"
        "import django_pgjobs.admin, django_pgjobs.observability.report\n"
        "run_checks()\n"
        "runjobs._worker(Options(queues=['default']))\n"
        "print('nats' in sys.modules, 'django_pgjobs.jetstream' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"DJANGO_SETTINGS_MODULE": "tests.settings", "PATH": "/usr/bin:/bin",
             "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("queues", "problem"),
    [
        ({"events": {"TRANSPORT": "kafka"}}, "['TRANSPORT'] must be one of"),
        ({"events": {"TRANSPORT": "nats", "SUBJECT": "jobs.>"}}, "without wildcards"),
        ({"events": {"TRANSPORT": "nats", "STREAM": "a.b"}}, "['STREAM'] must be letters"),
        ({"events": {"TRANSPORT": "nats", "RETENTION": "forever"}}, "['RETENTION'] must be"),
        ({"events": {"TRANSPORT": "nats", "MAX_ACK_PENDING": 0}}, "greater than 0"),
        ({"events": {"TRANSPORT": "nats", "MAX_AGE": 30}}, "at least its DUPLICATE_WINDOW"),
        ({"events": {"TRANSPORT": "nats", "SERVER": "x"}}, "unknown key 'SERVER'"),
        ({"events": "nats"}, "must be a dict"),
    ],
)
def test_queue_settings_that_cannot_work_are_reported(
    settings: Any, queues: dict[str, Any], problem: str
) -> None:
    settings.PGJOBS = {"QUEUES": queues}
    found = transports.problems()
    assert any(problem in text for text in found), found
    assert transports.nats_queues() == {}


def test_a_nats_queue_gets_names_nats_accepts(settings: Any) -> None:
    settings.PGJOBS = {"QUEUES": {"mail:eu.fast": {"TRANSPORT": "nats"}, "slow": {}}}
    assert transports.problems() == []
    (queue,) = transports.nats_queues().values()
    assert (queue.stream, queue.subject, queue.consumer) == (
        "PGJOBS_mail_eu_fast", "pgjobs.mail_eu_fast", "pgjobs_mail_eu_fast",
    )  # fmt: skip
    assert transports.transport_of("slow") == transports.POSTGRES


def test_nats_server_settings_are_checked(settings: Any) -> None:
    settings.PGJOBS = {"NATS": {"SERVERS": "127.0.0.1:4222", "RELAY_BATCH": 0}}
    found = transports.problems()
    assert any("['SERVERS'] must be a URL" in text for text in found)
    assert any("['RELAY_BATCH'] must be" in text for text in found)


def test_only_headers_nats_can_carry_become_message_headers() -> None:
    pytest.importorskip("nats", reason="the NATS tests need nats-py (the nats extra)")
    from django_pgjobs.jetstream import messages
    from django_pgjobs.models import Job

    job = Job(task="shop.tasks.ship", claims=2, headers={
        "traceparent": "00-abc-01", "bad name": "x", "x-evil": "a\r\nNats-Msg-Id: forged",
    })  # fmt: skip
    sent = messages.headers(job)
    assert sent == {
        "traceparent": "00-abc-01",
        "Nats-Msg-Id": f"{job.pk}:2",
        "Pgjobs-Task": "shop.tasks.ship",
    }


def test_nats_connect_options_must_be_a_dict(settings: Any) -> None:
    settings.PGJOBS = {"NATS": {"OPTIONS": "tls"}}
    assert any("['OPTIONS'] must be a dict" in text for text in transports.problems())
    settings.PGJOBS = {"NATS": {"OPTIONS": {"name": "relay"}}}
    assert transports.problems() == []
    assert transports.nats_servers().options == {"name": "relay"}
