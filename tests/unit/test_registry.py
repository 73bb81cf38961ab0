from __future__ import annotations

import pytest

from django_pgjobs import task
from django_pgjobs.errors import UnknownTask
from django_pgjobs.registry import Task, all_tasks, get_task, unknown_task_help
from tests import tasks


def test_bare_decorator_registers_under_the_dotted_path():
    assert get_task("tests.tasks.noop") is tasks.noop
    assert isinstance(tasks.noop, Task)


def test_decorator_options_are_kept():
    send_email = get_task("tests.tasks.send_email")
    assert (send_email.queue, send_email.priority, send_email.max_attempts) == ("emails", 10, 7)
    assert get_task("custom.name").redact == {"password"}


def test_tasks_modules_of_installed_apps_are_autodiscovered():
    assert "tests.tasks.always_fails" in all_tasks()


def test_a_task_is_still_callable_directly():
    tasks.named(password="x")
    assert tasks.calls["named"] >= 1


def test_an_unknown_name_is_a_clear_error_and_imports_nothing():
    with pytest.raises(UnknownTask, match=r"'os\.system'"):
        get_task("os.system")


@pytest.mark.parametrize(
    ("name", "close"),
    [
        ("tests.tasks.send_emial", "tests.tasks.send_email"),  # a typo
        ("shop.tasks.send_email", "tests.tasks.send_email"),  # moved to another module
    ],
)
def test_a_worker_says_which_registered_tasks_look_like_an_unknown_one(name, close):
    said = unknown_task_help(name)
    assert f"Registered tasks with a close name: {close}" in said
    assert "deploy the code that defines it to every worker, then replay the job" in said


def test_a_worker_lists_the_registered_tasks_when_none_looks_like_an_unknown_one():
    said = unknown_task_help("antigravity.fly")
    assert "No registered task has a close name (registered tasks: " in said
    assert "If nothing should run it any more: delete the job." in said


def test_two_functions_under_one_name_are_refused():
    def first() -> None: ...

    def second() -> None: ...

    task(name="tests.clash")(first)
    with pytest.raises(ValueError, match=r"Two tasks are registered as 'tests\.clash'"):
        task(name="tests.clash")(second)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queue": "bad queue"}, "not a valid queue name"),
        ({"lease": 0}, "lease"),
        ({"max_attempts": 0}, "max_attempts"),
        # Past what an interval holds: every heartbeat of its worker failed, all its jobs'
        # leases ran out and other workers ran them again.
        ({"lease": float("inf")}, r"lease=\.\.\.\) must be a positive number of seconds below"),
        ({"lease": 1e13}, "below 1e\\+09"),
        ({"lease": True}, "lease"),
        ({"timeout": float("nan")}, "timeout"),
        ({"max_attempts": 2**32 + 2}, "from 1 to 2147483647"),  # a COPY wrapped it to 2
        ({"name": "x" * 201}, "201 characters long"),
    ],
)
def test_bad_task_options_are_refused_at_decoration(options, message):
    with pytest.raises(ValueError, match=message):
        task(**options)(lambda: None)


def test_redacted_masks_the_declared_payload_keys():
    assert get_task("custom.name").redacted({"password": "s3cret", "user": 1}) == {
        "password": "[redacted]",
        "user": 1,
    }
