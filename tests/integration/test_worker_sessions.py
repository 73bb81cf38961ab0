"""The session settings of the worker's own connections (runtime/locks.py)."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from django_pgjobs.runtime.locks import LOCK_TIMEOUT, LockWaits, application_name


def _settings() -> tuple[str, str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('application_name'), "
            "current_setting('synchronous_commit')"
        )
        return cursor.fetchone()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("durable", "expected"), [(False, "off"), (True, "on")])
def test_the_workers_connections_are_named_and_commit_as_the_setting_says(
    settings, durable, expected
):
    settings.PGJOBS = {"WORKER_SYNCHRONOUS_COMMIT": durable}
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        assert _settings() == (LOCK_TIMEOUT, "pgjobs worker host:1:ab", expected)
        connection.close()  # and again after a reconnect
        assert _settings() == (LOCK_TIMEOUT, "pgjobs worker host:1:ab", expected)
    finally:
        sessions.stop()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_other_threads_connections_keep_their_own_settings():
    sessions = LockWaits("default", application_name("host:1:ab"))
    seen = []
    try:
        sessions.limit_this_thread()

        def handler() -> None:
            seen.append(_settings())
            connection.close()

        thread = threading.Thread(target=handler)
        thread.start()
        thread.join()
    finally:
        sessions.stop()
        connection.close()
    assert seen[0][1:] == ("", "on")


@pytest.mark.django_db(transaction=True)
def test_an_application_name_the_project_configured_is_kept():
    """DATABASES OPTIONS naming the connections is the project's choice (its monitoring, or the
    chaos suite's audit trigger, may read it): the worker keeps it, and sets the rest."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    options["application_name"] = "shop worker 7"
    connection.close()
    sessions = LockWaits("default", application_name("host:1:ab"))
    try:
        sessions.limit_this_thread()
        assert _settings() == (LOCK_TIMEOUT, "shop worker 7", "off")
    finally:
        sessions.stop()
        del options["application_name"]
        connection.close()
