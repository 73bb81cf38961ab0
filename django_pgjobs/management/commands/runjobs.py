"""manage.py runjobs: run a worker until SIGTERM/SIGINT (or, with --once, until drained)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from argparse import SUPPRESS, ArgumentParser, ArgumentTypeError
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import router

from django_pgjobs import checks, transports
from django_pgjobs.conf import get_settings
from django_pgjobs.errors import EnqueueError
from django_pgjobs.models import Job
from django_pgjobs.runtime import processes, sessions
from django_pgjobs.runtime.lifecycle import STOP_SIGNALS, Exit, Options, worker_id
from django_pgjobs.runtime.processes import Supervisor
from django_pgjobs.runtime.reporting import WorkerError, log_safely
from django_pgjobs.runtime.worker import Worker, refuse_unmigrated
from django_pgjobs.validation import MAX_SECONDS, check_queue

logger = logging.getLogger("django_pgjobs.runtime.worker")


def _queue(value: str) -> str:
    try:
        return check_queue(value)
    except EnqueueError as error:
        raise ArgumentTypeError(str(error)) from None


def _number(kind: type[int] | type[float], value: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number") from None


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(value: str) -> int | float:
        number = _number(kind, value)
        if number <= 0:
            raise ArgumentTypeError(f"must be greater than 0, got {value}")
        return number

    return parse


#: The shortest --lease: heartbeats renew leases every lease/3 seconds, so a shorter lease is
#: lost to any statement that takes a moment. Under checks.MIN_LEASE it only warns.
MIN_LEASE = 1.0


def _lease(value: str) -> float:
    seconds = _number(float, value)
    if seconds >= MAX_SECONDS:
        raise ArgumentTypeError(f"must be below {MAX_SECONDS:g} seconds, got {value}")
    if not seconds >= MIN_LEASE:  # NaN too
        raise ArgumentTypeError(
            f"must be at least {MIN_LEASE:g} second, got {value}: heartbeats renew a lease "
            f"every lease/3 seconds, so a shorter lease is lost while its job still runs "
            f"(use {checks.MIN_LEASE:g} or more in production)"
        )
    return seconds


def _grace(value: str) -> float:
    seconds = _number(float, value)
    if not 0 <= seconds < 1e9:
        raise ArgumentTypeError(
            f"must be 0 or more seconds, got {value}: the time running jobs get to finish "
            "after a stop signal (0 releases them at once)"
        )
    return seconds


#: The options a worker's Options takes under the same names.
_AS_NAMED = ("concurrency", "batch_size", "lease", "grace", "poll_interval", "listen", "once",
             "worker_id", "relay", "yielding")  # fmt: skip

#: How to stop what runs now (the worker, or the supervisor), for --reload.
_stoppers: list[processes.Stops] = []


class Command(BaseCommand):
    help = (
        "Run a job worker: claim due jobs from the given queues, run their handlers on threads, "
        "and record the outcomes. SIGTERM or SIGINT stops claiming and lets running jobs finish "
        "within --grace seconds; a second signal releases them at once."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        defaults = Options()
        parser.add_argument(
            "--queue",
            "-q",
            dest="queues",
            action="append",
            type=_queue,
            metavar="QUEUE",
            help="a queue to take jobs from; repeat for several "
            f"(default: {get_settings().DEFAULT_QUEUE!r})",
        )
        parser.add_argument(
            "--concurrency",
            "-c",
            type=_positive(int),
            default=defaults.concurrency,
            help=f"handlers run in parallel (threads; default {defaults.concurrency})",
        )
        parser.add_argument(
            "--batch-size",
            type=_positive(int),
            default=defaults.batch_size,
            help="most jobs claimed per statement, never more than free slots "
            f"(default {defaults.batch_size})",
        )
        parser.add_argument(
            "--lease",
            type=_lease,
            help="seconds a claim holds a job before it may be reaped; heartbeats "
            "extend it every lease/3 (default PGJOBS['LEASE'], "
            f"{get_settings().LEASE:g})",
        )
        parser.add_argument(
            "--grace",
            type=_grace,
            default=defaults.grace,
            help="seconds running jobs get to finish on shutdown before they are "
            f"released back to ready (default {defaults.grace:g})",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="run what is due now, then exit (for tests and cron-style use)",
        )
        parser.add_argument(
            "--poll-interval",
            type=_positive(float),
            default=defaults.poll_interval,
            help="longest wait between polls when idle, in seconds "
            f"(default {defaults.poll_interval:g})",
        )
        parser.add_argument("--no-listen", dest="listen", action="store_false",
                            help="do not LISTEN for wake-ups; poll only (PgBouncer in transaction "
                                 "pooling mode)")  # fmt: skip
        parser.add_argument("--no-relay", dest="relay", action="store_false",
                            help="leave the outbox of NATS queues to other runjobs or relayjobs "
                                 "processes")  # fmt: skip
        parser.add_argument("--no-yield", dest="yielding", action="store_false",
                            help="claim at full speed, whatever the application's transactions "
                                 "(by default queues yield to them: YIELD_BUDGET)")  # fmt: skip
        parser.add_argument(
            "--processes",
            "-p",
            type=_positive(int),
            default=1,
            help="worker processes, each with --concurrency threads, run and restarted by a "
            "supervisor (default 1: this process is the worker)",
        )
        parser.add_argument(
            "--max-jobs-per-child",
            type=_positive(int),
            metavar="N",
            help="replace a worker process gracefully after it recorded N outcomes",
        )
        parser.add_argument(
            "--max-memory-per-child",
            type=_positive(float),
            metavar="MB",
            help="replace a worker process gracefully when its resident memory passes MB",
        )
        parser.add_argument(
            "--reload",
            action="store_true",
            help="restart when Python files change (development; Django's autoreloader)",
        )
        # Set by the supervisor for its children.
        parser.add_argument("--worker-id", help=SUPPRESS)
        parser.add_argument("--supervised-by", type=int, help=SUPPRESS)
        parser.add_argument(
            "--metrics-port",
            type=_positive(int),
            metavar="PORT",
            help="serve this worker's Prometheus metrics on PORT (needs the prometheus extra)",
        )
        parser.add_argument(
            "--metrics-addr",
            default="0.0.0.0",
            metavar="ADDRESS",
            help="the address --metrics-port listens on (default 0.0.0.0)",
        )

    def run_from_argv(self, argv: list[str]) -> None:
        """As Django runs it from the command line; the process then ends within the grace even
        if threads its handlers started are still running (runtime/processes.py)."""
        code = 1
        try:
            super().run_from_argv(argv)
            code = 0
        except SystemExit as exit:
            code = processes.exit_code(exit.code)
            raise
        finally:
            # Its status is known: a stop signal now must not turn it into the signal's.
            for signum in STOP_SIGNALS:
                with contextlib.suppress(ValueError):  # not the main thread
                    signal.signal(signum, signal.SIG_IGN)
            processes.bound_exit(code, self._grace)

    def execute(self, *args: Any, **options: Any) -> str | None:
        if options.get("reload"):
            # As runserver's: checks run in the reloading child, where an error keeps it watching.
            self.requires_system_checks = []
        return super().execute(*args, **options)

    #: --grace, once handle() has read it.
    _grace = Options().grace

    def handle(self, *args: Any, **options: Any) -> None:
        _show_logs(options["verbosity"])
        self._grace = options["grace"]
        lease = options["lease"]
        # A supervisor's children leave the warnings to it (runjobs --processes).
        if lease is not None and lease < checks.MIN_LEASE and not options["supervised_by"]:
            log_safely(logger.warning,
                "--lease %g is under %gs: heartbeats go out every lease/3 and the reaper looks "
                "every 5 s, so a worker paused for more than %gs (a database failover, a long "
                "garbage collection) loses its jobs to another worker while their handlers "
                "still run (see check pgjobs.W021)",
                lease, checks.MIN_LEASE, lease,
            )  # fmt: skip
        if options["processes"] > 1 and options["once"]:
            raise CommandError("--once runs one worker; leave out --processes.")
        if options["once"] and options["max_jobs_per_child"]:
            raise CommandError(
                "--once drains the queues and exits; --max-jobs-per-child would end it part "
                "way, jobs left and status 75 (a failure to cron): leave one out."
            )
        if options["processes"] > 1 and options["metrics_port"]:
            raise CommandError(
                "--metrics-port serves one process's metrics; with --processes, scrape the "
                "report view (django_pgjobs.metrics.report_view) instead."
            )

        def run() -> int:
            return self.run(options)

        def check() -> None:
            if not options["skip_checks"]:
                self.check()

        code = processes.run_reloading(run, _stoppers, check) if options["reload"] else run()
        if code and options["processes"] > 1:
            raise CommandError(
                "worker processes failed (kept dying, or stopped without releasing their "
                "jobs): see the supervisor's log lines above"
            )
        if code == Exit.UNRELEASED:
            raise CommandError(
                "stopped without recording or releasing every job it held; "
                "those return to ready when their leases expire"
            )
        if code:
            sys.exit(code)

    def run(self, options: dict[str, Any]) -> int:
        """Run the supervisor or the worker until stopped; returns the exit code."""
        queues = options["queues"] or [get_settings().DEFAULT_QUEUE]
        if options["processes"] > 1:
            try:
                refuse_unmigrated(router.db_for_write(Job))
            except WorkerError as error:
                raise CommandError(str(error)) from None
            who = f"the workers of supervisor {os.getpid()}"
            sessions.warn(router.db_for_write(Job), queues, who)
            supervisor = Supervisor(options["processes"], _child_args(options), options["grace"])
            _stoppers.append(supervisor)
            try:
                return supervisor.run()
            finally:
                _stoppers.remove(supervisor)
        if options["metrics_port"]:
            _serve_metrics(options["metrics_port"], options["metrics_addr"])
        ident = options["worker_id"] or worker_id()  # a new one for each run of --reload
        with sessions.named_connections(router.db_for_write(Job), ident):
            return self.work(queues, {**options, "worker_id": ident})

    def work(self, queues: list[str], options: dict[str, Any]) -> int:
        """Run this process's worker until it stops; its exit status."""
        worker = _worker(
            Options(
                queues=queues,
                max_jobs=options["max_jobs_per_child"],
                max_memory_mb=options["max_memory_per_child"],
                parent_pid=options["supervised_by"],
                **{name: options[name] for name in _AS_NAMED},
            )
        )

        def on_signal(signum: int, frame: FrameType | None) -> None:
            worker.signalled(signum)

        # Signal handlers belong to the main thread (under --reload the reloader passes signals on).
        main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS} if main else {}
        _stoppers.append(worker)
        try:
            return int(worker.run())
        except WorkerError as error:
            raise CommandError(str(error)) from None
        finally:
            _stoppers.remove(worker)
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _worker(options: Options) -> Worker:
    """A Worker; when a queue uses NATS (PGJOBS["QUEUES"]), what jetstream/source.py picks.
    Imported only then: the PostgreSQL-only install never imports nats."""
    if not transports.nats_queues():
        return Worker(options)
    from django_pgjobs.jetstream import source

    try:
        return source.worker(options)
    except source.MixedQueues as error:
        raise CommandError(str(error)) from None


def _child_args(options: dict[str, Any]) -> list[str]:
    """The command line of a supervisor's children: these options, but one process each."""
    args = [f"--verbosity={options['verbosity']}"]
    for queue in options["queues"] or []:
        args += ["--queue", queue]
    for name in ("concurrency", "batch_size", "lease", "grace", "poll_interval",
                 "max_jobs_per_child", "max_memory_per_child"):  # fmt: skip
        if options.get(name) is not None:
            args.append(f"--{name.replace('_', '-')}={options[name]}")
    if not options["listen"]:
        args.append("--no-listen")
    if not options["relay"]:
        args.append("--no-relay")
    if not options["yielding"]:
        args.append("--no-yield")
    if options.get("settings"):
        args.append(f"--settings={options['settings']}")
    return args


def _serve_metrics(port: int, addr: str) -> None:
    try:
        from django_pgjobs import metrics
    except ImportError as error:
        raise CommandError(
            f"--metrics-port needs the prometheus-client package ({error}); install it with "
            "pip install 'django-pgjobs[prometheus]'"
        ) from None
    try:
        metrics.serve(port, addr)
    except OSError as error:
        raise CommandError(f"--metrics-port {port}: cannot listen on {addr}: {error}") from None


def _show_logs(verbosity: int) -> None:
    """Print the worker's log lines unless the project configured logging for them."""
    logger = logging.getLogger("django_pgjobs")
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)
