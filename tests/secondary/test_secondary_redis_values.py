"""Numbers as they were given (1, not 1.0) in the Redis tier's errors and timeouts, and what a
closed tier's gates learn. No Redis server: the tier's I/O is replaced (white box)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tiering.errors import ConfigError
from tiering.secondary import RemoteNamespace
from tiering.secondary.health import Admission, HealthGate, NodeGates

pytestmark = pytest.mark.anyio

URL = "redis://127.0.0.1:1"


async def test_a_timeout_shows_the_timeout_as_it_was_given(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    pytest.importorskip("redis")
    from tiering.secondary.redis import RedisTier

    tier = RedisTier(URL, namespace, timeout_s=1)
    release = threading.Event()

    def hung(work: Any, guard: Any, rows: Any, answer: Any = None) -> Any:
        release.wait(10)
        return answer

    tier._wire.run = hung  # type: ignore[method-assign]  # white box: a store that hangs
    try:
        assert await tier.contains(chunks.keys(1)) == [False]
    finally:
        release.set()
        await tier.aclose()
    s = tier.statistics()
    assert (s.timeouts_total, s.last_error) == (1, "TimeoutError: no answer within 1 s")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": 0}, r"timeout_s must be a positive number of seconds, got 0$"),
        ({"connect_timeout_s": -1}, r"connect_timeout_s must be a positive .*, got -1$"),
        ({"ttl_s": 0}, r"ttl_s must be None or at least 0.001 seconds, got 0$"),
        ({"backoff_s": (2, 1)}, r"backoff_s must be .*, got \(2, 1\)$"),
    ],
)
def test_a_bad_number_is_shown_as_it_was_given(
    namespace: RemoteNamespace, options: dict[str, Any], message: str
) -> None:
    from tiering.secondary.redis import RedisTier

    with pytest.raises(ConfigError, match=message):
        RedisTier(URL, namespace, **options)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_that_ends_after_close_does_not_bring_the_gate_up() -> None:
    clock = Clock()
    g = HealthGate((1.0, 8.0), jitter=0.0, clock=clock)
    g.failed(Admission.NORMAL)
    clock.now = g.retry_at
    assert g.admit() is Admission.PROBE
    g.close()  # the tier closes while its probe is out
    assert g.succeeded(Admission.PROBE) is False  # no reconnect counted, no "accepts writes"
    assert g.admit() is None


def test_a_node_probe_that_ends_after_close_does_not_bring_the_node_up() -> None:
    clock = Clock()
    gates: NodeGates[str] = NodeGates((1.0, 8.0), jitter=0.0, clock=clock)
    gates.failed("a", Admission.NORMAL)
    clock.now += 10.0
    assert gates.take_due() == [("a", Admission.PROBE)]
    gates.close()
    assert gates.succeeded("a", Admission.PROBE) is False  # no "answers again" after close
    assert gates.admit("a") is None
