from __future__ import annotations

from unittest import mock

from django.core.checks import run_checks
from django.db import connection


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
