"""The control plane of the CPU tier: a pool of chunk slots and their states.

`CPUOffloadingManager` decides what lives where; it never moves bytes, never
blocks and does no I/O, so the scheduler can call it from the event loop and
tests can drive it without one.

Chunk states::

    absent --prepare_store--> writing        (not readable; lookup says HIT_PENDING)
    writing --complete_store(ok)--> ready    (evictable)
    writing --complete_store(failed)--> absent   (slot freed, no public event)
    ready --prepare_load--> pinned           (pin count > 0; never evicted)
    pinned --complete_load--> ready          (when the pin count drops to 0)
    ready --evicted inside prepare_store--> absent

The cache policy orders the ready chunks; the manager keeps a count of the
evictable ones (ready, unpinned), so a ``prepare_store`` that cannot make room
fails in O(1) before touching the policy.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import msgspec

from tiering._checks import check_int
from tiering._types import Medium, OffloadKey
from tiering.config import DEFAULT_POLICY
from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import ChunkStateError, ConfigError, InvalidKeyError, UnknownKeyError
from tiering.hints import Hint
from tiering.policies import CachePolicy, create_policy
from tiering.policies.hints import DEFAULT_HINT_SHARE, HintBook, HintStatistics

__all__ = [
    "AllChunksCleared",
    "CPUOffloadingManager",
    "ChunkEvent",
    "ChunksRemoved",
    "ChunksStored",
    "LookupResult",
    "ManagerStatistics",
    "PrepareStoreOutput",
]

_WRITING = -1  # pin count of a chunk whose store has not landed yet


class LookupResult(enum.Enum):
    """What the tier holds for one key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # being written: not readable yet


class PrepareStoreOutput(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a store must copy: the keys not yet in the tier, their slots, and evictions."""

    keys_to_store: tuple[OffloadKey, ...]
    store_spec: CPULoadStoreSpec
    evicted_keys: tuple[OffloadKey, ...]


class ChunksStored(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag=True):
    """Chunks whose stores landed: readable from now on. ``job`` is the store's
    job id when `complete_store` was given one (to match it with what its
    submitter said about the chunks)."""

    keys: tuple[OffloadKey, ...]
    medium: Medium = Medium.CPU
    job: Any = None


class ChunksRemoved(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag=True):
    """Chunks evicted from the tier."""

    keys: tuple[OffloadKey, ...]
    medium: Medium = Medium.CPU


class AllChunksCleared(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag=True):
    """The tier was reset: every chunk is gone. ``keys`` are the ready chunks it held
    (those announced by a `ChunksStored`); a chunk still being written was never
    announced and is not among them."""

    medium: Medium = Medium.CPU
    keys: tuple[OffloadKey, ...] = ()


ChunkEvent = ChunksStored | ChunksRemoved | AllChunksCleared


class ManagerStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A snapshot of the manager. Chunk counts are now; ``*_total`` count since creation."""

    capacity: int
    used: int
    free: int
    writing: int
    ready: int
    pinned: int
    evictable: int
    lookups_hit_total: int
    lookups_miss_total: int
    lookups_pending_total: int
    stored_total: int
    store_failed_total: int
    loaded_total: int
    evictions_total: int
    allocation_failures_total: int
    events_pending: int
    events_dropped_total: int
    #: Jobs holding manager state now: stores prepared and not completed, loads
    #: pinned and not completed (those prepared with a job id). Back to 0 when idle.
    open_store_jobs: int = 0
    open_load_jobs: int = 0
    #: What the retention hints hold and did (`tiering.policies.hints`); None until
    #: a hint was given.
    hints: HintStatistics | None = None

    @property
    def used_ratio(self) -> float:
        """Fraction of the slots that hold a chunk (writing or ready)."""
        return self.used / self.capacity if self.capacity else 0.0


class _Chunk(msgspec.Struct, gc=False):
    """A chunk in the tier: its slot, and its pin count (``_WRITING`` while being stored).

    Not tracked by the garbage collector (it holds two ints): a tier holds
    millions of these, and every tracked allocation brings the next collection
    closer, which in a process that imported torch walks a very large heap.
    """

    slot: int
    pins: int = _WRITING


def _check_key(key: object) -> None:
    """Refuse a key that is not `bytes` (an `OffloadKey`), before anything changes."""
    if not isinstance(key, bytes):
        raise InvalidKeyError(
            f"offload keys must be bytes, as make_offload_key(block_hash, group) gives; "
            f"got {key!r} ({type(key).__name__})"
        )


class CPUOffloadingManager:
    """The slot pool of a CPU tier of ``num_chunks`` chunks, and its state machine.

    ``policy`` is a `CachePolicy` or a policy name (`tiering.policies.POLICY_NAMES`;
    `tiering.config.DEFAULT_POLICY` by default).
    With ``enable_events``, stores, evictions and resets queue `ChunkEvent`
    records for `take_events`, at most ``max_pending_events`` of them: past
    that the oldest are dropped and counted (a consumer that lost events may
    then see a removal whose store it missed; ``events_dropped_total`` tells
    it to resynchronise). Without it no event is built. ``on_events`` (if
    given) is called whenever an event is queued while none was pending, so
    an owner can gather what one turn of its loop produced into one batch.

    Slots are allocated deterministically: never-used slots in increasing
    order first, then freed slots, most recently freed first.
    """

    def __init__(
        self,
        num_chunks: int,
        policy: CachePolicy | str = DEFAULT_POLICY,
        *,
        enable_events: bool = False,
        max_pending_events: int = 65536,
        on_events: Callable[[], object] | None = None,
        hint_share: float = DEFAULT_HINT_SHARE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        num_chunks = check_int("num_chunks", num_chunks, minimum=1)
        max_pending_events = check_int("max_pending_events", max_pending_events, minimum=1)
        if isinstance(policy, str):
            policy = create_policy(policy, num_chunks)
        elif not isinstance(policy, CachePolicy):
            raise ConfigError(f"policy must be a CachePolicy or a policy name, got {policy!r}")
        elif len(policy):
            raise ConfigError(
                f"policy {policy!r} already tracks {len(policy)} keys; give each manager a new one"
            )
        self._capacity = num_chunks
        self._policy = policy
        self._hints = HintBook(num_chunks, share=hint_share, clock=clock)
        self._chunks: dict[OffloadKey, _Chunk] = {}
        self._next_fresh = 0
        self._free: list[int] = []
        self._writing = 0
        self._pinned = 0  # chunks with pins > 0
        # Keys no eviction may take: pinned or being written (kept for the policy's scans).
        self._busy: set[OffloadKey] = set()
        self._evictable = 0
        self._loads: dict[Hashable, tuple[OffloadKey, ...]] = {}
        self._store_jobs: dict[Hashable, tuple[OffloadKey, ...]] = {}
        self._enable_events = enable_events
        self._events: deque[ChunkEvent] = deque()
        self._max_events = max_pending_events
        self._events_dropped = 0
        self._on_events = on_events
        self._lookups = dict.fromkeys(LookupResult, 0)
        self._stored = 0
        self._store_failed = 0
        self._loaded = 0
        self._evictions = 0
        self._alloc_failures = 0

    # -- queries --------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    def lookup(self, key: OffloadKey) -> LookupResult:
        """Whether ``key`` is ready (`HIT`), being written (`HIT_PENDING`) or absent."""
        chunk = self._chunks.get(key)
        if chunk is None:
            result = LookupResult.MISS
        elif chunk.pins == _WRITING:
            result = LookupResult.HIT_PENDING
        else:
            result = LookupResult.HIT
        self._lookups[result] += 1
        return result

    @property
    def writing(self) -> int:
        """Chunks being written now (as in `statistics`, without building it)."""
        return self._writing

    def store_in_flight(self, job: Hashable) -> bool:
        """Whether store job ``job`` was prepared and not completed yet."""
        return job in self._store_jobs

    def holds(self, key: OffloadKey, *, ready: bool = False) -> bool:
        """Whether ``key`` is in the tier (ready, or with ``ready=False`` also being
        written); not counted as a lookup."""
        chunk = self._chunks.get(key)
        return chunk is not None and (not ready or chunk.pins != _WRITING)

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int:
        """How many of ``keys``, from the first, are ready to load."""
        chunks = self._chunks
        hits = 0
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None or chunk.pins == _WRITING:
                self._lookups[LookupResult.MISS if chunk is None else LookupResult.HIT_PENDING] += 1
                break
            hits += 1
        self._lookups[LookupResult.HIT] += hits
        return hits

    # -- loads ----------------------------------------------------------------

    def prepare_load(
        self, keys: Sequence[OffloadKey], *, job: Hashable | None = None, count: bool = True
    ) -> CPULoadStoreSpec:
        """Pin ready chunks for reading; returns their slots, co-indexed with ``keys``.

        Every key must be ready (else `UnknownKeyError` or `ChunkStateError`,
        and nothing is pinned). Pins are counted: each ``prepare_load`` needs one
        ``complete_load``. Passing a ``job`` id makes the completion idempotent:
        ``complete_load(job=...)`` then releases exactly this call's pins once.
        ``count=False`` pins without counting a load (a copy to a lower tier).
        """
        keys = tuple(keys)  # walked twice: an iterator must not pin nothing
        chunks = self._chunks
        slots = []
        for key in keys:
            try:
                chunk = chunks.get(key)
            except TypeError:  # unhashable: never a key
                chunk = None
            if chunk is None:
                _check_key(key)
                raise UnknownKeyError(f"cannot load chunk {key.hex()}: it is not in the tier")
            if chunk.pins == _WRITING:
                raise ChunkStateError(
                    f"cannot load chunk {key.hex()}: it is still being written "
                    "(HIT_PENDING); load it after its store completes"
                )
            slots.append(chunk.slot)
        if job is not None:
            if job in self._loads:
                raise ChunkStateError(f"load job {job!r} already holds pins; use a new job id")
            self._loads[job] = keys
        for key in keys:
            chunk = chunks[key]
            if chunk.pins == 0:
                self._evictable -= 1
                self._pinned += 1
                self._busy.add(key)
            chunk.pins += 1
        if count:
            self._loaded += len(slots)
        return CPULoadStoreSpec.from_valid_ids(slots)

    def complete_load(
        self, keys: Sequence[OffloadKey] = (), *, job: Hashable | None = None
    ) -> None:
        """Release the pins of a finished load (whether it succeeded or not).

        With ``job``, releases that job's pins and ignores ``keys``; a job
        already completed (or never prepared) is a no-op, so completion is
        idempotent. Without it, unpins each key once. Either way, a key with
        fewer pins than are being released (unpinning more than was pinned,
        e.g. by mixing both ways for one load) raises `ChunkStateError`
        before anything changes.
        """
        if job is not None:
            held = self._loads.get(job)
            if held is None:
                return
            keys = held
        else:
            keys = tuple(keys)
        chunks = self._chunks
        get = chunks.get
        try:
            distinct = len(set(keys))
        except TypeError:  # an unhashable key: never a key
            for key in keys:
                _check_key(key)
            raise  # pragma: no cover - some key above is refused
        if distinct == len(keys) and all((c := get(k)) is not None and c.pins > 0 for k in keys):
            need: dict[OffloadKey, int] = {}  # the common case: nothing to check further
        else:
            need = {}
            for key in keys:
                need[key] = need.get(key, 0) + 1
        for key, count in need.items():
            chunk = chunks.get(key)
            if chunk is None:
                _check_key(key)
                raise UnknownKeyError(f"cannot unpin chunk {key.hex()}: it is not in the tier")
            if chunk.pins < count:
                if chunk.pins == _WRITING:
                    state = "being written"
                else:
                    state = f"pinned {chunk.pins}x" if chunk.pins else "not pinned"
                raise ChunkStateError(
                    f"cannot unpin chunk {key.hex()} {count}x: it is {state}; "
                    "each prepare_load is completed exactly once"
                )
        if job is not None:
            del self._loads[job]
        for key in keys:
            chunk = chunks[key]
            chunk.pins -= 1
            if chunk.pins == 0:
                self._pinned -= 1
                self._busy.discard(key)
                self._evictable += 1

    # -- stores ---------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[OffloadKey], *, job: Hashable | None = None, count: bool = True
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the keys not in the tier yet, evicting if needed.

        Keys already present (ready or writing) are skipped, as are repeats.
        Eviction is all or nothing and takes exactly the missing room; it never
        takes pinned or writing chunks nor any key of this call. Returns
        ``None`` (and changes nothing but the failure count) when the room
        cannot be made. The new keys join the policy now, in request order and
        protected while they are written, so a request's recency is right
        whenever its store lands. With a ``job`` id, ``complete_store(job=...)``
        completes exactly this call's keys, once; a call with no new key
        records no job (there is nothing to complete). ``count=False`` leaves a
        refusal out of ``allocation_failures_total`` (a caller trying smaller
        sets counts its own final refusal with `count_allocation_failure`).
        """
        chunks = self._chunks
        keys = tuple(keys)  # an iterator is walked once, whatever refuses it
        try:
            offered = dict.fromkeys(keys)
        except TypeError:  # an unhashable key: never a key
            for key in keys:
                _check_key(key)
            raise  # pragma: no cover - some key above is refused
        new_keys = [key for key in offered if key not in chunks]
        for key in new_keys:  # keys already held were checked when they came in
            if type(key) is not bytes:
                _check_key(key)
        # Evictable chunks this call offers again must not be evicted by it.
        offered_ready = (
            [key for key in offered if key in chunks and chunks[key].pins == 0]
            if len(new_keys) < len(offered)
            else []
        )
        need = len(new_keys) - (self._capacity - len(chunks))
        if need > 0 and self._evictable - len(offered_ready) < need:
            if count:
                self._alloc_failures += 1
            return None
        if job is not None and job in self._store_jobs:
            raise ChunkStateError(f"store job {job!r} is already in flight; use a new job id")
        busy = self._busy
        busy.update(new_keys)
        self._writing += len(new_keys)
        self._policy.insert(new_keys)
        evicted: list[OffloadKey] = []
        free = self._free
        if need > 0:
            busy.update(offered_ready)  # protected for this eviction only
            hints = self._hints
            victims = (
                hints.evict(self._policy, need, busy)
                if hints.engaged
                else self._policy.evict(need, busy)
            )
            busy.difference_update(offered_ready)
            if victims is None or len(victims) != need:
                raise RuntimeError(  # the evictable count and the policy disagree: a bug
                    f"policy {self._policy!r} gave {victims!r} for {need} victims"
                )
            pop = chunks.pop
            free.extend([pop(key).slot for key in victims])
            self._evictable -= need
            self._evictions += need
            evicted = victims
            if self._enable_events:
                self._push_event(ChunksRemoved(keys=tuple(victims)))
        # Never-used slots first, in order; then freed ones, most recently freed first.
        fresh = min(len(new_keys), self._capacity - self._next_fresh)
        slots = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        reuse = len(new_keys) - fresh
        if reuse:
            slots += free[: -reuse - 1 : -1]
            del free[-reuse:]
        chunks.update(zip(new_keys, map(_Chunk, slots), strict=True))
        stored = tuple(new_keys)
        if job is not None and stored:  # nothing to store: nothing to complete, no record
            self._store_jobs[job] = stored
        return PrepareStoreOutput(
            keys_to_store=stored,
            store_spec=CPULoadStoreSpec.from_valid_ids(slots),
            evicted_keys=tuple(evicted),
        )

    def complete_store(
        self, keys: Iterable[OffloadKey] = (), success: bool = True, *, job: Hashable | None = None
    ) -> None:
        """Mark the stores of ``keys`` landed (ready) or failed (slot freed, no event).

        Idempotent: keys not being written (already completed, never prepared,
        or skipped by ``prepare_store``) are ignored. With ``job``, completes
        that job's keys and ignores ``keys``; a job already completed is a
        no-op, so a late duplicate cannot complete a later store of the same key.
        """
        if job is not None:
            held = self._store_jobs.pop(job, None)
            if held is None:
                return
            keys = held
        chunks = self._chunks
        done: list[OffloadKey] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is not None and chunk.pins == _WRITING:
                done.append(key)
                if success:
                    chunk.pins = 0
                else:
                    del chunks[key]
                    self._free.append(chunk.slot)
        if not done:
            return
        self._writing -= len(done)
        self._busy.difference_update(done)
        if success:
            self._evictable += len(done)
            self._stored += len(done)
            if self._enable_events:
                self._push_event(ChunksStored(keys=tuple(done), job=job))
        else:
            self._policy.remove(done)
            if self._hints.engaged:
                self._hints.forget(done)
            self._store_failed += len(done)

    def count_allocation_failure(self) -> None:
        """Count one store that found no room (after tries made with ``count=False``)."""
        self._alloc_failures += 1

    def touch(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> None:
        """Commit a request's recency for ``keys``, given head first (the tail is evicted
        first), and its retention ``hint`` if it has one (`tiering.hints`)."""
        self._policy.touch(keys)
        if hint is not None or self._hints.engaged:
            self._hints.note(keys, hint, self._chunks)

    def hint(self, keys: Sequence[OffloadKey], hint: Hint | None) -> None:
        """Apply a request's ``hint`` to those of ``keys`` the tier holds, without a use
        (keys its store wrote after its touch)."""
        self._hints.apply(keys, hint, self._chunks)

    @property
    def hints(self) -> HintBook:
        """The retention hints the tier holds (`tiering.policies.hints`)."""
        return self._hints

    # -- events, reset, statistics ---------------------------------------------

    def _push_event(self, event: ChunkEvent) -> None:
        events = self._events
        if len(events) >= self._max_events:
            events.popleft()
            self._events_dropped += 1
        elif not events and self._on_events is not None:
            self._on_events()
        events.append(event)

    def take_events(self) -> list[ChunkEvent]:
        """The events queued since the last call, oldest first (empty without events)."""
        events = list(self._events)
        self._events.clear()
        return events

    def reset(self, *, force: bool = False) -> None:
        """Drop every chunk and the policy's history; queue `AllChunksCleared` with the
        keys of the ready chunks dropped.

        Refuses (`ChunkStateError`) while chunks are being written or are
        pinned, as their bytes are in use, unless ``force`` (for use after all
        transfers have ended).
        """
        if not force and (self._writing or self._pinned):
            raise ChunkStateError(
                f"cannot reset the tier while {self._writing} chunks are being written and "
                f"{self._pinned} are pinned; wait for the transfers or pass force=True"
            )
        held: tuple[OffloadKey, ...] = ()
        if self._enable_events:
            held = tuple(k for k, c in self._chunks.items() if c.pins != _WRITING)
        self._chunks.clear()
        self._free.clear()
        self._next_fresh = 0
        self._writing = self._evictable = 0
        self._pinned = 0
        self._busy.clear()
        self._loads.clear()
        self._store_jobs.clear()
        self._policy.clear()
        self._hints.clear()
        if self._enable_events:
            self._push_event(AllChunksCleared(keys=held))

    def statistics(self) -> ManagerStatistics:
        used = len(self._chunks)
        return ManagerStatistics(
            capacity=self._capacity,
            used=used,
            free=self._capacity - used,
            writing=self._writing,
            ready=used - self._writing,
            pinned=self._pinned,
            evictable=self._evictable,
            lookups_hit_total=self._lookups[LookupResult.HIT],
            lookups_miss_total=self._lookups[LookupResult.MISS],
            lookups_pending_total=self._lookups[LookupResult.HIT_PENDING],
            stored_total=self._stored,
            store_failed_total=self._store_failed,
            loaded_total=self._loaded,
            evictions_total=self._evictions,
            allocation_failures_total=self._alloc_failures,
            events_pending=len(self._events),
            events_dropped_total=self._events_dropped,
            open_store_jobs=len(self._store_jobs),
            open_load_jobs=len(self._loads),
            hints=self._hints.statistics() if self._hints.engaged else None,
        )

    def __repr__(self) -> str:
        used = len(self._chunks)
        return (
            f"<CPUOffloadingManager [{used}/{self._capacity} chunks: "
            f"{self._writing} writing, {self._pinned} pinned, {self._evictable} evictable; "
            f"policy {self._policy.name}]>"
        )
