"""Dueling segmented LRU: a tier run by LRU or a segmented LRU, whichever sampled shadows favour.

Design note. No one eviction rule wins everywhere. A segmented LRU (probation
for chunks stored once, protected for chunks reused, a ghost list that admits
a chunk stored again straight to protected: `ASLRUPolicy`) hits well above LRU
on chat traffic, where most keys are never used again and LRU gives each of
them as long a stay as a chunk reused many times. Near a workload's whole reuse
set the same split costs: every chunk would have stayed long enough under LRU,
and the split evicts first reuses LRU keeps. How long a chunk stored once
should be remembered differs from one workload to the next too, so a constant
tuned to one loses on another, and a workload no one has measured may sit
anywhere between. So this policy runs one tier with the data of a segmented
LRU and lets three *experts* vote on how to run it, as set dueling does in
hardware caches (DIP, DRRIP):

- *LRU*: evict the least recently used key of both segments (their union is
  one LRU order, merged by the request clock each key keeps);
- *segmented, history h* (``histories``: 2 and 4 tiers' worth): evict as
  `ASLRUPolicy` does, and admit to protected a key stored again within h
  tiers' worth of probation evictions of its own.

Each expert runs a *shadow*: its rule over a ``1 / 2**k`` sample of the keys
(a CRC-32 of the key picks it, so a run is deterministic) in a tier of
``capacity >> k`` chunks, fed the sampled keys of every request in order. A
shadow counts its hits as the manager does (the leading run of a request's
keys it holds) and stores the rest; sampling keys and capacity alike keeps an
expert's hit rate (as SHARDS keeps miss-ratio curves). ``k`` is chosen so a
shadow holds about 64 chunks (one key in 64 at most; small tiers are shadowed
whole). Every quarter of a shadow's capacity of sampled keys the shadows' hits
are added to decayed scores (factor ``decay``); the tier follows another
expert when its score beats the current one's by ``margin``. It starts under
LRU: a tier still filling, or one holding the whole reuse set, where the
experts tie, stays LRU, and a split has to prove itself first, over the long
run too (scores decayed by ``long_decay``): where the experts only take turns
ahead, following each lead costs more than it wins. Every expert keeps the
segments alike (promotion on reuse, admission from a ghost, ASLRU's probation
target learnt from marginal ghost hits), so a switch finds them ready; the
experts differ in eviction and in how far back a ghost admits.

What it does not do is predict a chunk's *first* reuse: whether a conversation
seen once comes back is all but random to anything a policy sees. The hit
rates it reaches, against LRU, the other policies and the offline optimum, and
what is left to win, are measured in README.md ("Cache policies"), printed by
``bench/policy.py`` and ``bench/first_reuse.py``.

Prefix order: keys come head first and are committed tail first in both
segments, so within a segment a request's tail goes before its head; under
a segmented expert a request's new last block goes to probation's cold end.
A key stored and not yet touched by its request is marked, so a request's own
first touch is never taken for a reuse, however many requests finish between
its store and its end (the engine at concurrency > 1, vLLM's batches).

Costs: O(1) amortized per key in the tier (OrderedDict moves; an eviction
plans every victim before it changes anything, so it is all or nothing), the
same per sampled key in the shadows; the ghosts forget a generation at a
time, at no cost per key. Metadata is bounded: the tier's ghosts hold at most
2 x (``max(histories)`` + 2) capacities of keys, each shadow its capacity of
keys and as many ghosts in proportion (`statistics`: ``history`` counts ghosts
and shadow keys, ``history_limit`` bounds them). Its speed against LRU's is in
README.md (``bench/manager.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from itertools import filterfalse, islice
from zlib import crc32

from tiering._checks import is_int
from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.policies._segments import Ghosts, marginal_hits, plan_victims, remove, take
from tiering.policies._shadows import LRUShadow, SegmentedShadow
from tiering.policies.base import CachePolicy, PolicyStatistics, estimate_entry_bytes

__all__ = ["DSLRUPolicy"]

_TARGET_SHADOW = 64  # chunks a shadow aims for
_MAX_SHIFT = 6  # sample at least one key in 64
_PERIODS = 4  # score periods per shadow capacity of sampled keys


class _Segments(CachePolicy):
    """Probation and protected segments, their ghosts and ASLRU's learnt target.

    Values are use numbers: a touch gives each of its keys the next one, tail
    first, so that their order across both segments is LRU's; a stored key
    awaiting the first touch of its request holds ``-2 - clock`` (``clock`` the
    last number given at its store: it counts as the next one). ``lru`` evicts
    by these numbers across both segments; otherwise as `ASLRUPolicy`.
    ``history``, ``window`` and ``step`` are in chunks.
    """

    name = "dslru"

    def __init__(self, capacity: int, history: int, window: int, step: float, *, lru: bool) -> None:
        self._capacity = capacity
        self._history = history  # evictions a probation ghost is remembered for, at least
        self._admit = history  # how far back a probation ghost is still admitted
        self._window = window
        self._step = step
        self._lru = lru
        self._target = 0.0
        self._clock = 0
        # Front = coldest.
        self._probation: OrderedDict[OffloadKey, int] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, int] = OrderedDict()
        self._ghosts = Ghosts(history, history + 2 * capacity)
        self._probation_evictions = self._protected_evictions = 0
        self._admitted = 0

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        probation = self._probation
        ghosts = self._ghosts
        stored = -2 - self._clock  # counts as the next number: newer than any
        if ghosts.isdisjoint(keys):
            probation.update(dict.fromkeys(reversed(keys), stored))  # the common case, in C
            return
        evicted1, evicted2 = self._probation_evictions, self._protected_evictions
        grow, shrink = marginal_hits(keys, ghosts.get, evicted1, evicted2, self._window)
        # Admission: the remembered keys recent enough go to protected, in one step,
        # and the others to probation in another.
        remembered = ghosts.new.keys() & keys | ghosts.old.keys() & keys
        oldest1 = evicted1 - self._admit
        oldest2 = evicted2 - self._capacity
        admit = set()
        pop = ghosts.pop
        for key in remembered:
            left = pop(key)
            if left >= oldest1 if left > 0 else -left >= oldest2:
                admit.add(key)
        order = reversed(keys)
        if admit:
            self._protected.update(dict.fromkeys([k for k in reversed(keys) if k in admit], stored))
            order = [k for k in order if k not in admit]  # type: ignore[assignment]
        probation.update(dict.fromkeys(order, stored))
        self._admitted += len(admit)
        target = self._target + self._step * (grow - shrink)
        self._target = min(float(self._capacity), max(0.0, target))

    def _commit(self, keys: Sequence[OffloadKey], mask: int) -> list[OffloadKey]:
        """`touch` of non-empty ``keys``; returns those of them the CRC-32 ``mask``
        samples (``crc32(key) & mask == 0``), head first, found on the same walk."""
        start = now = self._clock
        probation, protected = self._probation, self._protected
        get = probation.get
        sampled = []
        for key in reversed(keys):  # each key its own number, tail first: LRU's order
            if not crc32(key) & mask:
                sampled.append(key)
            now += 1
            last = get(key)
            if last is not None:
                if last < 0:  # the storing request's own touch
                    probation[key] = now
                    probation.move_to_end(key)  # others may have ended since its store
                else:  # a second request: reuse proven
                    del probation[key]
                    protected[key] = now
            elif key in protected:
                protected[key] = now
                protected.move_to_end(key)
        self._clock = now
        if not self._lru and get(keys[-1]) == start + 1:
            probation.move_to_end(keys[-1], last=False)  # a new last block: first to go
        sampled.reverse()
        return sampled

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        probation, kept = self._probation, self._protected
        if self._lru:
            planned = self._plan_lru(n, protected)
            if planned is None:
                return None
            from_probation, from_kept = planned
        else:
            planned = plan_victims(n, protected, probation, kept, len(probation) - self._target)
            if planned is None:
                return None
            from_probation, from_kept = planned
        take(probation, kept, from_probation, from_kept)
        ghosts = self._ghosts
        if from_probation:
            self._probation_evictions = ghosts.add(
                from_probation, self._probation_evictions, probation=True
            )
        if from_kept:
            self._protected_evictions = ghosts.add(
                from_kept, self._protected_evictions, probation=False
            )
            from_probation += from_kept
        return from_probation

    def _plan_lru(
        self, n: int, protected: Container[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
        """The ``n`` least recently used keys of both segments, merged by their clocks."""
        probation, kept = self._probation, self._protected
        victims = list(islice(filterfalse(protected.__contains__, probation), n))
        first = next(filterfalse(protected.__contains__, kept), None) if kept else None
        if first is None:
            return (victims, []) if len(victims) == n else None
        if len(victims) == n and _used(probation[victims[-1]]) <= _used(kept[first]):
            return victims, []  # the usual case: every victim older than protected's coldest
        left: Iterator[OffloadKey] = filterfalse(protected.__contains__, probation)
        right: Iterator[OffloadKey] = filterfalse(protected.__contains__, kept)
        from_probation: list[OffloadKey] = []
        from_kept: list[OffloadKey] = []
        a = next(left, None)
        b = next(right, None)
        for _ in range(n):
            if a is not None and (b is None or _used(probation[a]) <= _used(kept[b])):
                from_probation.append(a)
                a = next(left, None)
            elif b is not None:
                from_kept.append(b)
                b = next(right, None)
            else:
                return None
        return from_probation, from_kept

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        remove(keys, self._probation, self._protected)

    def clear(self) -> None:
        for segment in (self._probation, self._protected):
            segment.clear()
        self._ghosts.clear()
        self._target = 0.0
        self._clock = self._probation_evictions = self._protected_evictions = 0
        self._admitted = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def ghosts(self) -> int:
        return len(self._ghosts)


def _used(value: int) -> int:
    """The use a segment value stands for (a stored key's: the number after its store's)."""
    return value if value >= 0 else -1 - value


class DSLRUPolicy(_Segments):
    """Segmented LRU data, evicted by LRU or by the segments, whichever its shadows favour.

    ``capacity`` chunks size the ghost lists, the target and the shadows.
    ``histories`` are the segmented experts' ghost histories, in capacities
    (how long a key stored once is remembered, so that its next store admits
    it to protected); ``decay`` is the factor on the experts' scores each
    period, ``long_decay`` that on the long-run scores that leaving LRU also
    needs; ``margin`` how much more an expert must score than the current one
    to take over. ``window`` and ``step`` are ASLRU's (marginal window,
    probation step, fractions of the capacity).
    """

    name = "dslru"

    def __init__(
        self,
        capacity: int,
        *,
        histories: Sequence[float] = (2.0, 4.0),
        decay: float = 0.97,
        long_decay: float = 0.999,
        margin: float = 0.003,
        window: float = 0.1,
        step: float = 1 / 1024,
    ) -> None:
        if not is_int(capacity) or capacity < 1:
            raise ConfigError(f"DSLRUPolicy capacity must be at least 1 chunk, got {capacity!r}")
        capacity = int(capacity)  # numpy's integers too
        histories = tuple(histories)
        if not histories or not all(
            not isinstance(h, bool) and isinstance(h, int | float) and math.isfinite(h) and h >= 0
            for h in histories
        ):
            raise ConfigError(
                f"DSLRUPolicy histories must be one or more finite numbers >= 0, got {histories!r}"
            )
        for name, value, high in (
            ("decay", decay, 1.0),
            ("long_decay", long_decay, 1.0),
            ("margin", margin, math.inf),
            ("window", window, math.inf),
            ("step", step, math.inf),
        ):
            if isinstance(value, bool) or not (math.isfinite(value) and 0.0 <= value <= high):
                raise ConfigError(
                    f"DSLRUPolicy {name} must be a finite number in [0, {high}], got {value!r}"
                )
        self._admits = tuple(int(h * capacity) for h in histories)
        super().__init__(
            capacity,
            max(self._admits),
            max(1, int(window * capacity)),
            max(1.0, step * capacity) if step > 0 else 0.0,
            lru=True,
        )
        shift = min(_MAX_SHIFT, max(0, int(math.log2(max(1, capacity // _TARGET_SHADOW)))))
        size = max(1, capacity >> shift)
        self._mask = (1 << shift) - 1
        # Expert 0 is LRU; expert i >= 1 the segments with ghost history histories[i - 1].
        # A shadow has the same history, window and step as fractions of its (smaller)
        # capacity: one sampled marginal hit stands for 2**shift real ones.
        self._shadows: list[LRUShadow | SegmentedShadow] = [LRUShadow(size)]
        self._shadows += (
            SegmentedShadow(
                size, int(h * size), int(max(histories) * size), max(1, int(window * size)),
                self._step,
            )
            for h in histories
        )  # fmt: skip
        self._scores = [0.0] * len(self._shadows)
        self._long_scores = [0.0] * len(self._shadows)
        self._decay = decay
        self._long_decay = long_decay
        self._margin = margin
        self._period = max(1, size // _PERIODS)
        self._sampled = 0
        self._expert = 0
        self._switches = 0

    @property
    def expert(self) -> str:
        """The expert evicting from the tier now: ``lru`` or ``history=<h>`` (capacities)."""
        if self._lru:
            return "lru"
        return f"history={self._admit / self._capacity:g}"

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        sampled = self._commit(keys, self._mask)
        if sampled:
            tail = sampled[-1] is keys[-1]
            for shadow in self._shadows:
                shadow.access(sampled, tail)
            self._sampled += len(sampled)
            if self._sampled >= self._period:
                self._score()

    def _score(self) -> None:
        """Close a period: decay and add each shadow's hits; follow a clear lead. Leaving
        LRU takes the long run's word too: where the experts take turns ahead, following
        each lead costs more than it wins."""
        self._sampled = 0
        decay, long_decay = self._decay, self._long_decay
        scores, long_scores = self._scores, self._long_scores
        for i, shadow in enumerate(self._shadows):
            scores[i] = scores[i] * decay + shadow.hits
            long_scores[i] = long_scores[i] * long_decay + shadow.hits
            shadow.hits = 0
        best = max(range(len(scores)), key=scores.__getitem__)
        current, lead = self._expert, 1.0 + self._margin
        if best == current or scores[best] <= scores[current] * lead:
            return
        if current == 0 and long_scores[best] <= long_scores[0] * lead:
            return
        self._follow(best)

    def _follow(self, expert: int) -> None:
        self._expert = expert
        self._switches += 1
        self._lru = expert == 0
        # Under LRU the segments keep the longest memory, for whichever expert comes next.
        self._admit = self._admits[expert - 1] if expert else self._history

    def clear(self) -> None:
        super().clear()
        self._lru = True
        self._expert = 0
        self._admit = self._history
        for shadow in self._shadows:
            shadow.clear()
        self._scores = [0.0] * len(self._shadows)
        self._long_scores = [0.0] * len(self._shadows)
        self._sampled = self._switches = 0

    def statistics(self) -> PolicyStatistics:
        own = self.ghosts()
        shadow_keys = sum(s.keys() for s in self._shadows)
        shadow_ghosts = sum(s.ghosts() for s in self._shadows)
        size = self._shadows[0].capacity
        # The tier's ghosts (two generations each); each shadow's keys and ghosts.
        limit = 2 * self._ghosts.limit + sum(s.limit() for s in self._shadows)
        detail: dict[str, float] = {
            "probation": len(self._probation),
            "protected": len(self._protected),
            "target_probation": self._target,
            "admitted_total": self._admitted,
            "expert": self._expert,
            "expert_switches_total": self._switches,
            "shadow_capacity": size,
            "shadow_keys": shadow_keys,
            "shadow_history": shadow_ghosts,
        }
        for i, (score, long) in enumerate(zip(self._scores, self._long_scores, strict=True)):
            detail[f"expert_{i}_score"] = score
            detail[f"expert_{i}_long_score"] = long
        return PolicyStatistics(
            name=self.name,
            tracked=len(self),
            history=own + shadow_keys + shadow_ghosts,
            history_limit=limit,
            metadata_bytes=estimate_entry_bytes(len(self) + shadow_keys, own + shadow_ghosts),
            detail=detail,
        )

    def __repr__(self) -> str:
        return (
            f"<DSLRUPolicy [probation: {len(self._probation)}, "
            f"protected: {len(self._protected)}, ghosts: {self.ghosts()}, "
            f"expert: {self.expert}]>"
        )
