"""The package's modules import one another in one direction: no cycle anywhere, not even
through an import inside a function (imports for type checking alone are left out)."""

from __future__ import annotations

import ast
from pathlib import Path

import django_pgjobs

ROOT = Path(django_pgjobs.__file__).parent
#: Imports inside functions that are not there to dodge a cycle: the package loads before the
#: models can (django_pgjobs/__init__.py), stats must import without settings, and optional
#: extras are imported only when used.
ALLOWED_LATE = {
    ("django_pgjobs", "django_pgjobs.runtime.execute"),
    ("django_pgjobs.observability.stats", "django_pgjobs.models"),
    ("django_pgjobs.management.commands.runjobs", "django_pgjobs.metrics"),
    # tracing imports opentelemetry, which only PGJOBS["TRACING"] may cost.
    ("django_pgjobs.data.enqueue", "django_pgjobs.tracing"),
    ("django_pgjobs.runtime.execute", "django_pgjobs.tracing"),
    # jetstream imports nats, which only a queue whose TRANSPORT is "nats" may cost.
    ("django_pgjobs.management.commands.runjobs", "django_pgjobs.jetstream.workers"),
    ("django_pgjobs.management.commands.relayjobs", "django_pgjobs.jetstream.workers"),
    ("django_pgjobs.apps", "django_pgjobs.jetstream.figures"),
    # apps.py hands observability the seam above once the app is ready.
    ("django_pgjobs.apps", "django_pgjobs.observability.figures"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """The package's modules that `path` imports, each with whether only inside a function."""
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                # `from package import module` imports that module (and runs the package's
                # __init__, which is not a cycle with it); `from module import name`, the module.
                names = [
                    f"{child.module}.{alias.name}"
                    if f"{child.module}.{alias.name}" in modules
                    else child.module
                    for alias in child.names
                ]
            for name in names:
                if name in modules:
                    found[name] = found.get(name, True) and inner
            visit(child, inner)

    visit(ast.parse(path.read_text()), False)
    return found


def test_no_module_of_the_package_takes_part_in_an_import_cycle():
    modules = _modules()
    graph = {
        name: {other for other in _imports(path, modules) if other != name}
        for name, path in modules.items()
    }
    # A package's __init__ importing its own modules is not a cycle with them.
    for name, imported in graph.items():
        graph[name] = {other for other in imported if not name.startswith(f"{other}.")}
    cycles = []
    state: dict[str, int] = {}

    def walk(name: str, stack: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycles.append(" → ".join([*stack[stack.index(other) :], other]))
            elif other not in state:
                walk(other, [*stack, other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_imports_inside_functions_are_only_the_few_with_a_reason():
    modules = _modules()
    late = {
        (name, other)
        for name, path in modules.items()
        for other, only_late in _imports(path, modules).items()
        if only_late and other != name
    }
    assert late <= ALLOWED_LATE, sorted(late - ALLOWED_LATE)
