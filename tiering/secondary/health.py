"""Whether a secondary tier may try the network now: up, or down with backoff.

Design note: a remote store that went away must cost the engine nothing, and
must not be hammered by every lookup of every request while it is away. So
the first failure takes the tier *down*; while down, calls are answered at once
(misses, dropped writes) without any I/O, except one *probe* at a time once the
retry time has come. The probe is an ordinary call: when it succeeds the tier
is up again; when it fails the next retry time moves out exponentially (with a
little jitter, so many engines do not retry in step), up to a ceiling.

`HealthGate` is the synchronous core of that: it decides and counts, and never
waits or does I/O. The tiers call `admit` before a call, then exactly one of
`succeeded`, `failed` or `release` after it. A tier's writes the store refused
back off on a gate of their own, whose ``down`` the tier reports as ``backing
off`` (`TierState.BACKING_OFF`).

Closed is not a health: it is the tier's lifecycle (`tiering._state.Lifecycle`).
A gate given the tier's lifecycle admits nothing once the tier is closing, and
a call that ends after that changes nothing; a closed tier reports its
lifecycle's ``closed`` (``TierState.CLOSED`` is that state, kept for the old
spelling).

A store of many nodes (a Redis Cluster) is not one server: a node that is away
must cost only its own keys. `NodeGates` keeps a `HealthGate` per node that
failed, on the same schedule: keys of a node that is down miss, its writes are
dropped, one probe at a time goes to it once its retry time has come, and the
other nodes' keys are served meanwhile. The store as a whole is down only when
every node is.
"""

from __future__ import annotations

import enum
import functools
import random
import threading
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any, Generic, TypeVar

from tiering._state import Lifecycle, ResourceState
from tiering.errors import ConfigError

__all__ = ["Admission", "HealthGate", "NodeGates", "TierState"]

N = TypeVar("N", bound=Hashable)


class TierState(enum.Enum):
    """The health a secondary tier reports in its statistics (``state``, ``write_state``)."""

    UP = "up"
    DOWN = "down"
    #: The tier's writes, after the store refused some (its write gate is down).
    BACKING_OFF = "backing off"
    #: Not a member: a closed tier reports its lifecycle's state, this one.
    CLOSED = enum.nonmember(ResourceState.CLOSED)


class Admission(enum.Enum):
    """Why a call may do I/O: the tier is up, or this call probes a tier that is down."""

    NORMAL = "normal"
    PROBE = "probe"


class HealthGate:
    """Up/down state with exponential backoff between probes. Not thread-safe: one event loop.

    ``backoff_s`` is ``(first delay, longest delay)`` in seconds; delay ``n``
    (after ``n`` failures in a row) is ``first * 2**(n-1)``, capped, then
    shortened by up to ``jitter`` of itself at random. ``life``: the lifecycle
    of the tier the gate guards (the gate's own by default, closed by `close`).
    """

    def __init__(
        self,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        *,
        jitter: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        life: Lifecycle | None = None,
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
        self._life = life if life is not None else Lifecycle("the health gate", opened=True)
        self._state = TierState.UP
        #: Failures in a row (0 while up).
        self.failures = 0
        #: When the next probe may run (clock time; meaningful while down).
        self.retry_at = 0.0
        self._probing = False

    @property
    def state(self) -> TierState | ResourceState:
        """Up or down; ``ResourceState.CLOSED`` (`TierState.CLOSED`) once its tier is closing."""
        return ResourceState.CLOSED if self._life.closed else self._state

    @property
    def due(self) -> bool:
        """Down, and its retry time has come (a probe may go)."""
        return self._state is TierState.DOWN and self._clock() >= self.retry_at

    def admit(self) -> Admission | None:
        """May a call do I/O now? ``None``: answer at once without I/O (down, or closed)."""
        if self._life.closed:
            return None
        if self._state is TierState.UP:
            return Admission.NORMAL
        if self._probing or not self.due:
            return None
        self._probing = True
        return Admission.PROBE

    def succeeded(self, admission: Admission) -> bool:
        """The call reached the store. True when that brought the tier back up."""
        if admission is Admission.PROBE:
            self._probing = False
        if self._life.closed:  # a call that ends once its tier is closing changes nothing
            return False
        if self._state is TierState.DOWN:
            self._state = TierState.UP
            self.failures = 0
            return True
        return False

    def failed(self, admission: Admission) -> bool:
        """The call could not reach the store. True when that took the tier down.

        A call admitted while up that fails after the tier already went down
        changes nothing: only the first failure and failed probes move the
        retry time.
        """
        if self._life.closed:
            return False
        went_down = self._state is TierState.UP
        if went_down or admission is Admission.PROBE:
            self._probing = False
            self._state = TierState.DOWN
            self.failures += 1
            self.retry_at = self._clock() + self.delay(self.failures)
        return went_down

    def release(self, admission: Admission) -> None:
        """The call ended without an answer either way (it was cancelled from outside)."""
        if admission is Admission.PROBE:
            self._probing = False

    def close(self) -> None:
        """Admit nothing from now on (closes the gate's lifecycle: its tier's, if given)."""
        self._life.close_now()
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

    def __init__(self, backoff_s: tuple[float, float] = (0.05, 5.0), **options: Any) -> None:
        """``backoff_s`` and ``options`` (``jitter``, ``clock``, ``rng``): `HealthGate`'s,
        for each node's gate."""
        options.setdefault("rng", random.Random())  # one for all the nodes
        self._life = Lifecycle("the node gates", opened=True)
        self._new_gate = functools.partial(HealthGate, backoff_s, life=self._life, **options)
        self._new_gate()  # checks the options once, here
        self._gates: dict[N, HealthGate] = {}
        self._lock = threading.Lock()

    def admit(self, node: N) -> Admission | None:
        """May a call do I/O on ``node`` now? ``None``: the node is down (or the gates closed)."""
        with self._lock:
            if self._life.closed:
                return None
            gate = self._gates.get(node)
            return Admission.NORMAL if gate is None else gate.admit()

    def take_due(self) -> list[tuple[N, Admission]]:
        """The nodes that are down and due a probe, each admitted as that probe."""
        with self._lock:
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
            if self._life.closed:
                return False
            gate = self._gates.get(node)
            if gate is None:
                gate = self._gates[node] = self._new_gate()
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
            for node in nodes:
                gate = self._gates.get(node)
                if gate is None or gate.state is not TierState.DOWN:
                    return False
                if waiting and gate.due:
                    return False
            return True

    def close(self) -> None:
        """Admit nothing from now on, on any node (their gates share this lifecycle)."""
        with self._lock:
            self._life.close_now()

    def __repr__(self) -> str:
        return f"<NodeGates [{len(self.down())} down]>"
