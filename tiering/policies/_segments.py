"""What the segmented policies share: two LRU segments of resident keys and their victims.

ARC (T1 and T2), ASLRU and DSLRU (probation and protected) each keep two
``OrderedDict`` segments, front = coldest, and take victims from both by one
rule: the first segment's coldest while it is over its target, then the
second's, then the first's again, never a protected key. The victims are all
planned before anything changes (`plan_victims`), so an eviction is all or
nothing, and then taken out in C (`take`), the hot path of a full tier.
DSLRU's tier and its segmented shadows share `Ghosts` (evicted keys, forgotten
a generation at a time) and `marginal_hits` (ASLRU's rule for moving the
probation target).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from itertools import filterfalse, islice
from typing import Any

from tiering._types import OffloadKey
from tiering.policies.base import CachePolicy, PolicyStatistics, estimate_entry_bytes

__all__ = [
    "Ghosts",
    "drain",
    "marginal_hits",
    "plan_victims",
    "remove",
    "statistics_of",
    "take",
]

_SINK: deque[object] = deque(maxlen=0)
#: Consume an iterator, looping in C (``drain(map(d.__delitem__, keys))``).
drain: Callable[[Iterable[object]], None] = _SINK.extend


def plan_victims(
    n: int,
    protected: Container[OffloadKey],
    first: Collection[OffloadKey],
    second: Collection[OffloadKey],
    over: float,
) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
    """``n`` victims, none of ``protected``: ``first``'s coldest while it is over its
    target (``over``: by how many keys), then ``second``'s, then ``first``'s again;
    None if there are too few (nothing is changed: the caller takes them, `take`)."""
    want = min(n, max(0, math.ceil(over)))
    spare = filterfalse(protected.__contains__, first)
    from_first = list(islice(spare, want))
    from_second = list(islice(filterfalse(protected.__contains__, second), n - len(from_first)))
    short = n - len(from_first) - len(from_second)
    if short:
        from_first.extend(islice(spare, short))
        if len(from_first) + len(from_second) < n:
            return None
    return from_first, from_second


def take(
    first: OrderedDict[OffloadKey, Any],
    second: OrderedDict[OffloadKey, Any],
    from_first: Iterable[OffloadKey],
    from_second: Iterable[OffloadKey],
) -> None:
    """Take planned victims out of their segments."""
    drain(map(first.__delitem__, from_first))
    drain(map(second.__delitem__, from_second))


def remove(
    keys: Sequence[OffloadKey],
    first: OrderedDict[OffloadKey, Any],
    second: OrderedDict[OffloadKey, Any],
) -> None:
    """Forget ``keys`` (each in one segment at most, or in none)."""
    for key in keys:
        if first.pop(key, None) is None:
            second.pop(key, None)


def statistics_of(
    policy: CachePolicy, history: int, history_limit: int, detail: Mapping[str, float]
) -> PolicyStatistics:
    """``policy``'s snapshot: its resident keys, ``history`` remembered (evicted) ones of
    at most ``history_limit``, and the metadata they take."""
    tracked = len(policy)
    return PolicyStatistics(
        name=policy.name,
        tracked=tracked,
        history=history,
        history_limit=history_limit,
        metadata_bytes=estimate_entry_bytes(tracked, history),
        detail=dict(detail),
    )


class Ghosts:
    """Keys evicted from either segment -> their segment's eviction count when they left
    (positive from probation, negated from protected), in two generations of plain
    dicts: the older is dropped whole when the newer has taken ``span`` probation keys
    (or ``limit`` keys in all), so forgetting costs nothing per key and a lookup is two
    dict probes. A probation key is remembered for ``span`` probation evictions or more
    (unless protected ones crowd a generation to ``limit``); at most 2 x ``limit`` keys."""

    __slots__ = ("added", "limit", "new", "old", "span")

    def __init__(self, span: int, limit: int) -> None:
        self.span = max(1, span)
        self.limit = max(self.span, limit)
        self.new: dict[OffloadKey, int] = {}
        self.old: dict[OffloadKey, int] = {}
        self.added = 0

    def isdisjoint(self, keys: Sequence[OffloadKey]) -> bool:
        return self.new.keys().isdisjoint(keys) and self.old.keys().isdisjoint(keys)

    def get(self, key: OffloadKey) -> int:
        """``key``'s signed count, 0 if it is not remembered."""
        left = self.new.get(key)
        return self.old.get(key, 0) if left is None else left

    def pop(self, key: OffloadKey) -> int:
        """Forget ``key`` (it is in one generation at most); its signed count, or 0."""
        left = self.new.pop(key, None)
        return self.old.pop(key, 0) if left is None else left

    def add(self, keys: list[OffloadKey], count: int, *, probation: bool) -> int:
        """Remember ``keys``, evicted from their segment after ``count`` others; the
        segment's count after them. A generation never holds more than ``limit`` keys
        (of a larger call, the last ``limit`` evicted are remembered)."""
        total = count + len(keys)
        if len(keys) > self.limit:
            keys = keys[-self.limit :]
            count = total - len(keys)
        new = self.new
        if len(new) + len(keys) > self.limit or (probation and self.added >= self.span):
            self.old, self.new = new, {}
            new = self.new
            self.added = 0
        if probation:
            new.update(zip(keys, range(count + 1, total + 1), strict=True))
            self.added += len(keys)
        else:
            new.update(zip(keys, range(-count - 1, -total - 1, -1), strict=True))
        return total

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def clear(self) -> None:
        self.new, self.old = {}, {}
        self.added = 0


def marginal_hits(
    keys: Sequence[OffloadKey],
    left: Callable[[OffloadKey], int],
    evicted1: int,
    evicted2: int,
    window: int,
) -> tuple[int, int]:
    """Marginal hits of a store's leading run (see `ASLRUPolicy`): how many of its first
    keys a probation segment larger by ``window`` would have kept, and how many a larger
    protected one would have; past the first key neither would, the request misses.
    ``left(key)`` is the eviction count of the key's segment when it left, positive from
    probation, negated from protected, 0 for a key not remembered."""
    grow = shrink = 0
    run1 = run2 = True
    for key in keys:
        count = left(key)
        if count > 0 and evicted1 - count <= window:
            grow += run1
            run2 = False
        elif count < 0 and evicted2 + count <= window:
            shrink += run2
            run1 = False
        else:
            break
        if not (run1 or run2):
            break
    return grow, shrink
