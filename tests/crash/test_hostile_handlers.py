"""Hostile handlers run by a real runjobs: whatever a handler does, its job gets an outcome, no
row stays running, and the worker keeps serving the other jobs."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from uuid import UUID

import pytest
from django.db import connection

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

#: A short lease, so that a job whose worker stops heartbeating it is reaped within seconds.
LEASE = 2.0
WORKER = ("--concurrency", "4", "--lease", str(LEASE), "--grace", "3", "--poll-interval", "0.5")

#: Long enough for anything a live worker does here (a reap included: lease + reap interval),
#: on a loaded machine too: every wait with it returns as soon as its outcome is there, and none
#: proves that something happens quickly (the leases, 2 s, are what the tests hold the worker
#: to). At 12 s, a 10 s handler's outcome missed it on 2 busy cores (CI's two legs at once).
SETTLE = 30.0


class State(NamedTuple):
    """A job's row, read with SQL: a run_at beyond year 9999 cannot become a datetime."""

    status: str
    attempts: int
    last_error: str
    due_within_a_day: bool


def state(pk: UUID) -> State:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT status, attempts, last_error, run_at < now() + interval '1 day' "
            "FROM pgjobs_job WHERE id = %s",
            [pk],
        )
        return State(*cursor.fetchone())


def running() -> list[UUID]:
    return list(Job.objects.filter(status=Status.RUNNING).values_list("pk", flat=True))


def record(numbers: Iterable[int]) -> list[UUID]:
    """Ordinary jobs: tests.tasks.record writes ledger row n."""
    jobs = Job.objects.bulk_enqueue("tests.tasks.record", ({"n": n} for n in numbers))
    return [job.pk for job in jobs]


def succeeded(pks: list[UUID]) -> bool:
    return Job.objects.filter(pk__in=pks, status=Status.SUCCEEDED).count() == len(pks)


def wait_while_alive(worker: WorkerProcess, predicate: Callable[[], Any], timeout: float) -> Any:
    """wait_until, failing at once if the worker process dies meanwhile."""

    def check() -> Any:
        if value := predicate():
            return value
        assert worker.alive(), f"the worker died with exit code {worker.process.returncode}"
        return None

    return wait_until(check, timeout)


# ---- what each hostile job must end as -------------------------------------------------------


def dead_letter(error: str = "") -> Callable[[State], bool]:
    """Failed (the dead letter) with a last error, one naming `error` when given."""
    return lambda s: s.status == Status.FAILED and bool(s.last_error) and error in s.last_error


def succeeded_state(s: State) -> bool:
    return s.status == Status.SUCCEEDED


def put_off_or_dead_letter(s: State) -> bool:
    """Either ready again and not due for more than a day (the delay kept, as far as a timestamp
    reaches), or failed with an error saying why: both are outcomes; running is not."""
    if s.status == Status.READY:
        return not s.due_within_a_day
    return s.status == Status.FAILED and bool(s.last_error)


@dataclass(frozen=True)
class Case:
    task: str
    outcome: Callable[[State], bool]
    payload: dict[str, Any] = field(default_factory=dict)
    #: Further checks once the outcome is recorded.
    then: Callable[[State], None] = lambda s: None


def _bounded_error(s: State) -> None:
    assert s.last_error.startswith("RuntimeError: yyy")
    assert len(s.last_error) <= 2000


def _rolled_back(n: int) -> Callable[[State], None]:
    def check(s: State) -> None:
        # The write made in a transaction the handler never closed is not committed by the
        # next job that thread runs; it goes when the connection is closed after the job.
        assert not Execution.objects.filter(n=n).exists()

    return check


def _atomic_block_undone(n: int) -> Callable[[State], None]:
    def check(s: State) -> None:
        assert Execution.objects.filter(n=n).exists()  # written before the atomic block
        assert not Execution.objects.filter(n=-n).exists()  # inside it: rolled back

    return check


CASES = [
    pytest.param(
        Case("raises_unprintable", dead_letter("tests.hostile.Unprintable")),
        id="an error whose str and repr raise is a dead letter naming its type",
    ),
    pytest.param(
        Case("retries_never", put_off_or_dead_letter),
        id="Retry with an infinite delay is put off or a dead letter",
    ),
    pytest.param(
        Case("retries_in_1e17_seconds", put_off_or_dead_letter),
        id="Retry with a 1e17 second delay is put off or a dead letter",
    ),
    pytest.param(
        # Backoffs are documented to return seconds. A timedelta is either read as its seconds
        # (as Retry(delay=...) reads one: one retry, then the dead letter of max_attempts=2) or
        # refused with an error saying so; either way a dead letter, and the worker lives.
        Case("fails_with_timedelta_backoff", dead_letter()),
        id="a timedelta backoff ends in a dead letter",
    ),
    pytest.param(
        Case("fails_with_1e17_backoff", put_off_or_dead_letter),
        id="a 1e17 second backoff is put off or a dead letter",
    ),
    pytest.param(
        Case("fails_with_infinite_backoff", put_off_or_dead_letter),
        id="an infinite backoff is put off or a dead letter",
    ),
    pytest.param(
        # The time limit is enforced on the worker's main thread, which heartbeats every job:
        # it waits a second for the backoff, then retries after the default backoff (the
        # next time-outs at once: the first call still hangs), until the attempts run out.
        Case("times_out_and_its_backoff_hangs", dead_letter("the default backoff applies")),
        id="a time-out whose backoff hangs is a dead letter",
    ),
    pytest.param(
        Case("times_out_and_its_backoff_exits", dead_letter("JobTimeout")),
        id="a time-out whose backoff raises SystemExit is a dead letter",
    ),
    pytest.param(
        # Outcome signals are sent on a thread of their own: the worker's main thread, which
        # keeps every lease, never waits for a receiver, nor dies of one.
        Case("announced_to_a_hanging_receiver", succeeded_state),
        id="a signal receiver that hangs stalls nothing",
    ),
    pytest.param(
        Case("announced_to_an_exiting_receiver", succeeded_state),
        id="a signal receiver raising SystemExit stops nothing",
    ),
    pytest.param(
        # Plain @task handlers' return values are not kept, so nothing needs to be JSON.
        Case("returns_an_object", succeeded_state),
        id="a return value that is not JSON is ignored",
    ),
    pytest.param(
        Case("swallows_a_database_error", succeeded_state, {"n": 100}, _atomic_block_undone(100)),
        id="a database error swallowed inside atomic succeeds",
    ),
    pytest.param(
        Case("leaves_a_transaction_open", succeeded_state, {"n": 100}, _rolled_back(100)),
        id="a transaction left open succeeds and its write is rolled back",
    ),
    pytest.param(
        Case("closes_its_connection", succeeded_state),
        id="closing the connection succeeds",
    ),
    pytest.param(
        Case("closes_the_raw_connection", succeeded_state),
        id="closing the raw psycopg connection succeeds",
    ),
    pytest.param(
        Case("raises_base_exception", dead_letter("tests.hostile.NotAnException")),
        id="a BaseException is a dead letter",
    ),
    pytest.param(
        Case("raises_system_exit", dead_letter("SystemExit: 3")),
        id="SystemExit is a dead letter",
    ),
    pytest.param(
        Case("raises_keyboard_interrupt", dead_letter("KeyboardInterrupt")),
        id="KeyboardInterrupt is a dead letter",
    ),
    pytest.param(
        Case("floods", dead_letter("RuntimeError"), {"megabytes": 5}, _bounded_error),
        id="five megabytes of log and error message are a bounded dead letter",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_handler_gets_an_outcome_while_the_worker_serves_other_jobs(
    start_worker, case: Case
):
    # The hostile job first (higher priority), ordinary jobs beside it, more after it.
    hostile = Job.objects.enqueue(f"tests.hostile.{case.task}", case.payload, priority=10)
    beside = record(range(1, 9))
    worker = start_worker(*WORKER)
    wait_while_alive(worker, lambda: case.outcome(state(hostile.pk)), timeout=SETTLE)
    wait_while_alive(worker, lambda: succeeded(beside), timeout=SETTLE)
    after = record(range(9, 13))
    wait_while_alive(worker, lambda: succeeded(after), timeout=SETTLE)
    assert set(Execution.objects.filter(n__in=range(1, 13)).values_list("n", flat=True)) == set(
        range(1, 13)
    )
    wait_while_alive(worker, lambda: not running(), timeout=SETTLE)
    case.then(state(hostile.pk))
    assert worker.alive()


def test_a_handler_that_exits_its_process_is_a_dead_letter_after_its_lease(start_worker):
    # The worker dies with the handler: what must hold is that the job is not left running
    # forever (its lease runs out and, with no attempts left, it is a dead letter) and that the
    # other jobs, those the dead worker held included, are served by the next worker.
    doomed = Job.objects.enqueue("tests.hostile.exits_the_process", priority=10)
    beside = record(range(1, 9))
    first = start_worker(*WORKER)
    assert first.wait(SETTLE) == 1
    second = start_worker(*WORKER)
    wait_while_alive(second, lambda: state(doomed.pk).status == Status.FAILED, timeout=SETTLE)
    assert state(doomed.pk).last_error.startswith("WorkerLost: lease expired")
    wait_while_alive(second, lambda: succeeded(beside), timeout=SETTLE)
    after = record(range(9, 13))
    wait_while_alive(second, lambda: succeeded(after), timeout=SETTLE)
    wait_while_alive(second, lambda: not running(), timeout=SETTLE)
    assert second.alive()


def test_a_logging_filter_that_raises_stops_neither_the_worker_nor_its_jobs(start_worker):
    # Python's logging calls filters outside its guard: the worker's lines (a dead letter's, at
    # ERROR) raise in the thread that logs them, the worker's main thread among them.
    doomed = Job.objects.enqueue("tests.hostile.raises_unprintable", priority=10)
    beside = record(range(1, 9))
    worker = start_worker(*WORKER, env={"PGJOBS_TEST_RAISING_FILTER": "1"})
    wait_while_alive(worker, lambda: state(doomed.pk).status == Status.FAILED, timeout=SETTLE)
    wait_while_alive(worker, lambda: succeeded(beside), timeout=SETTLE)
    after = record(range(9, 13))
    wait_while_alive(worker, lambda: succeeded(after), timeout=SETTLE)
    wait_while_alive(worker, lambda: not running(), timeout=SETTLE)
    assert worker.alive()


@pytest.mark.parametrize("task", ["ticks_to_a_hanging_receiver", "ticks_to_an_exiting_receiver"])
def test_a_periodic_ticks_receiver_holds_up_neither_the_worker_nor_the_schedule(
    start_worker, task: str
):
    # job_enqueued's receivers are sent the ticks' jobs after the tick's commit, on the
    # worker's signals thread: not inside the transaction holding the schedule's row, not on
    # the main thread that keeps every lease.
    per_second = {"tick": {"task": f"tests.hostile.{task}", "cron": "* * * * * *"}}
    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 3 * LEASE}, priority=5)
    beside = record(range(2, 8))
    worker = start_worker(*WORKER, env={"PGJOBS_TEST_PERIODIC": json.dumps(per_second)})
    leases_kept_until(worker, lambda: succeeded([slow.pk, *beside]), timeout=SETTLE)

    ticks = Job.objects.filter(task=f"tests.hostile.{task}", status=Status.SUCCEEDED)
    wait_while_alive(worker, lambda: ticks.count() >= 3, timeout=SETTLE)
    assert state(slow.pk).attempts == 1
    assert worker.alive()


def expired_leases(but: UUID | None = None) -> int:
    """Running jobs whose lease ran out, as any reaper sees them (committed rows only)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pgjobs_job WHERE status = 'running' AND leased_until < now() "
            "AND id IS DISTINCT FROM %s",
            [but],
        )
        return cursor.fetchone()[0]


def leases_kept_until(
    worker: WorkerProcess, predicate: Callable[[], Any], timeout: float, but: UUID | None = None
) -> None:
    """Wait for `predicate` while reaping beside the live worker, as other workers' reapers
    would; fail as soon as one of its running jobs (`but` one) has an expired lease or is
    reaped."""

    def check() -> Any:
        assert expired_leases(but) == 0, "the worker stopped extending its jobs' leases"
        assert Job.objects.reap()[:2] == (0, 0), "a job of the live worker was reaped"
        return predicate()

    wait_while_alive(worker, check, timeout)


def test_a_handler_waiting_on_a_row_lock_does_not_stop_its_worker_heartbeating_the_others(
    start_worker, other_connection
):
    Execution.objects.create(n=500, pid=0)
    with other_connection.transaction():
        other_connection.execute("SELECT 1 FROM tests_execution WHERE n = 500 FOR UPDATE")
        blocked = Job.objects.enqueue("tests.hostile.waits_for_a_row_lock", {"n": 500}, priority=10)
        slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 3 * LEASE}, priority=5)
        beside = record(range(2, 8))
        worker = start_worker(*WORKER)
        # Three leases go by with the handler waiting and the slow job running.
        leases_kept_until(worker, lambda: succeeded([slow.pk, *beside]), timeout=SETTLE)
        assert state(blocked.pk).status == Status.RUNNING  # still waiting for the lock
    wait_while_alive(worker, lambda: state(blocked.pk).status == Status.SUCCEEDED, timeout=SETTLE)
    assert Execution.objects.filter(n=501).exists()
    assert state(slow.pk).attempts == 1
    assert not running()


def test_a_finished_jobs_row_locked_by_another_session_holds_back_its_outcome_alone(
    start_worker, other_connection
):
    # An operator's open transaction on a running job's row: its outcome waits for the row;
    # the worker's other outcomes and claims do not (they waited with it, turn after turn).
    locked = Job.objects.enqueue("tests.tasks.record", {"n": 100, "seconds": 0.5}, priority=10)
    worker = start_worker(*WORKER)
    wait_while_alive(worker, lambda: state(locked.pk).status == Status.RUNNING, timeout=SETTLE)
    with other_connection.transaction():
        other_connection.execute("SELECT 1 FROM pgjobs_job WHERE id = %s FOR UPDATE", [locked.pk])
        time.sleep(2)  # its handler has finished (0.5 s): its outcome waits for the row
        beside = record(range(1, 9))
        leases_kept_until(worker, lambda: succeeded(beside), timeout=SETTLE, but=locked.pk)
        assert state(locked.pk).status == Status.RUNNING
    wait_while_alive(worker, lambda: succeeded([locked.pk]), timeout=SETTLE)
    assert state(locked.pk).attempts == 1
    wait_while_alive(worker, lambda: not running(), timeout=SETTLE)
    assert "the rows of 1 finished jobs are locked by another session" in worker.log()


def test_a_handler_locking_its_own_job_row_does_not_stop_its_worker_heartbeating_the_others(
    start_worker,
):
    locking = Job.objects.enqueue(
        "tests.hostile.locks_its_own_job_row", {"seconds": 5 * LEASE}, priority=10
    )
    slow = Job.objects.enqueue("tests.tasks.record", {"n": 1, "seconds": 3 * LEASE}, priority=5)
    beside = record(range(2, 8))
    worker = start_worker(*WORKER)
    # While the handler holds its lock, the other jobs keep their leases and are served (its own
    # lease may run out meanwhile: no reaper can take a row that is locked).
    leases_kept_until(worker, lambda: succeeded([slow.pk, *beside]), timeout=SETTLE, but=locking.pk)
    assert state(locking.pk).status == Status.RUNNING
    wait_while_alive(worker, lambda: succeeded([locking.pk]), timeout=SETTLE)
    assert state(slow.pk).attempts == 1
    assert not running()


@pytest.mark.parametrize("task", ["leaves_a_thread_behind", "leaves_a_pool_behind"])
def test_a_thread_a_handler_leaves_behind_does_not_keep_its_worker_from_exiting(
    start_worker, task: str
):
    # Python's exit waits for every thread that is not a daemon, and for the threads of every
    # concurrent.futures pool: a handler's left-behind thread kept a stopped worker's process
    # alive for good (a supervisor never replaced it; `runjobs --once` never ended).
    job = Job.objects.enqueue(f"tests.hostile.{task}")
    worker = start_worker(*WORKER)
    wait_while_alive(worker, lambda: succeeded([job.pk]), timeout=SETTLE)
    worker.signal(signal.SIGTERM)
    assert worker.wait(SETTLE) == 0
    assert "still running after its worker stopped" in worker.log()
    assert "left behind" in worker.log()
    assert "event loops" not in worker.log()  # no async handler ran: none is said to linger

    once = start_worker("--once", *WORKER)
    again = Job.objects.enqueue(f"tests.hostile.{task}")
    assert once.wait(SETTLE) == 0
    assert succeeded([again.pk])


def test_a_fork_a_handler_returns_in_ends_there(start_worker, tmp_path):
    # The child went back to the worker's handler thread code, waited for jobs for good and kept
    # the worker's sockets: its LISTEN session outlived the worker, and once that session's
    # socket buffer filled, the cluster's notification queue could no longer advance.
    path = tmp_path / "child.pid"
    job = Job.objects.enqueue("tests.hostile.forks_and_returns", {"path": str(path)})
    worker = start_worker(*WORKER)
    wait_while_alive(worker, lambda: succeeded([job.pk]) and path.exists(), timeout=SETTLE)
    child = int(wait_until(path.read_text, timeout=SETTLE))

    def ended() -> bool:  # gone, or a zombie its parent has not waited for
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            return True
        return stat.rsplit(")", 1)[1].split()[0] == "Z"

    wait_until(ended, timeout=SETTLE)
    assert worker.alive()
