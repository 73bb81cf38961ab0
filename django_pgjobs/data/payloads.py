"""Correcting a failed or cancelled job's payload before it is replayed: the one change of a
payload after enqueue."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from uuid import UUID

from django_pgjobs import validation
from django_pgjobs.conf import get_settings

if TYPE_CHECKING:
    from django_pgjobs.data.queryset import JobQuerySet


def replace_payload(jobs: JobQuerySet, payload: Any) -> list[UUID]:
    """Give the selected failed or cancelled jobs `payload`, checked as enqueue checks one
    (EnqueueError before anything is written). Returns the ids changed: a job that is no longer
    failed or cancelled (replayed, or deleted, meanwhile) is left alone.

    Only the payload changes; replay the jobs to run them (JobQuerySet.replay)."""
    text = validation.payload_json(payload, get_settings().MAX_PAYLOAD_BYTES)
    # The queryset's guarded UPDATE: the status is checked again on each row as it is written.
    return jobs._change("payload = %s::jsonb", [text], guard="j.status IN ('failed', 'cancelled')")
