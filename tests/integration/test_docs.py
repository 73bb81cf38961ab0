"""The documentation's code, run as written."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from django_pgjobs import registry
from django_pgjobs.models import Job

pytestmark = pytest.mark.django_db

DOCS = Path(__file__).resolve().parents[2] / "docs"


def snippet(page: str, first_line: str) -> str:
    """The code block of `page` that starts with `first_line`, unindented."""
    for block in re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S):
        lines = block.splitlines()
        indent = len(lines[0]) - len(lines[0].lstrip())
        code = "\n".join(line[indent:] for line in lines)
        if code.startswith(first_line):
            return code
    raise AssertionError(f"{page} has no python block starting with {first_line!r}")


def test_the_quickstarts_sign_up_can_run_twice_for_one_address(monkeypatch):
    monkeypatch.setattr(registry, "_registry", registry.all_tasks())  # forget its task after
    myapp, tasks = types.ModuleType("myapp"), types.ModuleType("myapp.tasks")
    monkeypatch.setitem(sys.modules, "myapp", myapp)
    monkeypatch.setitem(sys.modules, "myapp.tasks", tasks)
    exec(snippet("quickstart.md", "# myapp/tasks.py"), tasks.__dict__)
    views: dict[str, object] = {"__name__": "myapp.views"}
    exec(snippet("quickstart.md", "# myapp/views.py"), views)
    sign_up = views["sign_up"]
    assert callable(sign_up)
    sign_up("ada@example.com")
    sign_up("ada@example.com")  # the same person, twice: no IntegrityError, one welcome
    sign_up("grace@example.com")
    assert get_user_model().objects.count() == 2
    assert list(Job.objects.values_list("task", flat=True)) == ["myapp.tasks.send_welcome"] * 2
