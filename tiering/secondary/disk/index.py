"""`DiskIndex`: what a `DiskTier` holds, and what each write will do, with no I/O.

The index is the tier's memory of its folder: which values exist and their
sizes, the policy's order, the capacity it may fill now, the values that calls
in flight read or write, and the victims whose files are still on disk. The
tier's shell (`tiering.secondary.disk.tier`) asks it, does the file work the
answer names in a worker thread, and reports back; as the scheduler's
`Planner` does, nothing here awaits, reads a clock or touches a file, so the
same calls give the same decisions and the tests drive it without an event
loop (``tests/secondary/test_disk_index.py``).

Design note: a write, in two steps.

- `DiskIndex.plan_write` decides, once a worker thread is the call's own (a call
  answered without I/O evicts nothing): which items it writes (a key another
  call writes or deletes now is left to that call: ``busy``), which values go to
  make room for the new ones (by the policy, tail before head; never one being
  read or written, nor one of the batch), cutting the items to the longest head
  that fits when not all do (``no_room``), and which victims of earlier writes it
  deletes. It reserves the new values' bytes, so that two writes in flight
  never fill the same room, and marks its victims and items as in flight.
- `DiskIndex.settle` takes what the thread did (`WriteOutcome`): the values
  renamed into place are indexed, victims whose files stayed on disk are kept
  for the next write to delete (their room is counted as taken until then), and
  a measure of the file system (``space``) refits the effective capacity.

Retention hints (`tiering.hints`): the index holds a `HintBook`, as the CPU
tier's manager does, and asks it, not the policy, for victims: released values
go first, retained ones are spared until their deadline within ``hint_share``
of the tier (a preference, never a pin), and without a hint the policy decides
alone, victim for victim. Writes and whole reads are the tier's uses
(`HintBook.note`: a released value used again is no longer released); a write
carries the hint of the store that made it, `hint` applies one to values held.
Hints live in memory: a restart forgets them (the values stay).

Invariants (checked by the tests): ``used`` is the sum of the sizes; ``used``
plus what writes reserve stays within the effective capacity (the file system
may lower it below ``used`` until the next write evicts; so may a value lost
behind the tier's back while a write of it is in flight: that write, planned
while the value was held, reserved nothing, and indexes it again when it
lands); no key being read or written is ever a victim; once nothing is in
flight nothing is reserved, reading, writing or unlinking.
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from tiering._types import OffloadKey
from tiering.hints import Hint
from tiering.policies import CachePolicy, create_policy
from tiering.policies.hints import DEFAULT_HINT_SHARE, HintBook
from tiering.secondary.disk.layout import WriteOutcome

__all__ = ["DiskIndex", "Settled", "WritePlan"]

#: A key whose value has the size of every value with a 16-byte key (the engine's).
_PLAIN_KEY = OffloadKey(bytes(16))


class WritePlan:
    """What `DiskIndex.plan_write` chose for one write."""

    __slots__ = ("busy", "items", "measure", "new", "no_room", "reserved", "space", "victims")

    def __init__(self, items: list[tuple[OffloadKey, memoryview]], *, measure: bool) -> None:
        #: The items to write (a head of those offered that the index may take).
        self.items = items
        #: Keys of ``items`` the index does not hold yet (their bytes are ``reserved``).
        self.new: list[OffloadKey] = []
        #: Values out of the index whose files the write removes or reuses.
        self.victims: list[OffloadKey] = []
        #: Items left out: their key is written or deleted by another call now.
        self.busy = 0
        #: Items left out: no room could be made (every value held is in flight).
        self.no_room = 0
        self.reserved = 0
        #: Whether the write measures the file system's free space.
        self.measure = measure
        #: ``(free, total)`` bytes, set by the thread that measured (None: not measured).
        self.space: tuple[int, int] | None = None


class Settled:
    """What `DiskIndex.settle` found: the values written, and whether the file system's
    measure made room the next write will use."""

    __slots__ = ("room", "written")

    def __init__(self, written: int, room: bool) -> None:
        self.written = written
        self.room = room


class DiskIndex:
    """The index of one disk tier: at most ``capacity_bytes`` of values (less while the
    file system holds less: `fit`), evicted in ``policy``'s order (a policy, or the name
    of one to make for the values the capacity holds). ``value_bytes(key)``
    is the size of ``key``'s value file; ``announce(keys)`` is told of every value that
    leaves the index (evicted, lost or forgotten). Retained values hold at most
    ``hint_share`` of it (see the module's note)."""

    def __init__(
        self,
        policy: CachePolicy | str,
        capacity_bytes: int,
        value_bytes: Callable[[OffloadKey], int],
        announce: Callable[[Sequence[OffloadKey]], None],
        *,
        hint_share: float = DEFAULT_HINT_SHARE,
    ) -> None:
        #: The bytes of one value (with the engine's 16-byte keys).
        self.unit = value_bytes(_PLAIN_KEY)
        #: How many values the configured capacity holds (at least one).
        self.chunks = max(1, capacity_bytes // self.unit)
        self.policy = create_policy(policy, self.chunks) if isinstance(policy, str) else policy
        #: The retention hints of the values held (`tiering.policies.hints`).
        self.hints = HintBook(self.chunks, share=hint_share)
        self.capacity_bytes = capacity_bytes
        #: What the tier holds at most now: the configured capacity, or less where its
        #: file system holds less (see `fit`).
        self.effective_capacity_bytes = capacity_bytes
        self.value_bytes = value_bytes
        self._announce = announce
        self.sizes: dict[OffloadKey, int] = {}  # value file bytes, by key
        self.used = 0
        self.reserved = 0  # bytes of new values being written
        self.reading: dict[OffloadKey, int] = {}  # reads in flight, by key
        self.writing: dict[OffloadKey, int] = {}  # writes in flight, by key
        self.unlinking: set[OffloadKey] = set()  # victims an unfinished call may delete
        self.rewritten: set[OffloadKey] = set()  # written anew while being read
        self.trash: list[OffloadKey] = []  # victims still on disk: the next write deletes them
        self.evictions = 0
        self.lost = 0

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    # -- what a scan found ----------------------------------------------------------------

    def adopt(
        self, values: Iterable[tuple[OffloadKey, int, int]], space: tuple[int, int] | None
    ) -> list[OffloadKey]:
        """Index what a scan found (``(key, bytes, mtime)``, oldest first), fit into the
        file system's ``space`` if measured, and trim to the capacity: the victims (out
        of the index; their files are the caller's to delete)."""
        self.sizes.clear()
        self.policy.clear()
        self.hints.clear()
        self.used = 0
        for key, size, _ in values:
            self.sizes[key] = size
            self.used += size
            self.policy.insert([key])
        if space is not None:  # a file system smaller than the capacity: fit into it
            self.fit(space)
        return self.evict(self.used - self.effective_capacity_bytes, protected=()) or []

    # -- fitting the file system ----------------------------------------------------------

    def fit(self, space: tuple[int, int], quota: bool = False) -> None:
        """Set the effective capacity from ``(free, total)`` bytes of the file system: what
        the tier's files take (its values, and victims still on disk) plus what is free,
        less the reserve (max(one value, 1% of the file system)), at least one value and
        at most the configured capacity. ``quota``: the disk just refused a write for
        the user's quota (``EDQUOT``), which ``fstatvfs`` does not show: at most what the
        tier's files take now."""
        free, total = space
        value = self.unit
        own = self.used + value * (len(self.trash) + len(self.unlinking))
        fits = max(value, own + free - max(value, total // 100))
        if quota:
            fits = min(fits, max(value, own))
        self.effective_capacity_bytes = min(self.capacity_bytes, fits)

    def refit(self, space: tuple[int, int], quota: bool = False) -> bool:
        """`fit`, then evict down to the effective capacity (the victims' files go with
        the next write); whether there is room made that the next write will use (or,
        at a quota, values it may evict: their files take the next values)."""
        self.fit(space, quota)
        need = self.used + self.reserved - self.effective_capacity_bytes
        victims = self.evict(need, _Protected(set(), self.reading, self.writing)) or []
        self.trash.extend(victims)
        return bool(self.trash) or (quota and len(self.policy) > 0)

    # -- writes ---------------------------------------------------------------------------

    def plan_write(
        self, rows: Sequence[tuple[OffloadKey, memoryview]], *, measure: bool
    ) -> WritePlan:
        """Choose what a write does (see the design note): its items, victims and
        reservation, all marked in flight until `settle`."""
        # A key another call is writing or deleting now is left to that call.
        plan = WritePlan([(k, r) for k, r in rows if not self._busy_key(k)], measure=measure)
        plan.busy = len(rows) - len(plan.items)
        plan.victims = self._room_for(plan)
        plan.no_room = len(rows) - plan.busy - len(plan.items)
        plan.victims += self._take_trash()
        plan.reserved = sum(self.value_bytes(k) for k in plan.new)
        self.reserved += plan.reserved
        self.unlinking.update(plan.victims)
        for key, _ in plan.items:
            self.writing[key] = self.writing.get(key, 0) + 1
        return plan

    def settle(self, plan: WritePlan, out: WriteOutcome) -> Settled:
        """Take what the write's thread did (``out``; empty if it never ran) into the
        index: the values renamed into place are held, its victims whose files stayed on
        disk go to the next write, and a measure of the file system (``plan.space``)
        refits the effective capacity."""
        self.reserved -= plan.reserved
        self.unlinking.difference_update(plan.victims)
        gone = set(out.gone)
        # Victims whose files are still on disk: the next write deletes them.
        self.trash.extend(v for i, v in enumerate(plan.victims) if i not in gone)
        _uncount(self.writing, [key for key, _ in plan.items])
        written = self._index_written(plan.items, out)
        quota = any(e.errno == errno.EDQUOT for e in out.errors.values())
        room = False if plan.space is None else self.refit(plan.space, quota)
        return Settled(written, room)

    def _busy_key(self, key: OffloadKey) -> bool:
        return key in self.writing or key in self.unlinking

    def _room_for(self, plan: WritePlan) -> list[OffloadKey]:
        """Victims that make room for the plan's items, cutting them to the longest head
        that fits when not all do (a prefix is what gets reused)."""
        protected = _Protected({k for k, _ in plan.items}, self.reading, self.writing)
        victims, plan.new = self._make_room(plan.items, protected)
        if victims is not None:
            return victims
        # The longest fitting head, found in O(log n) tries; a failed try changes nothing.
        fits, fails = 0, len(plan.items)
        while fails - fits > 1:
            middle = (fits + fails) // 2
            if self._make_room(plan.items[:middle], protected, dry_run=True)[0] is None:
                fails = middle
            else:
                fits = middle
        plan.items = plan.items[:fits]
        victims, plan.new = self._make_room(plan.items, protected)
        if victims is None:  # the policy would not give what the count promised
            plan.items, plan.new = [], []
            return []
        return victims

    def _make_room(
        self,
        items: list[tuple[OffloadKey, memoryview]],
        protected: _Protected,
        *,
        dry_run: bool = False,
    ) -> tuple[list[OffloadKey] | None, list[OffloadKey]]:
        """Victims that make room for ``items``' new values (None: not possible), and those
        new keys. ``dry_run`` only says whether room can be made (victims stay)."""
        new = list(dict.fromkeys(k for k, _ in items if k not in self.sizes))
        need = self.used + self.reserved + sum(map(self.value_bytes, new))
        need -= self.effective_capacity_bytes
        if dry_run:
            evictable = len(self.policy) - sum(1 for k in set(protected) if k in self.sizes)
            possible = need <= 0 or math.ceil(need / self.unit) <= evictable
            return ([] if possible else None), new
        return self.evict(need, protected), new

    def _index_written(self, items: list[tuple[OffloadKey, memoryview]], out: WriteOutcome) -> int:
        """Index the values now on disk; their count."""
        added: list[OffloadKey] = []
        again: list[OffloadKey] = []
        for position in out.renamed:
            key = items[position][0]
            if key in self.reading:
                self.rewritten.add(key)
            if key in self.sizes:
                again.append(key)
                continue
            size = self.value_bytes(key)
            self.sizes[key] = size
            self.used += size
            added.append(key)
        if added:
            self.policy.insert(added)
        if again:
            self.policy.touch(again)
        return len(out.renamed)

    def written(self, keys: Sequence[OffloadKey], hint: Hint | None) -> None:
        """``keys`` were written (a use), carrying the ``hint`` of the store that made them
        (or none): it applies to those held."""
        if keys:
            self.hints.note(keys, hint, self.sizes)

    def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> int:
        """Apply ``hint`` to those of ``keys`` held, without a use; how many are held."""
        self.hints.apply(keys, hint, self.sizes)
        return sum(1 for key in keys if key in self.sizes)

    def _take_trash(self) -> list[OffloadKey]:
        trash = [k for k in self.trash if k not in self.sizes and k not in self.writing]
        self.trash.clear()
        return trash

    # -- reads ----------------------------------------------------------------------------

    def begin_read(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` are being read (each once by this call): never evicted meanwhile."""
        for key in keys:
            self.reading[key] = self.reading.get(key, 0) + 1

    def end_read(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """The read of ``keys`` ended; those written anew while it ran (what it found wrong
        with their old files says nothing of the new ones)."""
        _uncount(self.reading, keys)
        rewritten = self.rewritten
        fresh = {k for k in keys if k in rewritten}
        for key in fresh:
            if key not in self.reading:
                rewritten.discard(key)
        return fresh

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` were read whole: used now, in the policy's order (a released value
        read again is no longer released)."""
        if keys:
            self.policy.touch(keys)
            self.hints.note(keys, None, self.sizes)

    # -- leaving the index ----------------------------------------------------------------

    def evict(self, need: int, protected: _Protected | tuple[()]) -> list[OffloadKey] | None:
        """Victims that free at least ``need`` bytes, out of the index (None: not possible)."""
        if need <= 0:
            return []
        victims = self.hints.evict(self.policy, math.ceil(need / self.unit), protected)
        if victims is None:
            return None
        for key in victims:
            self.used -= self.sizes.pop(key)
        self.evictions += len(victims)
        self._announce(victims)
        return victims

    def forget(self, key: OffloadKey) -> None:
        """``key``'s file is gone or unsound: out of the index (not an eviction)."""
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used -= size
            self.policy.remove([key])
            self.hints.forget([key])
            self._announce([key])

    def lose(self, key: OffloadKey) -> None:
        """``key``'s file was deleted behind the tier's back: counted lost, forgotten."""
        self.lost += 1
        self.forget(key)

    def __repr__(self) -> str:
        return (
            f"<DiskIndex [{len(self.sizes)} values, {self.used:,}/"
            f"{self.effective_capacity_bytes:,} bytes; {self.reserved:,} reserved]>"
        )


def _uncount(counts: dict[OffloadKey, int], keys: Sequence[OffloadKey]) -> None:
    """One call fewer for each of ``keys`` (each counted once by that call)."""
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]


class _Protected:
    """The keys a write may not evict: its own, and those being read or written now
    (looked up in place: no copy of the tier's in-flight keys per call)."""

    __slots__ = ("batch", "reading", "writing")

    def __init__(
        self, batch: set[OffloadKey], reading: dict[OffloadKey, int], writing: dict[OffloadKey, int]
    ) -> None:
        self.batch, self.reading, self.writing = batch, reading, writing

    def __contains__(self, key: object) -> bool:
        return key in self.batch or key in self.reading or key in self.writing

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.batch | self.reading.keys() | self.writing.keys())
