"""Scenario 9: a worker frozen (SIGSTOP: a debugger, a paused container or VM) while the server
is sending it something too big for the sockets' buffers. Its backend then waits on the client
inside the statement, where neither statement_timeout nor idle_in_transaction_session_timeout
reaches: the rows of a claim stayed locked (every other worker's claim skipped them, the
lease-less rows no reaper could take back) and the wake-up listener stopped reading PostgreSQL's
notification queue (which, once full, fails every enqueue that notifies), for as long as the
process stayed frozen. The server's TCP_USER_TIMEOUT on the worker's own sessions ends them."""

from __future__ import annotations

import signal
import time

import pytest

from django_pgjobs.models import Job
from tests.chaos.conftest import ALIAS
from tests.chaos.servers import Cluster
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = 16
#: Big enough together (14 MB) that a claim's rows cannot all wait in the sockets' buffers.
PAYLOAD = "x" * 900_000
#: The workers' TCP_USER_TIMEOUT (milliseconds; their OPTIONS', shorter than KEEPALIVES's 20 s),
#: and how long the test waits for it to act, with room for a loaded machine.
USER_TIMEOUT = 4000
PATIENCE = USER_TIMEOUT / 1000 + 20
ENV = {
    "PGJOBS_TEST_DATABASE": "",
    "PGJOBS_CHAOS": "1",
    "PGJOBS_TCP_USER_TIMEOUT": str(USER_TIMEOUT),
}


def worker_backends(cluster: Cluster, pid: int) -> list[tuple[str, str | None, str]]:
    """(state, wait_event, query) of each session of the worker process `pid`."""
    with cluster.connect() as admin:
        return admin.execute(
            "SELECT state, wait_event, query FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            [f"chaos:{pid}"],
        ).fetchall()


def free_ready_jobs(cluster: Cluster) -> int:
    with cluster.connect() as admin:
        return admin.execute(
            "SELECT count(*) FROM (SELECT FROM pgjobs_job WHERE status = 'ready' "
            "FOR UPDATE SKIP LOCKED) AS free"
        ).fetchone()[0]


def test_a_worker_frozen_while_its_claim_is_sent_to_it_lets_the_rows_go(cluster: Cluster, tmp_path):
    for _ in range(JOBS):
        Job.objects.db_manager(ALIAS).enqueue(
            "tests.tasks.takes_anything", {"order_id": 1, "blob": PAYLOAD}
        )
    with cluster.connect() as admin:  # the claim takes a moment: time to freeze the worker in it
        admin.execute(
            "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF OLD.status = 'ready' AND NEW.status = 'running' THEN PERFORM pg_sleep(0.25); "
            "END IF; RETURN NEW; END $$; "
            "CREATE TRIGGER slow_claim BEFORE UPDATE ON pgjobs_job "
            "FOR EACH ROW EXECUTE FUNCTION slow_claim()"
        )
    env = {"DATABASE_URL": cluster.url(), **ENV}
    args = ["--concurrency", str(JOBS), "--batch-size", str(JOBS), "--no-listen"]
    worker = WorkerProcess(args, tmp_path / "worker.log", env=env)
    try:
        claiming = wait_until(
            lambda: [row for row in worker_backends(cluster, worker.pid) if row[1] == "PgSleep"],
            timeout=60,
            interval=0.05,
        )
        assert claiming
        worker.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        # The claim's statement ends, and its rows are sent to a process that reads nothing.
        wait_until(
            lambda: any(row[1] == "ClientWrite" for row in worker_backends(cluster, worker.pid)),
            timeout=30,
        )
        assert free_ready_jobs(cluster) < JOBS
        # Its session is ended: the claim rolled back, every row free, no attempt spent.
        wait_until(lambda: free_ready_jobs(cluster) == JOBS, timeout=PATIENCE, interval=0.5)
        assert time.monotonic() - frozen < PATIENCE
        with cluster.connect() as admin:
            assert admin.execute("SELECT max(attempts) FROM pgjobs_job").fetchone()[0] == 0
    finally:
        worker.signal(signal.SIGCONT)
        worker.kill()


def test_a_frozen_workers_listener_stops_holding_back_the_notification_queue(
    cluster: Cluster, tmp_path
):
    env = {"DATABASE_URL": cluster.url(), **ENV}
    worker = WorkerProcess(["--concurrency", "1"], tmp_path / "worker.log", env=env)
    try:
        wait_until(worker.started, timeout=60)
        wait_until(
            lambda: any(
                row[2].startswith("LISTEN") for row in worker_backends(cluster, worker.pid)
            ),
            timeout=30,
        )
        worker.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        with cluster.connect() as admin:  # wake-ups it cannot read: 16 MB of them
            for _ in range(2_000):
                admin.execute("SELECT pg_notify('pgjobs', repeat('q', 7900))")
        listening = [
            row for row in worker_backends(cluster, worker.pid) if row[2].startswith("LISTEN")
        ]
        assert listening and listening[0][1] == "ClientWrite", listening
        wait_until(
            lambda: (
                not any(row[2].startswith("LISTEN") for row in worker_backends(cluster, worker.pid))
            ),
            timeout=PATIENCE,
            interval=0.5,
        )
        assert time.monotonic() - frozen < PATIENCE
    finally:
        worker.signal(signal.SIGCONT)
        worker.kill()
