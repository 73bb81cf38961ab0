"""Tables only the tests use."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Execution(models.Model):
    """One row per handler execution (the ledger): written by the handler itself, in autocommit."""

    n = models.IntegerField(db_index=True)
    pid = models.IntegerField()
    at = models.DateTimeField(db_default=Now())

    def __str__(self) -> str:
        return f"run of job n={self.n} in pid {self.pid}"


class LimitedRun(models.Model):
    """One row per run of a limited task's handler (tests/tasks.py), written by the handler: its
    limit key, when it started and when it ended (the database's clock)."""

    key = models.CharField(max_length=200, db_index=True)
    n = models.IntegerField()
    pid = models.IntegerField()
    started = models.DateTimeField(db_default=Now())
    ended = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"run of {self.key} n={self.n} in pid {self.pid}"


class ChaosExecution(models.Model):
    """The chaos suite's ledger: one row per handler execution, written by the handler itself over
    its own autocommit connection. `ok` is False when the handler then raised or died."""

    job_id = models.UUIDField(db_index=True)
    attempt = models.IntegerField()
    worker = models.CharField(max_length=200)
    pid = models.IntegerField()
    ok = models.BooleanField()
    at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "chaos_execution"
        constraints = [
            # A ledger write retried after a lost acknowledgement must not look like a rerun.
            models.UniqueConstraint(fields=["job_id", "attempt", "worker"], name="chaos_once")
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} by {self.worker}"


class ChaosTransition(models.Model):
    """Every write to a running job (claim, heartbeat, finish, reap), recorded by a trigger the
    chaos suite installs, with the process that issued it (its application_name)."""

    job_id = models.UUIDField(db_index=True)
    kind = models.CharField(max_length=10)  # claim, heartbeat, finish, reap
    old_status = models.CharField(max_length=10)
    new_status = models.CharField(max_length=10)
    old_worker = models.CharField(max_length=200, null=True)
    new_worker = models.CharField(max_length=200, null=True)
    old_attempts = models.IntegerField()
    new_attempts = models.IntegerField()
    issuer = models.TextField()
    at = models.DateTimeField()

    class Meta:
        db_table = "chaos_transition"

    def __str__(self) -> str:
        return f"{self.kind} of job {self.job_id} by {self.issuer}"
