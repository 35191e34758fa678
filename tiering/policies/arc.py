"""Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over ready chunks.

Design note. ARC keeps two lists of resident keys, T1 (seen by one request) and
T2 (seen by two or more), and two ghost lists of recently evicted keys, B1 and B2.
A store of a key found in B1 means "recency was evicted too early": the target
size ``p`` of T1 grows; a store of a key found in B2 shrinks it. Eviction takes
T1's least recent key while T1 is larger than ``p``, else T2's.

Two adaptations to a KV-cache tier:

- A request stores its new chunks and then commits recency for all its keys
  (``touch``). That first touch of a just-inserted key is the same reference as
  the store, so it only refreshes recency within T1; the next request that uses
  the key promotes it to T2. Without this, every chunk would look frequent.
- Victims must be evictable (not pinned by a load, not being written, not
  offered by the store that asks for room), so eviction walks each list from
  its cold end past the keys it may not take, and plans all ``n`` victims
  before changing anything.
- The manager inserts a store's new keys before it asks for room, so a ghost
  hit adapts ``p`` before the replacement, as in the paper. The keys of that
  latest insert do not count towards |T1| in the replacement they cause (in
  the paper the missed key joins T1 after REPLACE). The paper's tie-break for
  a B2 hit with |T1| = p is not applied: eviction does not know the key.

Ghost lists are bounded as in the paper: ``|T1| + |B1| <= c`` and all four lists
together hold at most ``2c`` keys, for a capacity of ``c`` chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.policies._segments import plan_victims, remove, statistics_of, take
from tiering.policies.base import CachePolicy, PolicyStatistics

__all__ = ["ARCPolicy"]


class ARCPolicy(CachePolicy):
    """ARC eviction for a tier of ``capacity`` chunks (sizes the ghost lists)."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"ARCPolicy capacity must be at least 1 chunk, got {capacity}")
        self._capacity = capacity
        self._p = 0.0
        self._admitted = 0  # keys the latest insert put in T1 (not yet counted by REPLACE)
        # Front = least recent. T1 values: True while the key awaits its first touch.
        self._t1: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    @property
    def target_t1(self) -> float:
        """The adaptive target size ``p`` of T1."""
        return self._p

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        before = len(t1)
        if not (b1.keys() & keys or b2.keys() & keys):  # no ghost hit: all new to T1
            t1.update(dict.fromkeys(reversed(keys), True))
            self._admitted = len(t1) - before
            self._trim_ghosts()
            return
        for key in reversed(keys):
            if key in b1:
                self._p = min(self._capacity, self._p + max(len(b2) / len(b1), 1.0))
                del b1[key]
                t2[key] = None
            elif key in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                del b2[key]
                t2[key] = None
            else:
                t1[key] = True
        self._admitted = len(t1) - before
        self._trim_ghosts()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            fresh = t1.get(key)
            if fresh is not None:
                if fresh:
                    t1[key] = False
                    t1.move_to_end(key)
                else:
                    del t1[key]
                    t2[key] = None
            elif key in t2:
                t2.move_to_end(key)

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        # One victim at a time, ARC takes T1's coldest while |T1| (less what it
        # took) exceeds p, then T2's; a list short of candidates hands over.
        size_t1 = len(t1) - self._admitted
        self._admitted = 0
        planned = plan_victims(n, protected, t1, t2, size_t1 - self._p)
        if planned is None:
            return None
        from_t1, from_t2 = planned
        take(t1, t2, from_t1, from_t2)  # the hot path: looped in C
        self._b1.update(dict.fromkeys(from_t1))
        self._b2.update(dict.fromkeys(from_t2))
        self._trim_ghosts()
        return from_t1 + from_t2

    def _trim_ghosts(self) -> None:
        c = self._capacity
        t1, b1, b2 = self._t1, self._b1, self._b2
        over = len(t1) + len(b1) - c
        if over > 0:
            popitem = b1.popitem
            for _ in range(min(over, len(b1))):
                popitem(last=False)
        excess = len(t1) + len(self._t2) + len(b1) + len(b2) - 2 * c
        while excess > 0 and b2:
            b2.popitem(last=False)
            excess -= 1
        while excess > 0 and b1:
            b1.popitem(last=False)
            excess -= 1

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        remove(keys, self._t1, self._t2)

    def clear(self) -> None:
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()
        self._p = 0.0
        self._admitted = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def statistics(self) -> PolicyStatistics:
        detail = {"t1": len(self._t1), "t2": len(self._t2), "target_t1": self._p}
        return statistics_of(self, len(self._b1) + len(self._b2), 2 * self._capacity, detail)

    def __repr__(self) -> str:
        return (
            f"<ARCPolicy [T1: {len(self._t1)}, T2: {len(self._t2)}, "
            f"B1: {len(self._b1)}, B2: {len(self._b2)}, p: {self._p:.1f}]>"
        )
