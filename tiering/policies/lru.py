"""Least-recently-used eviction, committed per request head to tail."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from itertools import filterfalse, islice

from tiering._types import OffloadKey
from tiering.policies.base import CachePolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(CachePolicy):
    """Evicts the least recently used ready chunk first.

    Recency is committed per request: ``insert`` and ``touch`` walk the
    request's keys from tail to head, so the head ends most recent and the
    tail of a prefix is evicted before its head.
    """

    name = "lru"

    def __init__(self) -> None:
        # Front = least recently used. Values are unused.
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        for key in reversed(keys):
            order[key] = None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        move = order.move_to_end
        for key in reversed(keys):
            if key in order:
                move(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        order = self._order
        victims = list(islice(filterfalse(protected.__contains__, order), n))
        if len(victims) < n:
            return None
        for key in victims:
            del order[key]
        return victims

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return f"<LRUPolicy [{len(self._order)} keys]>"
