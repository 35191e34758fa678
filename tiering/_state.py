"""One lifecycle for every long-lived object of `tiering` (layer 0).

An engine, a scheduler, a transfer backend, a host memory pool, the event bus,
a publisher and a subscriber all move the same way, once and forward::

    NEW --open--> OPEN --aclose--> CLOSING --(what was running has ended)--> CLOSED

An object that opens as it is made starts ``OPEN``; one that has nothing to
wait for at close goes from ``OPEN`` to ``CLOSED`` directly. ``aclose`` is
idempotent; a call that needs the object open raises `ResourceClosedError`
naming the state (``state.value``: ``"new"``, ``"open"``, ``"closing"``,
``"closed"``, the strings `statistics()` reports).
"""

from __future__ import annotations

import enum

__all__ = ["ResourceState"]


class ResourceState(enum.Enum):
    """Where a long-lived object is in its life (see the module docstring)."""

    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
