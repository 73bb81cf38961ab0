"""Scenario 10: a prepared (two-phase) transaction that locks the job table: it stops every
worker until someone commits or rolls it back, and has no session in pg_stat_activity. jobstats
said the lock was held "for 0s" (its age came from the session), a warning for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.chaos.servers import Cluster
from tests.crash.conftest import ROOT

pytestmark = pytest.mark.django_db(transaction=True)


def test_jobstats_says_a_prepared_transaction_holds_the_job_table_and_for_how_long(
    cluster: Cluster,
):
    with cluster.connect() as dba:
        dba.execute("BEGIN")
        dba.execute("LOCK TABLE pgjobs_job IN ACCESS EXCLUSIVE MODE")
        dba.execute("PREPARE TRANSACTION 'dba-forgot-this'")
    try:
        time.sleep(6)  # past the workers' lock_timeout: they can do nothing now
        env = {**os.environ, "DATABASE_URL": cluster.url(), "PGJOBS_TEST_DATABASE": ""}
        done = subprocess.run(
            [sys.executable, "manage.py", "jobstats", "--settings", "tests.settings"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        with cluster.connect() as dba:
            dba.execute("ROLLBACK PREPARED 'dba-forgot-this'")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "a prepared transaction holds ACCESS EXCLUSIVE for" in done.stdout
    assert "PREPARE TRANSACTION 'dba-forgot-this'" in done.stdout
    held = int(done.stdout.split("holds ACCESS EXCLUSIVE for ")[1].split("s")[0])
    assert held >= 6
