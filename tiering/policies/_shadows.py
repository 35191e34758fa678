"""DSLRU's shadows: each expert's rule over a sample of the keys, counting its hits.

A shadow runs one expert (`LRUShadow`, or `SegmentedShadow` with its own ghost
history) over the keys a CRC-32 samples, in a tier as many times smaller, and
counts the hits the manager would (the leading run of a request's keys it
holds); `DSLRUPolicy` scores the experts by them (design note in
`tiering.policies.dslru`).
"""

from __future__ import annotations

from collections import OrderedDict

from tiering._types import OffloadKey
from tiering.policies._segments import Ghosts, marginal_hits, plan_victims, take

__all__ = ["LRUShadow", "SegmentedShadow"]


class LRUShadow:
    """The hits, as the manager counts them, of LRU over the sampled keys."""

    __slots__ = ("capacity", "held", "hits")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[OffloadKey, None] = OrderedDict()
        self.hits = 0

    def access(self, keys: list[OffloadKey], tail: bool) -> None:
        """One request's sampled ``keys``, head first (``tail``: unused by LRU)."""
        held = self.held
        run = 0
        for key in keys:
            if key not in held:
                break
            run += 1
        self.hits += run
        move = held.move_to_end
        for key in reversed(keys):
            if key in held:
                move(key)
            else:
                held[key] = None
        over = len(held) - self.capacity
        if over > 0:
            popitem = held.popitem
            for _ in range(over):
                popitem(last=False)

    def keys(self) -> int:
        return len(self.held)

    def ghosts(self) -> int:
        return 0

    def limit(self) -> int:
        return self.capacity

    def clear(self) -> None:
        self.held.clear()
        self.hits = 0


class SegmentedShadow:
    """The hits of a segmented expert over the sampled keys: the tier's segmented rule,
    in the few steps one request of a shadow needs (its store and its touch come
    together)."""

    __slots__ = (
        "admit", "capacity", "evicted1", "evicted2", "hits", "memory",
        "probation", "protected", "step", "target", "window",
    )  # fmt: skip

    def __init__(self, capacity: int, admit: int, span: int, window: int, step: float) -> None:
        self.capacity = capacity
        self.admit = admit
        self.window = window
        self.step = step
        self.probation: OrderedDict[OffloadKey, None] = OrderedDict()
        self.protected: OrderedDict[OffloadKey, None] = OrderedDict()
        self.memory = Ghosts(span, span + 2 * capacity)
        self.target = 0.0
        self.evicted1 = self.evicted2 = self.hits = 0

    def access(self, keys: list[OffloadKey], tail: bool) -> None:
        """One request's sampled ``keys``, head first; ``tail``: the last is the request's."""
        probation, protected = self.probation, self.protected
        run = 0
        for key in keys:
            if key not in probation and key not in protected:
                break
            run += 1
        self.hits += run
        new = [key for key in dict.fromkeys(keys[run:]) if key not in probation]
        new = [key for key in new if key not in protected]
        if new and not self._store(new, keys):
            new = []
        fresh = set(new)
        for key in reversed(keys):  # the touch
            if key in fresh:
                continue
            if key in probation:
                del probation[key]
                protected[key] = None
            elif key in protected:
                protected.move_to_end(key)
        if tail and new and new[-1] is keys[-1] and keys[-1] in probation:
            probation.move_to_end(keys[-1], last=False)

    def _store(self, new: list[OffloadKey], keys: list[OffloadKey]) -> bool:
        """Insert ``new`` and evict for it (never one of ``keys``); False, and nothing
        changed, if there is no room (as the manager refuses a store before its insert)."""
        probation, protected = self.probation, self.protected
        need = len(probation) + len(protected) + len(new) - self.capacity
        if need > 0:
            held = sum(1 for key in set(keys) if key in probation or key in protected)
            if len(probation) + len(protected) - held < need:
                return False
        ghosts = self.memory
        admitted: set[OffloadKey] = set()
        if not ghosts.isdisjoint(new):
            grow, shrink = marginal_hits(new, ghosts.get, self.evicted1, self.evicted2, self.window)
            oldest1, oldest2 = self.evicted1 - self.admit, self.evicted2 - self.capacity
            for key in new:
                left = ghosts.pop(key)
                if left and (left >= oldest1 if left > 0 else -left >= oldest2):
                    admitted.add(key)
            target = self.target + self.step * (grow - shrink)
            self.target = min(float(self.capacity), max(0.0, target))
        if need > 0:
            planned = plan_victims(need, keys, probation, protected, len(probation) - self.target)
            assert planned is not None  # the room was counted above
            victims1, victims2 = planned
            take(probation, protected, victims1, victims2)
            if victims1:
                self.evicted1 = ghosts.add(victims1, self.evicted1, probation=True)
            if victims2:
                self.evicted2 = ghosts.add(victims2, self.evicted2, probation=False)
        for key in reversed(new):
            if key in admitted:
                protected[key] = None
            else:
                probation[key] = None
        return True

    def keys(self) -> int:
        return len(self.probation) + len(self.protected)

    def ghosts(self) -> int:
        return len(self.memory)

    def limit(self) -> int:
        return self.capacity + 2 * self.memory.limit

    def clear(self) -> None:
        self.probation.clear()
        self.protected.clear()
        self.memory.clear()
        self.target = 0.0
        self.evicted1 = self.evicted2 = self.hits = 0
