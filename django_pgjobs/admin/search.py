"""The job lists' search box: what a term may mean, each meaning answered through an index.

A term is read every way it can be, and the jobs matching any reading are listed:

- a full job id, or its start (hex digits, dashes optional): a range of the primary key;
- a short id (the last 12 hex digits, as the lists show): random bits, so no range holds them;
  found by an index-only scan of the primary key (on Dead letters, of their own small index),
  cheaper than an index of them that every job would pay for;
- a task name, or part of one: the registered tasks whose name contains the term (and the term
  itself, for a task no longer registered), through pgjobs_job_task_idx;
- the unique key of a live (ready or running) job, through pgjobs_job_unique_key_live;
- text in the last error of a dead letter, among the newest ERROR_SCAN of them: a range of
  pgjobs_job_dead_idx, newest first. Errors are searched where one looks for them, in dead
  letters, and in the newest only: a substring is in no index, and reading every job's error
  would read the table (a trigram index would cost every job a write).
"""

from __future__ import annotations

from uuid import UUID

from django.db.models import BinaryField, F, Func, Q, QuerySet, Subquery, UUIDField, Value
from django.db.models.functions import Coalesce, Substr
from django.utils.translation import gettext_lazy

from django_pgjobs import registry
from django_pgjobs.models import Job
from django_pgjobs.status import HOLDS_KEY, Status

HEX = frozenset("0123456789abcdef")
#: The last 6 bytes (12 hex digits) of the id, as bytes: what a short id names.
SHORT_ID = Substr(
    Func(F("id"), function="uuid_send", output_field=BinaryField()), 11, output_field=BinaryField()
)
#: At most this many jobs share a short id in a search's answer (a collision is very rare).
SHORT_ID_MATCHES = 20
#: Error text is looked for in the last errors of the newest this many dead letters,
ERROR_SCAN = 10_000
#: and at most this many of them are listed.
ERROR_MATCHES = 500

HELP = gettext_lazy(
    "A job id, its start, or the short id shown in the list; part of a task name; the unique "
    "key of a live job; or text in the last error of one of the newest 10,000 dead letters."
)


def search(queryset: QuerySet[Job], term: str) -> QuerySet[Job]:
    """The jobs of `queryset` that `term` names in any of the ways above."""
    term = term.strip()
    if not term:
        return queryset
    try:
        return queryset.filter(pk=UUID(term))  # a full id: nothing else to look for
    except ValueError:
        pass
    readings = Q(unique_key=term, status__in=HOLDS_KEY)
    tasks = task_names(term)
    if tasks:
        readings |= Q(task__in=tasks)
    digits = term.lower().replace("-", "")
    if digits and len(digits) < 32 and set(digits) <= HEX:
        readings |= Q(pk__range=(UUID(digits.ljust(32, "0")), UUID(digits.ljust(32, "f"))))
        if len(digits) == 12 and "-" not in term:  # with a dash, it is the start of an id
            readings |= Q(pk__in=short_id_matches(queryset, digits))
    if "\x00" not in term:  # no text column holds one (PostgreSQL refuses it in a query)
        readings |= Q(pk__in=error_matches(queryset, term))
    return queryset.filter(readings)


def task_names(term: str) -> list[str]:
    """The registered tasks whose name contains `term` (ignoring case), and `term` itself."""
    lowered = term.lower()
    known = sorted(name for name in registry.all_tasks() if lowered in name.lower())
    return [term, *(name for name in known if name != term)]


def short_id_matches(queryset: QuerySet[Job], digits: str) -> list[UUID]:
    """The ids of `queryset` ending in these 12 hex digits, in one query that names no column
    but the id, so that an index alone answers it; run once, not in each query of the page."""
    found = queryset.order_by().alias(short=SHORT_ID).filter(short=bytes.fromhex(digits))
    return [pk for (pk,) in found.values_list("pk")[:SHORT_ID_MATCHES]]


def error_matches(queryset: QuerySet[Job], term: str) -> list[UUID]:
    """The ids of the dead letters of `queryset` among the newest ERROR_SCAN whose last error
    contains `term` (ignoring case), newest first: one range of pgjobs_job_dead_idx, from the
    ERROR_SCAN-th newest on. Run once, so that the page's queries read a list of ids."""
    dead = queryset.order_by("-pk").filter(status=Status.FAILED)
    oldest_read = Subquery(dead.values("pk")[ERROR_SCAN - 1 : ERROR_SCAN])
    since = Coalesce(oldest_read, Value(UUID(int=0)), output_field=UUIDField())
    found = dead.filter(pk__gte=since, last_error__icontains=term)
    return [pk for (pk,) in found.values_list("pk")[:ERROR_MATCHES]]
