#!/usr/bin/env python3
"""The project's two commands, with nothing but Python 3.11+ installed:

    python3 dev.py demo    set up everything and run the example shop's job burst
    python3 dev.py test    run the whole test suite (lint, types, migrations, tests, docs)

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
    step("pytest")
    code = run(tool(["pytest", *args]), check=False)
    print(
        f"\ndev.py test: {'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f}s"
    )
    return code


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
