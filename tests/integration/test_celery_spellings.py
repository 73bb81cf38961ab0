"""What people bring from Celery fails loudly (docs/howto/from-celery.md): django-pgjobs has no
aliases for Celery's spellings, so none of them may quietly do something else."""

from __future__ import annotations

import pytest

from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Job
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
@pytest.mark.parametrize(("option", "instead"), [("countdown", "delay"), ("eta", "run_at")])
def test_countdown_given_to_enqueue_is_refused_and_never_a_delay(option, instead):
    # enqueue(**kwargs) takes the payload; the handler cannot be called with this one, so
    # enqueue refuses it, saying where the option goes.
    with pytest.raises(EnqueueError) as refused:
        tasks.noop.enqueue(**{option: 60})
    assert f"unexpected argument {option!r}" in str(refused.value)
    assert f"task.using({instead}=...).enqueue(...)" in str(refused.value)
    assert not Job.objects.exists()
