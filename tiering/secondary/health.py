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
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable

from tiering.errors import ConfigError

__all__ = ["Admission", "HealthGate", "TierState"]


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
