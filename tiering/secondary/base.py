"""The contract of a secondary tier: a store below the CPU tier, maybe shared, maybe remote.

The engine uses a secondary tier two ways:

- *cascade* (write-through): once a chunk's store to the CPU tier has landed,
  its row is handed to `SecondaryTier.write` in the background;
- *promotion*: a lookup that misses the CPU tier asks `SecondaryTier.contains`
  about the missing keys (one round trip for the whole request), then
  `SecondaryTier.read` copies the hits into freshly allocated CPU rows.

What every implementation guarantees (tests/secondary/test_secondary_contract.py
checks each on every tier):

- **Expected outcomes are return values.** A missing chunk, a value that fails
  a check (`~tiering.secondary.codec.Verdict`), a store that is down, too
  slow or refusing writes: misses (``False``), or fewer chunks written, all
  counted in `SecondaryStatistics`. Only programming errors raise: a buffer of
  the wrong size, a read-only or non-contiguous read buffer (`SpecError`), a
  call after `aclose` (`ResourceClosedError`).
- **Nothing waits forever.** Every call ends within the tier's timeout (plus
  scheduling); a call that runs out of time is a failure like any other.
- **Batched.** A call is one round trip to the store for the whole batch (one
  per node on a cluster), split only past the tier's batch limits; an empty
  call, or one made while the tier is down and not due to retry, makes none.
- **Buffers are the caller's again when a call returns**, whatever happened:
  no byte of a read buffer is written, and no byte of a write payload is read,
  after the call has returned or been cancelled.
- **Values are self-checking** (`~tiering.secondary.codec.ChunkCodec`): a value
  written by an engine whose bytes differ, under another key, truncated,
  padded or corrupted is never loaded: `read` answers ``False`` for it. One
  that fails a check of its header is not copied at all; a corrupted payload
  may have been received into the buffer before its checksum failed (the
  buffer is then unspecified, as after any ``False``).
- **Counts add up.** Each thing is counted once, in one place (see
  `SecondaryStatistics`): every chunk not written in ``write_errors_by_reason``
  (so they sum to ``write_errors_total``), a refusal in ``refused_*`` and not
  also as an error, a failed call in ``errors_total``.
- **Every call is a checkpoint** (trio's rule), even one answered without I/O.

Retention hints (`tiering.hints`): a tier that honours them says so
(``honours_hints``): its `SecondaryTier.write_hinted` writes chunks with the
``hint`` of the store that made them, and `SecondaryTier.hint` applies one to
values it holds already. The disk tier evicts released values first and spares retained ones
(within a share of its capacity); a Redis tier sets their TTL. A tier that does
not honour them is never handed one: the chain counts the hints it drops
(``hints_ignored`` in `~tiering.secondary.cascade.SecondaryTierStatistics`).
"""

from __future__ import annotations

import abc
import contextlib
import enum
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio.lowlevel
import msgspec
from anyio.abc import AsyncResource

from tiering._types import Medium, OffloadKey
from tiering.hints import Hint
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, Verdict
from tiering.secondary.refusals import Unwritten, refused_reason

__all__ = [
    "Abandoned",
    "Guard",
    "Locality",
    "ReadItem",
    "SecondaryStatistics",
    "SecondaryTier",
    "TierCounters",
    "WriteItem",
]

#: A chunk to write: its key and its row (``row_bytes`` bytes, any contiguous buffer).
WriteItem = tuple[OffloadKey, memoryview | bytes]
#: A chunk to read: its key and a writable buffer of exactly ``row_bytes`` bytes.
ReadItem = tuple[OffloadKey, memoryview]


class Locality(enum.StrEnum):
    """Whether other engines may see what this tier holds (KV events carry it)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class SecondaryStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A snapshot of a secondary tier's counters. Every ``*_total`` only grows.

    Keys (``hits_total``, ``misses_total``) count `SecondaryTier.contains`
    answers; chunks (``reads_total``, ``read_misses_total``, ``rejected_total``)
    count `SecondaryTier.read` outcomes; bytes are payload bytes (rows), not
    headers. ``write_errors_total`` counts chunks handed to ``write`` that were
    not written, whatever the reason; ``write_errors_by_reason`` splits them
    (they add up; each reason is a `~tiering.secondary.refusals.Unwritten`):
    ``down`` (answered without I/O while the tier was down),
    ``backing off`` (without I/O, the store having refused writes just before),
    ``busy``, ``timeout``, ``failed`` (the call failed: connection lost,
    protocol error), ``cancelled`` (the caller gave up), or ``refused <CODE>``
    (the store refused that chunk: ``refused OOM`` from a full Redis with
    ``noeviction``), or ``node down`` (a store of many nodes, a Redis Cluster:
    the node that holds the chunk's key is down, the others are served), or
    ``not a regular file`` (the disk tier: a link, FIFO or folder where the
    chunk's value or its shard folder belongs, left alone).

    Each thing is counted once, in one place: ``errors_total`` counts failed
    calls (the store unreachable, a timeout, a protocol error), never a
    refusal; ``refused_total`` counts commands the store answered with an
    error (``refused_by_reason`` by its code; after a refused write the tier
    backs off its writes, ``write_state`` then says ``backing off``);
    ``rejected_total`` counts values read that failed a check
    (``rejected_by_reason`` by `Verdict`). ``unavailable_total`` counts calls
    answered at once, without I/O, because the tier was down (or backing off
    its writes) and not yet due for a retry. ``timeouts_total`` counts calls
    that ran out of time (the call's deadline or a socket's); each is also in
    ``errors_total``. ``busy_total`` counts calls that found every worker
    thread of the tier busy until their deadline (overload, not a fault:
    answered as misses, the tier stays up).
    """

    name: str
    state: str  # "up", "down" or "closed"
    contains_calls: int
    hits_total: int
    misses_total: int
    read_calls: int
    reads_total: int
    read_misses_total: int
    rejected_total: int
    read_bytes_total: int
    write_calls: int
    writes_total: int
    write_bytes_total: int
    write_errors_total: int
    errors_total: int
    timeouts_total: int
    unavailable_total: int
    busy_total: int
    reconnects_total: int
    round_trips_total: int
    last_error: str | None
    last_rejection: str | None
    refused_total: int = 0
    refused_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    rejected_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    write_errors_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    last_refusal: str | None = None
    write_state: str = "up"  # "up", or "backing off" after the store refused writes
    #: What a tier that manages its own capacity (the disk tier) holds; None for a
    #: store that does not say (Redis evicts by its own policy).
    capacity_bytes: int | None = None
    used_bytes: int | None = None
    chunks: int | None = None
    evictions_total: int = 0
    #: Values the tier had and found gone (deleted or lost behind its back): misses.
    lost_total: int = 0
    #: What the tier holds at most now: ``capacity_bytes`` (as configured), or less
    #: where its file system holds less (the disk tier); None where it does not say.
    effective_capacity_bytes: int | None = None
    #: Values a retention hint was applied to (written with one, or hinted after),
    #: by a tier that honours hints (`SecondaryTier.honours_hints`).
    hinted_total: int = 0


#: Why chunks handed to `SecondaryTier.write` were not written (see `SecondaryStatistics`):
#: the names of `Unwritten`'s members, kept from before it.
UNWRITTEN_DOWN = Unwritten.DOWN
UNWRITTEN_BACKING_OFF = Unwritten.BACKING_OFF
UNWRITTEN_BUSY = Unwritten.BUSY
UNWRITTEN_TIMEOUT = Unwritten.TIMEOUT
UNWRITTEN_FAILED = Unwritten.FAILED
UNWRITTEN_CANCELLED = Unwritten.CANCELLED
UNWRITTEN_NODE_DOWN = Unwritten.NODE_DOWN


class TierCounters:
    """The mutable counters behind `SecondaryStatistics`, updated on the event loop only."""

    __slots__ = (
        "busy_total",
        "contains_calls",
        "errors_total",
        "hinted_total",
        "hits_total",
        "last_error",
        "last_refusal",
        "last_rejection",
        "misses_total",
        "read_bytes_total",
        "read_calls",
        "read_misses_total",
        "reads_total",
        "reconnects_total",
        "refused_by_reason",
        "refused_total",
        "rejected_by_reason",
        "rejected_total",
        "round_trips_total",
        "timeouts_total",
        "unavailable_total",
        "write_bytes_total",
        "write_calls",
        "write_errors_by_reason",
        "write_errors_total",
        "writes_total",
    )

    def __init__(self) -> None:
        self.contains_calls = self.hits_total = self.misses_total = 0
        self.read_calls = self.reads_total = self.read_misses_total = 0
        self.rejected_total = self.read_bytes_total = 0
        self.write_calls = self.writes_total = self.write_bytes_total = 0
        self.write_errors_total = self.errors_total = self.timeouts_total = 0
        self.unavailable_total = self.reconnects_total = self.round_trips_total = 0
        self.busy_total = self.refused_total = self.hinted_total = 0
        self.refused_by_reason: dict[str, int] = {}
        self.rejected_by_reason: dict[str, int] = {}
        self.write_errors_by_reason: dict[str, int] = {}
        self.last_error: str | None = None
        self.last_rejection: str | None = None
        self.last_refusal: str | None = None

    def error(self, message: str) -> None:
        self.errors_total += 1
        self.last_error = message

    def found(self, found: list[bool]) -> list[bool]:
        """Count a `contains` answer's hits and misses; return it."""
        hits = sum(found)
        self.hits_total += hits
        self.misses_total += len(found) - hits
        return found

    def refused(self, reason: str, message: str) -> None:
        """Count one command the store refused (``reason``: its error code, e.g. ``OOM``)."""
        self.refused_total += 1
        self.refused_by_reason[reason] = self.refused_by_reason.get(reason, 0) + 1
        self.last_refusal = message

    def written(
        self,
        written: int,
        offered: int,
        row_bytes: int,
        *,
        cause: Unwritten | str = Unwritten.FAILED,
        refused: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Count a write of ``written`` of ``offered`` chunks; return it.

        ``refused`` holds ``(reason, message)`` per chunk the store refused
        (each also counted by `refused`); the other chunks not written are
        put down to ``cause``.
        """
        self.writes_total += written
        self.write_bytes_total += written * row_bytes
        unwritten = offered - written
        if unwritten:
            self.write_errors_total += unwritten
            by_reason = self.write_errors_by_reason
            for reason, message in refused:
                self.refused(reason, message)
                label = refused_reason(reason)
                by_reason[label] = by_reason.get(label, 0) + 1
            rest = unwritten - len(refused)
            if rest > 0:
                label = str(cause)  # the plain string: snapshots hold no enums
                by_reason[label] = by_reason.get(label, 0) + rest
        return written

    @contextlib.contextmanager
    def cancelled_writes(self, offered: int, row_bytes: int) -> Iterator[None]:
        """Around a write's wait: if it is cancelled (or raises), none of the ``offered``
        chunks was written, each counted so (``cancelled``)."""
        try:
            yield
        except BaseException:
            self.written(0, offered, row_bytes, cause=Unwritten.CANCELLED)
            raise

    def read(self, key: OffloadKey, verdict: Verdict | None, row_bytes: int) -> bool:
        """Count one chunk's read (``None``: a miss); whether it filled its buffer."""
        if verdict is None:
            self.read_misses_total += 1
        elif verdict is Verdict.OK:
            self.reads_total += 1
            self.read_bytes_total += row_bytes
        else:
            self.rejected(key, verdict)
        return verdict is Verdict.OK

    def rejected(self, key: OffloadKey, verdict: Verdict) -> None:
        self.rejected_total += 1
        reason = verdict.value
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        self.last_rejection = f"{verdict.value} for key {bytes(key).hex()}"

    def snapshot(self, name: str, state: str, write_state: str = "up") -> SecondaryStatistics:
        fields: dict[str, Any] = {slot: getattr(self, slot) for slot in self.__slots__}
        for slot, value in fields.items():
            if isinstance(value, dict):
                fields[slot] = dict(value)  # a snapshot: later counts do not change it
        return SecondaryStatistics(name=name, state=state, write_state=write_state, **fields)


class SecondaryTier(AsyncResource):
    """A store of chunk rows below the CPU tier. Use from one event loop (asyncio or trio).

    Also an async context manager that calls `aclose` on exit. Attributes:
    ``name`` (``"redis"``, ``"memory"``, ``"disk"``), ``label`` (its place in a
    chain of tiers: ``"disk"``, ``"remote"``), ``medium`` and ``locality`` (what KV
    events say about chunks this tier holds), ``codec`` (the namespace, remote
    keys and value format) and ``row_bytes`` (the size of every payload).
    """

    name: str
    #: What the tier is in a chain of tiers, and its ``tier`` label in metrics, hit
    #: attribution and dashboards: ``"disk"``, ``"remote"`` (unique in a chain).
    label: str = "remote"
    medium: Medium = Medium.STORAGE
    locality: Locality = Locality.REMOTE
    codec: ChunkCodec
    #: How many write-throughs the tier takes at once (the disk tier overlaps one
    #: call's file work with the next one's hand-off to its thread).
    write_concurrency: int = 1
    #: Told the keys of values that left the tier (evicted, or found damaged or gone)
    #: by a tier that knows (the disk tier; a Redis evicts on its own, unseen). The
    #: engine sets it to announce them as KV events.
    on_removed: Callable[[Sequence[OffloadKey]], None] | None = None
    #: Whether the tier honours retention hints (`tiering.hints`): its `write_hinted`
    #: and `hint` apply them. A tier that does not ignores them (the chain counts
    #: those it drops).
    honours_hints: bool = False

    @property
    def namespace(self) -> RemoteNamespace:
        return self.codec.namespace

    @property
    def row_bytes(self) -> int:
        return self.codec.row_bytes

    @abc.abstractmethod
    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the store holds now, co-indexed; one round trip for the batch.

        A ``True`` is a hint, not a promise: the value may be evicted (or fail
        its checks) before it is read. Down or too slow: all ``False``.
        """

    @abc.abstractmethod
    async def write(self, items: Sequence[WriteItem]) -> int:
        """Store each ``(key, row)``; return how many were written.

        Rows are copied (with their header) before the call returns; a chunk
        already there is overwritten (equal keys mean equal bytes). Chunks
        not written are counted in ``write_errors_total``, never raised.
        """

    @abc.abstractmethod
    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        """Fill each ``(key, buffer)`` with the chunk's row; co-indexed ``True`` where filled.

        ``False`` is a miss or a rejected value: that buffer's content is then
        unspecified and must not be used. Raises `SpecError` for a buffer that
        is read-only or not exactly ``row_bytes`` bytes.
        """

    async def write_hinted(self, items: Sequence[WriteItem], hint: Hint) -> int:
        """`write`, the chunks carrying the retention ``hint`` of the store that made
        them. A tier that does not honour hints (this default) just writes them."""
        return await self.write(items)

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> int:
        """Apply a request's retention ``hint`` to those of ``keys`` the tier holds now;
        return how many it applied to. One round trip for the batch; failures are
        counted, never raised. A tier that does not honour hints (this default)
        applies none; every call is a checkpoint."""
        await anyio.lowlevel.checkpoint()
        return 0

    @abc.abstractmethod
    def statistics(self) -> SecondaryStatistics:
        """A snapshot of the counters and the state; costs no I/O."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections and buffers; idempotent. Later calls raise `ResourceClosedError`."""

    def discard(self) -> None:
        """Release at once, without I/O, what the constructor took (the disk tier's lock),
        for a tier that was built and will never be used: its engine failed to build."""


class Guard:
    """Who may touch a call's buffers: its worker thread, until the call is abandoned.

    A tier whose I/O runs in worker threads touches the caller's buffers only
    while holding ``lock`` and seeing ``abandoned`` false; the event loop calls
    `abandon` when the call times out or is cancelled, and from then on no byte
    of the caller's buffers is touched.
    """

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> None:
        with self.lock:  # waits for at most one piece of a row being copied
            self.abandoned = True


class Abandoned(Exception):
    """The call was abandoned (timed out or cancelled): stop, touch no buffer."""


def describe(exc: BaseException, limit: int = 200) -> str:
    """One line about ``exc``: its type and message, cut to ``limit`` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
