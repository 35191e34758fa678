"""Adaptive segmented LRU: new chunks on probation, reused ones protected, sizes learned.

Design note. Most chunks a prefix cache stores are never used again (on chat
traffic, most keys are seen once, and a prompt's partial last block is almost
never reused: README.md, "Cache policies"). LRU gives each of them as long a
stay as a chunk that has been reused many times, so on real traffic it keeps
what was used last, not what will be used next. This policy keeps two LRU
segments:

- *probation* holds chunks stored and not used since by another request;
- *protected* holds chunks that proved reuse: used again while on probation, or
  stored again while still remembered in a ghost list after their eviction.

Two ghost lists remember recently evicted keys, with the eviction count of their
segment at the time: the probation ghost (up to ``history`` x capacity keys)
and the protected ghost (up to capacity keys). A key stored again while in a
ghost goes straight to protected: admission control in the spirit of TinyLFU's
"seen before" filter, with exact keys instead of a sketch.

The split between the segments adapts. A ghost hit tells how much larger its
segment would have had to be to turn the miss into a hit: the number of
evictions from it since the key left. Hits within ``window`` x capacity
evictions are marginal (a slightly larger segment would have caught them), and
only the leading run of a store counts (past the first key a larger segment
would not have kept, the request misses anyway). Each marginal hit moves the
probation target one ``step`` towards the segment that had it, as ARC moves
its ``p``, but counting marginal hits only: a hit far down a ghost list does
not say that a little more room would help. The target starts at zero, so the
policy starts as "store on second offer" (a chunk stays only if it is offered
again while remembered) and grows probation while marginal hits say it pays
(where most reuse comes back later than LRU can wait, it stays near zero;
where most reuse is within reach, it grows towards half the tier). Like
ARC's, the adaptation is local: it follows the marginal gains from where it
is, and where a large probation pays only as a whole (reuse that returns
after a think time, not at once) it takes a while to leave a poor split. Near
a workload's whole reuse set, where LRU is close to the optimum anyway, a
split costs a little against LRU (the figures: README.md, ``bench/policy.py``).

Prefix order. Keys come head first and are committed tail first (the head ends
most recent), in both segments, so within a segment a request's tail is evicted
before its head; a chunk is promoted only with its request, whose earlier keys
have all been used at least as often, so a protected tail has its head in
protected too (up to evictions of heads under pins). The last key of a request,
if it was new, goes to probation's cold end (evicted first among its segment):
a prompt's partial last block is almost never reused, and when it is, the ghost
list readmits it to protected on its next store.

Every operation is O(1) per key (OrderedDict moves), and eviction plans all its
victims before changing anything, so it is all or nothing. Metadata is bounded:
at most ``(history + 1)`` x capacity ghost keys.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Sequence

from tiering._checks import is_int
from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.policies._segments import marginal_hits, plan_victims, remove, statistics_of, take
from tiering.policies.base import CachePolicy, PolicyStatistics

__all__ = ["ASLRUPolicy"]


class ASLRUPolicy(CachePolicy):
    """Probation and protected LRU segments with ghost admission, sized by marginal hits.

    ``capacity`` chunks size the ghost lists and the target. ``history`` is the
    length of the probation ghost list in capacities (how long a stored-once
    key is remembered); ``window`` the fraction of the capacity within which a
    ghost hit counts as marginal; ``step`` how far the probation target moves
    per marginal hit, as a fraction of the capacity (at least one chunk; 0
    freezes it); ``initial_probation`` the starting target, as a fraction of
    the capacity. The defaults are not tuned to one trace (see the README).
    """

    name = "aslru"

    def __init__(
        self,
        capacity: int,
        *,
        history: float = 2.0,
        window: float = 0.1,
        step: float = 1 / 1024,
        initial_probation: float = 0.0,
    ) -> None:
        if not is_int(capacity) or capacity < 1:
            raise ConfigError(f"ASLRUPolicy capacity must be at least 1 chunk, got {capacity!r}")
        capacity = int(capacity)  # numpy's integers too
        for name, value, low in (
            ("history", history, 0.0),
            ("window", window, 0.0),
            ("step", step, 0.0),
            ("initial_probation", initial_probation, 0.0),
        ):
            if not (math.isfinite(value) and value >= low):
                raise ConfigError(f"ASLRUPolicy {name} must be a finite number >= 0, got {value}")
        if initial_probation > 1.0:
            raise ConfigError(
                f"ASLRUPolicy initial_probation is a fraction of the capacity, at most 1, "
                f"got {initial_probation}"
            )
        self._capacity = capacity
        self._history = int(history * capacity)
        self._window = max(1, int(window * capacity))
        self._step = max(1.0, step * capacity) if step > 0 else 0.0
        self._initial = initial_probation * capacity
        self._target = self._initial
        # Front = coldest. Probation values: True while awaiting the first touch
        # (the store's own request is not a reuse).
        self._probation: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, None] = OrderedDict()
        # Evicted keys -> their segment's eviction count when they left.
        self._probation_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._protected_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._probation_evictions = 0
        self._protected_evictions = 0
        self._marginal_probation = 0
        self._marginal_protected = 0
        self._admitted = 0  # keys stored again while remembered in a ghost list

    @property
    def target_probation(self) -> float:
        """The adaptive target size of the probation segment, in chunks."""
        return self._target

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        probation, protected = self._probation, self._protected
        ghost1, ghost2 = self._probation_ghost, self._protected_ghost
        if not (ghost1 and ghost1.keys() & keys) and not (ghost2 and ghost2.keys() & keys):
            probation.update(dict.fromkeys(reversed(keys), True))  # the common case, in C
            return

        def left(key: OffloadKey) -> int:  # as marginal_hits counts it (signed)
            count = ghost1.get(key)
            return -ghost2.get(key, 0) if count is None else count

        grow, shrink = marginal_hits(
            keys, left, self._probation_evictions, self._protected_evictions, self._window
        )
        admitted = 0
        for key in reversed(keys):
            if ghost1.pop(key, None) is not None or ghost2.pop(key, None) is not None:
                protected[key] = None
                admitted += 1
            else:
                probation[key] = True
        self._admitted += admitted
        self._marginal_probation += grow
        self._marginal_protected += shrink
        target = self._target + self._step * (grow - shrink)
        self._target = min(float(self._capacity), max(0.0, target))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        probation, protected = self._probation, self._protected
        for key in reversed(keys):
            fresh = probation.get(key)
            if fresh is not None:
                if fresh:  # the storing request itself
                    probation[key] = False
                    probation.move_to_end(key)
                else:  # a second request: reuse proven
                    del probation[key]
                    protected[key] = None
            elif key in protected:
                protected.move_to_end(key)
        last = keys[-1]
        if probation.get(last) is False:
            probation.move_to_end(last, last=False)  # a new last block: first to go

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        probation, kept = self._probation, self._protected
        planned = plan_victims(n, protected, probation, kept, len(probation) - self._target)
        if planned is None:
            return None
        from_probation, from_kept = planned
        take(probation, kept, from_probation, from_kept)
        if from_probation:
            self._probation_evictions = self._remember(
                self._probation_ghost, from_probation, self._probation_evictions, self._history
            )
        if from_kept:
            self._protected_evictions = self._remember(
                self._protected_ghost, from_kept, self._protected_evictions, self._capacity
            )
        return from_probation + from_kept

    @staticmethod
    def _remember(
        ghost: OrderedDict[OffloadKey, int], keys: list[OffloadKey], count: int, limit: int
    ) -> int:
        """Remember ``keys``, evicted from their segment after ``count`` others, in its
        ghost of at most ``limit`` keys (the oldest forgotten); the segment's count after."""
        total = count + len(keys)
        ghost.update(zip(keys, range(count + 1, total + 1), strict=True))
        over = len(ghost) - limit
        if over > 0:
            popitem = ghost.popitem
            for _ in range(over):
                popitem(last=False)
        return total

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        remove(keys, self._probation, self._protected)

    def clear(self) -> None:
        for segment in (self._probation, self._protected):
            segment.clear()
        for ghost in (self._probation_ghost, self._protected_ghost):
            ghost.clear()
        self._target = self._initial
        self._probation_evictions = self._protected_evictions = 0
        self._marginal_probation = self._marginal_protected = self._admitted = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def statistics(self) -> PolicyStatistics:
        history = len(self._probation_ghost) + len(self._protected_ghost)
        detail = {
            "probation": len(self._probation),
            "protected": len(self._protected),
            "target_probation": self._target,
            "admitted_total": self._admitted,
            "marginal_probation_hits_total": self._marginal_probation,
            "marginal_protected_hits_total": self._marginal_protected,
        }
        return statistics_of(self, history, self._history + self._capacity, detail)

    def __repr__(self) -> str:
        return (
            f"<ASLRUPolicy [probation: {len(self._probation)}, "
            f"protected: {len(self._protected)}, ghosts: {len(self._probation_ghost)}"
            f"+{len(self._protected_ghost)}, target: {self._target:.1f}]>"
        )
