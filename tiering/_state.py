"""One lifecycle for every long-lived object of `tiering` (layer 0).

An engine, a scheduler, a transfer backend, a host memory pool, the event bus,
a publisher, a subscriber, a lower tier and the metrics server all move the
same way, once and forward::

    NEW --open--> OPEN --aclose--> CLOSING --(what was running has ended)--> CLOSED

An object that opens as it is made starts ``OPEN``; one that has nothing to
wait for at close goes from ``OPEN`` to ``CLOSED`` directly. ``aclose`` is
idempotent; a call that needs the object open raises `ResourceClosedError`
naming the state (``state.value``: ``"new"``, ``"open"``, ``"closing"``,
``"closed"``, the strings `statistics()` reports).

`Lifecycle` is that state machine, and the only one: an object holds one and
asks it (`check_open`, `begin_close`, `end_close`) instead of keeping flags.
It is synchronous and lock-free (callers on one event loop, or under their own
lock); an async object that must let a second ``aclose`` wait for the first
uses `tiering._closing.AsyncLifecycle`, which adds that wait.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from tiering.errors import ResourceClosedError

__all__ = ["Lifecycle", "ResourceState"]


class ResourceState(enum.Enum):
    """Where a long-lived object is in its life (see the module docstring)."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Lifecycle:
    """The state of one long-lived object, named ``what`` in its errors ("the scheduler").

    ``opened``: the object opens as it is made (it starts ``OPEN``, not ``NEW``).
    """

    __slots__ = ("_on_closed", "state", "what")

    def __init__(self, what: str, *, opened: bool = False) -> None:
        self.what = what
        self.state = ResourceState.OPEN if opened else ResourceState.NEW
        self._on_closed: list[Callable[[], None]] = []

    @property
    def is_open(self) -> bool:
        return self.state is ResourceState.OPEN

    @property
    def closed(self) -> bool:
        """Closing or closed: nothing new may start."""
        return self.state is ResourceState.CLOSING or self.state is ResourceState.CLOSED

    def open(self) -> None:
        """``NEW`` -> ``OPEN``; an object opens once (`ResourceClosedError` otherwise)."""
        if self.state is not ResourceState.NEW:
            raise ResourceClosedError(
                f"{self.what} is {self.state.value}: it opens once; build a new one"
            )
        self.state = ResourceState.OPEN

    def check_open(self, doing: str = "") -> None:
        """Raise `ResourceClosedError` ("the scheduler is closed; no new jobs") unless open."""
        if self.state is not ResourceState.OPEN:
            raise ResourceClosedError(
                f"{self.what} is {self.state.value}" + (f"; {doing}" if doing else "")
            )

    def begin_close(self) -> bool:
        """Start closing: True for the one caller that must now close the object (it
        was new or open, and is ``CLOSING``), False for every later one."""
        if self.closed:
            return False
        self.state = ResourceState.CLOSING
        return True

    def end_close(self) -> None:
        """What was running has ended: ``CLOSED``; tells whoever waits (idempotent)."""
        if self.state is ResourceState.CLOSED:
            return
        self.state = ResourceState.CLOSED
        callbacks, self._on_closed = self._on_closed, []
        for callback in callbacks:
            callback()

    def close_now(self) -> bool:
        """`begin_close` and `end_close` at once (nothing to wait for): True the first time."""
        first = self.begin_close()
        self.end_close()
        return first

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the object is ``CLOSED`` (now, if it is)."""
        if self.state is ResourceState.CLOSED:
            callback()
        else:
            self._on_closed.append(callback)

    def __repr__(self) -> str:
        return f"<Lifecycle {self.what}: {self.state.value}>"
