"""A transaction-mode pooler that the settings do not announce (DISABLE_SERVER_SIDE_CURSORS
unset): the workers prepare their statements, which the pooler cannot keep. They must go on,
say what to set, and lose no job."""

from __future__ import annotations

import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.chaos.servers import Bouncer
from tests.conftest import wait_until
from tests.crash.conftest import start_worker  # noqa: F401  (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)


def test_workers_behind_an_unannounced_transaction_pooler_stop_preparing_and_lose_nothing(
    start_worker,  # noqa: F811
    bouncer: Bouncer,
):
    name = connection.settings_dict["NAME"]
    env = {"DATABASE_URL": f"postgres://postgres@127.0.0.1:{bouncer.port}/{name}"}
    workers = [
        start_worker("--concurrency", "4", "--no-listen", "--poll-interval", "0.05", env=env)
        for _ in range(3)
    ]
    # Started before the jobs come (on a loaded machine one may take seconds): a worker still
    # starting when the others have done all the jobs would die of the SIGTERM below.
    assert wait_until(lambda: all(worker.started() for worker in workers), 60)
    Job.objects.bulk_enqueue("tests.tasks.noop", [None] * 3000)
    # Trickled in too, so that every worker runs many small turns on many server connections.
    for _ in range(200):
        Job.objects.enqueue("tests.tasks.noop")

    wait_until(lambda: Job.objects.filter(status=Status.SUCCEEDED).count() == 3200, 90, 0.2)
    assert not Job.objects.exclude(status=Status.SUCCEEDED).exists()
    for worker in workers:
        worker.signal(15)
    assert [worker.wait(30) for worker in workers] == [0, 0, 0]
    logs = [worker.log() for worker in workers]
    assert "login attempt: db=" + name in bouncer.log()  # they did come through it
    for log in logs:  # a worker that met the pooler's loss said what to set, and nothing
        if "prepared statement" in log:  # of a job's was taken for a refusal
            assert "set DISABLE_SERVER_SIDE_CURSORS = True" in log, log[-3000:]
            assert "refused" not in log, log[-3000:]
