"""A worker's chores (runtime/chores.py) when the database refuses one: it pauses alone, and
its failure is the worker's only when the connection is lost."""

from __future__ import annotations

import pytest
from django.db import OperationalError, connection, transaction

from django_pgjobs.models import Job
from django_pgjobs.runtime import policy
from django_pgjobs.runtime.chores import Chore


class _Failing(Chore):
    """A chore whose statement the database refuses every time (a table it may not use)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def run(self) -> float:
        self.runs += 1
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM pgjobs_no_such_table")
        return 1.0


@pytest.mark.django_db(transaction=True)
def test_a_chore_the_database_refuses_is_tried_again_after_its_own_pause_and_fails_nothing_else(
    caplog,
):
    chore = _Failing()
    chore.run_if_due()  # no error raised into the worker's turn
    assert chore.runs == 1 and 0 < chore.due_in() <= policy.outage_pause(1)
    chore.run_if_due()  # not due yet: not run
    assert chore.runs == 1
    chore.next_at = 0
    chore.run_if_due()
    assert chore.runs == 2 and policy.outage_pause(1) < chore.due_in() <= policy.outage_pause(2)
    assert "_Failing failed (ProgrammingError: relation" in caplog.text
    assert "_Failing failed again (2 times" in caplog.text
    Job.objects.enqueue("tests.tasks.noop")  # the connection serves the worker's statements
    assert len(Job.objects.claim(["default"], worker="w1", limit=1)) == 1


class _TimesOut(Chore):
    def run(self) -> float:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = '10ms'")
            cursor.execute("SELECT pg_sleep(1)")
        return 1.0


class _LosesItsConnection(Chore):
    def run(self) -> float:
        raise OperationalError("server closed the connection unexpectedly")


@pytest.mark.django_db(transaction=True)
def test_a_chore_that_runs_out_of_time_pauses_alone_and_a_lost_connection_is_the_workers():
    slow = _TimesOut()
    slow.run_if_due()  # QueryCanceled: the statement's, not the connection's
    assert slow.failures == 1
    with pytest.raises(OperationalError):
        _LosesItsConnection().run_if_due()  # the worker's outage, as before
