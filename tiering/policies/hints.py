"""Retention hints honoured on top of any policy: released chunks first, retained ones kept.

Design note. A `tiering.hints.Hint` speaks for one request's prefix; the
manager hands it here with the request's keys (`HintBook.note`), and asks this
book, not the policy, for victims (`HintBook.evict`), so any `CachePolicy`
honours hints without knowing of them:

- *released* keys (the conversation is over) go first, the lowest priority
  first, then the oldest release; they leave the policy by ``remove`` (no
  ghost: nobody asked to keep them). A release covers the request's own part
  of the prefix, not the head other requests share: the book counts the
  requests that used each key of the tier, and a release starts after the last
  sharp drop of that count along the prefix (more than twice plus one: a
  system prompt used by every conversation, then one conversation's blocks,
  used by its few turns). A key used again by any request is no longer
  released either;
- *retained* keys (used again within ``retain_s``) are protected from the
  policy's choice until their deadline, within ``share`` of the tier: when more
  are retained, the lowest priority, then the oldest retention, loses its
  protection first. Protection is a preference, never a pin: if a store needs
  room only retained keys can give, they are evicted by the policy's order;
- without a hint nothing changes: the book hands ``evict`` to the policy as it
  came, so a tier that never saw a hint decides victim for victim as before.

Hints can be wrong, and a wrong one costs: a released prefix that comes back
is a miss, a retained one that does not holds room. A policy's state is also
path-dependent, so even a short stretch of following bad hints leaves a tier
a few percent behind for long after. So each kind of hint is followed only
while it carries information, measured on every request once a hint was seen
(`_Accuracy`): how often a request's keys are used again by a later request
within a tier's worth of keys, per kind (released, retained, no hint), each
request weighted once. Releases are followed while released requests' keys
are used again less than ``ratio`` (0.6) times as often as the others',
retentions while the others' are used again less than ``ratio`` times as
often as retained ones'; a kind stops being followed past ``ratio + slack``
and starts again below ``ratio``. A tier starts following both (a hint is
information given on purpose) and decides after ``evidence`` requests of each
side: hints right for only half the requests are dropped within the first few
hundred requests, before a tier of a few thousand chunks is full, so they cost
nothing (``bench/policy.py``: 50 % wrong hints give dslru's hit rate within a
few tenths of a percent at 1M to 10M tokens). A measure of information
rather than of hits (as DSLRU's shadows measure its experts) because the
hits of a tier following hints early, while the policy itself still learns,
say little of what following them will be worth later.

Time is ``clock()`` seconds (`time.monotonic` by default; a simulation gives
the trace's clock). Memory is bounded: released keys are keys of the tier
(at most its capacity), retained ones at most ``share`` of it, the accuracy's
stamps a tier's worth of keys. Costs: O(1) per key of a request once a hint
was seen (nothing before); an eviction walks the released keys it takes and
the protected keys the policy skips.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from itertools import chain, filterfalse, islice

import msgspec

from tiering._checks import check_int, check_real
from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.policies.base import CachePolicy

__all__ = ["DEFAULT_HINT_SHARE", "HintBook", "HintStatistics"]

#: The share of a tier retained keys may hold, protected, by default.
DEFAULT_HINT_SHARE = 0.2

_RELEASED, _RETAINED, _PLAIN = 0, 1, 2  # the kinds of keys _Accuracy tells apart


class HintStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of what the hints hold and did (``*_total`` count since the start).
    ``retained`` counts the chunks protected now (their deadline ahead)."""

    retained: int
    retained_limit: int
    released: int
    following_releases: bool
    following_retentions: bool
    hinted_keys_total: int
    #: Of ``hinted_keys_total``: chunks named by a release, and by a retention.
    released_keys_total: int
    retained_keys_total: int
    released_evicted_total: int
    retention_overflow_total: int
    retention_overridden_total: int
    switches_total: int
    #: How often keys were used again (within a tier's worth of later keys), by the
    #: hint of the request that used them last: what decides following the hints.
    reuse_released: float
    reuse_retained: float
    reuse_unhinted: float


class _Buckets:
    """Keys in insertion order, in one ordered bucket per priority: value, priority."""

    __slots__ = ("by_priority", "where")

    def __init__(self) -> None:
        self.by_priority: dict[int, OrderedDict[OffloadKey, float]] = {}
        self.where: dict[OffloadKey, int] = {}

    def put(self, key: OffloadKey, value: float, priority: int) -> None:
        old = self.where.get(key)
        if old is not None:
            del self.by_priority[old][key]
        bucket = self.by_priority.get(priority)
        if bucket is None:
            bucket = self.by_priority[priority] = OrderedDict()
        bucket[key] = value
        self.where[key] = priority

    def get(self, key: OffloadKey) -> float | None:
        priority = self.where.get(key)
        return None if priority is None else self.by_priority[priority][key]

    def pop(self, key: OffloadKey) -> None:
        priority = self.where.pop(key, None)
        if priority is not None:
            del self.by_priority[priority][key]

    def ordered(self) -> list[OrderedDict[OffloadKey, float]]:
        """The buckets, lowest priority first."""
        return [self.by_priority[p] for p in sorted(self.by_priority) if self.by_priority[p]]

    def pop_first(self) -> OffloadKey:
        """Forget and return the oldest key of the lowest priority (there is one)."""
        for bucket in self.ordered():
            key, _ = bucket.popitem(last=False)
            del self.where[key]
            return key
        raise KeyError("no key")  # pragma: no cover - callers check len first

    def __len__(self) -> int:
        return len(self.where)

    def __bool__(self) -> bool:
        return bool(self.where)

    def clear(self) -> None:
        self.by_priority.clear()
        self.where.clear()


class _Guard:
    """The keys an eviction may not take: ``protected``, ``taken`` (released victims
    already chosen) and, when ``retained`` is given, retained keys whose deadline is
    after ``now``."""

    __slots__ = ("now", "protected", "retained", "taken")

    def __init__(
        self,
        protected: Container[OffloadKey],
        taken: set[OffloadKey],
        retained: _Buckets | None,
        now: float,
    ) -> None:
        self.protected = protected
        self.taken = taken
        self.retained = retained
        self.now = now

    def __contains__(self, key: object) -> bool:
        if key in self.protected or key in self.taken:
            return True
        if self.retained is None:
            return False
        deadline = self.retained.get(key)  # type: ignore[arg-type]
        return deadline is not None and deadline > self.now


class _Accuracy:
    """How often a request's keys are used again, by the hint the request gave.

    Each request's keys are stamped with its kind (released, retained, none) and a
    weight of one over its number of keys, so that each request counts once
    whatever its length (a few long requests would otherwise decide alone); a
    later request using a stamped key adds the stamp's weight to the kind's reuses.
    The rate of a kind is its reuses over its requests, both halved whenever the
    requests pass ``memory``, so the rates follow the traffic. Stamps are forgotten
    after ``horizon`` keys of later requests (a reuse that far away is no reuse a
    tier of that size could catch). Costs O(1) per key; at most ``horizon`` stamps.
    """

    __slots__ = ("clock", "horizon", "memory", "pending", "stamped", "used")

    def __init__(self, horizon: int, memory: int) -> None:
        self.horizon = max(1, horizon)
        self.memory = max(1, memory)
        self.clock = 0
        self.pending: OrderedDict[OffloadKey, tuple[int, int, float]] = OrderedDict()
        self.stamped = [0.0, 0.0, 0.0]
        self.used = [0.0, 0.0, 0.0]

    def note(self, keys: Sequence[OffloadKey], kind: int) -> None:
        if not keys:
            return
        pending, used = self.pending, self.used
        if pending:
            pop = pending.pop
            for key in keys:
                entry = pop(key, None)
                if entry is not None:
                    used[entry[0]] += entry[2]
        self.clock += len(keys)
        oldest = self.clock - self.horizon
        while pending:
            stamp = next(iter(pending.values()))
            if stamp[1] > oldest:
                break
            pending.popitem(last=False)
        pending.update(dict.fromkeys(keys, (kind, self.clock, 1.0 / len(keys))))
        stamped = self.stamped
        stamped[kind] += 1.0
        if sum(stamped) > self.memory:
            for i in range(3):
                stamped[i] /= 2
                used[i] /= 2

    def rates(self, kind: int) -> tuple[float, float, float, float]:
        """Requests of ``kind`` and of the others, and the reuse rate of ``kind``'s
        and of the others' keys."""
        stamped, used = self.stamped, self.used
        mine = stamped[kind]
        others = sum(stamped) - mine
        # A stamp waiting for its reuse keeps its weight when the counts halve: a rate
        # may pass 1 by a little, which means 1.
        rate = min(1.0, used[kind] / mine) if mine else 0.0
        other_rate = min(1.0, (sum(used) - used[kind]) / others) if others else 0.0
        return mine, others, rate, other_rate

    def clear(self) -> None:
        self.pending.clear()
        self.clock = 0
        self.stamped = [0.0, 0.0, 0.0]
        self.used = [0.0, 0.0, 0.0]


class HintBook:
    """The hints a tier of ``capacity`` chunks holds, and the evictions that honour them.

    ``share`` of the tier at most is retained (protected); ``clock`` gives the time
    in seconds. Releases are followed while released keys are used again less than
    ``ratio`` times as often as the others, retentions while the others are used
    again less than ``ratio`` times as often as retained keys; a kind stops being
    followed at ``ratio + slack``. A kind is judged once ``evidence`` requests of it
    and of the others were seen; the measure halves its counts every ``memory``
    requests (see the module's design note).
    """

    def __init__(
        self,
        capacity: int,
        *,
        share: float = DEFAULT_HINT_SHARE,
        clock: Callable[[], float] = time.monotonic,
        ratio: float = 0.6,
        slack: float = 0.1,
        evidence: int = 64,
        memory: int = 2048,
    ) -> None:
        capacity = check_int("capacity", capacity, minimum=1)
        share = check_real("hint_share", share, minimum=0.0)
        if share > 1.0:
            raise ConfigError(f"hint_share must be a fraction from 0 to 1, got {share!r}")
        ratio = check_real("hint ratio", ratio, minimum=0.0)
        slack = check_real("hint slack", slack, minimum=0.0)
        self._evidence = check_int("hint evidence", evidence, minimum=1)
        if not callable(clock):
            raise TypeError(f"clock must be a callable giving seconds, got {clock!r}")
        self._limit = int(share * capacity)
        self._clock = clock
        self._ratio = ratio
        self._slack = slack
        self._retained = _Buckets()
        self._deadlines: list[tuple[float, OffloadKey]] = []  # a heap over the retentions
        self._released = _Buckets()
        self._accuracy = _Accuracy(capacity, memory)
        self._follow = [True, True]  # releases, retentions
        self._uses: dict[OffloadKey, int] = {}  # held keys -> requests that used them
        #: Whether a hint was ever given (or since the last `clear`): until then the
        #: manager calls the policy alone, as if there were no book.
        self.engaged = False
        self._hinted_keys = self._released_evicted = self._overflow = self._overridden = 0
        self._switches = 0
        self._hinted_released = self._hinted_retained = 0

    @property
    def following(self) -> bool:
        """Whether evictions follow any of the hints now (they do until proven wrong)."""
        return self._follow[0] or self._follow[1]

    @property
    def following_retentions(self) -> bool:
        """Whether retentions are followed now (others may rank retained work first)."""
        return self._follow[1]

    @property
    def active(self) -> bool:
        """Whether any key is released or retained (else `evict` is the policy's own)."""
        return bool(self._released) or bool(self._retained)

    def note(
        self, keys: Sequence[OffloadKey], hint: Hint | None, held: Container[OffloadKey]
    ) -> None:
        """A request used ``keys`` (head first) with ``hint`` (or none): a used key is
        no longer released; the hint then applies to the keys the tier ``held``s.
        Call it at each touch, hint or not: how often keys of each hint are used
        again is measured on every request once a hint was seen."""
        if hint is not None and hint.empty:
            hint = None
        if hint is not None:
            self.engaged = True
        if self.engaged:
            kind = _PLAIN if hint is None else _RELEASED if hint.release else _RETAINED
            self._accuracy.note(keys, kind)
            self._judge()
        released = self._released
        if released:
            for key in keys:
                released.pop(key)
        if self.engaged:
            uses = self._uses
            for key in keys:
                if key in held:
                    uses[key] = uses.get(key, 0) + 1
        self.apply(keys, hint, held)

    def _judge(self) -> None:
        """Follow a kind of hint while it tells apart the keys used again from the others."""
        follow, accuracy = self._follow, self._accuracy
        for i, kind in enumerate((_RELEASED, _RETAINED)):
            mine, theirs, rate, others = accuracy.rates(kind)
            if mine < self._evidence or theirs < self._evidence:
                continue
            # Releases: their keys used again less than the others'; retentions: more.
            low, high = (rate, others) if kind == _RELEASED else (others, rate)
            bound = self._ratio + (self._slack if follow[i] else 0.0)
            ok = low < bound * high
            if ok != follow[i]:
                follow[i] = ok
                self._switches += 1

    def apply(
        self, keys: Sequence[OffloadKey], hint: Hint | None, held: Container[OffloadKey]
    ) -> None:
        """``hint`` (or none) applies to those of ``keys`` the tier ``held``s, without a
        use (keys a request stored after its touch)."""
        if hint is None or hint.empty:
            return
        self.engaged = True
        released = self._released
        mine = [key for key in keys if key in held]
        self._hinted_keys += len(mine)
        if hint.release:
            self._hinted_released += len(mine)
            retained = self._retained
            mine = mine[self._shared_head(mine) :]
            for key in mine:
                retained.pop(key)
                released.put(key, 0.0, hint.priority)
        elif hint.retain_s is not None:
            self._hinted_retained += len(mine)
            if not self._limit:
                return
            deadline = self._clock() + hint.retain_s
            retained = self._retained
            for key in reversed(mine):  # the head retained last: the last to lose it
                old = retained.get(key)
                if old is None or old < deadline:
                    retained.put(key, deadline, hint.priority)
                    heapq.heappush(self._deadlines, (deadline, key))
                else:
                    retained.put(key, old, hint.priority)
            self._bound()

    def _shared_head(self, keys: Sequence[OffloadKey]) -> int:
        """How many of a request's leading ``keys`` other requests share: up to the last
        sharp drop of the use counts along the prefix (a branch point: a system prompt
        used by every conversation, then one conversation's own blocks)."""
        uses = self._uses
        head = 0
        before = uses.get(keys[0], 0) if keys else 0
        for i in range(1, len(keys)):
            now = uses.get(keys[i], 0)
            if before > 2 * now + 1:
                head = i
            before = now
        return head

    def _bound(self) -> None:
        """Drop retentions past the share: expired ones first, then the lowest priority,
        oldest first."""
        retained = self._retained
        if len(retained) <= self._limit:
            return
        self._expire()
        while len(retained) > self._limit:
            retained.pop_first()
            self._overflow += 1

    def _expire(self) -> None:
        """Forget the retentions whose deadline passed, soonest first (a heap of
        deadlines; an entry a later retention extended is skipped, and the heap is
        rebuilt when such entries outnumber the live ones)."""
        now, heap, retained = self._clock(), self._deadlines, self._retained
        while heap and heap[0][0] <= now:
            deadline, key = heapq.heappop(heap)
            if retained.get(key) == deadline:
                retained.pop(key)
        if len(heap) > 2 * len(retained) + 64:
            self._deadlines = [
                (deadline, key)
                for bucket in retained.by_priority.values()
                for key, deadline in bucket.items()
            ]
            heapq.heapify(self._deadlines)

    def evict(
        self, policy: CachePolicy, n: int, protected: Container[OffloadKey]
    ) -> list[OffloadKey] | None:
        """``n`` victims for ``policy``'s tier, none of ``protected``, all or nothing:
        released keys first, then the policy's choice sparing retained keys, each while
        followed; the policy's own call, unchanged, when neither applies."""
        if n <= 0:
            return []
        releases = self._follow[0] and bool(self._released)
        retained = self._retained if self._follow[1] and self._retained else None
        if not releases and retained is None:
            victims = policy.evict(n, protected)
            if victims and self.engaged:  # their hints and use counts go with them
                self.forget(victims)
            return victims
        taken: list[OffloadKey] = []
        if releases:  # the lowest priority first, then the oldest release
            spare = filterfalse(
                protected.__contains__, chain.from_iterable(self._released.ordered())
            )
            taken = list(islice(spare, n))
        chosen: list[OffloadKey] | None = []
        rest = n - len(taken)
        if rest:
            taken_set = set(taken)
            now = self._clock()
            chosen = policy.evict(rest, _Guard(protected, taken_set, retained, now))
            if chosen is None and retained is not None:
                chosen = policy.evict(rest, _Guard(protected, taken_set, None, now))
                if chosen is not None:
                    self._overridden += sum(1 for key in chosen if key in retained.where)
            if chosen is None:
                return None
        if taken:
            policy.remove(taken)
            self._released_evicted += len(taken)
        victims = taken + chosen if chosen else taken
        self.forget(victims)
        return victims

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` left the tier: their hints go with them."""
        released, retained, uses = self._released, self._retained, self._uses
        for key in keys:
            released.pop(key)
            retained.pop(key)
            uses.pop(key, None)

    def clear(self) -> None:
        """Forget every hint and what they were measured to be worth (a tier reset)."""
        self._released.clear()
        self._retained.clear()
        self._deadlines = []
        self._accuracy.clear()
        self._uses.clear()
        self._follow = [True, True]
        self.engaged = False

    def statistics(self) -> HintStatistics:
        self._expire()  # what is retained now
        accuracy = self._accuracy
        released_rate = accuracy.rates(_RELEASED)[2]
        retained_rate = accuracy.rates(_RETAINED)[2]
        plain_rate = accuracy.rates(_PLAIN)[2]
        return HintStatistics(
            retained=len(self._retained),
            retained_limit=self._limit,
            released=len(self._released),
            following_releases=self._follow[0],
            following_retentions=self._follow[1],
            hinted_keys_total=self._hinted_keys,
            released_keys_total=self._hinted_released,
            retained_keys_total=self._hinted_retained,
            released_evicted_total=self._released_evicted,
            retention_overflow_total=self._overflow,
            retention_overridden_total=self._overridden,
            switches_total=self._switches,
            reuse_released=released_rate,
            reuse_retained=retained_rate,
            reuse_unhinted=plain_rate,
        )
