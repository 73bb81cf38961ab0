"""What people bring from Celery fails loudly (docs/howto/from-celery.md): django-pgjobs has no
aliases for Celery's spellings, so none of them may log_safely do something else, and each one says
what to write instead."""

from __future__ import annotations

from typing import Any

import pytest

from django_pgjobs import Retry, task
from django_pgjobs.errors import CelerySpelling, EnqueueError
from tests import tasks


@pytest.mark.parametrize(
    ("attribute", "instead"),
    [
        ("delay", "task.enqueue(**payload)"),
        ("apply_async", "task.using(delay=..., run_at=..., queue=..., priority=...)"),
        ("s", "there are no signatures"),
        ("si", "there are no signatures"),
        ("signature", "there are no signatures"),
        ("map", "Job.objects.bulk_enqueue(task, payloads)"),
        ("starmap", "Job.objects.bulk_enqueue(task, payloads)"),
        ("chunks", "Job.objects.bulk_enqueue(task, payloads)"),
    ],
)
def test_celerys_attributes_of_a_task_say_what_to_write_instead(attribute, instead):
    with pytest.raises(CelerySpelling) as refused:
        getattr(tasks.noop, attribute)
    assert str(refused.value).startswith(
        f"Task 'tests.tasks.noop' has no attribute {attribute!r}: "
    )
    assert instead in str(refused.value)
    assert isinstance(refused.value, AttributeError)
    assert not hasattr(tasks.noop, attribute)


def test_delay_called_as_celery_calls_it_is_refused_before_anything_runs():
    with pytest.raises(AttributeError, match=r"task\.enqueue\(\*\*payload\)"):
        tasks.noop.delay()  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match=r"task\.using\(delay="):
        tasks.noop.apply_async(kwargs={}, countdown=60)  # type: ignore[attr-defined]


def test_other_missing_attributes_are_plain_attribute_errors():
    with pytest.raises(AttributeError) as missing:
        tasks.noop.enqeue  # type: ignore[attr-defined]  # noqa: B018
    assert type(missing.value) is AttributeError
    assert str(missing.value) == "'Task' object has no attribute 'enqeue'"
    assert hasattr(tasks.noop, "enqueue")


@pytest.mark.parametrize(
    ("options", "instead"),
    [
        ({"bind": True}, "call django_pgjobs.current_job() in the handler"),
        ({"max_retries": 3}, "pass max_attempts=4 (it counts attempts, the first run included)"),
        ({"max_retries": None}, "max_retries=3 is max_attempts=4"),
        ({"acks_late": True}, "drop it, as django-pgjobs always acknowledges late"),
        ({"soft_time_limit": 30}, "pass timeout=<seconds>"),
        ({"time_limit": 60}, "pass timeout=<seconds>"),
    ],
)
def test_celerys_task_options_say_what_to_write_instead(options: dict[str, Any], instead):
    [(option, value)] = options.items()
    with pytest.raises(TypeError) as refused:
        task(**options)
    assert str(refused.value).startswith(f"@task({option}={value!r}) is Celery's: ")
    assert instead in str(refused.value)


def test_an_option_that_is_not_celerys_is_still_pythons_unexpected_keyword():
    with pytest.raises(TypeError, match=r"^@task\(\) got an unexpected keyword argument 'queu'"):
        task(queu="emails")  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("options", "instead"),
    [
        ({"countdown": 60}, "pass Retry(delay=...): seconds, or a timedelta"),
        ({"eta": "tomorrow"}, "pass Retry(delay=...), the time until then"),
        ({"exc": ValueError()}, "re-raise the error"),
    ],
)
def test_celerys_retry_options_say_what_to_write_instead(options: dict[str, Any], instead):
    [(option, value)] = options.items()
    with pytest.raises(TypeError) as refused:
        Retry(**options)
    assert str(refused.value).startswith(f"Retry({option}={value!r}) is Celery's: ")
    assert instead in str(refused.value)


def test_retry_still_takes_its_delay():
    assert Retry(delay=60).delay == Retry(60).delay == 60.0


@pytest.mark.parametrize("option", ["countdown", "eta", "expires"])
def test_using_refuses_celerys_options(option):
    with pytest.raises(TypeError, match=option):
        tasks.noop.using(**{option: 60})


@pytest.mark.parametrize(("option", "instead"), [("countdown", "delay"), ("eta", "run_at")])
def test_countdown_given_to_enqueue_is_refused_and_never_a_delay(option, instead):
    # enqueue(**kwargs) takes the payload; the handler cannot be called with this one, so
    # enqueue refuses it, saying where the option goes. This tier has no database: a write
    # would have raised a RuntimeError, not this EnqueueError.
    with pytest.raises(EnqueueError) as refused:
        tasks.noop.enqueue(**{option: 60})
    assert f"unexpected argument {option!r}" in str(refused.value)
    assert f"task.using({instead}=...).enqueue(...)" in str(refused.value)
