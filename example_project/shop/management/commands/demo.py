"""Show django-pgjobs at work: migrate, create a superuser, enqueue a burst of orders, and run
a real `runjobs` worker process on them with a live progress line."""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Count, Q, QuerySet

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from example_project.shop import tasks
from example_project.shop.models import Order, Product

USERNAME, PASSWORD = "admin", "pgjobs-demo"
QUEUES = ["emails", "payments", "warehouse", "default"]
#: Every this many orders, a customer typed "UK" for Great Britain: its invoice job is a
#: dead letter, because no retry can make up a VAT rate.
BAD_COUNTRY_EVERY = 25
COUNTRIES = ["GB", "DE", "FR", "IE", "NL", "US"]


@dataclass(frozen=True)
class Progress:
    total: int
    done: int
    retried: int
    dead: int
    live: int


class Command(BaseCommand):
    help = (
        "Demo: migrate, create a superuser, enqueue a burst of sample orders and process them "
        "with a runjobs worker process, showing its progress."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=200, help="orders in the burst")
        parser.add_argument("--concurrency", type=int, default=8, help="the worker's threads")
        parser.add_argument(
            "--timeout", type=float, default=45.0, help="give up after this many seconds"
        )

    def handle(
        self, *args: Any, orders: int, concurrency: int, timeout: float, **options: Any
    ) -> None:
        if not settings.DEBUG:
            raise CommandError("demo creates a superuser with a known password: DEBUG only.")
        self.step("migrating the database")
        call_command("migrate", verbosity=0)
        self.step(f"superuser for the admin: username {USERNAME!r}, password {PASSWORD!r}")
        ensure_superuser()
        self.step(f"placing {orders} orders (each enqueues send_confirmation and charge_card)")
        burst = place_orders(orders)
        log = worker_log()
        self.step(f"starting the worker: {' '.join(worker_command(concurrency)[1:])}")
        self.stdout.write(f"    (its log: {shown(str(log))})")
        started = time.monotonic()
        with log.open("w") as output:
            worker = subprocess.Popen(worker_command(concurrency), stdout=output, stderr=output)
        try:
            progress = self.watch(burst, started, worker, deadline=started + timeout)
        except KeyboardInterrupt:  # the worker had the Ctrl-C too; stop() waits for it
            raise CommandError("interrupted; the worker stopped") from None
        finally:
            code = stop(worker)
        elapsed = time.monotonic() - started
        self.summarise(progress, burst, elapsed, code, orders)
        if code != 0 or progress.live:
            self.stdout.write(tail(log))
            raise CommandError(
                f"the worker exited with {code}"
                if code != 0
                else f"{progress.live} jobs still unfinished after {timeout:.0f}s"
            )

    def watch(
        self, burst: Burst, started: float, worker: subprocess.Popen[bytes], deadline: float
    ) -> Progress:
        """Poll the job counts until no job of the burst is ready or running."""
        tty = self.stdout.isatty()
        last_line = 0.0
        while True:
            progress = count_jobs(burst)
            now = time.monotonic()
            finished = progress.total and not progress.live
            if tty or finished or now - last_line >= 2:
                line = render(progress, now - started)
                self.stdout.write(f"\r\033[K    {line}" if tty else f"    {line}", ending="")
                self.stdout.write("" if tty and not finished else "\n", ending="")
                self.stdout.flush()
                last_line = now
            if finished or now > deadline or worker.poll() is not None:
                if tty and not finished:
                    self.stdout.write("\n", ending="")
                return progress
            time.sleep(0.2)

    def summarise(
        self, progress: Progress, burst: Burst, elapsed: float, code: int, orders: int
    ) -> None:
        rate = progress.done / elapsed if elapsed else 0.0
        dead_tasks = ", ".join(f"{name} × {count}" for name, count in dead_letters_by_task(burst))
        self.stdout.write("")
        self.step("summary")
        self.stdout.write(
            f"    {progress.total} jobs for {orders} orders in {elapsed:.1f}s "
            f"({rate:.0f} jobs/s)\n"
            f"    succeeded {progress.done}, of which {progress.retried} after a retry\n"
            f"    dead letters {progress.dead}" + (f" ({dead_tasks})" if dead_tasks else "") + "\n"
            f"    the worker stopped on SIGTERM with exit code {code}"
        )
        self.step("look around")
        self.stdout.write(look_around(os.environ.get("DATABASE_URL", "")))

    def step(self, message: str) -> None:
        self.stdout.write(self.style.MIGRATE_HEADING(f"==> {message}"))


def look_around(database_url: str) -> str:
    """The commands that open the admin and run a worker on the demo's database: with the
    DATABASE_URL the demo ran with, since a new shell without it opens the embedded server."""
    manage = f"{shown(sys.executable)} manage.py"
    if database_url:
        manage = f"DATABASE_URL={shlex.quote(database_url)} {manage}"
    return (
        f"    {manage} runserver\n"
        f"    http://127.0.0.1:8000/admin/  (username {USERNAME}, password {PASSWORD})\n"
        "        the dead letters are invoices for orders to 'UK': set such an order's\n"
        "        country to GB, then replay its job\n"
        "    http://127.0.0.1:8000/  places orders; a worker processes them:\n"
        f"    {manage} runjobs " + " ".join(f"--queue {q}" for q in QUEUES)
    )


def shown(path: str) -> str:
    """`path` relative to the current folder when it is inside it (the checkout's .venv/)."""
    return os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path


def worker_log() -> Path:
    """The demo worker's log: in the project (ignored by git), each demo's in place of the last
    one's, rather than one more file in the system's temporary folder per demo."""
    return Path(settings.BASE_DIR) / ".demo-worker.log"


def ensure_superuser() -> None:
    user_model = get_user_model()
    user, _ = user_model._default_manager.get_or_create(
        username=USERNAME, defaults={"email": "admin@example.com"}
    )
    user.is_staff = user.is_superuser = True
    user.set_password(PASSWORD)
    user.save()


def place_orders(count: int) -> Burst:
    """Create `count` orders and their first two jobs in one transaction, in bulk (the view
    does the same for one order). Returns the jobs' created_at, the database's clock."""
    rng = random.Random()
    products = list(Product)
    new = []
    for n in range(1, count + 1):
        product, quantity = rng.choice(products), rng.randint(1, 3)
        new.append(
            Order(
                email=f"customer{n}@example.com",
                product=product,
                quantity=quantity,
                country="UK" if n % BAD_COUNTRY_EVERY == 0 else rng.choice(COUNTRIES),
                amount_cents=Order.price(product, quantity),
            )
        )
    with transaction.atomic():
        placed = Order.objects.bulk_create(new)
        payloads = [{"order_id": order.pk} for order in placed]
        jobs = Job.objects.bulk_enqueue(tasks.send_confirmation, payloads)
        Job.objects.bulk_enqueue(tasks.charge_card, payloads)
    return Burst(jobs[0].created_at, [order.pk for order in placed])


def worker_command(concurrency: int) -> list[str]:
    manage = Path(settings.BASE_DIR) / "manage.py"
    queues = [arg for queue in QUEUES for arg in ("--queue", queue)]
    return [sys.executable, str(manage), "runjobs", *queues, "--concurrency", str(concurrency)]


@dataclass(frozen=True)
class Burst:
    """The orders one demo placed, and when."""

    since: datetime
    order_ids: list[int]

    def jobs(self) -> QuerySet[Job]:
        """Every job of this burst, those its handlers enqueue later included (each carries its
        order's id): not the jobs of an earlier demo stopped midway, nor of another at once."""
        return Job.objects.filter(created_at__gte=self.since, payload__order_id__in=self.order_ids)


def count_jobs(burst: Burst) -> Progress:
    counts = burst.jobs().aggregate(
        total=Count("pk"),
        done=Count("pk", filter=Q(status=Status.SUCCEEDED)),
        retried=Count("pk", filter=~Q(status=Status.FAILED) & ~Q(last_error="")),
        dead=Count("pk", filter=Q(status=Status.FAILED)),
        live=Count("pk", filter=Q(status__in=[Status.READY, Status.RUNNING])),
    )
    return Progress(**counts)


def dead_letters_by_task(burst: Burst) -> list[tuple[str, int]]:
    rows = (
        burst.jobs()
        .filter(status=Status.FAILED)
        .values_list("task")
        .annotate(count=Count("pk"))
        .order_by("task")
    )
    return [(name.rsplit(".", 1)[-1], count) for name, count in rows]


def render(progress: Progress, elapsed: float) -> str:
    rate = progress.done / elapsed if elapsed else 0.0
    return (
        f"done {progress.done}/{progress.total}  retried {progress.retried}  "
        f"dead {progress.dead}  running or waiting {progress.live}  {rate:,.0f} jobs/s"
    )


def stop(worker: subprocess.Popen[bytes], grace: float = 20.0) -> int:
    """SIGTERM the worker and wait for it; kill it if it ignores that."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
    try:
        return worker.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        worker.kill()
        return worker.wait()


def tail(log: Path, lines: int = 30) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])
