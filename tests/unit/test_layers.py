"""The package's layers import one another in one direction. Every import of every module counts:
at the top, inside functions, under TYPE_CHECKING, and importlib.import_module("a literal").
docs/explanation/architecture.md lists these rules, (a) to (g); change both together."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import django_pgjobs

ROOT = Path(django_pgjobs.__file__).parent

#: (f) Import cycles allowed for now, each the set of its modules (none: keep it so). The test
#: fails while a cycle listed here no longer exists.
KNOWN_CYCLES: list[frozenset[str]] = []

#: The upper layers: the runtime, observability, the admin, the commands, NATS, and the callers
#: at the package's root.
UPPER = (
    "django_pgjobs.runtime",
    "django_pgjobs.observability",
    "django_pgjobs.admin",
    "django_pgjobs.management",
    "django_pgjobs.jetstream",
    "django_pgjobs.apps",
    "django_pgjobs.backend",
    "django_pgjobs.checks",
    "django_pgjobs.metrics",
    "django_pgjobs.testing",
)

#: Each rule: the modules it holds (a prefix), and what they never import.
NEVER = {
    # (a) The data layer decides how job state changes; it knows nothing of when or who asks.
    "django_pgjobs.data": (
        "django_pgjobs.runtime",
        "django_pgjobs.observability",
        "django_pgjobs.admin",
        "django_pgjobs.management",
        "django_pgjobs.jetstream",
    ),
    # (b) The schema and the statuses are below everything but the data layer's managers.
    "django_pgjobs.models": UPPER,
    "django_pgjobs.status": UPPER,
    # (c) Observability only reads: it serves the admin, the commands and metrics.
    "django_pgjobs.observability": (
        "django_pgjobs.runtime",
        "django_pgjobs.admin",
        "django_pgjobs.management",
        "django_pgjobs.metrics",
    ),
}

#: (c) Inside observability/, each module imports only those before it (as its __init__ lists).
OBSERVABILITY_ORDER = ("stats", "dbstats", "load", "figures", "health", "report", "tasks")

#: (d) The only modules outside jetstream/ that import it (or nats), each only when a queue uses
#: NATS: jetstream/ needs nats-py, which a project without such queues does not install.
JETSTREAM_SEAMS = {
    "django_pgjobs.management.commands.runjobs": "runs a NATS queue's worker, and the relay",
    "django_pgjobs.management.commands.relayjobs": "runs the relay alone",
    "django_pgjobs.apps": "hands the health report the NATS queues' figures",
}

#: (e) Optional extras, each imported only by the modules named here.
EXTRAS = {
    "opentelemetry": {
        "django_pgjobs.tracing": "the spans, imported only when PGJOBS['TRACING'] is on",
        "django_pgjobs.checks": "pgjobs.E030 tries importing it when PGJOBS['TRACING'] is on",
    },
    "prometheus_client": {"django_pgjobs.metrics": "the Prometheus integration"},
}

#: (g) Imports inside functions that are not there to dodge a cycle: the package loads before the
#: models can (django_pgjobs/__init__.py, apps.py), stats must import without settings, and
#: optional extras are imported only when used.
ALLOWED_LATE = {
    ("django_pgjobs", "django_pgjobs.runtime.execute"),
    ("django_pgjobs.apps", "django_pgjobs.checks"),
    ("django_pgjobs.apps", "django_pgjobs.periodic"),
    ("django_pgjobs.apps", "django_pgjobs.backend"),
    ("django_pgjobs.apps", "django_pgjobs.observability.figures"),
    ("django_pgjobs.observability.stats", "django_pgjobs.models"),
    ("django_pgjobs.management.commands.runjobs", "django_pgjobs.metrics"),
    # tracing imports opentelemetry, which only PGJOBS["TRACING"] may cost.
    ("django_pgjobs.data.enqueue", "django_pgjobs.tracing"),
    ("django_pgjobs.runtime.execute", "django_pgjobs.tracing"),
    # jetstream imports nats, which only a queue whose TRANSPORT is "nats" may cost.
    ("django_pgjobs.management.commands.runjobs", "django_pgjobs.jetstream.source"),
    ("django_pgjobs.management.commands.relayjobs", "django_pgjobs.jetstream.relay"),
    ("django_pgjobs.apps", "django_pgjobs.jetstream.streams"),
}


@dataclass(frozen=True)
class Import:
    name: str  # the module imported: the package's own resolved to a module of it
    line: int
    late: bool  # inside a function
    typing: bool  # under `if TYPE_CHECKING:`


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _names(node: ast.AST, module: str) -> list[str]:
    """The modules `node` imports, if it is an import: `from package import module` imports that
    module, `from module import name` the module; a literal importlib.import_module too."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package of the importing module
            is_package = module not in MODULES or MODULES[module].name == "__init__.py"
            package = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
        return [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
            for alias in node.names
        ]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def imports_in(source: str, module: str) -> list[Import]:
    """Every import in `source`, the text of `module`."""
    found: list[Import] = []

    def visit(node: ast.AST, late: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner_late = late or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            inner_typing = typing or (isinstance(child, ast.If) and _is_type_checking(child))
            for name in _names(child, module):
                found.append(Import(name, getattr(child, "lineno", 0), inner_late, inner_typing))
            visit(child, inner_late, inner_typing)

    visit(ast.parse(source), False, False)
    return found


IMPORTS = {module: imports_in(path.read_text(), module) for module, path in MODULES.items()}


def _within(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == prefix or name.startswith(f"{prefix}.") for prefix in prefixes)


def test_every_kind_of_import_counts():
    source = (
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "from django_pgjobs import registry\n"
        "if TYPE_CHECKING:\n"
        "    from django_pgjobs.models import Job\n"
        "def later():\n"
        "    from django_pgjobs.runtime import execute\n"
        "    from .data import rows\n"
        "    importlib.import_module('django_pgjobs.checks')\n"
    )
    found = {(each.name, each.late, each.typing) for each in imports_in(source, "django_pgjobs")}
    assert found >= {
        ("django_pgjobs.registry", False, False),
        ("django_pgjobs.models", False, True),
        ("django_pgjobs.runtime.execute", True, False),
        ("django_pgjobs.data.rows", True, False),
        ("django_pgjobs.checks", True, False),
    }


def _offences(held: str, forbidden: tuple[str, ...]) -> Iterator[str]:
    for module, imports in IMPORTS.items():
        if _within(module, held):
            for each in imports:
                if _within(each.name, forbidden):
                    yield f"{module}:{each.line} imports {each.name}"


@pytest.mark.parametrize("held", list(NEVER))
def test_a_lower_layer_never_imports_an_upper_one(held):
    assert list(_offences(held, NEVER[held])) == []


def test_observability_modules_import_only_those_before_them():
    package = "django_pgjobs.observability"
    ours = {name.removeprefix(f"{package}.") for name in MODULES if name.startswith(f"{package}.")}
    assert ours == set(OBSERVABILITY_ORDER)
    offences = []
    for position, stem in enumerate(OBSERVABILITY_ORDER):
        module = f"{package}.{stem}"
        below = {f"{package}.{each}" for each in OBSERVABILITY_ORDER[:position]} | {package}
        offences += [
            f"{module}:{each.line} imports {each.name}"
            for each in IMPORTS[module]
            if _within(each.name, package) and each.name not in below
        ]
    assert offences == []


def test_only_the_seams_import_jetstream_or_nats():
    offences = [
        f"{module}:{each.line} imports {each.name}"
        for module, imports in IMPORTS.items()
        if not _within(module, "django_pgjobs.jetstream") and module not in JETSTREAM_SEAMS
        for each in imports
        if _within(each.name, ("django_pgjobs.jetstream", "nats"))
    ]
    assert offences == []
    # Each seam still is one: a stale entry would let the next import slip through unseen.
    stale = [
        seam
        for seam in JETSTREAM_SEAMS
        if not any(_within(each.name, "django_pgjobs.jetstream") for each in IMPORTS[seam])
    ]
    assert stale == []


@pytest.mark.parametrize("extra", list(EXTRAS))
def test_an_optional_extra_is_imported_only_by_its_own_modules(extra):
    offences = [
        f"{module}:{each.line} imports {each.name}"
        for module, imports in IMPORTS.items()
        if module not in EXTRAS[extra]
        for each in imports
        if _within(each.name, extra)
    ]
    assert offences == []


def _graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports, however. A package's __init__ importing its
    own modules is not a cycle with them; nor is the model classes' name in an annotation:
    models.py imports the data layer's managers (Django wants them in the class body), and the
    data layer (with the records, registry, signals and tracing it uses) names the models only
    under TYPE_CHECKING, reaching them at run time through the manager."""
    return {
        module: {
            each.name
            for each in imports
            if each.name in MODULES
            and each.name != module
            and not _within(module, each.name)
            and not (each.typing and each.name == "django_pgjobs.models")
        }
        for module, imports in IMPORTS.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def connect(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in sorted(graph[name]):
            if other not in index:
                connect(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == name:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return found


def test_the_cycle_check_finds_every_module_of_a_cycle_and_only_those():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "e"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycle_but_the_known_ones():
    cycles = _cycles(_graph())
    assert [sorted(cycle) for cycle in cycles if cycle not in KNOWN_CYCLES] == []
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES if cycle not in cycles]
    assert gone == [], "this cycle is gone: take it off KNOWN_CYCLES"


def test_imports_inside_functions_are_only_the_few_with_a_reason():
    late = set()
    for module, imports in IMPORTS.items():
        running = [each for each in imports if each.name in MODULES and not each.typing]
        for name in {each.name for each in running} - {module}:
            if all(each.late for each in running if each.name == name):
                late.add((module, name))
    assert late <= ALLOWED_LATE, sorted(late - ALLOWED_LATE)
