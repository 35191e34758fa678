"""Whether a secondary tier may try the network now: up, down with backoff, or closed.

Design note: a remote store that went away must cost the engine nothing, and
must not be hammered by every lookup of every request while it is away. So
the first failure takes the tier *down*; while down, calls are answered at once
(misses, dropped writes) without any I/O, except one *probe* at a time once the
retry time has come. The probe is an ordinary call: when it succeeds the tier
is up again; when it fails the next retry time moves out exponentially (with a
little jitter, so many engines do not retry in step), up to a ceiling.

`HealthGate` is the synchronous core of that: it decides and counts, and never
waits or does I/O. The tiers call `admit` before a call, then exactly one of
`succeeded`, `failed` or `release` after it.

A store of many nodes (a Redis Cluster) is not one server: a node that is away
must cost only its own keys. `NodeGates` keeps a `HealthGate` per node that
failed, on the same schedule: keys of a node that is down miss, its writes are
dropped, one probe at a time goes to it once its retry time has come, and the
other nodes' keys are served meanwhile. The store as a whole is down only when
every node is.
"""

from __future__ import annotations

import enum
import random
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Generic, TypeVar

from tiering.errors import ConfigError

__all__ = ["Admission", "HealthGate", "NodeGates", "TierState"]

N = TypeVar("N", bound=Hashable)


class TierState(enum.Enum):
    """The state a secondary tier reports in its statistics."""

    UP = "up"
    DOWN = "down"
    CLOSED = "closed"


class Admission(enum.Enum):
    """Why a call may do I/O: the tier is up, or this call probes a tier that is down."""

    NORMAL = "normal"
    PROBE = "probe"


class HealthGate:
    """Up/down state with exponential backoff between probes. Not thread-safe: one event loop.

    ``backoff_s`` is ``(first delay, longest delay)`` in seconds; delay ``n``
    (after ``n`` failures in a row) is ``first * 2**(n-1)``, capped, then
    shortened by up to ``jitter`` of itself at random.
    """

    def __init__(
        self,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        *,
        jitter: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        first, longest = backoff_s
        if not 0 < first <= longest:
            raise ConfigError(
                f"backoff_s must be (first, longest) with 0 < first <= longest, got {backoff_s!r}"
            )
        if not 0 <= jitter < 1:
            raise ConfigError(f"jitter must be in [0, 1), got {jitter!r}")
        self._first = first
        self._longest = longest
        self._jitter = jitter
        self._clock = clock
        self._rng = rng or random.Random()
        self.state = TierState.UP
        #: Failures in a row (0 while up).
        self.failures = 0
        #: When the next probe may run (clock time; meaningful while down).
        self.retry_at = 0.0
        self._probing = False

    def admit(self) -> Admission | None:
        """May a call do I/O now? ``None``: answer at once without I/O (down, or closed)."""
        if self.state is TierState.UP:
            return Admission.NORMAL
        if self.state is TierState.CLOSED or self._probing or self._clock() < self.retry_at:
            return None
        self._probing = True
        return Admission.PROBE

    def succeeded(self, admission: Admission) -> bool:
        """The call reached the store. True when that brought the tier back up."""
        if admission is Admission.PROBE:
            self._probing = False
        if self.state is TierState.DOWN:
            self.state = TierState.UP
            self.failures = 0
            return True
        return False

    def failed(self, admission: Admission) -> bool:
        """The call could not reach the store. True when that took the tier down.

        A call admitted while up that fails after the tier already went down
        changes nothing: only the first failure and failed probes move the
        retry time.
        """
        if self.state is TierState.CLOSED:
            return False
        went_down = self.state is TierState.UP
        if went_down or admission is Admission.PROBE:
            self._probing = False
            self.state = TierState.DOWN
            self.failures += 1
            self.retry_at = self._clock() + self.delay(self.failures)
        return went_down

    def release(self, admission: Admission) -> None:
        """The call ended without an answer either way (it was cancelled from outside)."""
        if admission is Admission.PROBE:
            self._probing = False

    def close(self) -> None:
        self.state = TierState.CLOSED
        self._probing = False

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row."""
        base = min(self._longest, self._first * 2.0 ** max(0, failures - 1))
        return base * (1.0 - self._jitter * self._rng.random())

    def __repr__(self) -> str:
        if self.state is TierState.DOWN:
            wait = max(0.0, self.retry_at - self._clock())
            return f"<HealthGate [down; {self.failures} failures, retry in {wait:.2f} s]>"
        return f"<HealthGate [{self.state.value}]>"


class NodeGates(Generic[N]):
    """A `HealthGate` per node of a store of many nodes. Thread-safe (one lock).

    A node that never failed, or came back, is up and has no gate. A node's
    failure takes only that node down; `admit`, `succeeded`, `failed` and
    `release` are `HealthGate`'s, per node. `take_due` hands out the probes
    whose time has come (the caller probes each, then settles it).
    """

    def __init__(
        self,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        *,
        jitter: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        HealthGate(backoff_s, jitter=jitter)  # checks the options once, here
        self._backoff_s = backoff_s
        self._jitter = jitter
        self._clock = clock
        self._rng = rng or random.Random()
        self._gates: dict[N, HealthGate] = {}
        self._lock = threading.Lock()
        self._closed = False

    def admit(self, node: N) -> Admission | None:
        """May a call do I/O on ``node`` now? ``None``: the node is down (or the gates closed)."""
        with self._lock:
            if self._closed:
                return None
            gate = self._gates.get(node)
            return Admission.NORMAL if gate is None else gate.admit()

    def take_due(self) -> list[tuple[N, Admission]]:
        """The nodes that are down and due a probe, each admitted as that probe."""
        with self._lock:
            if self._closed:
                return []
            due = [(node, gate.admit()) for node, gate in self._gates.items()]
            return [(node, admission) for node, admission in due if admission is not None]

    def succeeded(self, node: N, admission: Admission) -> bool:
        """``node`` answered. True when that brought it back up."""
        with self._lock:
            gate = self._gates.get(node)
            if gate is None:
                return False
            back = gate.succeeded(admission)
            if gate.state is TierState.UP:
                del self._gates[node]
            return back

    def failed(self, node: N, admission: Admission) -> bool:
        """``node`` could not be reached. True when that took it down."""
        with self._lock:
            if self._closed:
                return False
            gate = self._gates.get(node)
            if gate is None:
                gate = self._gates[node] = HealthGate(
                    self._backoff_s, jitter=self._jitter, clock=self._clock, rng=self._rng
                )
            return gate.failed(admission)

    def release(self, node: N, admission: Admission) -> None:
        """The call ended without an answer from ``node`` either way."""
        with self._lock:
            gate = self._gates.get(node)
            if gate is not None:
                gate.release(admission)

    def retain(self, nodes: Collection[N]) -> list[N]:
        """Forget the nodes not in ``nodes`` (no longer in the store's map); return them."""
        with self._lock:
            gone = [node for node in self._gates if node not in nodes]
            for node in gone:
                del self._gates[node]
            return gone

    def down(self) -> list[N]:
        """The nodes that are down now."""
        with self._lock:
            return [node for node, gate in self._gates.items() if gate.state is TierState.DOWN]

    def all_down(self, nodes: Collection[N], *, waiting: bool = False) -> bool:
        """Whether every one of ``nodes`` (at least one) is down; with ``waiting``, and
        none of them is due a probe yet."""
        with self._lock:
            if not nodes:
                return False
            now = self._clock()
            for node in nodes:
                gate = self._gates.get(node)
                if gate is None or gate.state is not TierState.DOWN:
                    return False
                if waiting and now >= gate.retry_at:
                    return False
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for gate in self._gates.values():
                gate.close()

    def __repr__(self) -> str:
        return f"<NodeGates [{len(self.down())} down]>"
