"""`SecondaryCascade`: a CPU tier's write-through to one secondary tier below it.

Two flows join the tiers (see `tiering.secondary.base`); this module is the first,
per tier, and `tiering.secondary.chain` the second, over every tier:

- **Write-through.** A store that lands in the CPU tier (`stored`) pins its
  chunks, so no eviction takes them while their rows are read, and queues
  them; one background task hands each queued batch to `SecondaryTier.write`,
  then unpins it. When the queue is full, or its chunks would take the pins
  past ``cascade_chunks``, the chunks are dropped, counted and unpinned at
  once: the GPU path never waits for the secondary tier, and a slow tier never
  pins so much of the CPU tier that stores find no room.
- **Promotion** (`TierChain.promote`): the tiers are asked, one round trip
  each, about a request's chunks that follow what the CPU tier holds, and the
  leading run they have is read into fresh CPU slots.

Life: `start` runs the write-through task in a task group the owner holds;
`stop_intake` (any task) queues no more writes; `stop` (any task) waits until
what is queued has been written, releasing every pin however the task ends (a
cancelled write counts as failed); `aclose` stops and closes the tier, which
the cascade owns. A reset of the CPU tier voids queued writes (`tier_reset`).
The rows are read through ``row(chunk_id)``, a view of the CPU tier's memory:
its owner keeps that memory alive until `stop` has returned.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Hashable, Sequence

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tiering._types import OffloadKey
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ChunkStateError, ConfigError, ResourceClosedError
from tiering.secondary.base import SecondaryStatistics, SecondaryTier

__all__ = ["CascadeLimits", "Promotion", "SecondaryCascade", "SecondaryTierStatistics"]

logger = logging.getLogger(__name__)


class CascadeLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds of the write-through: at most ``cascade_queue`` landed stores wait to be
    written, holding at most ``cascade_chunks`` chunks pinned (None: half the CPU tier)."""

    cascade_queue: int = 64
    cascade_chunks: int | None = None

    def __post_init__(self) -> None:
        queue = self.cascade_queue
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ConfigError(f"cascade_queue must be a positive integer, got {queue!r}")

    def max_pinned(self, capacity: int) -> int:
        """The pins allowed in a CPU tier of ``capacity`` chunks (`ConfigError` if out of range)."""
        chunks = self.cascade_chunks
        if chunks is None:
            return max(1, capacity // 2)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= capacity:
            raise ConfigError(
                f"cascade_chunks must be an integer from 1 to the CPU tier's {capacity} "
                f"chunks, got {chunks!r}"
            )
        return chunks


class SecondaryTierStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The secondary tier as the engine uses it: its own counters, and the flows.

    ``cascade_*`` count chunks written through after their CPU store
    (``dropped``: not queued, the tier being behind; ``failed``: handed to the
    tier and not written); ``cascade_pinned`` is how many are queued or being
    written now (pinned in the CPU tier), at most ``cascade_max_pinned``;
    ``promoted`` counts chunks read into the CPU tier, ``promote_failed``
    those the tier claimed but could not give.
    """

    tier: SecondaryStatistics
    label: str  # the tier's label (``disk``, ``remote``): its ``tier`` in metrics
    cascade_queued: int
    cascade_written: int
    cascade_dropped: int
    cascade_failed: int
    cascade_pinned: int
    cascade_max_pinned: int
    promoted: int
    promote_failed: int


class Promotion(msgspec.Struct, frozen=True):
    """What a promotion did: ``ready`` leading chunks (after the caller's ``start``)
    are now ready in the CPU tier, ``promoted`` of which it read from the tiers below
    just now; ``by_tier`` splits those by tier label (``{"disk": 3, "remote": 1}``,
    only the tiers that gave some)."""

    ready: int
    promoted: int
    by_tier: dict[str, int] = msgspec.field(default_factory=dict)


#: A queued write-through: (manager job, keys, chunk ids, reset generation).
_Write = tuple[Hashable, tuple[OffloadKey, ...], list[int], int]


class SecondaryCascade:
    """Writes a CPU tier's landed stores through to ``tier`` (promotion from it is the
    `~tiering.secondary.chain.TierChain`'s).

    ``manager`` is the CPU tier's; ``row(chunk_id)`` its memory of a chunk slot,
    ``row_bytes`` long, which must be the tier's row size; ``on_written(keys)``
    (if given) is told of every batch written whole. ``max_pinned`` overrides the
    limits' bound on pins (a chain shares one bound among its tiers).
    """

    def __init__(
        self,
        tier: SecondaryTier,
        manager: CPUOffloadingManager,
        row: Callable[[int], memoryview],
        *,
        row_bytes: int,
        limits: CascadeLimits | None = None,
        on_written: Callable[[Sequence[OffloadKey]], None] | None = None,
        max_pinned: int | None = None,
    ) -> None:
        if tier.row_bytes != row_bytes:
            raise ConfigError(
                f"the secondary tier holds rows of {tier.row_bytes} bytes but this "
                f"engine's chunks are {row_bytes} bytes; build its namespace "
                "from this engine's layout (RemoteNamespace.from_config)"
            )
        limits = limits or CascadeLimits()
        self.tier = tier
        self.limits = limits
        #: Most chunks pinned by write-throughs at once (queued or being written).
        self.max_pinned = limits.max_pinned(manager.capacity) if max_pinned is None else max_pinned
        self._manager = manager
        self._row = row
        self._on_written = on_written
        self._send: MemoryObjectSendStream[_Write] | None = None  # made by start
        self._intake = False  # whether landed stores are queued (from start to stop_intake)
        self._done: anyio.Event | None = None  # set when the task has ended
        self._jobs = itertools.count()
        self._generation = 0  # bumped by a reset: queued writes of older ones are void
        self._pending = 0  # chunks queued or being written
        self._idle: anyio.Event | None = None  # made by a waiter; set when nothing is pending
        self._writing = 0  # chunks whose rows a write is reading now
        self._writers = 0  # write-through tasks still running
        self._queued = self._written = self._dropped = self._failed = 0
        self._promoted = self._promote_failed = 0

    # -- life -------------------------------------------------------------------

    def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run the write-through tasks in ``task_group``: as many as the tier takes writes
        at once (its ``write_concurrency``, 1 unless it says more)."""
        if self._done is not None:
            raise ResourceClosedError("a secondary cascade starts once; build a new one")
        send, receive = anyio.create_memory_object_stream[_Write](self.limits.cascade_queue)
        self._send = send
        self._intake = True
        self._done = anyio.Event()
        writers = max(1, int(getattr(self.tier, "write_concurrency", 1)))
        self._writers = writers
        with receive:  # each writer reads a clone; the stream ends when all are closed
            for _ in range(writers):
                task_group.start_soon(self._write_queued, receive.clone())

    def stop_intake(self) -> None:
        """Queue no more write-throughs (later landed stores are dropped and counted);
        what is queued is still written."""
        self._intake = False
        if self._send is not None:
            self._send.close()

    async def stop(self) -> None:
        """Return once the write-through task has written what is queued and ended."""
        self.stop_intake()
        if self._done is None:
            await anyio.lowlevel.checkpoint()
            return
        await self._done.wait()

    async def aclose(self) -> None:
        """Stop (even when cancelled), then close the tier. Idempotent."""
        with anyio.CancelScope(shield=True):
            await self.stop()
            await self.tier.aclose()

    async def wait_idle(self) -> None:
        """Return once no write-through is queued or being written (a checkpoint even
        when none is): every landed store so far has been written through or counted
        as not written."""
        if not self._pending:
            await anyio.lowlevel.checkpoint()
            return
        if self._idle is None:
            self._idle = anyio.Event()
        await self._idle.wait()

    # -- write-through ----------------------------------------------------------

    def stored(self, keys: tuple[OffloadKey, ...]) -> None:
        """A store of ``keys`` landed in the CPU tier: queue them to be written through."""
        if self._send is None or not self._intake or self._pending + len(keys) > self.max_pinned:
            # Pins beyond the bound would leave stores no chunk to evict.
            self._dropped += len(keys)
            return
        job = ("cascade", self.tier.label, next(self._jobs))
        manager = self._manager
        try:
            spec = manager.prepare_load(keys, job=job, count=False)  # pinned while read
        except ChunkStateError:
            self._dropped += len(keys)  # evicted already (a tiny tier): nothing to write
            return
        try:
            self._send.send_nowait((job, keys, spec.chunk_ids.tolist(), self._generation))
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            manager.complete_load(job=job)
            self._dropped += len(keys)
        else:
            self._queued += len(keys)
            self._pending += len(keys)

    async def _write_queued(self, receive: MemoryObjectReceiveStream[_Write]) -> None:
        """Write queued batches; never raises but a cancellation (it shares a task group
        with the owner), and releases every pin however it ends."""
        current: list[_Write] = []
        try:
            async for item in receive:
                current.append(item)
                await self._write(item)
                current.clear()
        except Exception:
            logger.exception("secondary tier: the write-through task failed")
        finally:
            for item in current:  # cancelled during its write: not written
                self._settle(item, 0)
            while True:
                try:
                    self._settle(receive.receive_nowait(), 0)
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            receive.close()
            self._writers -= 1
            assert self._done is not None  # made by start, before this task runs
            if not self._writers:
                self._done.set()

    async def _write(self, item: _Write) -> None:
        _, keys, chunk_ids, generation = item
        written = 0
        if generation == self._generation:  # else reset since: the rows hold other chunks
            self._writing += len(keys)
            try:
                rows = [(k, self._row(c)) for k, c in zip(keys, chunk_ids, strict=True)]
                written = await self.tier.write(rows)
            except Exception:
                logger.exception("secondary tier: a write-through failed")
            finally:
                self._writing -= len(keys)
        self._settle(item, written)
        if written == len(keys) and self._on_written is not None:
            try:
                self._on_written(keys)
            except Exception:
                logger.exception("secondary tier: announcing a write-through failed")

    def _settle(self, item: _Write, written: int) -> None:
        job, keys, _, _ = item
        self._manager.complete_load(job=job)  # unpin (a no-op after a reset)
        self._pending -= len(keys)
        self._written += written
        self._failed += len(keys) - written
        if not self._pending and self._idle is not None:
            self._idle.set()
            self._idle = None

    # -- resets -----------------------------------------------------------------

    def check_reset(self, *, force: bool) -> None:
        """Refuse (`ChunkStateError`) a reset of the CPU tier while write-throughs are
        queued (unless ``force``) or read its rows (even forced: a reset would hand
        those rows out)."""
        if self._writing or (not force and self._pending):
            raise ChunkStateError(
                "cannot reset the tier while chunks are being written through to the "
                "secondary tier; wait for them (statistics().secondary)"
                + ("" if self._writing else " or pass force=True")
            )

    def tier_reset(self) -> None:
        """The CPU tier was reset: queued write-throughs name slots now void."""
        self._generation += 1

    def promoted(self, good: int, failed: int) -> None:
        """Count a promotion from this tier (`TierChain.promote` reads it)."""
        self._promoted += good
        self._promote_failed += failed

    # -- seeing state -----------------------------------------------------------

    def statistics(self) -> SecondaryTierStatistics:
        return SecondaryTierStatistics(
            tier=self.tier.statistics(),
            label=self.tier.label,
            cascade_queued=self._queued,
            cascade_written=self._written,
            cascade_dropped=self._dropped,
            cascade_failed=self._failed,
            cascade_pinned=self._pending,
            cascade_max_pinned=self.max_pinned,
            promoted=self._promoted,
            promote_failed=self._promote_failed,
        )

    def __repr__(self) -> str:
        return (
            f"<SecondaryCascade [{self.tier.name}; {self._pending}/{self.max_pinned} pinned, "
            f"{self._written} written, {self._dropped} dropped, {self._failed} failed, "
            f"{self._promoted} promoted]>"
        )
