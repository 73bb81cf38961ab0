"""Job.objects: the one seam through which every job changes state.

Each transition is one short statement guarded so it changes only what it should, and returns
what it changed; the statements themselves are in data/sql.py. The runtime decides *when*, this
module decides *how*.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.apps import apps
from django.db import connections, models, router, transaction

from django_pgjobs import batches, signals
from django_pgjobs import limits as limits_module
from django_pgjobs.conf import get_settings
from django_pgjobs.data import enqueue, rows, sql
from django_pgjobs.data.queryset import JobQuerySet
from django_pgjobs.data.records import (
    Claim,
    FailedAttempt,
    Failure,
    Keyed,
    Position,
    Settled,
    TakenBack,
    as_claim,
)
from django_pgjobs.errors import EnqueueError
from django_pgjobs.limits import LOCK_CLASS, TaskLimits
from django_pgjobs.status import FINISHED, HOLDS_KEY, Status
from django_pgjobs.validation import json_text

if TYPE_CHECKING:
    from django_pgjobs.models import Batch, Job
    from django_pgjobs.registry import Task

logger = logging.getLogger(__name__)

#: How often enqueue looks for the job holding its unique_key before giving up.
ENQUEUE_TRIES = 5
#: The most keys one claim of limited jobs looks at (with room or not): keys at their limit are
#: passed over, so a key with room behind hundreds of full ones is reached in one claim.
SCAN_KEYS = 200

#: What JobManager.write_back says besides a status: the job's row exists already.
WRITTEN, IN_OUTBOX = "written", "in outbox"

#: The error a reaped attempt records.
LEASE_EXPIRED = Failure(
    "WorkerLost", "lease expired: the worker holding the job died, hung or lost its connection"
)


# Where a settled job's status and claim are in a row of sql.SETTLE_AND_CLAIM (after its kind).
_STATUS = 1 + sql.JOB_COLUMNS.index("status")
_CLAIMS = 1 + sql.JOB_COLUMNS.index("claims")
_BATCH = 1 + sql.JOB_COLUMNS.index("batch_id")


class JobManager(models.Manager.from_queryset(JobQuerySet)):  # type: ignore[misc]
    """Job.objects: the seam through which every job changes state."""

    # ---- enqueue -----------------------------------------------------------------------------

    def enqueue(
        self,
        task: Task | str,
        payload: dict[str, Any] | None = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        unique_key: str | None = None,
        after: Any = None,
        announce: bool = True,
    ) -> Job:
        """Write one job in the caller's transaction (one INSERT on the caller's connection).

        With a `unique_key` that a ready or running job already holds, nothing is written and
        that job is returned instead. `after`: jobs and batches (or their ids) the job waits
        for: it is ready once they have all succeeded (batches.py). `announce=False`: no
        job_enqueued signal.
        """
        if after is not None and unique_key is not None:
            raise EnqueueError(
                "after= with unique_key=: a waiting job holds no key. Enqueue it without "
                "unique_key, or give the key to the jobs it waits for."
            )
        waits_for = None if after is None else batches.targets(after)
        job = enqueue.new_job(
            task, payload, queue=queue, priority=priority, run_at=run_at, delay=delay,
            max_attempts=max_attempts, unique_key=unique_key,
        )  # fmt: skip
        db = self._write_db()
        if waits_for is not None:
            with transaction.atomic(using=db):  # the job with what it waits for, or neither
                waiting = enqueue.insert(self.model, db, job, payload or {}, waiting=True)
                assert waiting is not None  # no unique_key: always inserted
                batches.add_dependencies(db, job.id, *waits_for)
            if announce:
                signals.send(signals.job_enqueued, self.model, jobs=[waiting])
            return waiting
        for _ in range(ENQUEUE_TRIES):
            inserted = enqueue.insert(self.model, db, job, payload or {})
            if inserted is not None:
                if announce:
                    signals.send(signals.job_enqueued, self.model, jobs=[inserted])
                return inserted
            # The write database: a replica behind a router may not have the holder yet.
            holder = self.using(db).filter(unique_key=unique_key, status__in=HOLDS_KEY).first()
            if holder is not None:
                return holder  # type: ignore[no-any-return]
            # The job holding the key finished between the insert and the look: insert again.
        raise EnqueueError(
            f"unique_key={unique_key!r}: a live job kept taking and releasing the key; "
            f"{ENQUEUE_TRIES} tries neither inserted a job nor found the one holding it."
        )

    def bulk_enqueue(
        self,
        task: Task | str,
        payloads: Iterable[dict[str, Any] | None],
        *,
        queue: str | None = None,
        priority: int | None = None,
        run_at: datetime | None = None,
        delay: float | timedelta | None = None,
        max_attempts: int | None = None,
        batch_size: int = 5000,
    ) -> list[Job]:
        """Write many jobs of one task, `batch_size` per COPY, all in one transaction (the
        caller's, else its own). Every payload is checked before anything is written."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise EnqueueError(f"batch_size={batch_size!r} must be an integer of 1 or more.")
        # The options are the same for every job: check them once, then each payload.
        registered, options = enqueue.options_of(
            task, queue=queue, priority=priority, run_at=run_at, delay=delay,
            max_attempts=max_attempts, unique_key=None,
        )  # fmt: skip
        checked = [{} if payload is None else payload for payload in payloads]
        with enqueue.collector_paused(len(checked)):
            texts = enqueue.payload_texts(registered, checked)
            keys = enqueue.limit_keys(registered, checked)
            db = self._write_db()
            jobs = enqueue.insert_many(self.model, db, options, checked, texts, keys, batch_size)
        signals.send(signals.job_enqueued, self.model, jobs=jobs)
        return jobs

    @contextmanager
    def batch(
        self,
        on_complete: Task | str | None = None,
        on_success: Task | str | None = None,
        **payload: Any,
    ) -> Iterator[Batch]:
        """Make the jobs enqueued in the block one batch, and enqueue `on_complete` once when
        they have all finished (succeeded, dead letter or cancelled) and `on_success` once when
        they have all succeeded (maybe later, after replays). Each callback gets `payload` and
        ``batch={"id", "succeeded", "failed", "cancelled"}`` (batches.py).

        The block is a transaction (a savepoint in the caller's): the batch and its jobs are
        written together or not at all."""
        if "batch" in payload:
            raise EnqueueError(
                "batch(batch=...): the callbacks get the batch's id and counts as `batch`; "
                "give your value another name."
            )
        callbacks = {}
        for name, task in (("on_complete", on_complete), ("on_success", on_success)):
            try:
                callbacks[name] = None if task is None else enqueue.callback(task, payload)
            except EnqueueError as error:
                raise EnqueueError(f"batch({name}=...): {error}") from error.__cause__
        db = self._write_db()
        made = apps.get_model("pgjobs", "Batch")(size=0, **callbacks)  # saved at the block's end
        with transaction.atomic(using=db):
            with batches.writing(made):
                yield made
            # Counted as written: a job whose insert a savepoint rolled back is not one.
            made.size = self.using(db).filter(batch_id=made.id).count()
            made.save(using=db, force_insert=True)
            if made.size == 0:  # nothing to wait for: its callbacks now, with it
                batches.follow_up(db, batches=[made.id])

    # ---- claim and settle --------------------------------------------------------------------

    def claim(
        self, queues: Sequence[str], *, worker: str, limit: int = 1, lease: float | None = None
    ) -> list[Job]:
        """Take up to `limit` due jobs from `queues`, highest priority first, then oldest run_at.

        Concurrent workers never claim the same job nor wait for each other. Each job comes
        back running, leased to `worker` for `lease` seconds; run it once the claim committed.
        """
        settled = self.settle_and_claim([], [], queues, worker=worker, limit=limit, lease=lease)
        if settled.unread is not None:
            raise settled.unread
        return settled.claimed

    def settle_and_claim(
        self,
        succeeded: Sequence[Job | Claim],
        failed: Sequence[FailedAttempt],
        queues: Sequence[str],
        *,
        worker: str,
        limit: int,
        lease: float | None = None,
        results: Mapping[UUID, str] | None = None,
        after: Mapping[str, Position] | None = None,
        rooms: Mapping[str, int] | None = None,
        follow_batches: bool = True,
    ) -> Settled:
        """Record the outcomes of `worker`'s finished jobs and claim up to `limit` due jobs
        from `queues` in one statement: one round trip and one commit per turn. A queue in
        `rooms` gives at most that many of them (none for 0).

        `succeeded` keep their return values in `results` (job id → JSON text); each of `failed`
        is recorded as by `fail`. A queue's claim starts after its Position in `after`, else at
        the start. Returns what this worker still owned of the outcomes, and the claimed jobs.
        The jobs waiting for those that ended are followed up (batches.py), and their batches
        too unless `follow_batches` is False: then the caller does (Settled.batches).
        """
        if rooms is not None:
            queues = [queue for queue in queues if rooms.get(queue, limit) > 0]
        claiming = bool(queues) and limit >= 1
        if not (claiming or succeeded or failed):
            return Settled(set(), {}, [], {})
        done, ended = [as_claim(x) for x in succeeded], [as_claim(f.job) for f in failed]
        _one_worker([worker, *(c.worker for c in done), *(c.worker for c in ended)])
        params = turn_params(
            succeeded, failed, queues if claiming else [], worker=worker,
            limit=limit if claiming else 0, lease=lease, results=results or {},
            after=after, rooms=rooms,
        )  # fmt: skip
        db = self._write_db()
        statement = sql.SETTLE_AND_CLAIM if succeeded or failed else sql.CLAIM
        found = rows.execute(db, statement, params, binary=True)
        recorded = {(row[1], row[_CLAIMS]): row[_STATUS] for row in found if row[0] == "settled"}
        # Jobs that ended: their batches, and the jobs waiting for them (row[-1]: waited).
        last = [
            row for row in found
            if (row[_BATCH] is not None or row[-1]) and row[0] == "settled"
            and row[_STATUS] in FINISHED
        ]  # fmt: skip
        ending = frozenset(row[_BATCH] for row in last if row[_BATCH] is not None)
        batches.after_commit(
            db, jobs=[row[1] for row in last if row[-1]], batches=ending if follow_batches else ()
        )
        claimed_rows = [row for row in found if row[0] != "settled"]
        unread: Exception | None = None
        try:
            claimed = rows.load_jobs(self.model, db, (row[1:-1] for row in claimed_rows))
        except BaseException as error:
            # Committed claims the caller will never see (a model signal's receiver raised): given
            # back now, not left to run out their leases; the outcomes stay the caller's (`unread`).
            given_back = {
                "ids": [row[1] for row in claimed_rows],
                "claims": [row[_CLAIMS] for row in claimed_rows],
                "progress": [None] * len(claimed_rows),
                "worker": worker,
                "delay": None,
            }
            rows.execute(db, sql.RELEASE, given_back)
            if not isinstance(error, Exception):
                raise
            claimed, unread = [], error
        claimed.sort(key=lambda job: (-job.priority, job.run_at, job.id))
        return Settled(
            {c.id for c in done if c.key in recorded},
            {c.id: recorded[c.key] for c in ended if c.key in recorded},
            claimed,
            recorded,
            unread,
            frozenset() if follow_batches else ending,
        )

    def claim_keyed(
        self,
        queue: str,
        limits: TaskLimits,
        *,
        worker: str,
        limit: int,
        lease: float | None = None,
        after: tuple[str, str] = ("", ""),
    ) -> Keyed:
        """Claim up to `limit` due jobs of limited tasks (those with a limit key) from `queue`
        under their tasks' `limits`, the keys taking turns from the one after `after` (the
        `cursor` of the previous claim). Runs in a transaction of its own, unless in one."""
        db = self._write_db()
        with transaction.atomic(using=db):
            # Not for long behind a lock on a bucket: the worker's other claims wait on this.
            rows.execute(db, sql.BRIEF_LOCK_TIMEOUT, {})
            scan = max(limit, SCAN_KEYS)
            looked = rows.execute(db, sql.LOCK_KEYS, {
                "queue": queue, "after_task": after[0], "after_key": after[1], "limit": limit,
                "scan": scan, "locking": limits.locking, "lock_class": LOCK_CLASS,
                **_limit_arrays(limits),
            }, binary=True)  # fmt: skip
            if not looked:
                return Keyed([], None, after, 0)  # no due job of a limited task
            keys = [(task, key) for kept, task, key, _, _ in looked if kept]
            last = next((row for row in looked if not row[0]), None)
            cursor, held_for, more = keys[-1] if keys else after, None, False
            if last is not None:  # fewer kept than asked: on from the last one looked at
                _, last_task, last_key, held_for, examined = last
                cursor, more = (last_task, last_key), examined >= scan
            if not keys:
                return Keyed([], held_for, cursor, 0, more=more)
            found = rows.execute(db, sql.CLAIM_KEYED, {
                "queue": queue, "worker": worker, "limit": limit,
                "lease": get_settings().LEASE if lease is None else lease,
                "tasks": [task for task, _ in keys], "keys": [key for _, key in keys],
                **_limit_arrays(limits),
            }, binary=True)  # fmt: skip
            wait = found[0][-1]
            claimed = rows.load_jobs(self.model, db, (row[:-1] for row in found if row[0]))
        claimed.sort(key=lambda job: (-job.priority, job.run_at, job.id))
        return Keyed(claimed, wait, cursor, len(keys), more=more)

    def claim_limited(
        self,
        queue: str,
        *,
        worker: str,
        limit: int,
        lease: float | None = None,
        limits: TaskLimits | None = None,
        after: tuple[str, str] = ("", ""),
        round_up: bool = True,
    ) -> Keyed:
        """Claim as `claim` from one queue that has controls (a Queue row): nothing while it is
        paused or another session holds its row (never waited for), never more than its
        `max_running` jobs running at once across all workers, nor more starts than its
        `rate_limit`. With `limits`, its limited tasks' jobs too, as `claim_keyed`, in up to
        half of the room (rounded up or down: an odd slot goes to either in turns); None: the
        queue holds none of their jobs."""
        db = self._write_db()
        nothing = Keyed([], None, after)
        with transaction.atomic(using=db), connections[db].cursor() as cursor:
            cursor.execute(sql.BRIEF_LOCK_TIMEOUT)
            cursor.execute(sql.LOCK_QUEUE, {"queue": queue})
            controls = cursor.fetchone()
            if controls is None:
                cursor.execute(sql.QUEUE_CONTROLLED, {"queue": queue})
                if cursor.fetchone()[0]:
                    return nothing  # locked elsewhere: this queue's turn is another worker's
                controls = (False, None, None, None, None)
            paused, max_running, rate_text, full_at, now = controls
            if paused:
                return nothing
            if max_running is not None:
                cursor.execute(sql.COUNT_RUNNING, {"queue": queue})
                (running,) = cursor.fetchone()
                limit = min(limit, max_running - running)
            rate = limits_module.rate_or_none(rate_text)
            # A bucket spent at a lower rate (before the limit was raised) counts as just spent
            # whole at this one, and is written so: it fills at the new rate from now on.
            raised = rate is not None and full_at is not None and full_at > rate.emptiest(now)
            if rate is not None:
                limit = min(
                    limit, rate.starts(min(full_at, rate.emptiest(now)) if raised else full_at, now)
                )
            claimed: list[Job] = []
            keyed = nothing
            if limit >= 1:
                share = (limit + round_up) // 2
                if limits is not None and share:
                    keyed = self.claim_keyed(
                        queue, limits, worker=worker, limit=share, lease=lease, after=after
                    )
                elif limits is not None:
                    keyed = Keyed([], 0.0, after)  # their turn is the next claim
                claimed = keyed.claimed + self.claim(
                    [queue], worker=worker, limit=limit - len(keyed.claimed), lease=lease
                )
            if rate is not None and (claimed or raised):
                spent = {"seconds": rate.interval * len(claimed), "most": rate.emptiest_in}
                cursor.execute(sql.SPEND_QUEUE_RATE, {"queue": queue, **spent})
            return keyed._replace(claimed=claimed)

    def complete(self, job: Job | Claim, result_json: str | None = None) -> bool:
        """Record success, keeping `result_json` (the return value as JSON text) when given.
        False means the lease ran out and another worker owns the job now."""
        held = as_claim(job)
        assert held.worker is not None, "only a claimed job can complete"
        results = {held.id: result_json} if result_json is not None else None
        done = self.settle_and_claim([held], [], [], worker=held.worker, limit=0, results=results)
        return held.id in done.succeeded

    def complete_many(self, jobs: Sequence[Job | Claim]) -> set[UUID]:
        """Record success for many jobs of one worker in one statement; returns the ids it still
        owned (the others were reaped and possibly claimed again: their outcome is not ours)."""
        if not jobs:
            return set()
        worker = _one_worker([as_claim(job).worker for job in jobs])
        return self.settle_and_claim(jobs, [], [], worker=worker, limit=0).succeeded

    def fail(
        self, job: Job | Claim, failure: Failure, *, permanent: bool, delay: float
    ) -> str | None:
        """Record a failed attempt: back to ready in `delay` seconds while attempts remain and the
        error is not permanent, else failed (the dead letter). Returns the new status, or None
        when this worker no longer owned the job."""
        held = as_claim(job)
        if held.worker is None:
            return None  # never claimed: no worker holds it, so none may record its outcome
        attempt = FailedAttempt(held, failure, permanent, delay)
        settled = self.settle_and_claim([], [attempt], [], worker=held.worker, limit=0)
        return settled.failed.get(held.id)

    def release(self, jobs: Sequence[Job | Claim]) -> set[UUID]:
        """Running → ready without spending an attempt, keeping its place (a worker shutting
        down); cancelled instead when a cancellation was requested. Each keeps the progress its
        handler last reported."""
        released = self._own(sql.RELEASE, jobs, delay=None, progress=reports(jobs))
        batches.after_commit(self._write_db(), jobs=[i for i, ended in released.items() if ended])
        return set(released)

    def retry_later(self, job: Job | Claim, delay: float) -> bool:
        """The handler asked to run again in `delay` seconds: ready again, attempt not counted,
        keeping the progress it last reported."""
        released = self._own(sql.RELEASE, [job], delay=delay, progress=reports([job]))
        batches.after_commit(self._write_db(), jobs=[i for i, ended in released.items() if ended])
        return as_claim(job).id in released

    def heartbeat(self, jobs: Sequence[Job | Claim], lease: float | None = None) -> set[UUID]:
        """Extend the lease of a worker's running jobs by `lease` seconds from now and record
        the progress their handlers last reported; returns the ids renewed (a job locked
        elsewhere is skipped this time). A cancellation requested meanwhile shows on the Job."""
        lease = get_settings().LEASE if lease is None else lease
        owned = self._own(sql.HEARTBEAT, jobs, lease=lease, progress=reports(jobs))
        for held in map(as_claim, jobs):
            if owned.get(held.id):
                held.job.cancel_requested = True
        return set(owned)

    def owned(self, jobs: Sequence[Job | Claim]) -> set[UUID]:
        """The ids of those of `jobs` whose claims their worker still holds."""
        return set(self._own(sql.OWNED, jobs))

    def locked_elsewhere(self, jobs: Sequence[Job | Claim]) -> set[UUID]:
        """The ids of those of `jobs` whose rows another session holds locked (sql.
        LOCKED_ELSEWHERE): recording their outcomes would wait for it. Never waits itself."""
        if not jobs:
            return set()
        params = {"ids": [as_claim(job).id for job in jobs]}
        found = rows.execute(self._write_db(), sql.LOCKED_ELSEWHERE, params)
        return {job_id for (job_id,) in found}

    def promote(self, *, limit: int = 1000) -> int:
        """Move scheduled jobs that have come due into the claim index (sql.PROMOTE); returns
        how many."""
        with rows.cursor(self._write_db()) as cursor:
            cursor.execute(sql.PROMOTE, {"limit": limit})
            return int(cursor.rowcount)

    def abandon(self, worker: str, reason: str) -> TakenBack:
        """Take back every running job of `worker`, known to be dead, at once, as `reap` does
        (so a job that kills its worker is not taken at once by the next), recording `reason`.
        Rows locked elsewhere are passed over: their leases bring them back."""
        params = {"worker": worker, "reason": reason, **_taking_back(Failure("WorkerLost", reason))}
        return self._taken_back(rows.execute(self._write_db(), sql.ABANDON, params))

    def reap(self, *, limit: int = 1000, sparing: Sequence[Job | Claim] = ()) -> TakenBack:
        """Take back running jobs whose lease expired: to ready after the default backoff, or
        failed when no attempts remain, recording "lease expired". Safe from every worker at
        once (SKIP LOCKED). `sparing`: the caller's claims whose handlers are running."""
        params = {
            "limit": limit,
            "spared_ids": [as_claim(job).id for job in sparing],
            "spared_claims": [as_claim(job).count for job in sparing],
            **_taking_back(LEASE_EXPIRED),
        }
        return self._taken_back(rows.execute(self._write_db(), sql.REAP, params))

    def _taken_back(self, taken: list[tuple[Any, ...]]) -> TakenBack:
        """The jobs a reap or an abandon took back (id, claims, status, task, attempts)."""
        batches.after_commit(
            self._write_db(), jobs=[row[0] for row in taken if row[2] != Status.READY]
        )
        ready = tuple(
            (job_id, claims, task, attempts)
            for job_id, claims, status, task, attempts in taken
            if status == Status.READY
        )
        failed = sum(1 for _, _, status, *_ in taken if status == Status.FAILED)
        return TakenBack(len(ready), failed, ready)

    def delay(self, delays: Sequence[tuple[UUID, int, float]]) -> None:
        """Make jobs taken back due after these delays (id, claim count, seconds) instead of
        the default backoff: the runtime asks their tasks' own backoffs."""
        if delays:
            ids, claims, seconds = (list(column) for column in zip(*delays, strict=True))
            params = {"ids": ids, "claims": claims, "delays": seconds}
            rows.execute(self._write_db(), sql.REAP_BACKOFF, params)

    # ---- the outbox of NATS queues (transports.py) -----------------------------------------

    def relay(
        self,
        queues: Sequence[str],
        *,
        limit: int,
        publish: Callable[[list[Job]], Collection[UUID] | None],
    ) -> list[Job]:
        """Take up to `limit` due outbox rows of each of `queues` (NATS queues), locked, and hand
        them to `publish`, which returns the ids of those done with (None: all). Those rows are
        deleted in the same transaction, which commits when `publish` returns and rolls back
        when it raises; the others stay for the next round. Returns the jobs done with."""
        db = self._write_db()
        params = {"queues": list(queues), "limit": limit}
        with transaction.atomic(using=db):
            jobs = rows.load_jobs(self.model, db, rows.execute(db, sql.RELAY, params, True))
            jobs.sort(key=lambda job: (-job.priority, job.run_at, job.id))
            if not jobs:
                return []
            done = publish(jobs)
            if done is not None:
                jobs = [job for job in jobs if job.pk in done]
            if jobs:
                rows.execute(db, sql.RELAYED, {"ids": [job.pk for job in jobs]})
        return jobs

    def refuse_relayed(self, job: Job, failure: Failure) -> None:
        """The outbox row of `job`, locked by a relay's round, becomes a dead letter recording
        `failure` as an attempt: its message cannot be published."""
        db = self._write_db()
        with transaction.atomic(using=db):
            rows.execute(db, sql.RELAYED, {"ids": [job.pk]})
            job.attempts, job.claims = job.attempts + 1, job.claims + 1
            self.write_back(job, failure, permanent=True, delay=0)

    def write_back(
        self, job: Job, failure: Failure, *, permanent: bool, delay: float, hand_back: bool = False
    ) -> str:
        """Record a failed attempt of `job`, run from NATS by `job.worker` (an unsaved Job
        with its attempts and claims), as `fail` would, and say what to do with its message:

        - ``failed`` (or ``cancelled``): written here as a dead letter; the message is done with;
        - ``ready``: nothing written, the message is delivered again after `delay`; with
          `hand_back`, written as an outbox row due after `delay` (one claim more, so a message
          id of its own): the message is done with;
        - WRITTEN: a row of this job with at least its claims exists already: nothing to do;
        - IN_OUTBOX: the job's outbox row is still there (its relay has not committed): try
          again shortly.
        """
        db = self._write_db()
        self.drop_superseded(job, below=job.claims)  # committed, whatever follows
        with transaction.atomic(using=db):
            if (found := self._written_back(job, job.attempts)) is not None:
                return found
            status = self.fail(job, failure, permanent=permanent, delay=delay)
            assert status is not None, "the row was inserted as held by this worker"
            if status == Status.READY and not hand_back:
                transaction.set_rollback(True, using=db)  # the message carries the retry
            return status

    def hand_back(self, job: Job, delay: float) -> str:
        """`job`, run from NATS by `job.worker`, asked to run again in `delay` seconds (Retry),
        its attempt counted: written as an outbox row due then, as write_back's `hand_back`.
        Returns ``ready``, or WRITTEN or IN_OUTBOX as write_back."""
        self.drop_superseded(job, below=job.claims)
        with transaction.atomic(using=self._write_db()):
            # One attempt more, which retry_later's release gives back: this attempt counts.
            if (found := self._written_back(job, job.attempts + 1)) is not None:
                return found
            released = self.retry_later(job, delay)
            assert released, "the row was inserted as held by this worker"
            return Status.READY

    def drop_superseded(self, job: Job, below: int) -> bool:
        """Delete the outbox row an older delivery of NATS job `job` wrote (its claims under
        `below`), unless a relay is publishing it; whether there was one. Called before writing
        back an outcome, which that row would otherwise block for good (IN_OUTBOX)."""
        return bool(rows.execute(self._write_db(), sql.SUPERSEDED, {"id": job.pk, "below": below}))

    def _written_back(self, job: Job, attempts: int) -> str | None:
        """Insert `job` as a running row held by `job.worker` (sql.WRITE_BACK) with `attempts`;
        None when inserted, else WRITTEN or IN_OUTBOX (see write_back)."""
        params = {
            "id": job.pk, "queue": job.queue, "task": job.task,
            "payload": json.dumps(job.payload), "priority": job.priority, "run_at": job.run_at,
            "attempts": attempts, "max_attempts": job.max_attempts, "worker": job.worker,
            "errors": json.dumps(job.errors), "created_at": job.created_at, "claims": job.claims,
            "headers": None if job.headers is None else json.dumps(job.headers),
        }  # fmt: skip
        found = rows.execute(self._write_db(), sql.WRITE_BACK, params)
        if not found:  # the row in the way was deleted as the insert waited for it
            return IN_OUTBOX
        ((inserted, _, claims),) = found
        if not inserted:
            return WRITTEN if claims >= job.claims else IN_OUTBOX
        return None

    # ---- helpers -----------------------------------------------------------------------------

    def _own(self, statement: str, jobs: Sequence[Job | Claim], **params: Any) -> dict[UUID, bool]:
        """Run a guarded statement over those of `jobs` their worker still owns; returns their
        ids, each with whether a cancellation of it was requested."""
        claims = [as_claim(job) for job in jobs]
        if not claims or all(held.worker is None for held in claims):
            return {}  # never claimed: no worker holds them
        params |= {
            "ids": [held.id for held in claims],
            "claims": [held.count for held in claims],
            "worker": _one_worker([held.worker for held in claims]),
        }
        return dict(rows.execute(self._write_db(), statement, params))

    def _write_db(self) -> str:
        return self._db or router.db_for_write(self.model)


def _limit_arrays(limits: TaskLimits) -> dict[str, list[Any]]:
    """The limited tasks' limits, as LOCK_KEYS and CLAIM_KEYED take them."""
    return {
        "limited": list(limits.tasks), "concurrency": list(limits.concurrency),
        "every": list(limits.every), "burst": list(limits.burst),
    }  # fmt: skip


def turn_params(
    succeeded: Sequence[Job | Claim],
    failed: Sequence[FailedAttempt],
    queues: Sequence[str],
    *,
    worker: str,
    limit: int,
    lease: float | None,
    results: Mapping[UUID, str],
    after: Mapping[str, Position] | None = None,
    rooms: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The parameters of sql.SETTLE_AND_CLAIM, by name."""
    settings = get_settings()
    positions = [(after or {}).get(queue) for queue in queues]
    succeeded_claims = [as_claim(job).key for job in succeeded]
    failed_claims = [as_claim(f.job).key for f in failed]
    return {
        "worker": worker,
        "succeeded_ids": [job_id for job_id, _ in succeeded_claims],
        "succeeded_claims": [count for _, count in succeeded_claims],
        "results": [results.get(job_id) for job_id, _ in succeeded_claims],
        "failed_ids": [job_id for job_id, _ in failed_claims],
        "failed_claims": [count for _, count in failed_claims],
        "permanent": [f.permanent for f in failed],
        "delays": [float(f.delay) for f in failed],
        "summaries": [f.failure.summary for f in failed],
        "errors": [f.failure.as_json() for f in failed],
        "succeeded_progress": reports(succeeded),
        "failed_progress": reports([f.job for f in failed]),
        "errors_kept": sql.errors_kept(settings.ERRORS_KEPT),
        "queues": list(queues),
        "rooms": [min(limit, (rooms or {}).get(queue, limit)) for queue in queues],
        "after_priority": [p.priority if p else None for p in positions],
        "after_run_at": [p.run_at if p else None for p in positions],
        "after_id": [p.id if p else None for p in positions],
        "limit": limit,
        "lease": settings.LEASE if lease is None else lease,
    }


def reports(jobs: Sequence[Job | Claim]) -> list[str | None]:
    """Each job's progress report as the statements take it: JSON text without "at" (the
    database adds it), or None for a job without one."""
    return [_report(as_claim(job).job.progress) for job in jobs]


#: The most a progress report may weigh as JSON (progress() makes them of a few dozen bytes).
MAX_REPORT_BYTES = 4096


def _report(progress: Any) -> str | None:
    if not isinstance(progress, dict):
        return None  # none yet; never anything else than what progress() sets
    try:
        report = {k: v for k, v in progress.items() if k != "at"}
        return json_text(report, "a progress report", MAX_REPORT_BYTES, "")
    except Exception:  # EnqueueError, RecursionError, an object's __eq__ that raises, ...
        # Something jsonb cannot hold: the stored report stays, and the outcome is not refused.
        return None


def _one_worker(workers: Iterable[str | None]) -> str:
    """The one worker whose jobs these are; a statement guards on a single worker."""
    distinct = set(workers)
    if len(distinct) != 1 or None in distinct:
        raise ValueError(f"jobs of one worker at a time, got {sorted(map(str, distinct))}")
    return str(distinct.pop())


def _taking_back(error: Failure) -> dict[str, Any]:
    """The parameters sql._TAKEN_BACK needs: the default backoff, and the lost attempt's
    error for the job's history."""
    settings = get_settings()
    return {
        "cap": settings.BACKOFF_MAX,
        "base": settings.BACKOFF_BASE,
        "error": error.as_json(),
        "errors_kept": sql.errors_kept(settings.ERRORS_KEPT),
    }
