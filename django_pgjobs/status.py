"""The job state machine.

waiting ──its dependencies succeeded──▶ ready (one failed: cancelled, released again if it
                                                     is replayed and then succeeds)
ready ──claim──▶ running ──complete──▶ succeeded
  ▲  │             │ │
  │  │             │ └──fail (attempts left) / retry_later / release / reap──▶ ready
  │  │             └────fail (permanent or out of attempts) / reap (out of attempts)──▶ failed
  │  └──cancel──▶ cancelled ◀── running, when an attempt of a job asked to cancel ends
  └──replay── failed | cancelled                 other than by succeeding
"""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class Status(models.TextChoices):
    READY = "ready", _("ready")
    RUNNING = "running", _("running")
    SUCCEEDED = "succeeded", _("succeeded")
    FAILED = "failed", _("failed")
    CANCELLED = "cancelled", _("cancelled")
    #: Enqueued with after=: waits for the jobs and batches it names to succeed (batches.py).
    WAITING = "waiting", _("waiting")


FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
LIVE = (Status.READY, Status.RUNNING, Status.WAITING)
#: The statuses in which a job holds its unique_key (a waiting job has none: enqueue refuses both).
HOLDS_KEY = (Status.READY, Status.RUNNING)
