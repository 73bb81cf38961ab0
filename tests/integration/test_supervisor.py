"""The supervisor of runjobs --processes (runtime/processes.py), in this process: a child it
cannot start."""

from __future__ import annotations

import pytest


@pytest.mark.django_db(transaction=True)
def test_a_child_that_cannot_be_started_is_a_crash_not_the_supervisors_end(monkeypatch, caplog):
    # Popen's error (the interpreter gone in a deploy, no process left to fork) ended the
    # supervisor with a traceback, its other children left running unsupervised.
    from django_pgjobs.runtime import processes

    monkeypatch.setattr(processes.sys, "executable", "/nonexistent/python3")
    monkeypatch.setattr(processes.policy, "doubling", lambda *args: 0.01)  # restart at once
    assert processes.Supervisor(2, []).run() == 1  # gave up, as for children that keep dying
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("could not be started" in line and "starting another in" in line for line in said)
    assert "stopping them all" in said[-1]
