#!/usr/bin/env python3
"""The project's two commands, with nothing but Python 3.11+ installed:

    python3 dev.py demo    set up everything and run the example shop's job burst
    python3 dev.py test    run the whole test suite (lint, types, migrations, docs, then the tests
                           tier by tier: unit, integration, crash, chaos, browser)

Both create .venv/ and install the project into it on first use, and use DATABASE_URL when it
is set, else an embedded PostgreSQL kept in .pgdata/. `python3 dev.py stopdb` stops that server.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
STAMP = VENV / ".installed"


def main(argv: list[str]) -> int:
    commands = {"demo": demo, "test": test, "stopdb": stopdb}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    if sys.version_info < (3, 11):
        print(f"django-pgjobs needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
        return 2
    if Path(sys.prefix).resolve() != VENV.resolve():
        ensure_venv()
        return run([str(PYTHON), str(ROOT / "dev.py"), *argv], check=False)
    os.chdir(ROOT)
    return commands[argv[0]](argv[1:])


def ensure_venv() -> None:
    """Create .venv and install the project with its dev extras (again when pyproject changes)."""
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return
    if not PYTHON.exists():
        step("creating the virtualenv in .venv/")
        venv.create(VENV, with_pip=True)
    step("installing django-pgjobs and its development tools into .venv/ (first run: ~1 minute)")
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    run([str(PYTHON), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[dev]"])
    STAMP.write_text(wanted)


def test(args: list[str]) -> int:
    started = time.monotonic()
    checks = [
        ("ruff check", ["ruff", "check", "."]),
        ("ruff format --check", ["ruff", "format", "--check", "."]),
        ("mypy", ["mypy"]),
        (
            "makemigrations --check",
            [
                "python",
                "manage.py",
                "makemigrations",
                "--check",
                "--dry-run",
                "--settings",
                "tests.settings",
            ],
        ),
        (
            "docs (sphinx -W)",
            ["sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", "docs/_build/html"],
        ),
    ]
    for name, command in checks:
        step(name)
        if run(tool(command), check=False) != 0:
            print(f"\n{name} failed.")
            return 1
    code = pytest_in_tiers(args)
    print(
        f"\ndev.py test: {'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f}s"
    )
    return code


#: The test tiers, cheapest first (markers given by folder in tests/conftest.py).
TIERS = ["unit", "integration", "property", "crash", "chaos", "browser"]

#: pytest's exit code when a run selects no test: a tier the arguments leave empty.
NO_TESTS_COLLECTED = 5


def pytest_in_tiers(args: list[str]) -> int:
    """Run pytest once per tier, fast first, stopping at the first tier that fails; `args` go
    to every run (a path or -k narrows each tier; with a -m of their own, one plain run)."""
    if any(arg.startswith("-m") for arg in args):
        step("pytest")
        return run(tool(["pytest", *args]), check=False)
    times: list[str] = []
    selected = False
    for n, tier in enumerate(TIERS):
        step(f"pytest: {tier} tests")
        tier_started = time.monotonic()
        code = run(tool(["pytest", "-m", tier, *args]), check=False)
        if code == NO_TESTS_COLLECTED:
            times.append(f"{tier} none selected")
            continue
        times.append(f"{tier} {time.monotonic() - tier_started:.0f}s")
        if code != 0:
            print(f"\nthe {tier} tests failed; not run: {', '.join(TIERS[n + 1 :]) or 'none'}")
            return code
        selected = True
    print(f"\ntiers: {', '.join(times)}")
    if not selected:
        print("no tier selected any test")
        return NO_TESTS_COLLECTED
    return 0


def demo(args: list[str]) -> int:
    return run(tool(["python", "manage.py", "demo", *args]), check=False)


def stopdb(args: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    import devdb

    devdb.stop_embedded()
    return 0


def tool(command: list[str]) -> list[str]:
    """Run a console script or python of the virtualenv we are in."""
    name, *rest = command
    if name == "python":
        return [sys.executable, *rest]
    return [str(Path(sys.executable).parent / name), *rest]


def run(command: list[str], check: bool = True) -> int:
    code = subprocess.call(command, cwd=ROOT)
    if check and code != 0:
        raise SystemExit(f"command failed ({code}): {' '.join(command)}")
    return code


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
