"""What one call of the Redis tier did in its worker thread, for the event loop to count.

The thread fills an `Answer` as it goes; the async side (`RedisTier`) reads it
when the call returns, or, if the call timed out, reads what the thread had
filled by then (which cluster node it was waiting on: ``stuck``). Nothing here
does I/O or counts: the tier's counters are the event loop's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tiering._types import OffloadKey
from tiering.secondary.base import Guard

__all__ = ["Answer", "Node", "Row", "Work"]

T = TypeVar("T")

#: One chunk of a call: its key, its remote key, and its row (``None`` for ``contains``).
Row = tuple[OffloadKey, bytes, Any]
#: A cluster node: its host and port.
Node = tuple[str, int]


class Answer(Generic[T]):
    """What a worker thread did: a value per row (``None``: no answer), errors, trips."""

    __slots__ = (
        "errors",
        "moved",
        "node_down",
        "node_failures",
        "nodes_back",
        "refused",
        "round_trips",
        "stuck",
        "timed_out",
        "unavailable",
        "values",
    )

    def __init__(self, rows: int) -> None:
        self.values: list[T | None] = [None] * rows
        self.round_trips = 0
        #: What made the call fail (the store could not answer it as a whole).
        self.errors: list[str] = []
        #: ``(reason, message)`` per command the server refused (``OOM``, ``READONLY``, ...).
        self.refused: list[tuple[str, str]] = []
        #: How many of those say a key's slot moved (not the server refusing writes).
        self.moved = 0
        #: Why the store could not be reached, if it could not (the rest is unanswered).
        self.unavailable: str | None = None
        #: Whether that was a socket timing out.
        self.timed_out = False
        #: Rows not answered because their cluster node is down (or went down in this call).
        self.node_down: list[int] = []
        #: ``(what failed, whether it timed out)`` per cluster node that failed in this call.
        self.node_failures: list[tuple[str, bool]] = []
        #: Cluster nodes this call found back up.
        self.nodes_back = 0
        #: The cluster node the call waits on now (if the call times out: the one to blame).
        self.stuck: Node | None = None


#: What a call does in its thread: ``work(guard, answer, rows, batch)``.
Work = Callable[[Guard, "Answer[T]", list[Row], list[int]], None]
