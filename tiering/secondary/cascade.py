"""`SecondaryCascade`: a CPU tier's write-through to one secondary tier below it.

Two flows join the tiers (see `tiering.secondary.base`); this module is the first,
per tier, and `tiering.secondary.chain` the second, over every tier. Every
decision of both (what is pinned, what is dropped, what a reset voids, the
counts) is `tiering.cpu.flows.Flows`'s; this is its async shell:

- **Write-through.** A store that lands in the CPU tier (`stored`) is pinned by
  the flows (or dropped and counted) and queued; background tasks hand each
  queued batch to `SecondaryTier.write`, then settle it (unpin, count). When the
  queue is full the batch is dropped and counted at once: the GPU path never
  waits for the secondary tier.
- **Promotion** (`TierChain.promote`): the tiers are asked, one round trip
  each, about a request's chunks that follow what the CPU tier holds, and the
  leading run they have is read into fresh CPU slots.

Life (`tiering._closing.AsyncLifecycle`): `start` opens it and runs the
write-through tasks in a task group the owner holds; `stop_intake` (any task)
begins the close: no more writes are queued; `stop` (any task) waits until what
is queued has been written, releasing every pin however the tasks end (a
cancelled write counts as failed); `aclose` stops and closes the tier, which the
cascade owns. A reset of the CPU tier voids queued writes (`tier_reset`). The
rows are read through ``row(chunk_id)``, a view of the CPU tier's memory: its
owner keeps that memory alive until `stop` has returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tiering._checks import check_int, is_int
from tiering._closing import AsyncLifecycle
from tiering._state import ResourceState
from tiering._types import OffloadKey
from tiering.cpu.flows import FlowCounts, Flows, WriteTicket, default_pin_bound
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.secondary.base import SecondaryStatistics, SecondaryTier

__all__ = ["CascadeLimits", "Promotion", "SecondaryCascade", "SecondaryTierStatistics"]

logger = logging.getLogger(__name__)


class CascadeLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds of the write-through: at most ``cascade_queue`` landed stores wait to be
    written, holding at most ``cascade_chunks`` chunks pinned (None: half the CPU tier)."""

    cascade_queue: int = 64
    cascade_chunks: int | None = None

    def __post_init__(self) -> None:
        # Held as an int: anyio's stream refuses numpy's integers, which the check takes.
        queue = check_int("cascade_queue", self.cascade_queue, minimum=1)
        msgspec.structs.force_setattr(self, "cascade_queue", queue)

    def max_pinned(self, capacity: int) -> int:
        """The pins allowed in a CPU tier of ``capacity`` chunks (`ConfigError` if out of range)."""
        chunks = self.cascade_chunks
        if chunks is None:
            return default_pin_bound(capacity)
        if not is_int(chunks) or not 1 <= chunks <= capacity:
            raise ConfigError(
                f"cascade_chunks must be an integer from 1 to the CPU tier's {capacity} "
                f"chunks, got {chunks!r}"
            )
        return int(chunks)


class SecondaryTierStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The secondary tier as the engine uses it: its own counters, and the flows.

    ``cascade_*`` count chunks written through after their CPU store
    (``dropped``: not queued, the tier being behind; ``failed``: handed to the
    tier and not written); ``cascade_pinned`` is how many are queued or being
    written now (pinned in the CPU tier), at most ``cascade_max_pinned``;
    ``promoted`` counts chunks read into the CPU tier, ``promote_failed``
    those the tier claimed but could not give: read from the tier's
    `tiering.cpu.flows.FlowCounts`. ``hints_sent`` counts chunks a retention hint
    was handed to the tier for (with their write-through, or alone), ``hints_ignored``
    those whose hint was dropped, the tier not honouring hints (the cascade's own).
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
    hints_sent: int = 0
    hints_ignored: int = 0


#: The fields of `SecondaryTierStatistics` read from the tier's `FlowCounts`, by name.
_FROM_FLOWS = tuple(
    name
    for name in SecondaryTierStatistics.__struct_fields__
    if name in FlowCounts.__struct_fields__
)


class Promotion(msgspec.Struct, frozen=True):
    """What a promotion did: ``ready`` leading chunks (after the caller's ``start``)
    are now ready in the CPU tier, ``promoted`` of which it read from the tiers below
    just now; ``by_tier`` splits those by tier label (``{"disk": 3, "remote": 1}``,
    only the tiers that gave some)."""

    ready: int
    promoted: int
    by_tier: dict[str, int] = msgspec.field(default_factory=dict)


class SecondaryCascade:
    """Writes a CPU tier's landed stores through to ``tier`` (promotion from it is the
    `~tiering.secondary.chain.TierChain`'s).

    ``manager`` is the CPU tier's; ``row(chunk_id)`` its memory of a chunk slot,
    ``row_bytes`` long, which must be the tier's row size; ``on_written(keys)``
    (if given) is told of every batch written whole. ``max_pinned`` overrides the
    limits' bound on pins. A chain passes its ``flows`` (shared by its tiers, this
    one being tier ``index`` of them); alone, the cascade makes its own.
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
        flows: Flows | None = None,
        index: int = 0,
    ) -> None:
        if tier.row_bytes != row_bytes:
            raise ConfigError(
                f"the secondary tier holds rows of {tier.row_bytes} bytes but this "
                f"engine's chunks are {row_bytes} bytes; build its namespace "
                "from this engine's layout (RemoteNamespace.from_config)"
            )
        limits = limits or CascadeLimits()
        if flows is None:
            bound = limits.max_pinned(manager.capacity) if max_pinned is None else max_pinned
            flows, index = Flows(manager, (tier.label,), pin_bound=bound), 0
        self.tier, self.limits = tier, limits
        self.flows, self.index = flows, index  # this tier's decisions: flows' tier ``index``
        self._row, self._on_written = row, on_written
        self._life = AsyncLifecycle("a secondary cascade")
        self._send: MemoryObjectSendStream[WriteTicket] | None = None  # made by start
        self._idle: anyio.Event | None = None  # made by a waiter; set when nothing is pinned
        self._writers = 0  # write-through tasks still running
        self._hints_sent = 0  # chunks whose hint was handed to the tier
        self._hints_ignored = 0  # chunks whose hint was dropped (the tier ignores hints)

    @property
    def max_pinned(self) -> int:
        """Most chunks pinned by write-throughs at once (queued or being written)."""
        return self.flows.max_pinned(self.index)

    # -- life -------------------------------------------------------------------

    def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Run the write-through tasks in ``task_group``: as many as the tier takes writes
        at once (its ``write_concurrency``, 1 unless it says more)."""
        self._life.open()
        send, receive = anyio.create_memory_object_stream[WriteTicket](self.limits.cascade_queue)
        self._send = send
        self.flows.open_intake(self.index)
        writers = max(1, int(getattr(self.tier, "write_concurrency", 1)))
        self._writers = writers
        with receive:  # each writer reads a clone; the stream ends when all are closed
            for _ in range(writers):
                task_group.start_soon(self._write_queued, receive.clone())

    def stop_intake(self) -> None:
        """Queue no more write-throughs (later landed stores are dropped and counted);
        what is queued is still written."""
        self.flows.close_intake(self.index)
        started = self._life.state is not ResourceState.NEW
        if self._life.begin_close() and not started:
            self._life.end_close()  # never started: nothing to wait for
        if self._send is not None:
            self._send.close()

    async def stop(self) -> None:
        """Return once the write-through tasks have written what is queued and ended."""
        self.stop_intake()
        await self._life.wait_closed()

    async def aclose(self) -> None:
        """Stop (even when cancelled), then close the tier. Idempotent."""
        with anyio.CancelScope(shield=True):
            await self.stop()
            await self.tier.aclose()

    async def wait_idle(self) -> None:
        """Return once no write-through is queued or being written (a checkpoint even
        when none is): every landed store so far has been written through or counted
        as not written."""
        if not self.flows.pinned(self.index):
            await anyio.lowlevel.checkpoint()
            return
        if self._idle is None:
            self._idle = anyio.Event()
        await self._idle.wait()

    # -- write-through ----------------------------------------------------------

    def stored(self, keys: tuple[OffloadKey, ...], hint: Hint | None = None) -> None:
        """A store of ``keys`` landed in the CPU tier: queue them to be written through,
        with the retention ``hint`` of the store that made them."""
        ticket = self.flows.reserve_write(self.index, keys, hint)
        if ticket is None:
            return
        assert self._send is not None  # the intake is open only once start made it
        try:
            self._send.send_nowait(ticket)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self.flows.refuse_write(ticket)

    async def _write_queued(self, receive: MemoryObjectReceiveStream[WriteTicket]) -> None:
        """Write queued batches; never raises but a cancellation (it shares a task group
        with the owner), and releases every pin however it ends."""
        current: list[WriteTicket] = []
        try:
            async for ticket in receive:
                current.append(ticket)
                await self._write(ticket)
                current.clear()
        except Exception:
            logger.exception("secondary tier: the write-through task failed")
        finally:
            for ticket in current:  # cancelled during its write: not written
                self._settle(ticket, 0)
            while True:
                try:
                    self._settle(receive.receive_nowait(), 0)
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            receive.close()
            self._writers -= 1
            if not self._writers:
                self._life.begin_close()
                self._life.end_close()

    async def _write(self, ticket: WriteTicket) -> None:
        written = 0
        if self.flows.begin_write(ticket):  # else reset since: the rows hold other chunks
            try:
                rows = [
                    (k, self._row(c)) for k, c in zip(ticket.keys, ticket.chunk_ids, strict=True)
                ]
                if ticket.hint is None:
                    written = await self.tier.write(rows)
                else:
                    self._count_hint(len(rows))
                    written = await self.tier.write_hinted(rows, ticket.hint)
            except Exception:
                logger.exception("secondary tier: a write-through failed")
        if self._settle(ticket, written) and self._on_written is not None:
            try:
                self._on_written(ticket.keys)
            except Exception:
                logger.exception("secondary tier: announcing a write-through failed")

    def _settle(self, ticket: WriteTicket, written: int) -> bool:
        whole = self.flows.settle_write(ticket, written)
        if not self.flows.pinned(self.index) and self._idle is not None:
            self._idle.set()
            self._idle = None
        return whole

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """Apply a retention ``hint`` to the values of ``keys`` the tier holds (one round
        trip), or count it ignored where the tier does not honour hints. A checkpoint;
        never raises but a cancellation or a closed tier's `ResourceClosedError`."""
        if not self._count_hint(len(keys)) or not keys:
            await anyio.lowlevel.checkpoint()
            return
        await self.tier.hint(keys, hint)

    def _count_hint(self, chunks: int) -> bool:
        """Count a hint for ``chunks`` chunks handed to the tier, or dropped (said once in
        the log, at the first dropped); whether the tier honours hints."""
        if self.tier.honours_hints:
            self._hints_sent += chunks
            return True
        if not self._hints_ignored and chunks:
            logger.warning(
                "secondary tier %s (%s) does not honour retention hints; %d chunks' hints "
                "ignored (counted in its statistics)",
                self.tier.name,
                self.tier.label,
                chunks,
            )
        self._hints_ignored += chunks
        return False

    # -- resets -----------------------------------------------------------------

    def check_reset(self, *, force: bool) -> None:
        """Refuse (`ChunkStateError`) a reset of the CPU tier while write-throughs are
        queued (unless ``force``) or read its rows (even forced: a reset would hand
        those rows out)."""
        self.flows.check_reset(force=force)

    def tier_reset(self) -> None:
        """The CPU tier was reset: queued write-throughs name slots now void."""
        self.flows.reset()

    # -- seeing state -----------------------------------------------------------

    def statistics(self) -> SecondaryTierStatistics:
        counts = msgspec.structs.asdict(self.flows.counts(self.index))
        flows = {name: counts[name] for name in _FROM_FLOWS}
        return SecondaryTierStatistics(
            tier=self.tier.statistics(),
            label=self.tier.label,
            **flows,
            hints_sent=self._hints_sent,
            hints_ignored=self._hints_ignored,
        )

    def __repr__(self) -> str:
        c = self.flows.counts(self.index)
        return (
            f"<SecondaryCascade [{self.tier.name}; {c.cascade_pinned}/{self.max_pinned} "
            f"pinned, {c.cascade_written} written, {c.cascade_dropped} dropped, "
            f"{c.cascade_failed} failed, {c.promoted} promoted]>"
        )
