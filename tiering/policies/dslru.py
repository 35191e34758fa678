"""Dueling segmented LRU: the tier follows whichever expert sampled shadow caches say hits most.

Design note. No one eviction rule wins everywhere. On the conversation trace an
adaptive segmented LRU (`ASLRUPolicy`) hits 1.3x-1.9x what LRU hits at 1-3
million tokens, and a longer ghost history (how long a chunk stored once is
remembered, so that its second store admits it to the protected segment) adds
to that at small capacities and costs a little on the synthetic workloads; near
a workload's whole reuse set (the trace at 20 million tokens) plain LRU beats
every split. A constant tuned to one of these loses on another, and issue #20
asks for a policy that is never below LRU on a workload it has not seen. So
this policy keeps the data of one segmented LRU and lets *experts* vote on how
to run it, as set dueling does in hardware caches (DIP, DRRIP) and as ACME runs
several policies in shadow:

- the experts: LRU, and segmented LRU with a ghost history of ``histories[i]``
  capacities (2 and 4 by default; 2 is ASLRU's own default);
- each expert runs a *shadow*: the real policy class over a ``1 / 2**k`` sample
  of the keys (a CRC-32 of the key picks it, deterministic) in a tier of
  ``capacity >> k`` chunks, fed the sampled keys of every request in order: its
  leading run of keys it holds are its hits (prefix hits, as the manager counts
  them), the rest are stored, evicting as the manager does; sampling keys and
  capacity alike keeps the hit rate of each expert (as SHARDS keeps miss-ratio
  curves);
- every quarter of ``capacity >> k`` sampled keys the hits of each shadow are
  added to a decayed score (factor ``decay`` a period); the real tier switches
  to the best expert once its score beats the current one's by ``margin``
  (hysteresis, so noise does not flap it). It starts under LRU: where the
  experts tie (a tier still filling, or one near the whole reuse set) it stays
  LRU, and a split has to prove itself first.

The real tier has a probation and a protected segment, each ordered by a
request clock (the value of a key is the request that last used it), two ghost
lists with the eviction count of their segment (as `ASLRUPolicy`), and the
probation target ASLRU learns from marginal ghost hits. Every expert keeps them
alike (promotion on reuse, admission from a ghost, the target), so a switch
finds them ready; experts differ in eviction only. A segmented expert evicts
as `ASLRUPolicy` does, with its own ghost history; LRU evicts the older of the
two segments' coldest keys, so their union is one LRU order.

Figures (hit blocks over all blocks; x LRU; share of the LRU-to-optimum gap),
conversation trace: 500,000 tokens 8.03% (1.81x, 27%; aslru 1.65x), 1,000,000
10.92% (2.05x, 29%; aslru 1.92x), 3,000,000 18.03% (1.32x, 21%; as aslru),
10,000,000 30.11% (1.06x, 20%), 20,000,000 35.13% (1.00x: LRU's own, where
aslru is 0.98x). ``chat`` and ``documents`` at bench/policy.py's capacities:
1.02x-1.32x, within 0.5 point of aslru. What it does not do: predict a chunk's
first reuse. On the trace at 3,000,000 tokens the optimum's lead over aslru is
13.8 of its 17.1 points in second uses of a chunk (first reuses), and no
feature this policy sees (depth, request length, hits of the prefix, position
from the end but the last block) moves the chance of a first reuse far from
one in four.

Prefix order: keys come head first and are committed tail first in both
segments, so within a segment a request's tail goes before its head; the new
last block of a request goes to probation's cold end under a segmented expert.

Costs: O(1) amortized per key in the real tier (OrderedDict moves; an
eviction plans every victim before it changes anything, so it is all or
nothing), plus the shadows' O(1) per sampled key; ``k`` is chosen so a shadow
holds about 256 chunks, sampling between one key in 16 and one in 32. Below
``_MIN_SHADOW`` chunks of shadow (tiers under 512 chunks) there are no shadows
and the first segmented expert runs alone: ASLRU with ``histories[0]``.
Metadata is bounded: at most ``max(histories) + 1`` capacities of ghost keys in
the real tier, and ``(max(histories) + 2) / 16`` of a capacity or less in each
of the ``len(histories) + 1`` shadows (`statistics`: ``history`` counts the
shadows' keys and ghosts too, ``history_limit`` bounds it). The manager runs at
about 0.4-0.46x of its speed with LRU with it (bench/manager.py, 3,000,000
tokens; aslru 0.54-0.58x on the same runs).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import filterfalse, islice
from zlib import crc32

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.policies.base import CachePolicy, PolicyStatistics, estimate_entry_bytes

__all__ = ["DSLRUPolicy"]

_SINK: deque[object] = deque(maxlen=0)
_drain: Callable[[Iterable[object]], None] = _SINK.extend  # consume an iterator in C

_MIN_SHADOW = 32  # chunks: below this a shadow says nothing worth following
_TARGET_SHADOW = 256  # chunks a shadow aims for
_MIN_SHIFT, _MAX_SHIFT = 4, 5  # sample between 1/16 and 1/32 of the keys
_PERIODS = 4  # score periods per shadow capacity of sampled keys
_LRU = 0  # the expert index of LRU; 1.. are the segmented experts


class _SegmentedCore(CachePolicy):
    """Probation and protected segments, ghosts and a learned target, run by one expert.

    ``expert`` 0 runs the segments as one LRU order; ``expert`` i >= 1 runs them
    as `ASLRUPolicy` with a ghost history of ``histories[i - 1]`` chunks. ``step``
    is in chunks (a float: a shadow's moves are a fraction of a chunk).
    """

    name = "dslru"

    def __init__(
        self, capacity: int, histories: tuple[int, ...], expert: int, window: int, step: float
    ) -> None:
        self._capacity = capacity
        self._histories = histories
        self._expert = expert
        self._window = window
        self._step = step
        self._target = 0.0
        self._clock = 0
        # Front = coldest; values: the request clock of the key's last use.
        self._probation: OrderedDict[OffloadKey, int] = OrderedDict()
        self._protected: OrderedDict[OffloadKey, int] = OrderedDict()
        # Evicted keys -> their segment's eviction count when they left.
        self._probation_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._protected_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._probation_evictions = self._protected_evictions = 0

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        now = self._clock + 1  # the request storing these keys touches them next
        probation, protected = self._probation, self._protected
        ghost1, ghost2 = self._probation_ghost, self._protected_ghost
        if not (ghost1 and ghost1.keys() & keys) and not (ghost2 and ghost2.keys() & keys):
            probation.update(dict.fromkeys(reversed(keys), now))  # the common case, in C
            return
        window, evicted1, evicted2 = (
            self._window,
            self._probation_evictions,
            self._protected_evictions,
        )
        grow = shrink = 0
        run1 = run2 = True
        for key in keys:  # marginal hits of the leading run (see ASLRUPolicy)
            left = ghost1.get(key)
            if left is not None and evicted1 - left <= window:
                grow += run1
                run2 = False
            else:
                left = ghost2.get(key)
                if left is not None and evicted2 - left <= window:
                    shrink += run2
                    run1 = False
                else:
                    break
            if not (run1 or run2):
                break
        for key in reversed(keys):
            if ghost1.pop(key, None) is not None or ghost2.pop(key, None) is not None:
                protected[key] = now
            else:
                probation[key] = now
        target = self._target + self._step * (grow - shrink)
        self._target = min(float(self._capacity), max(0.0, target))

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            self.commit(keys, True)

    def commit(self, keys: Sequence[OffloadKey], tail: bool) -> None:
        """`touch` of non-empty ``keys``; ``tail``: the last key ends its request."""
        self._clock = now = self._clock + 1
        probation, protected = self._probation, self._protected
        for key in reversed(keys):
            last = probation.get(key)
            if last is not None:
                if last == now:  # the storing request itself
                    probation.move_to_end(key)
                else:  # a second request: reuse proven
                    del probation[key]
                    protected[key] = now
            elif key in protected:
                protected[key] = now
                protected.move_to_end(key)
        if tail and self._expert != _LRU and probation.get(keys[-1]) == now:
            probation.move_to_end(keys[-1], last=False)  # a new last block: first to go

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        if n <= 0:
            return []
        probation, kept = self._probation, self._protected
        if self._expert == _LRU:
            planned = self._plan_lru(n, protected)
            if planned is None:
                return None
            from_probation, from_kept = planned
        else:
            want = min(n, max(0, math.ceil(len(probation) - self._target)))
            from_probation_iter = filterfalse(protected.__contains__, probation)
            from_probation = list(islice(from_probation_iter, want))
            from_kept = list(
                islice(filterfalse(protected.__contains__, kept), n - len(from_probation))
            )
            short = n - len(from_probation) - len(from_kept)
            if short:
                from_probation.extend(islice(from_probation_iter, short))
                if len(from_probation) + len(from_kept) < n:
                    return None
        _drain(map(probation.__delitem__, from_probation))
        _drain(map(kept.__delitem__, from_kept))
        if from_probation:
            base = self._probation_evictions
            self._probation_evictions = base + len(from_probation)
            self._probation_ghost.update(
                zip(from_probation, range(base + 1, self._probation_evictions + 1), strict=True)
            )
        # Under LRU the longest history is kept, for the segmented experts to come.
        self._trim(self._probation_ghost, self._histories[self._expert - 1 if self._expert else -1])
        if from_kept:
            base = self._protected_evictions
            self._protected_evictions = base + len(from_kept)
            self._protected_ghost.update(
                zip(from_kept, range(base + 1, self._protected_evictions + 1), strict=True)
            )
            self._trim(self._protected_ghost, self._capacity)
        return from_probation + from_kept

    def _plan_lru(
        self, n: int, protected: Container[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]] | None:
        """The ``n`` least recently used keys of both segments, merged by their clocks."""
        probation, kept = self._probation, self._protected
        if not kept:  # the usual state under LRU once protected has drained
            victims = list(islice(filterfalse(protected.__contains__, probation), n))
            return (victims, []) if len(victims) == n else None
        left: Iterator[OffloadKey] = filterfalse(protected.__contains__, probation)
        right: Iterator[OffloadKey] = filterfalse(protected.__contains__, kept)
        from_probation: list[OffloadKey] = []
        from_kept: list[OffloadKey] = []
        a = next(left, None)
        b = next(right, None)
        for _ in range(n):
            if a is not None and (b is None or probation[a] <= kept[b]):
                from_probation.append(a)
                a = next(left, None)
            elif b is not None:
                from_kept.append(b)
                b = next(right, None)
            else:
                return None
        return from_probation, from_kept

    @staticmethod
    def _trim(ghost: OrderedDict[OffloadKey, int], limit: int) -> None:
        over = len(ghost) - limit
        if over > 0:
            popitem = ghost.popitem
            for _ in range(over):
                popitem(last=False)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            if self._probation.pop(key, None) is None:
                self._protected.pop(key, None)

    def clear(self) -> None:
        for segment in (self._probation, self._protected):
            segment.clear()
        for ghost in (self._probation_ghost, self._protected_ghost):
            ghost.clear()
        self._target = 0.0
        self._clock = self._probation_evictions = self._protected_evictions = 0

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def history(self) -> int:
        return len(self._probation_ghost) + len(self._protected_ghost)


class _Shadow:
    """One expert over the sampled keys, and its hits as the manager would count them."""

    __slots__ = ("capacity", "held", "hits", "policy")

    def __init__(self, policy: _SegmentedCore, capacity: int) -> None:
        self.policy = policy
        self.capacity = capacity
        self.held: set[OffloadKey] = set()
        self.hits = 0

    def access(self, keys: list[OffloadKey], tail: bool) -> None:
        """One request's sampled ``keys``, head first; ``tail``: the last is the request's."""
        held = self.held
        run = 0
        for key in keys:
            if key not in held:
                break
            run += 1
        self.hits += run
        policy = self.policy
        new = [key for key in dict.fromkeys(keys[run:]) if key not in held]
        if new:
            need = len(held) + len(new) - self.capacity
            policy.insert(new)
            if need > 0:
                victims = policy.evict(need, frozenset(keys))
                if victims is None:  # no room: the store fails, as in the manager
                    policy.remove(new)
                    new = []
                else:
                    held.difference_update(victims)
            held.update(new)
        policy.commit(keys, tail)

    def clear(self) -> None:
        self.policy.clear()
        self.held.clear()
        self.hits = 0


class DSLRUPolicy(_SegmentedCore):
    """A segmented LRU run by the expert (LRU, or a ghost history) its sampled shadows favour.

    ``capacity`` chunks size the ghost lists, the target and the shadows.
    ``histories`` are the ghost histories of the segmented experts, in
    capacities (the first runs until the shadows have a say, and alone where
    the tier is too small for shadows); ``decay`` is the factor on the experts'
    scores each period; ``margin`` how much more an expert must score than the
    current one to take over. ``window`` and ``step`` are ASLRU's (marginal
    window, probation step, fractions of the capacity).
    """

    name = "dslru"

    def __init__(
        self,
        capacity: int,
        *,
        histories: Sequence[float] = (2.0, 4.0),
        decay: float = 0.97,
        margin: float = 0.003,
        window: float = 0.1,
        step: float = 1 / 1024,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"DSLRUPolicy capacity must be at least 1 chunk, got {capacity!r}")
        histories = tuple(histories)
        if not histories or not all(math.isfinite(h) and h >= 0 for h in histories):
            raise ConfigError(
                f"DSLRUPolicy histories must be one or more finite numbers >= 0, got {histories!r}"
            )
        for name, value, high in (
            ("decay", decay, 1.0),
            ("margin", margin, math.inf),
            ("window", window, math.inf),
            ("step", step, math.inf),
        ):
            if not (math.isfinite(value) and 0.0 <= value <= high):
                raise ConfigError(
                    f"DSLRUPolicy {name} must be a finite number in [0, {high}], got {value}"
                )
        super().__init__(
            capacity,
            tuple(int(h * capacity) for h in histories),
            1,
            max(1, int(window * capacity)),
            max(1.0, step * capacity) if step > 0 else 0.0,
        )
        self._decay = decay
        self._margin = margin
        self._switches = 0
        # Shadows: one per expert, over 1 / 2**shift of the keys, in capacity >> shift.
        shift = int(math.log2(max(1, capacity // _TARGET_SHADOW)))
        shift = min(_MAX_SHIFT, max(_MIN_SHIFT, shift))
        size = capacity >> shift
        self._mask = (1 << shift) - 1
        self._shadows: list[_Shadow] = []
        if size >= _MIN_SHADOW:
            # Same window and step as fractions of the (smaller) capacity: one sampled
            # marginal hit stands for 2**shift real ones.
            for expert in range(len(histories) + 1):
                core = _SegmentedCore(
                    size,
                    tuple(int(h * size) for h in histories),
                    expert,
                    max(1, int(window * size)),
                    step * size * (1 << shift),
                )
                self._shadows.append(_Shadow(core, size))
        self._scores = [0.0] * len(self._shadows)
        self._period = max(1, size // _PERIODS)
        self._sampled = 0
        self._first = _LRU if self._shadows else 1
        self._expert = self._first

    @property
    def expert(self) -> str:
        """The expert running the tier now: ``lru`` or ``history=<h>`` (in capacities)."""
        if self._expert == _LRU:
            return "lru"
        return f"history={self._histories[self._expert - 1] / self._capacity:g}"

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        if self._shadows:
            mask = self._mask
            sampled = [key for key in keys if not crc32(key) & mask]
            if sampled:
                self._feed_shadows(sampled, sampled[-1] is keys[-1])
        self.commit(keys, True)

    def _feed_shadows(self, sampled: list[OffloadKey], tail: bool) -> None:
        for shadow in self._shadows:
            shadow.access(sampled, tail)
        self._sampled += len(sampled)
        if self._sampled < self._period:
            return
        self._sampled = 0
        decay, scores = self._decay, self._scores
        for i, shadow in enumerate(self._shadows):
            scores[i] = scores[i] * decay + shadow.hits
            shadow.hits = 0
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != self._expert and scores[best] > scores[self._expert] * (1 + self._margin):
            self._expert = best
            self._switches += 1

    def clear(self) -> None:
        super().clear()
        for shadow in self._shadows:
            shadow.clear()
        self._scores = [0.0] * len(self._shadows)
        self._expert = self._first
        self._sampled = self._switches = 0

    def statistics(self) -> PolicyStatistics:
        own = super().history()
        shadow_keys = sum(len(s.policy) for s in self._shadows)
        shadow_history = sum(s.policy.history() for s in self._shadows)
        history = own + shadow_keys + shadow_history
        # Real ghosts: the longest history and a capacity; each shadow: its capacity
        # of keys, and ghosts of its longest history and its capacity.
        bound = max(self._histories) + self._capacity
        limit = bound + sum(
            s.capacity + max(s.policy._histories) + s.capacity for s in self._shadows
        )
        detail: dict[str, float] = {
            "probation": len(self._probation),
            "protected": len(self._protected),
            "target_probation": self._target,
            "expert": self._expert,
            "expert_switches_total": self._switches,
            "shadow_keys": shadow_keys,
            "shadow_history": shadow_history,
        }
        for i, score in enumerate(self._scores):
            detail[f"expert_{i}_score"] = score
        return PolicyStatistics(
            name=self.name,
            tracked=len(self),
            history=history,
            history_limit=limit,
            metadata_bytes=estimate_entry_bytes(len(self) + shadow_keys, own + shadow_history),
            detail=detail,
        )

    def __repr__(self) -> str:
        return (
            f"<DSLRUPolicy [probation: {len(self._probation)}, "
            f"protected: {len(self._protected)}, ghosts: {len(self._probation_ghost)}"
            f"+{len(self._protected_ghost)}, expert: {self.expert}]>"
        )
