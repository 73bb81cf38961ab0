"""The process model as real processes: runjobs --processes N (a supervisor and its children),
time limits, --max-jobs-per-child, --max-memory-per-child and --reload, with real signals.

Children of a supervisor run in their own session, so every test kills what a supervisor left
behind by pid at teardown (see `runjobs`). Times that the tests measure are printed (pytest -s,
or in the captured output of a failure) as "measured: ...".
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from django_pgjobs.errors import JobTimeout
from django_pgjobs.models import Job
from django_pgjobs.runtime.execute import exception_path
from django_pgjobs.runtime.lifecycle import Exit
from django_pgjobs.status import Status
from tests.conftest import wait_until
from tests.crash.conftest import WorkerProcess
from tests.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

RECORD = "tests.tasks.record"
HANGS = "tests.process_tasks.hangs"  # @task(timeout=2, max_attempts=2), never returns
TIMEOUT = 2.0
JOB_TIMEOUT = exception_path(JobTimeout)


def measured(what: str, seconds: float) -> None:
    sys.stdout.write(f"measured: {what}: {seconds:.2f} s\n")


# ---- processes, from /proc ----------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, parent = text.rsplit(")", 1)[1].split()[:2]
    return int(parent), state


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] != "Z"


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children_of(pid: int) -> list[int]:
    """The live child processes of `pid`, oldest first."""
    return sorted(
        child for child in _pids() if (stat := _stat(child)) and stat[0] == pid and stat[1] != "Z"
    )


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def option(pid: int, name: str) -> str | None:
    """The value after `name` on a process's command line."""
    line = command_line(pid)
    return line[line.index(name) + 1] if name in line[:-1] else None


def supervised_by(pids: set[int]) -> set[int]:
    """Live runjobs children whose --supervised-by names one of `pids` (orphans included)."""
    return {
        pid
        for pid in _pids()
        if alive(pid) and (parent := option(pid, "--supervised-by")) and int(parent) in pids
    }


@pytest.fixture
def runjobs(transactional_db: None, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """runjobs(*args, env={...}) -> WorkerProcess. At teardown each is killed with everything it
    started (a supervisor's children live in their own session; a dead supervisor's are
    orphans), and the end of its log is shown."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        process = WorkerProcess(list(args), tmp_path / f"runjobs-{len(started)}.log", env)
        started.append(process)
        return process

    yield start
    for process in started:
        family = {process.pid, *descendants(process.pid)}
        process.kill()  # first, so that a supervisor starts no more children
        stray = (family | supervised_by(family)) - {process.pid}
        for pid in stray:
            if alive(pid) and command_line(pid):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(pid) for pid in stray), timeout=10)  # noqa: B023
        sys.stderr.write(f"--- {process.log_path.name} ---\n{process.log()[-4000:]}\n")


# ---- the ledger and the jobs --------------------------------------------------------------------


def statuses() -> Counter[str]:
    return Counter(Job.objects.values_list("status", flat=True))


def runs() -> Counter[int]:
    return Counter(Execution.objects.values_list("n", flat=True))


def ledger_pids() -> set[int]:
    return set(Execution.objects.values_list("pid", flat=True))


def running_of(worker: str) -> set[object]:
    return set(
        Job.objects.filter(status=Status.RUNNING, worker=worker).values_list("pk", flat=True)
    )


def serving(supervisor: WorkerProcess, count: int) -> Callable[[], list[int]]:
    """`count` children of the supervisor, each of which has run a job (an empty list until)."""

    def check() -> list[int]:
        children = children_of(supervisor.pid)
        if len(children) == count and set(children) <= ledger_pids():
            return children
        return []

    return check


def steady(supervisor: WorkerProcess, count: int) -> Callable[[], set[int]]:
    """`count` live children, each past its start-up (it logged that its worker started) and
    none on its way out to be replaced (an empty set until then)."""

    def check() -> set[int]:
        live = set(children_of(supervisor.pid))
        log = supervisor.log()
        ids = [option(pid, "--worker-id") for pid in live]
        up = all(f"worker {id} started: " in log and f"worker {id} stops" not in log for id in ids)
        return live if len(live) == count and up else set()

    return check


def started_at(n: int) -> list[datetime]:
    """When each execution of ledger row n started (the handler writes its row first)."""
    return list(Execution.objects.filter(n=n).order_by("at").values_list("at", flat=True))


def overlaps(starts: list[datetime], seconds: float) -> int:
    """The most of these `seconds`-long executions that ran at one moment."""
    ordered = sorted(starts)
    return max(
        (
            sum(1 for other in ordered if 0 <= (at - other).total_seconds() < seconds)
            for at in ordered
        ),
        default=0,
    )


# ---- 1. a child killed mid-batch ----------------------------------------------------------------


def test_a_child_killed_mid_batch_is_replaced_and_its_jobs_are_taken_back_at_once(runjobs):
    count = 2000
    Job.objects.bulk_enqueue(RECORD, ({"n": n, "seconds": 0.005} for n in range(count)))
    # A lease of 60 s: a job back within seconds was taken back, not reaped.
    supervisor = runjobs("--processes", "3", "--concurrency", "4", "--lease", "60")
    first = wait_until(serving(supervisor, 3), timeout=60)
    victim = max(first, key=lambda pid: len(running_of(option(pid, "--worker-id") or "")))
    victim_id = option(victim, "--worker-id")
    assert victim_id and victim_id.startswith(f"{os.uname().nodename[:150]}:{supervisor.pid}:")
    assert re.fullmatch(r"[^/]+/[0-2]", victim_id)  # its slot

    # Freeze it, and read what it holds once its last statement is through (the holdings stay
    # the same for two reads in a row).
    os.kill(victim, signal.SIGSTOP)
    wait_until(lambda: (_stat(victim) or (0, ""))[1] == "T", timeout=10)
    previous: list[set[object]] = [set()]

    def unchanged() -> set[object]:
        now = running_of(victim_id)
        same, previous[0] = now == previous[0], now
        return now if same else set()

    held = wait_until(unchanged, timeout=10, interval=0.2)
    assert statuses()[Status.SUCCEEDED] < count - 500  # mid-batch: plenty left to do
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()

    wait_until(lambda: not running_of(victim_id), timeout=30, interval=0.01)
    back = time.monotonic() - killed
    replacement = wait_until(
        lambda: [pid for pid in children_of(supervisor.pid) if pid not in first], timeout=30
    )[0]
    spawned = time.monotonic() - killed
    wait_until(lambda: replacement in ledger_pids(), timeout=30, interval=0.01)
    served = time.monotonic() - killed
    measured("the killed child's jobs ready again after", back)
    measured("a new child process started after", spawned)
    measured("the new child ran its first job after", served)
    assert back < 3  # taken back by the supervisor: the lease (60 s) had nowhere near expired
    assert served < 10

    wait_until(lambda: statuses()[Status.SUCCEEDED] == count, timeout=120)
    assert statuses() == {Status.SUCCEEDED: count}  # none running, none failed
    executed = runs()
    assert set(executed) == set(range(count))  # every job of the ledger ran
    # Only the attempts the dead child held ran twice (at least once, not more otherwise).
    again = {n for n, times in executed.items() if times > 1}
    held_n = {job.payload["n"] for job in Job.objects.filter(pk__in=held)}
    assert again <= held_n
    lost = f"worker process {victim} was killed by signal 9"
    recorded = [
        job for job in Job.objects.all() if any(e["type"] == "WorkerLost" for e in job.errors)
    ]
    assert {job.pk for job in recorded} == held
    for job in recorded:
        [entry] = [e for e in job.errors if e["type"] == "WorkerLost"]
        assert (entry["message"], entry["worker"]) == (lost, victim_id)
        assert job.last_error == f"WorkerLost: {lost}"
    assert f"took back {len(held)} jobs of {victim_id}" in supervisor.log()
    assert set(children_of(supervisor.pid)) == (set(first) - {victim}) | {replacement}

    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0


def test_a_lock_on_the_job_table_holds_up_neither_restarts_nor_the_stop_of_a_supervisor(
    runjobs, other_connection
):
    # Taking back a dead child's jobs waited for any lock on their rows or the table (an
    # application's open transaction, a migration) with the supervisor's loop: no child was
    # restarted and SIGTERM went unheeded for as long as the lock was held.
    job = Job.objects.enqueue(RECORD, {"n": 1, "seconds": 60})
    supervisor = runjobs("--processes", "2", "--concurrency", "1", "--lease", "60", "--grace", "2")
    wait_until(steady(supervisor, 2), timeout=60)
    holder = wait_until(lambda: Job.objects.get(pk=job.pk).worker, timeout=30)
    (child,) = [pid for pid in children_of(supervisor.pid) if option(pid, "--worker-id") == holder]
    with other_connection.transaction():
        other_connection.execute("LOCK TABLE pgjobs_job IN SHARE MODE")
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: child not in children_of(supervisor.pid), timeout=30)
        replaced = wait_until(steady(supervisor, 2), timeout=30)
        assert f"could not take back the jobs of {holder}" in supervisor.log()
    assert Job.objects.get(pk=job.pk).status == Status.RUNNING  # its lease brings it back
    assert child not in replaced
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0


# ---- 2. a handler that never returns, past its time limit ---------------------------------------


def _timed_out_by_policy(job: Job, lease: float) -> list[float]:
    """The job failed after two attempts, each recorded as JobTimeout within timeout + lease of
    its start; returns how long each attempt ran before it was recorded."""
    job.refresh_from_db()
    assert (job.status, job.attempts) == (Status.FAILED, 2)
    assert [e["type"] for e in job.errors] == [JOB_TIMEOUT, JOB_TIMEOUT]
    assert job.errors[0]["message"] == f"the attempt ran longer than its time limit of {TIMEOUT:g}s"
    starts = started_at(job.payload["n"])
    assert len(starts) == 2
    took = [
        (datetime.fromisoformat(entry["at"]) - start).total_seconds()
        for entry, start in zip(job.errors, starts, strict=True)
    ]
    # (the ledger row is written just after the clock starts)
    assert all(TIMEOUT - 0.2 <= seconds < TIMEOUT + lease for seconds in took), took
    return took


def test_a_hung_handler_is_timed_out_by_policy_and_its_worker_keeps_two_threads(runjobs):
    hung = Job.objects.enqueue(HANGS, {"n": -1})
    short = 16
    Job.objects.bulk_enqueue(RECORD, ({"n": n, "seconds": 0.5} for n in range(short)))
    worker = runjobs("--concurrency", "2", "--lease", "10")
    wait_until(lambda: Job.objects.get(pk=hung.pk).status == Status.FAILED, timeout=60)
    took = _timed_out_by_policy(hung, lease=10)
    for seconds in took:
        measured("a hung attempt recorded as JobTimeout after", seconds)

    # The short jobs (due before the hung job's retry) all ran, once each, and after the first
    # attempt was abandoned they ran two at a time: its thread was replaced.
    assert statuses() == {Status.SUCCEEDED: short, Status.FAILED: 1}
    executed = runs()
    assert {n: executed[n] for n in range(short)} == dict.fromkeys(range(short), 1)
    abandoned = datetime.fromisoformat(hung.errors[0]["at"])
    after = list(Execution.objects.filter(n__gte=0, at__gt=abandoned).values_list("at", flat=True))
    assert len(after) >= 6
    assert overlaps(after, 0.5) == 2
    # The second abandoned thread (never returning) made as many as it has threads: it stops
    # gracefully to be replaced.
    assert worker.wait(30) == Exit.RECYCLE
    assert "abandoned past their time limit" in worker.log()
    assert not Job.objects.filter(status=Status.RUNNING).exists()


def test_hung_handlers_under_a_supervisor_are_timed_out_and_the_short_jobs_keep_flowing(runjobs):
    hung = [Job.objects.enqueue(HANGS, {"n": -n}) for n in (1, 2)]
    short = 40
    Job.objects.bulk_enqueue(RECORD, ({"n": n, "seconds": 0.5} for n in range(short)))
    began = time.monotonic()
    supervisor = runjobs("--processes", "2", "--concurrency", "2", "--lease", "10")
    wait_until(lambda: statuses() == {Status.SUCCEEDED: short, Status.FAILED: 2}, timeout=90)
    measured("40 short jobs and 2 hung ones (2 × 2 s each) done, from start, after",
             time.monotonic() - began)  # fmt: skip
    for job in hung:
        for seconds in _timed_out_by_policy(job, lease=10):
            measured("a hung attempt recorded as JobTimeout after", seconds)
    executed = runs()
    assert {n: executed[n] for n in range(short)} == dict.fromkeys(range(short), 1)
    first_abandoned = min(datetime.fromisoformat(job.errors[0]["at"]) for job in hung)
    after = list(
        Execution.objects.filter(n__gte=0, at__gt=first_abandoned).values_list("at", flat=True)
    )
    sys.stdout.write(f"measured: most short jobs at once after a timeout: {overlaps(after, 0.5)}\n")
    assert overlaps(after, 0.5) >= 3  # more than one process's worth: capacity came back
    assert supervisor.alive()
    wait_until(steady(supervisor, 2), timeout=30)  # a recycled child's replacement is up
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    assert not Job.objects.filter(status=Status.RUNNING).exists()


# ---- 3. --max-jobs-per-child --------------------------------------------------------------------


def test_children_are_replaced_after_max_jobs_and_every_job_runs_exactly_once(runjobs):
    count = 500
    Job.objects.bulk_enqueue(RECORD, ({"n": n} for n in range(count)))
    supervisor = runjobs(
        "--processes", "2", "--concurrency", "4", "--max-jobs-per-child", "50", "--lease", "60"
    )
    wait_until(lambda: statuses() == {Status.SUCCEEDED: count}, timeout=90)
    assert runs() == Counter(range(count))  # each exactly once: nothing lost, nothing doubled
    # The children that recorded their 50th outcome at the very end are replaced too: wait
    # until the supervisor runs two children again, both up (see the test below on a
    # SIGTERM that reaches a child still starting).
    live = wait_until(steady(supervisor, 2), timeout=30)
    replaced = re.compile(r"worker process (\d+) exited to be replaced")
    recycled = {int(pid) for pid in replaced.findall(supervisor.log())}
    per_pid = Counter(Execution.objects.values_list("pid", flat=True))
    sys.stdout.write(f"measured: jobs per child process: {sorted(per_pid.values())}\n")
    assert len(per_pid) >= 6  # 500 / (50 + what was in flight) children at least
    assert set(per_pid) <= recycled | live
    assert all(per_pid[pid] >= 50 for pid in recycled)  # each recorded its 50 before it went
    assert "killed by signal" not in supervisor.log()
    assert "exited with code" not in supervisor.log()
    assert supervisor.alive()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    assert not any(alive(pid) for pid in live)


def test_a_worker_over_max_memory_exits_to_be_replaced(runjobs):
    Job.objects.enqueue(RECORD, {"n": 1})
    worker = runjobs("--max-memory-per-child", "1")  # 1 MB: any Python process is over it
    wait_until(worker.started, timeout=30)
    assert worker.wait(10) == Exit.RECYCLE  # checked every second
    log = worker.log()
    # Over it before its first job: replaced then, it would have started as large, again and
    # again, and run nothing. It runs the job first, saying so.
    assert "before its first job ended, over --max-memory-per-child 1" in log
    assert "stops to be replaced: it uses" in log
    assert runs() == {1: 1}


def test_children_stop_when_their_supervisor_is_killed(runjobs):
    supervisor = runjobs("--processes", "2")
    wait_until(lambda: supervisor.log().count(" started: ") == 2, timeout=60)
    children = children_of(supervisor.pid)
    assert len(children) == 2
    supervisor.signal(signal.SIGKILL)
    supervisor.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in children), timeout=6)


# ---- 4. --reload --------------------------------------------------------------------------------

RELOADABLE = "VERSION = {version}\n"


def test_reload_restarts_the_worker_when_a_module_changes_and_runs_the_new_code(runjobs, tmp_path):
    # A module on the workers' PYTHONPATH that tests/process_tasks.py imports (so Django's
    # autoreloader watches it); tests.process_tasks.stamp_version reads its VERSION.
    folder = tmp_path / "reloadable"
    folder.mkdir()
    module = folder / "pgjobs_reloadable.py"
    module.write_text(RELOADABLE.format(version=1))
    env = {
        "PYTHONPATH": str(folder),
        "PGJOBS_TEST_RELOADABLE": "pgjobs_reloadable",
        "PYTHONDONTWRITEBYTECODE": "1",  # no .pyc whose timestamp could hide the change
        "DJANGO_SETTINGS_MODULE": "tests.process_settings",  # the reloader's debug log
    }
    worker = runjobs("--reload", env=env)
    Job.objects.enqueue("tests.process_tasks.stamp_version", {"n": 1})
    wait_until(lambda: Execution.objects.filter(n=1001).exists(), timeout=60)
    [first] = children_of(worker.pid)  # the reloader's child runs the worker
    assert Execution.objects.get(n=1001).pid == first
    # A change is one against the reloader's first look at the file: wait for that look.
    wait_until(lambda: f"File {module} first seen" in worker.log(), timeout=30)

    module.write_text(RELOADABLE.format(version=2))
    later = time.time() + 2
    os.utime(module, (later, later))  # newer than what the reloader saw, whatever the clock
    changed = time.monotonic()
    wait_until(lambda: worker.log().count(" started: ") >= 2, timeout=30)
    measured("the worker restarted after the module changed, after", time.monotonic() - changed)
    Job.objects.enqueue("tests.process_tasks.stamp_version", {"n": 2})
    wait_until(lambda: Execution.objects.filter(n__in=[1002, 2002]).exists(), timeout=60)
    assert Execution.objects.get(n__in=[1002, 2002]).n == 2002  # the new code ran it
    [second] = children_of(worker.pid)
    assert second != first and not alive(first)
    assert Execution.objects.get(n=2002).pid == second
    # The handler's row is written before its outcome is recorded (at the worker's next turn).
    wait_until(lambda: statuses() == {Status.SUCCEEDED: 2}, timeout=30)
    # (Stopping it is left to the teardown: see the two tests below.)


def test_runjobs_reload_exits_promptly_on_sigterm(runjobs):
    # With nothing running, well within the grace: about 2 s here (the autoreloader looks at
    # its files once a second); CI's load once made it more than 5.
    worker = runjobs("--reload", "--grace", "60")
    wait_until(worker.started, timeout=60)
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0


def test_sigterm_to_runjobs_reload_lets_the_running_job_finish(runjobs):
    job = Job.objects.enqueue(RECORD, {"n": 1, "seconds": 2})
    worker = runjobs("--reload", "--lease", "60")
    wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=60)
    [child] = children_of(worker.pid)
    worker.signal(signal.SIGTERM)
    wait_until(lambda: not alive(child), timeout=20)
    assert "stopped" in worker.log()
    assert "SIGTERM: stopping; running jobs get" in worker.log()  # as without --reload
    assert Job.objects.get(pk=job.pk).status == Status.SUCCEEDED


SCRATCH_SETTINGS = """\
from tests.process_settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "pgjobs_scratch"]  # noqa: F405
"""
SCRATCH_TASKS = """\
from django_pgjobs import task


@task
def noop() -> None:
    pass
"""
BROKEN_TASKS = SCRATCH_TASKS.replace("noop()", "noop(")  # a SyntaxError


def scratch_app(folder: Path, **modules: str) -> dict[str, str]:
    """An app, pgjobs_scratch, with these modules (tasks="...", models="...") in `folder`, and
    settings of its own there that install it: the environment of a runjobs that runs it.
    Django's autoreloader watches its modules, and logs what it watches."""
    app = folder / "pgjobs_scratch"
    app.mkdir()
    (app / "__init__.py").write_text("")
    for name, text in modules.items():
        (app / f"{name}.py").write_text(text)
    (folder / "pgjobs_scratch_settings.py").write_text(SCRATCH_SETTINGS)
    return {
        "PYTHONPATH": str(folder),
        "PYTHONDONTWRITEBYTECODE": "1",  # no .pyc whose timestamp could hide a change
        "DJANGO_SETTINGS_MODULE": "pgjobs_scratch_settings",
    }


def rewrite(module: Path, text: str) -> None:
    """Write `module` anew, dated after what the reloader saw of it, whatever the clock."""
    later = max(time.time(), module.stat().st_mtime) + 2
    module.write_text(text)
    os.utime(module, (later, later))


def waits_saying_it_once(worker: WorkerProcess, job: Job, error: str, line: str) -> None:
    """The reloading runjobs whose code cannot start said `error` (with `line`) once and waits,
    running no worker: its reloader looks every second, so a loop of restarts would show
    within these few seconds."""
    time.sleep(3)
    assert worker.alive()
    log = worker.log()
    assert log.count(error) == 1, log[-3000:]
    assert log.count(line) == 1, log[-3000:]
    assert Job.objects.get(pk=job.pk).status == Status.READY


def stops_cleanly(worker: WorkerProcess) -> None:
    worker.signal(signal.SIGTERM)
    assert worker.wait(20) == 0
    assert "without recording or releasing" not in worker.log()


def test_reload_waits_through_a_syntax_error_in_a_tasks_module_and_starts_once_fixed(
    runjobs, tmp_path
):
    env = scratch_app(tmp_path, tasks=BROKEN_TASKS)
    tasks = tmp_path / "pgjobs_scratch" / "tasks.py"
    job = Job.objects.enqueue(RECORD, {"n": 1})
    worker = runjobs("--reload", env=env)
    # The reloader watches the file the error came from: a fix is a change against its first look.
    wait_until(lambda: f"File {tasks} first seen" in worker.log(), timeout=60)
    waits_saying_it_once(worker, job, "SyntaxError", "runjobs could not start")

    rewrite(tasks, SCRATCH_TASKS)
    wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=60)
    stops_cleanly(worker)


def test_sigterm_to_runjobs_reload_waiting_through_an_error_exits_0(runjobs, tmp_path):
    worker = runjobs("--reload", env=scratch_app(tmp_path, tasks=BROKEN_TASKS))
    wait_until(lambda: "runjobs could not start" in worker.log(), timeout=60)
    stops_cleanly(worker)


def test_without_reload_a_syntax_error_in_a_tasks_module_fails_at_once(runjobs, tmp_path):
    worker = runjobs(env=scratch_app(tmp_path, tasks=BROKEN_TASKS))
    assert worker.wait(60) != 0
    assert "SyntaxError" in worker.log()


def test_reload_waits_through_a_syntax_error_saved_while_it_runs(runjobs, tmp_path):
    env = scratch_app(tmp_path, tasks=SCRATCH_TASKS)
    tasks = tmp_path / "pgjobs_scratch" / "tasks.py"
    worker = runjobs("--reload", env=env)
    wait_until(worker.started, timeout=60)
    wait_until(lambda: f"File {tasks} first seen" in worker.log(), timeout=30)

    rewrite(tasks, BROKEN_TASKS)
    # The worker restarted, could not start, and its reloader took its first look at the file.
    wait_until(lambda: worker.log().count(f"File {tasks} first seen") == 2, timeout=30)
    job = Job.objects.enqueue(RECORD, {"n": 1})
    waits_saying_it_once(worker, job, "SyntaxError", "runjobs could not start")

    rewrite(tasks, SCRATCH_TASKS)
    wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=60)
    stops_cleanly(worker)


def test_reload_waits_through_an_error_django_meets_as_it_sets_up(runjobs, tmp_path):
    # An app's models module is imported by Django's setup, before runjobs runs at all.
    env = scratch_app(tmp_path, models="")
    models = tmp_path / "pgjobs_scratch" / "models.py"
    worker = runjobs("--reload", env=env)
    wait_until(worker.started, timeout=60)
    wait_until(lambda: f"File {models} first seen" in worker.log(), timeout=30)

    rewrite(models, "import pgjobs_scratch.missing\n")
    wait_until(lambda: "runjobs exited with status 1" in worker.log(), timeout=30)
    job = Job.objects.enqueue(RECORD, {"n": 1})
    waits_saying_it_once(worker, job, "ModuleNotFoundError", "runjobs exited with status 1")

    rewrite(models, "")
    wait_until(lambda: Execution.objects.filter(n=1).exists(), timeout=60)
    stops_cleanly(worker)


# ---- 5. SIGTERM to a supervisor -----------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_supervisor_lets_every_childs_running_jobs_finish_and_exits_zero(
    runjobs, signum
):
    # SIGINT: what Ctrl-C sends the supervisor alone (its children have their own session); it
    # passes SIGTERM on.
    Job.objects.bulk_enqueue(RECORD, ({"n": n, "seconds": 1.5} for n in range(12)))
    supervisor = runjobs("--processes", "2", "--concurrency", "2", "--grace", "30")
    children = wait_until(serving(supervisor, 2), timeout=60)
    running = set(Job.objects.filter(status=Status.RUNNING).values_list("pk", flat=True))
    assert running
    supervisor.signal(signum)
    signalled = time.monotonic()
    assert supervisor.wait(30) == 0
    measured(f"the supervisor exited after {signum.name}, after", time.monotonic() - signalled)
    assert not any(alive(pid) for pid in children)
    assert not Job.objects.filter(status=Status.RUNNING).exists()
    # What had started finished (none released half-run); the rest is ready, untouched.
    executed = runs()
    assert set(executed.values()) == {1}
    done = Job.objects.filter(status=Status.SUCCEEDED)
    assert {job.payload["n"] for job in done} == set(executed)
    assert running <= {job.pk for job in done}
    rest = Job.objects.exclude(status=Status.SUCCEEDED)
    assert {(job.status, job.attempts) for job in rest} <= {(Status.READY, 0)}
    assert len(executed) + rest.count() == 12


def test_a_second_sigterm_to_the_supervisor_releases_the_running_jobs_at_once(runjobs):
    Job.objects.bulk_enqueue(RECORD, ({"n": n, "seconds": 60} for n in range(2)))
    supervisor = runjobs("--processes", "2", "--concurrency", "1", "--grace", "60")
    wait_until(serving(supervisor, 2), timeout=60)
    supervisor.signal(signal.SIGTERM)
    time.sleep(0.5)  # inside the grace period: still waiting for the jobs
    assert supervisor.alive()
    supervisor.signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert supervisor.wait(15) == 0
    measured("the supervisor exited after a second SIGTERM, after", time.monotonic() - signalled)
    assert {(job.status, job.attempts) for job in Job.objects.all()} == {(Status.READY, 0)}


def test_sigterm_to_a_supervisor_whose_children_are_still_starting_exits_zero(runjobs):
    supervisor = runjobs("--processes", "2")
    wait_until(lambda: len(children_of(supervisor.pid)) == 2, timeout=30, interval=0.01)
    assert " started: " not in supervisor.log()  # no worker is up yet: Django is loading
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0


def test_a_child_that_cannot_act_on_sigterm_is_killed_and_the_supervisor_stops(runjobs):
    # The supervisor only ever sent SIGTERM again: one child that could not act on it (stopped,
    # frozen) kept `runjobs --processes` running for as long as that lasted, saying nothing.
    job = Job.objects.enqueue(RECORD, {"n": 1, "seconds": 60})
    supervisor = runjobs("--processes", "2", "--concurrency", "1", "--lease", "60", "--grace", "1")
    wait_until(steady(supervisor, 2), timeout=60)
    holder = wait_until(lambda: Job.objects.get(pk=job.pk).worker, timeout=30)
    (frozen,) = [pid for pid in children_of(supervisor.pid) if option(pid, "--worker-id") == holder]
    os.kill(frozen, signal.SIGSTOP)
    supervisor.signal(signal.SIGTERM)
    # Its grace and KILL_MARGIN (20 s), and time for a loaded machine.
    assert supervisor.wait(40) == 1  # not a clean stop: a child had to be killed
    assert f"worker process {frozen} did not stop when asked" in supervisor.log()
    assert f"took back 1 jobs of {holder}" in supervisor.log()
    assert Job.objects.get(pk=job.pk).status == Status.READY


# ---- a crash loop -------------------------------------------------------------------------------


def test_a_job_that_kills_its_worker_is_dead_lettered_and_the_supervisor_serves_on(runjobs):
    # Its deaths counted towards the supervisor's crash limit (5 in 60 s) and, taken back due at
    # once, it was taken by the next child at once: the supervisor gave up after six, the job
    # left ready with attempts to spare, instead of the dead letter the docs promise.
    poison = Job.objects.enqueue("tests.process_tasks.kills_its_worker")  # max_attempts=7
    supervisor = runjobs("--processes", "2", "--lease", "60")
    wait_until(lambda: Job.objects.get(pk=poison.pk).status == Status.FAILED, timeout=120)
    job = Job.objects.get(pk=poison.pk)
    assert job.attempts == 7
    assert job.last_error.startswith("WorkerLost: worker process")
    Job.objects.enqueue(RECORD, {"n": 1})
    wait_until(lambda: runs() == {1: 1}, timeout=60)  # it serves on
    assert "stopping them all" not in supervisor.log()
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0


def test_a_child_that_exits_unasked_has_its_jobs_taken_back_at_once(runjobs):
    # Status 0 nobody asked for: replaced without a word, its running job left to its lease.
    job = Job.objects.enqueue("tests.process_tasks.ends_its_worker_cleanly")  # max_attempts=2
    supervisor = runjobs("--processes", "2", "--lease", "60")
    wait_until(lambda: Job.objects.get(pk=job.pk).status == Status.FAILED, timeout=60)
    log = supervisor.log()
    assert "exited (code 0) though nobody asked it to" in log
    assert "WorkerLost: worker process" in Job.objects.get(pk=job.pk).last_error
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0


CRASHING = {"PGJOBS_TEST_CRASH_CHILDREN": "1"}  # children exit(3) while Django sets up


def test_children_that_keep_dying_make_the_supervisor_give_up_with_a_non_zero_exit(runjobs):
    supervisor = runjobs("--processes", "3", env=CRASHING)
    began = time.monotonic()
    code = supervisor.wait(90)
    measured("the supervisor gave up after", time.monotonic() - began)
    assert code not in (0, None)
    log = supervisor.log()
    # The first five each restarted after a longer pause, the sixth made it give up.
    assert log.count("exited with code 3; starting another in") == 5
    assert "worker processes died 6 times in 60s; stopping them all" in log
    assert not supervised_by({supervisor.pid})


def test_a_supervisor_that_gives_up_does_not_blame_unreleased_jobs(runjobs):
    supervisor = runjobs("--processes", "3", env=CRASHING)
    assert supervisor.wait(90) != 0
    assert "stopped without recording or releasing every job it held" not in supervisor.log()


def test_a_supervisor_gives_the_start_up_warnings_once_for_all_its_children(runjobs):
    supervisor = runjobs("--processes", "2", "--queue", "emial", "--lease", "3")
    wait_until(lambda: supervisor.log().count(" started: ") == 2, timeout=60)
    supervisor.signal(signal.SIGTERM)
    assert supervisor.wait(30) == 0
    log = supervisor.log()
    assert log.count("the queue 'emial', served by the workers of supervisor ") == 1, log
    assert log.count("no running worker serves the queue 'emails'") == 1, log
    assert log.count("--lease 3 is under 10s") == 1, log
