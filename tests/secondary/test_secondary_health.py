"""The up/down state machine with backoff, on a clock the test turns by hand."""

from __future__ import annotations

import random

import pytest

from tiering.errors import ConfigError
from tiering.secondary.health import Admission, HealthGate, TierState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock, backoff: tuple[float, float] = (1.0, 8.0)) -> HealthGate:
    return HealthGate(backoff, jitter=0.0, clock=clock)


def test_up_admits_every_call() -> None:
    g = gate(Clock())
    assert [g.admit() for _ in range(3)] == [Admission.NORMAL] * 3
    assert g.succeeded(Admission.NORMAL) is False
    assert g.state is TierState.UP


def test_a_failure_takes_it_down_and_calls_fail_fast_until_the_retry_time() -> None:
    clock = Clock()
    g = gate(clock)
    assert g.failed(Admission.NORMAL) is True
    assert g.state is TierState.DOWN
    assert g.retry_at == 101.0
    clock.now = 100.99
    assert g.admit() is None
    clock.now = 101.0
    assert g.admit() is Admission.PROBE
    assert g.admit() is None  # one probe at a time
    assert g.succeeded(Admission.PROBE) is True
    assert g.state is TierState.UP
    assert g.failures == 0
    assert g.admit() is Admission.NORMAL


def test_failed_probes_back_off_exponentially_up_to_the_ceiling() -> None:
    clock = Clock()
    g = gate(clock)
    g.failed(Admission.NORMAL)
    delays = []
    for _ in range(6):
        clock.now = g.retry_at
        assert g.admit() is Admission.PROBE
        start = clock.now
        assert g.failed(Admission.PROBE) is False  # it was down already
        delays.append(g.retry_at - start)
    assert delays == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_calls_admitted_before_the_fall_do_not_move_the_retry_time() -> None:
    clock = Clock()
    g = gate(clock)
    first, second = g.admit(), g.admit()
    assert first is second is Admission.NORMAL
    g.failed(Admission.NORMAL)
    clock.now = 100.5
    g.failed(Admission.NORMAL)  # the second in-flight call fails late
    assert g.retry_at == 101.0
    assert g.failures == 1


def test_a_late_success_brings_it_back_up() -> None:
    g = gate(Clock())
    g.failed(Admission.NORMAL)
    assert g.succeeded(Admission.NORMAL) is True
    assert g.state is TierState.UP


def test_a_cancelled_probe_lets_the_next_call_probe() -> None:
    clock = Clock()
    g = gate(clock)
    g.failed(Admission.NORMAL)
    clock.now = g.retry_at
    assert g.admit() is Admission.PROBE
    g.release(Admission.PROBE)
    assert g.admit() is Admission.PROBE


def test_jitter_shortens_delays_within_bounds() -> None:
    g = HealthGate((1.0, 8.0), jitter=0.5, rng=random.Random(7))
    for failures in range(1, 8):
        base = min(8.0, 2.0 ** (failures - 1))
        assert base * 0.5 <= g.delay(failures) <= base


def test_closed_admits_nothing_and_ignores_results() -> None:
    g = gate(Clock())
    g.close()
    assert g.admit() is None
    assert g.failed(Admission.NORMAL) is False
    assert g.state is TierState.CLOSED
    assert "closed" in repr(g)


@pytest.mark.parametrize(
    ("backoff", "jitter"), [((0.0, 1.0), 0.1), ((2.0, 1.0), 0.1), ((1, 2), 1.0)]
)
def test_bad_settings_are_refused(backoff: tuple[float, float], jitter: float) -> None:
    with pytest.raises(ConfigError):
        HealthGate(backoff, jitter=jitter)


def test_health_is_up_down_or_backing_off_and_closed_is_the_lifecycles() -> None:
    from tiering._state import Lifecycle, ResourceState

    assert [s.value for s in TierState] == ["up", "down", "backing off"]
    assert TierState.CLOSED is ResourceState.CLOSED  # the old spelling
    life = Lifecycle("a tier", opened=True)
    clock = Clock()
    g = HealthGate((1.0, 8.0), jitter=0.0, clock=clock, life=life)
    assert g.admit() is Admission.NORMAL
    g.failed(Admission.NORMAL)
    assert g.state is TierState.DOWN
    life.begin_close()  # the tier closes: its gate admits nothing, and learns nothing
    clock.now += 100.0
    assert g.admit() is None
    assert g.failed(Admission.PROBE) is False
    assert g.state is ResourceState.CLOSED
