#!/usr/bin/env python3
"""The project's two commands, with nothing but Python 3.11+ installed:

    python3 dev.py demo    set up everything and run the example shop's job burst
    python3 dev.py test    run the whole test suite (lint, types, migrations, docs, then the tests
                           tier by tier: unit, integration, property, crash, chaos, browser)

Both create .venv/ and install the project into it on first use, and use DATABASE_URL when it
is set, else an embedded PostgreSQL kept in .pgdata/. `python3 dev.py stopdb` stops that server.

    --django 6             (before or after the command) the same on the newest Django 6.x, in
                           .venv-django6/ with Python 3.12 or 3.13 (PGJOBS_PYTHON=/path/to/python
                           to choose one), less what Django's version does not touch (LEGS);
                           without it, Django 5.2 LTS on the Python running dev.py
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Leg:
    """A Django version the suite runs on: its virtualenv and the Pythons that can run it."""

    name: str
    venv: Path
    django: str  # the pip requirement
    pythons: tuple[str, ...]  # the versions to look for, preferred first; () is this Python
    checks: tuple[str, ...]  # the static checks it runs (some do not depend on Django)
    #: Tiers this leg narrows (a marker expression) or leaves out (None); the others run whole.
    tiers: dict[str, str | None] = field(default_factory=dict)


ALL_CHECKS = ("ruff", "mypy", "makemigrations", "docs")
LEGS = {
    "5.2": Leg("5.2", ROOT / ".venv", "Django>=5.2,<6", (), ALL_CHECKS),
    # 3.12 first: pgserver (the embedded PostgreSQL) has no wheel for 3.13 yet. Ruff and the
    # docs do not depend on Django's version; mypy and the migrations check do. Of the crash
    # tests, those through Django's own machinery (tests/conftest.py, EVERY_DJANGO); the
    # property tests' state machines (our SQL) and the chaos tests' faults do not change with
    # Django. So CI's two legs fit its 15 minutes on 2 cores.
    "6": Leg(
        "6",
        ROOT / ".venv-django6",
        "Django>=6,<7",
        ("3.12", "3.13"),
        ("mypy", "makemigrations"),
        {"property": None, "crash": "crash and every_django", "chaos": None},
    ),
}


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):
        print(f"django-pgjobs needs Python 3.11 or newer; this is {sys.version.split()[0]}.")
        return 2
    commands = {"demo": demo, "test": test, "stopdb": stopdb}
    try:
        leg, argv = pop_leg(argv)
    except ValueError as error:
        print(f"dev.py: {error}")
        return 2
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    if argv[0] == "stopdb":
        return stopdb(argv[1:])
    python = venv_python(leg.venv)
    if Path(sys.prefix).resolve() != leg.venv.resolve():
        ensure_venv(leg)
        env = {**os.environ, "PGJOBS_LEG": leg.name}
        return subprocess.call([str(python), str(ROOT / "dev.py"), *argv], cwd=ROOT, env=env)
    os.chdir(ROOT)
    return commands[argv[0]](argv[1:])


def pop_leg(argv: list[str]) -> tuple[Leg, list[str]]:
    """The leg `--django N` names (anywhere in argv; PGJOBS_LEG in the venv's own run), and
    argv without it."""
    name = os.environ.get("PGJOBS_LEG", "5.2")
    rest = []
    args = iter(argv)
    for arg in args:
        if arg == "--django":
            name = next(args, "")
        elif arg.startswith("--django="):
            name = arg.partition("=")[2]
        else:
            rest.append(arg)
    if name not in LEGS:
        raise ValueError(f"--django takes one of {', '.join(LEGS)}, not {name!r}")
    return LEGS[name], rest


def venv_python(folder: Path) -> Path:
    return folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(leg: Leg) -> None:
    """Create the leg's virtualenv and install the project with its dev extras and the leg's
    Django into it (again when pyproject.toml or the leg changes). A virtualenv this run made
    and could not finish is removed, so that the next run makes it again."""
    stamp = leg.venv / ".installed"
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + leg.django.encode())
    if stamp.exists() and stamp.read_text() == wanted.hexdigest():
        return
    python = venv_python(leg.venv)
    made = not python.exists()
    base = find_python(leg) if made else ""
    if not made:
        check_venv_python(leg, python)
    try:
        if made:
            step(f"creating the virtualenv in {leg.venv.name}/ ({base})")
            if base == sys.executable:
                venv.create(leg.venv, with_pip=True)
            else:
                run([base, "-m", "venv", str(leg.venv)])
        step(
            f"installing django-pgjobs, {leg.django} and the development tools into "
            f"{leg.venv.name}/ (first run: ~1 minute)"
        )
        run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
        run([str(python), "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[dev]", leg.django])
    except BaseException:  # a failed install, or Ctrl-C during it
        if made:
            shutil.rmtree(leg.venv, ignore_errors=True)
            print(f"dev.py: removed the unfinished {leg.venv.name}/; the next run makes it again")
        raise
    stamp.write_text(wanted.hexdigest())


def python_version(python: str) -> str | None:
    """The version `python` runs ("3.12"), or None when it does not run."""
    # A pyenv shim on PATH exists even when pyenv cannot run that version: ask it.
    try:
        probe = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    version = probe.stdout.strip()
    return version if probe.returncode == 0 and version.replace(".", "", 1).isdigit() else None


def too_old(version: str, leg: Leg) -> bool:
    """Whether Python `version` is older than the first (the oldest) of the leg's versions."""
    if not leg.pythons:
        return False
    have, needed = (tuple(map(int, text.split("."))) for text in (version, leg.pythons[0]))
    return have < needed


def check_venv_python(leg: Leg, python: Path) -> None:
    """Refuse a leg's existing virtualenv whose Python is older than the leg's Django needs (made
    by hand, or by an older dev.py): every install into it would fail the same way."""
    found = python_version(str(python))
    if found is not None and too_old(found, leg):
        raise SystemExit(
            f"dev.py: {leg.venv.name}/ runs Python {found}, and Django {leg.name} needs "
            f"{leg.pythons[0]} or newer: delete it (rm -rf {leg.venv}) and run again"
        )


def find_python(leg: Leg) -> str:
    """The Python to build the leg's virtualenv with: PGJOBS_PYTHON, else the first of the leg's
    versions found on PATH or in pyenv's folder; a leg without versions uses this Python."""
    if not leg.pythons:
        return sys.executable
    chosen = os.environ.get("PGJOBS_PYTHON")
    if chosen:
        found = python_version(chosen)
        if found is None:
            raise SystemExit(f"dev.py: PGJOBS_PYTHON={chosen} does not run")
        if too_old(found, leg):
            raise SystemExit(
                f"dev.py: PGJOBS_PYTHON={chosen} is Python {found}, and Django {leg.name} needs "
                f"{leg.pythons[0]} or newer: point PGJOBS_PYTHON at a Python "
                f"{' or '.join(leg.pythons)}, or unset it to have one looked for"
            )
        return chosen
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for version in leg.pythons:
        candidates = sorted(str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}"))
        candidates += [shutil.which(f"python{version}") or ""]
        for candidate in filter(None, candidates):
            if python_version(candidate) == version:
                return candidate
    raise SystemExit(
        f"dev.py: Django {leg.name} runs here on Python {' or '.join(leg.pythons)}, and none was "
        f"found on PATH or in {pyenv}: install one, or set PGJOBS_PYTHON=/path/to/python3.12"
    )


def database(*, must_exist: bool) -> None:
    """Reach the database first (one line on failure), before any tool needs it: Django's
    settings open it, and the mypy plugin loads them, which would hide the reason."""
    sys.path.insert(0, str(ROOT))
    import devdb

    step(f"database: {devdb.describe(devdb.database_config(), must_exist=must_exist)}")


def test(args: list[str]) -> int:
    started = time.monotonic()
    leg = LEGS[os.environ.get("PGJOBS_LEG", "5.2")]
    step(f"Django {django_version()} on Python {sys.version.split()[0]} ({leg.venv.name}/)")
    database(must_exist=False)
    migrations = ["makemigrations", "--check", "--dry-run", "--settings", "tests.settings"]
    docs = ["sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", "docs/_build/html"]
    checks = [  # (the check, its step, the command)
        ("ruff", "ruff check", ["ruff", "check", "."]),
        ("ruff", "ruff format --check", ["ruff", "format", "--check", "."]),
        ("mypy", "mypy", ["mypy", "--cache-dir", f".mypy_cache/{leg.name}"]),  # legs run at once
        ("makemigrations", "makemigrations --check", ["python", "manage.py", *migrations]),
        ("docs", "docs (sphinx -W)", docs),
    ]
    for check, name, command in checks:
        if check not in leg.checks:
            continue
        step(name)
        if run(tool(command), check=False) != 0:
            print(f"\n{name} failed.")
            return 1
    skipped = [check for check in ALL_CHECKS if check not in leg.checks]
    if skipped:
        print(f"(not run on this leg, they do not depend on Django: {', '.join(skipped)})")
    code = pytest_in_tiers(args)
    print(
        f"\ndev.py test (Django {django_version()}, Python {sys.version.split()[0]}): "
        f"{'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f}s"
    )
    return code


def django_version() -> str:
    import django

    return django.get_version()


#: The test tiers, cheapest first (markers given by folder in tests/conftest.py), each with the
#: pytest-xdist processes it runs in (0: in pytest's own; each process has a test database of
#: its own). Measured on 2 busy cores with CI's two legs at once: integration and property gain
#: from 2; crash gains from 2 (about 230 s against 330 s in one) and fails timing assertions from
#: 3 on; chaos loses (its workers, SIGKILLed and restarted every 2 s, spend their lives starting
#: up: 170 s and "stuck" jobs in 2, against about 90 s in one), and browser gains nothing.
#: PGJOBS_TEST_PROCESSES=N runs every tier in N (0: one process each); PGJOBS_TIERS=a,b only
#: those tiers.
TIERS = {"unit": 0, "integration": 2, "property": 2, "crash": 2, "chaos": 0, "browser": 0}

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
    names = list(TIERS)
    leg = LEGS[os.environ.get("PGJOBS_LEG", "5.2")]
    only = os.environ.get("PGJOBS_TIERS")  # e.g. CI runs one tier beside the others
    for n, (tier, processes) in enumerate(TIERS.items()):
        marker = leg.tiers.get(tier, tier)
        if marker is None:
            times.append(f"{tier} not on this leg")
            continue
        if only is not None and tier not in only.split(","):
            times.append(f"{tier} not in PGJOBS_TIERS")
            continue
        processes = int(os.environ.get("PGJOBS_TEST_PROCESSES", processes))
        parallel = [] if processes == 0 or chooses_processes(args) else ["-n", str(processes)]
        narrowed = f" ({marker})" if marker != tier else ""
        step(f"pytest: {tier} tests{narrowed}" + (f" ({processes} processes)" if parallel else ""))
        tier_started = time.monotonic()
        code = run(tool(["pytest", "-m", marker, *parallel, *args]), check=False)
        if code == NO_TESTS_COLLECTED:
            times.append(f"{tier} none selected")
            continue
        times.append(
            f"{tier} {time.monotonic() - tier_started:.0f}s" + (" (failed)" if code else "")
        )
        if code != 0:
            print(f"\nthe {tier} tests failed; not run: {', '.join(names[n + 1 :]) or 'none'}")
            print(f"tiers: {', '.join(times)}")
            return code
        selected = True
    print(f"\ntiers: {', '.join(times)}")
    if not selected:
        print("no tier selected any test")
        return NO_TESTS_COLLECTED
    return 0


def chooses_processes(args: list[str]) -> bool:
    """The arguments have an -n of their own (-n 4, -n4, -nauto, --numprocesses)."""
    return any(arg.startswith(("-n", "--numprocesses")) for arg in args)


def demo(args: list[str]) -> int:
    database(must_exist=True)
    code = run(tool(["python", "manage.py", "demo", *args]), check=False)
    if not os.environ.get("DATABASE_URL"):
        print(
            "\nThe embedded PostgreSQL keeps running (data in .pgdata/); "
            "stop it with: python3 dev.py stopdb"
        )
    return code


def stopdb(args: list[str]) -> int:
    """Stop the embedded server; it needs no virtualenv (pg_ctl of pgserver's, or on PATH)."""
    sys.path.insert(0, str(ROOT))
    import devdb

    return devdb.stop_embedded()


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
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C: what ran under dev.py has said how it ended
        sys.exit(130)
