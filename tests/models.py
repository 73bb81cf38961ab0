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
