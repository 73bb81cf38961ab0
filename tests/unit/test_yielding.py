"""Yielding to the application (runtime/controls.py), without a database: the allowed rate a
window's signal leads to, the tokens a claim may take, and the windows, probes and baselines
the gauge makes of samples stamped with the database's clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from django_pgjobs.runtime import controls
from django_pgjobs.runtime.controls import (
    DECREASE,
    DECREASE_MOST,
    PROBE_EVERY,
    PROBE_FROM,
    SAMPLE,
    STARTS_AFTER,
    UNUSED_WINDOWS,
    WINDOW,
    Gauge,
    QueueControls,
    Yielding,
)

BASE = 0.002  # seconds: the application's open transactions, added up, on a normal day


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(controls.time, "monotonic", clock)
    return clock


def window(group: Yielding, signal: float, took: int, held: bool = True) -> str | None:
    """One window in which the worker claimed `took` jobs (held back: it wanted more)."""
    group.took(took)
    group._held = held
    return group.judge(signal, BASE)


def test_no_baseline_no_limit():
    group = Yielding(1.1, 10, ["default"])
    for _ in range(10):
        group.took(5000)
        assert group.judge(BASE * 50, None) is None
    assert group.rate is None
    assert group.room(100) == 100


def test_it_starts_yielding_after_windows_over_the_budget_in_a_row():
    group = Yielding(1.1, 10, ["default"])
    over = BASE * 1.1**2 * 1.5
    results = [window(group, over, 5000) for _ in range(STARTS_AFTER)]
    assert results[:-1] == [None] * (STARTS_AFTER - 1)
    assert results[-1] == "started"
    limit = group.over(BASE)
    assert group.rate == pytest.approx(5000 * limit / over)  # as much less as it was over


def test_a_signal_far_over_the_budget_starts_at_once_and_at_most_halves_the_rate():
    group = Yielding(1.1, 10, ["default"])
    assert window(group, BASE * 100, 5000) == "started"
    assert group.rate == pytest.approx(5000 * DECREASE_MOST)
    window(group, group.over(BASE) * 1.01, int(group.rate))
    assert group.rate == pytest.approx(5000 * DECREASE_MOST * DECREASE)  # a little over: -10%


def test_one_window_over_the_budget_is_not_enough():
    group = Yielding(1.1, 10, ["default"])
    for _ in range(10):
        assert window(group, BASE * 2, 5000) is None or STARTS_AFTER == 1
        assert window(group, BASE, 5000) is None
    assert group.rate is None


def test_over_the_budget_the_rate_falls_to_the_floor_and_no_lower():
    group = Yielding(1.1, 10, ["a", "b"])
    for _ in range(200):
        window(group, BASE * 10, 5000)
    assert group.rate == 20  # the floor of each of its two queues


def test_under_the_budget_the_rate_grows_back_and_is_lifted_once_unused():
    group = Yielding(1.1, 10, ["default"])
    for _ in range(STARTS_AFTER):
        window(group, BASE * 3, 1000)
    low = group.rate
    assert low is not None
    window(group, BASE, int(low))
    assert group.rate is not None and group.rate > low
    changes = [window(group, BASE, 10, held=False) for _ in range(UNUSED_WINDOWS)]
    assert changes[-1] == "stopped"
    assert group.rate is None


def test_tokens_let_through_the_rate_in_claims_of_a_chunk_or_more(clock: Clock):
    group = Yielding(1.1, 10, ["default"])
    group.rate = 1000.0
    assert group.room(100) == 0  # no token saved up yet
    clock.now += 0.05
    room = group.room(100)
    assert room == 50
    group.took(room)
    assert group.room(100) == 0
    assert group.next_in(100) == pytest.approx(0.02)  # a chunk: 20 jobs at 1,000/s
    clock.now += 10
    assert group.room(1000) == 100  # what it saves up is capped: no burst after a pause


def test_a_probe_holds_the_group_at_its_floor(clock: Clock):
    group = Yielding(1.1, 10, ["default"])
    assert group.limit() is None
    group.probing = True
    assert group.limit() == 10
    clock.now += 0.5
    assert group.room(100) == 1  # (the floor saves up a token at least)


# ---- the gauge ----------------------------------------------------------------------------


def run(gauge: Gauge, start: float, seconds: float, ages: list[float], every: float = SAMPLE):
    """Samples from `start` (the database's clock) for `seconds`, each seeing `ages`."""
    n = round(seconds / every)
    for i in range(n):
        gauge.seen(start + i * every, ages)
    return start + n * every


def quiet_windows_start() -> float:
    """A database clock at the start of a window that probes."""
    return PROBE_EVERY * WINDOW * 1_000_000.0


def test_a_sparse_application_is_not_probed_nor_judged():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    at = quiet_windows_start() + WINDOW
    for _ in range(10 * PROBE_EVERY):  # a transaction seen now and then: 4 a window
        gauge.wanted()
        at = run(gauge, at, WINDOW / 5, [0.001])
        at = run(gauge, at, WINDOW * 4 / 5, [])
        group.took(5000)
    assert gauge.baseline is None
    assert group.rate is None


def test_the_first_probe_comes_once_the_application_is_seen_and_measures_the_baseline():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    ages = [0.0002] * 12  # 12 open transactions, 2.4 ms in all
    start = quiet_windows_start() + 3 * WINDOW
    at = run(gauge, start, WINDOW, [])  # nothing of the application: no probe
    assert gauge.probing() is False
    at = run(gauge, at, WINDOW, ages)  # the application seen: the next window probes
    assert gauge.probing() is False
    at = run(gauge, at, WINDOW * PROBE_FROM, [0.005] * 12)  # the jobs claimed before, finishing
    assert gauge.probing() and group.probing and group.limit() == 10
    at = run(gauge, at, WINDOW * (1 - PROBE_FROM), ages)
    run(gauge, at, WINDOW, ages)
    assert gauge.quiet == pytest.approx(0.0024)
    assert group.probing is False


def test_probes_line_up_on_the_database_clock_while_the_worker_does_not_keep_up():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    gauge.quiet = BASE
    gauge._probes = [BASE]
    start = quiet_windows_start() + WINDOW
    probing = []
    at = start
    for _ in range(2 * PROBE_EVERY):
        gauge.wanted(dry=False)
        at = run(gauge, at, WINDOW, [0.0002] * 12)
        probing.append(gauge.probing())
    windows = [int(start // WINDOW) + i for i in range(2 * PROBE_EVERY)]
    assert [w for w, p in zip(windows, probing, strict=True) if p] == [
        w for w in windows if w % PROBE_EVERY == 0
    ]


def test_while_the_worker_keeps_up_its_normal_day_is_the_baseline_and_nothing_probes():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    at = quiet_windows_start() + WINDOW
    for _ in range(3 * PROBE_EVERY):
        gauge.wanted(dry=True)
        at = run(gauge, at, WINDOW, [0.0003] * 10)
        assert not gauge.probing()
    assert gauge.normal == pytest.approx(0.003)
    assert gauge.baseline == pytest.approx(0.003)
    assert group.rate is None


def test_a_backlog_that_slows_the_application_is_yielded_to_and_a_calm_one_is_not():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    gauge.normal, gauge._kept_up_at = 0.003, 0
    at = quiet_windows_start() + WINDOW
    gauge._kept_up_at = int(at // WINDOW)
    for _ in range(5):
        group.took(5000)
        at = run(gauge, at, WINDOW, [0.0003] * 10)  # the backlog: as calm as the normal day
    assert group.rate is None
    for _ in range(5):
        group.took(5000)
        at = run(gauge, at, WINDOW, [0.0006] * 10)  # twice as long
    assert group.rate is not None and group.rate < 5000


def test_a_gap_in_the_samples_drops_the_window():
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    at = run(gauge, quiet_windows_start() + WINDOW, WINDOW / 2, [0.0003] * 10)
    gauge.seen(at + 5 * WINDOW, [0.0003] * 10)  # five windows later: nothing judged
    assert gauge.signal is None


# ---- the claim's rooms ----------------------------------------------------------------------


def test_a_queue_that_never_yields_takes_all_it_wants_beside_one_held_back(clock: Clock):
    queues = QueueControls(["payments", "reports"], 1.0)
    queues.open = ["payments", "reports"]
    queues.yield_to("default", {"payments": None, "reports": 1.1}, 10)
    group = queues.yielding["reports"]
    group.rate = 100.0
    assert queues.admit(50) == 50
    assert queues.rooms == {"payments": 50, "reports": 0}
    clock.now += 0.05
    assert queues.admit(50) == 50
    assert queues.rooms == {"payments": 50, "reports": 5}
    queues.took([SimpleNamespace(queue="reports")] * 5, 50)  # type: ignore[list-item]
    assert group.tokens == pytest.approx(0, abs=1e-6)


def test_only_yielding_queues_held_back_claim_nothing_until_a_token(clock: Clock):
    queues = QueueControls(["reports"], 1.0)
    queues.open = ["reports"]
    queues.yield_to("default", {"reports": 1.1}, 10)
    queues.yielding["reports"].rate = 100.0
    assert queues.admit(50) == 0
    assert queues.next_in(50) == pytest.approx(0.02)
    clock.now += 0.02
    assert queues.admit(50) == 2


def test_without_yielding_queues_the_claim_is_untouched():
    queues = QueueControls(["a", "b"], 1.0)
    queues.open = ["a", "b"]
    queues.yield_to("default", {"a": None, "b": None}, 10)
    assert queues.admit(100) == 100
    assert queues.next_in(100) == 0
    assert queues.gauge is not None and queues.gauge.groups == []


def test_it_never_yields_below_the_rate_of_its_normal_day():
    # A worker keeping up with 1,000 jobs a second; then the application gets busier by itself.
    group = Yielding(1.1, 10, ["default"])
    for _ in range(5):
        group.took(1000)
        group.judge(BASE, BASE, kept_up=True)
    for _ in range(50):
        window(group, BASE * 10, 1000)
    assert group.rate == pytest.approx(1000)


def test_nothing_probes_while_the_application_is_not_there():
    # A drain with no application beside it: a probe would only hold its first second back.
    group = Yielding(1.1, 10, ["default"])
    gauge = Gauge("default", [group])
    at = quiet_windows_start()
    for _ in range(2 * PROBE_EVERY):
        at = run(gauge, at, WINDOW, [])
        assert not gauge.probing() and group.limit() is None


def test_it_reads_a_few_times_a_second_until_the_application_is_seen():
    gauge = Gauge("default", [Yielding(1.1, 10, ["default"])])
    gauge.sample = lambda: None  # type: ignore[method-assign]  # no database here
    gauge.wanted()
    assert gauge.run() == controls.SAMPLE_ABSENT
    at = run(gauge, quiet_windows_start() + WINDOW, WINDOW, [0.0002] * 3)  # 60 seen
    run(gauge, at, controls.SAMPLE, [])  # the next window: the last one saw it
    assert gauge.run() == SAMPLE
