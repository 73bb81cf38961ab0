"""What people bring from Celery fails loudly (docs/howto/from-celery.md): django-pgjobs has no
aliases for Celery's spellings, so none of them may quietly do something else."""

from __future__ import annotations

import pytest

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.testing import run_jobs
from tests import tasks


def test_a_task_has_no_delay_or_apply_async():
    with pytest.raises(AttributeError, match="delay"):
        tasks.noop.delay()  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="apply_async"):
        tasks.noop.apply_async()  # type: ignore[attr-defined]


@pytest.mark.parametrize("option", ["countdown", "eta", "expires"])
def test_using_refuses_celerys_options(option):
    with pytest.raises(TypeError, match=option):
        tasks.noop.using(**{option: 60})


@pytest.mark.django_db
def test_countdown_given_to_enqueue_is_a_payload_key_and_never_a_delay():
    # enqueue(**kwargs) takes the payload: the handler cannot be called with it, a permanent
    # error. (When enqueue checks payloads against the handler's signature, it is refused there.)
    job = tasks.noop.enqueue(countdown=60)
    assert job.run_at <= job.created_at  # not delayed

    run = run_jobs()

    assert [j.pk for j in run.failed] == [job.pk]
    failed = Job.objects.get(pk=job.pk)
    assert failed.status == Status.FAILED and failed.attempts == 1
    assert "unexpected keyword argument 'countdown'" in failed.last_error
