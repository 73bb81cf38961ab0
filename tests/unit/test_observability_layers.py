"""The observability modules import only the modules below them, not even inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import django_pgjobs.observability

PACKAGE = "django_pgjobs.observability"
#: Lowest first, as django_pgjobs/observability/__init__.py lists them.
ORDER = ("stats", "dbstats", "load", "figures", "health", "report")
#: What observability serves, so it never imports it: the admin, commands, runtime, metrics.
ABOVE = (
    "django_pgjobs.admin",
    "django_pgjobs.management",
    "django_pgjobs.metrics",
    "django_pgjobs.worker",
    "django_pgjobs.execute",
    "django_pgjobs.periodic",
    "django_pgjobs.notify",
    "django_pgjobs.cancellation",
    "django_pgjobs.runtime",
)


def imports_of(module: str) -> set[str]:
    """Every module `module` imports, at the top, inside functions or for type checking."""
    source = Path(django_pgjobs.observability.__file__).with_name(f"{module}.py").read_text()
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_order_lists_every_module_of_the_package():
    modules = Path(django_pgjobs.observability.__file__).parent.glob("*.py")
    assert {path.stem for path in modules} - {"__init__"} == set(ORDER)


@pytest.mark.parametrize(("position", "module"), list(enumerate(ORDER)))
def test_a_module_imports_only_the_modules_below_it(position, module):
    ours = {
        name.removeprefix(f"{PACKAGE}.").split(".")[0]
        for name in imports_of(module)
        if name.startswith(f"{PACKAGE}.")
    }
    assert ours <= set(ORDER[:position])
    assert not [name for name in imports_of(module) if name.startswith(ABOVE)]
