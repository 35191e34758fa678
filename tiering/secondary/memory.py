"""An in-process secondary tier: a dict of encoded values, with faults on demand.

`MemoryTier` honours the whole `SecondaryTier` contract and the value format
(every value is encoded and checked by the `ChunkCodec`), so the engine's
cascade and promotion logic can be tested without a server. Several tiers may
share one `MemoryStore`, as several engines share one Redis. Faults are
scripted, never timed: `set_available` (down until told otherwise),
`fail_next` (the next calls fail with an error), `pause`/`resume` (calls wait,
then time out), `refuse_writes` (the store answers writes with an error code,
as a full Redis does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import anyio
import anyio.lowlevel

from tiering._checks import check_int, check_real
from tiering._closing import AsyncLifecycle
from tiering._state import ResourceState
from tiering._types import Medium, OffloadKey
from tiering.errors import ConfigError
from tiering.secondary.base import (
    Locality,
    ReadItem,
    SecondaryStatistics,
    SecondaryTier,
    TierCounters,
    WriteItem,
)
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, writable_row
from tiering.secondary.health import TierState
from tiering.secondary.refusals import Unwritten

__all__ = ["MemoryStore", "MemoryTier"]


class MemoryStore:
    """Values by remote key, least recently read or written evicted past ``capacity`` values.

    Stands for one server; share it between tiers to share chunks. Tests may
    put any bytes under any key (``store[key] = value``) to play a foreign or
    damaged value.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None:
            check_int("capacity", capacity, minimum=1)
        self.capacity = capacity
        self.evictions = 0
        self._values: OrderedDict[bytes, bytes] = OrderedDict()

    def exists(self, key: bytes) -> bool:
        return key in self._values  # like Redis EXISTS: no recency change

    def get(self, key: bytes) -> bytes | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def __getitem__(self, key: bytes) -> bytes:
        return self._values[key]

    def __setitem__(self, key: bytes, value: bytes | bytearray | memoryview) -> None:
        self._values[key] = bytes(value)
        self._values.move_to_end(key)
        while self.capacity is not None and len(self._values) > self.capacity:
            self._values.popitem(last=False)
            self.evictions += 1

    def __delitem__(self, key: bytes) -> None:
        del self._values[key]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[bytes]:
        return list(self._values)

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else f"capacity {self.capacity}"
        return f"<MemoryStore [{len(self._values)} values, {cap}, {self.evictions} evicted]>"


class MemoryTier(SecondaryTier):
    """A `SecondaryTier` over a `MemoryStore`. Works on asyncio and trio.

    ``timeout_s`` bounds how long a call waits while the tier is paused.
    ``locality`` says what KV events should report (``LOCAL`` by default; a
    test standing in for a shared store may say ``REMOTE``); ``label`` names it
    in a chain of tiers (``remote`` by default; ``disk`` to stand in for one).
    """

    name = "memory"

    def __init__(
        self,
        namespace: RemoteNamespace,
        *,
        store: MemoryStore | None = None,
        capacity: int | None = None,
        timeout_s: float = 5.0,
        locality: Locality = Locality.LOCAL,
        medium: Medium = Medium.STORAGE,
        label: str = "remote",
    ) -> None:
        if store is not None and capacity is not None:
            raise ConfigError("give either a shared store or a capacity, not both")
        check_real("timeout_s", timeout_s, minimum=0.0, inclusive=False)
        self.codec = ChunkCodec(namespace)
        self.store = store if store is not None else MemoryStore(capacity)
        self.timeout_s = timeout_s
        self.locality = locality
        self.medium = medium
        self.label = label
        self._counters = TierCounters()
        self._life = AsyncLifecycle("the memory tier", opened=True)
        self._state = TierState.UP  # its health: up or down
        self._available = True
        self._fail_next = 0
        self._fail_message = ""
        self._paused: anyio.Event | None = None
        self._pause_requested = False
        self._refusing: str | None = None

    # -- faults -----------------------------------------------------------------

    def set_available(self, available: bool) -> None:
        """Take the store away (every call is answered at once as down) or bring it back."""
        self._available = available
        if not available and self._state is TierState.UP:
            self._state = TierState.DOWN

    def fail_next(self, calls: int = 1, message: str = "injected failure") -> None:
        """The next ``calls`` calls fail with an error ``message`` (the tier then reads as down)."""
        self._fail_next = calls
        self._fail_message = message

    def pause(self) -> None:
        """Calls wait from now on until `resume`, each at most ``timeout_s`` (then they fail)."""
        self._pause_requested = True

    def refuse_writes(self, code: str | None = "OOM") -> None:
        """The store refuses every write with error ``code`` from now on (``None``: no more).

        As a Redis full under ``noeviction`` answers ``OOM``: each chunk is
        counted as refused (``refused_by_reason``, ``write_errors_by_reason``
        ``refused <code>``), the call is no failure and the tier stays up.
        """
        self._refusing = code

    def resume(self) -> None:
        self._pause_requested = False
        if self._paused is not None:
            self._paused.set()
            self._paused = None

    # -- the contract -----------------------------------------------------------

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._life.check_open()
        c = self._counters
        c.contains_calls += 1
        if not keys:  # nothing to ask: no round trip, but still a checkpoint
            await anyio.lowlevel.checkpoint()
            return []
        if await self._unreachable() is not None:
            return c.found([False] * len(keys))
        return c.found([self.store.exists(self.codec.remote_key(k)) for k in keys])

    async def write(self, items: Sequence[WriteItem]) -> int:
        self._life.check_open()
        values = [(self.codec.remote_key(k), self.codec.encode(k, row)) for k, row in items]
        c = self._counters
        c.write_calls += 1
        if not values:
            await anyio.lowlevel.checkpoint()
            return 0
        with c.cancelled_writes(len(values), self.row_bytes):
            cause = await self._unreachable()
        if cause is not None:
            return c.written(0, len(values), self.row_bytes, cause=cause)
        if self._refusing is not None:
            refusal = (self._refusing, f"{self._refusing}: the store refuses writes")
            return c.written(0, len(values), self.row_bytes, refused=[refusal] * len(values))
        for remote_key, value in values:
            self.store[remote_key] = value
        return c.written(len(values), len(values), self.row_bytes)

    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        self._life.check_open()
        views = [writable_row(buffer, self.row_bytes) for _, buffer in items]
        c = self._counters
        c.read_calls += 1
        if not views:
            await anyio.lowlevel.checkpoint()
            return []
        if await self._unreachable() is not None:
            c.read_misses_total += len(views)
            return [False] * len(views)
        filled = []
        for (key, _), view in zip(items, views, strict=True):
            value = self.store.get(self.codec.remote_key(key))
            verdict = None if value is None else self.codec.decode_into(key, value, view)
            filled.append(c.read(key, verdict, self.row_bytes))
        return filled

    @property
    def state(self) -> TierState | ResourceState:
        """Up or down; ``closed`` (its lifecycle's) once closing."""
        return ResourceState.CLOSED if self._life.closed else self._state

    def statistics(self) -> SecondaryStatistics:
        return self._counters.snapshot(self.name, self.state.value)

    async def aclose(self) -> None:
        if not await self._life.begin_aclose():
            return
        self.resume()  # calls paused now end, as misses
        self._life.end_close()

    # -- internals --------------------------------------------------------------

    async def _unreachable(self) -> Unwritten | None:
        """One "round trip": ``None`` when the store answers, else why not (counted):
        away (``down``), paused too long (``timeout``) or failing (``failed``)."""
        c = self._counters
        await anyio.lowlevel.checkpoint()  # a store in memory answers at once: still yield
        if self._life.closed:
            return Unwritten.DOWN  # closed while this call yielded: a miss, not an error
        if not self._available:
            c.unavailable_total += 1
            return Unwritten.DOWN
        if self._pause_requested:
            if self._paused is None:
                self._paused = anyio.Event()
            with anyio.move_on_after(self.timeout_s):
                await self._paused.wait()
            if self._life.closed:
                return Unwritten.DOWN  # closed while this call waited: a miss, not an error
            if self._pause_requested:
                c.timeouts_total += 1
                self._failed(f"TimeoutError: no answer within {self.timeout_s} s")
                return Unwritten.TIMEOUT
        c.round_trips_total += 1
        if self._fail_next > 0:
            self._fail_next -= 1
            self._failed(self._fail_message)
            return Unwritten.FAILED
        if self._state is TierState.DOWN:
            self._state = TierState.UP
            c.reconnects_total += 1
        return None

    def _failed(self, message: str) -> None:
        self._counters.error(message)
        if self._state is TierState.UP:
            self._state = TierState.DOWN

    def __repr__(self) -> str:
        c = self._counters
        return (
            f"<MemoryTier [{self.state.value}; {len(self.store)} values, "
            f"{c.hits_total} hits, {c.misses_total} misses, {c.reads_total} read, "
            f"{c.writes_total} written, {c.rejected_total} rejected, {c.errors_total} errors]>"
        )
