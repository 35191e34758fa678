"""`KVEventEmitter`: what a CPU tier holds, published as KV cache events.

The chunk manager queues `ChunkEvent` records as it changes; the emitter turns
them into wire events (`EventTranslator`) and publishes them on an `EventBus`
(to in-process subscribers and, when configured, a ZMQ publisher), one batch
per turn of the event loop that changed the tier: the manager's first queued
event schedules a publish at the end of the turn (`publish_soon`).

Ordering: a chunk written to a tier below (`publish_stored_below`) is announced
after every CPU-tier event still pending, so a subscriber never hears of a
chunk in a lower tier before it heard of it in the CPU tier.

Descriptions: a store is described as vLLM describes an offloaded chunk (one
hash, ``block_size=0``) unless the config's ``extra_config`` asks for
self-describing events under vLLM's own key, ``self_describing_kv_events``
(read as vLLM reads it: any truthy value). Only then is what a caller said
about a store's blocks (`describe`) kept
by store job until the job's `ChunksStored` is translated (matched by job id, so
a key stored, evicted and stored again is described by the right store); those
of jobs that failed or were cancelled are pruned once they outnumber the stores
in flight. With ``keep_landed``, a landed chunk's description is kept (the
latest `LANDED_KEPT`, the oldest leaving first), so the events of every lower
tier of a chain it is written to describe it alike, and so do their removals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import anyio.lowlevel

from tiering._extras import require
from tiering._types import Medium, OffloadKey
from tiering.config import OffloadingConfig
from tiering.cpu.manager import ChunkEvent, ChunksRemoved, ChunksStored, CPUOffloadingManager
from tiering.errors import ConfigError, ResourceClosedError
from tiering.events.bus import EventBus, EventSink, EventStatistics, EventSubscription
from tiering.events.config import KVEventsConfig
from tiering.events.schema import ChunkBlocks, EventTranslator, KVEvent, KVEventBatch

__all__ = ["SELF_DESCRIBING_KEY", "KVEventEmitter"]

logger = logging.getLogger(__name__)

#: vLLM's ``kv_connector_extra_config`` key that asks for self-describing store events.
SELF_DESCRIBING_KEY = "self_describing_kv_events"
#: Landed chunks' descriptions kept for their lower tier's event, at most.
LANDED_KEPT = 1 << 16


class KVEventEmitter:
    """Publishes a manager's events, and lower tiers' writes, on a bus it owns.

    `open` (on the event loop) builds the bus and its sinks and binds the
    emitter to ``manager``; `aclose` publishes what is still pending, then
    closes the bus. ``settings`` configures a ZMQ publisher (None: in-process
    subscribers only; given without pyzmq, a `ConfigError` naming the ``events``
    extra).
    """

    def __init__(
        self,
        config: OffloadingConfig,
        settings: KVEventsConfig | None = None,
        *,
        keep_landed: bool = False,
    ) -> None:
        if settings is not None:  # pyzmq missing: one ConfigError now, not at open
            require("zmq", "events", "the ZMQ publisher of KV events")
        bpc = config.cache.blocks_per_chunk
        self._settings = settings
        self._translator = EventTranslator(
            tokens_per_chunk=[g.tokens_per_block * bpc for g in config.groups] or 1,
            hash_format=settings.hash_format if settings is not None else "int",
            self_describing=bool(config.extra_config.get(SELF_DESCRIBING_KEY, False)),
        )
        self._below: dict[str, EventTranslator] = {}  # by locality
        self._rank = config.parallel.data_parallel_index
        self._keep_landed = keep_landed
        self._described: dict[Hashable, dict[OffloadKey, ChunkBlocks]] = {}
        self._landed: dict[OffloadKey, ChunkBlocks] = {}
        self._manager: CPUOffloadingManager | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._scheduled = False
        self._bus: EventBus | None = None
        self._endpoints: tuple[str, str | None] | None = None
        self._binds: bool | None = None
        self._lost = 0

    # -- life -----------------------------------------------------------------

    def open(self, manager: CPUOffloadingManager) -> None:
        """Build the bus and its sinks, and publish ``manager``'s events from now on."""
        if self._bus is not None:
            raise ResourceClosedError("an event emitter opens once")
        sinks: list[EventSink] = []
        if self._settings is not None:
            from tiering.events.publisher import ZmqEventPublisher  # pyzmq only when used

            publisher = ZmqEventPublisher(self._settings, data_parallel_rank=self._rank)
            self._endpoints = (publisher.endpoint, publisher.replay_endpoint)
            self._binds = publisher.binds
            sinks.append(publisher)
        self._manager = manager
        self._token = anyio.lowlevel.current_token()
        self._bus = EventBus(sinks)

    async def aclose(self) -> None:
        """Publish the events still pending, then close the bus (and its sinks)."""
        if self._bus is None:
            await anyio.lowlevel.checkpoint()
            return
        self.publish_pending()
        await self._bus.aclose()

    @property
    def endpoints(self) -> tuple[str, str | None] | None:
        """The ZMQ publisher's bound ``(endpoint, replay_endpoint)``, once open; else None."""
        return self._endpoints

    @property
    def binds(self) -> bool | None:
        """Whether the ZMQ publisher binds its endpoint, once open; else None."""
        return self._binds

    def subscribe(self, max_batches: int = 1024) -> EventSubscription:
        if self._bus is None:
            raise ResourceClosedError("the event bus is not open")
        return self._bus.subscribe(max_batches)

    # -- describing stores ------------------------------------------------------

    @staticmethod
    def check(keys: Sequence[OffloadKey], blocks: Sequence[ChunkBlocks | None]) -> None:
        """Refuse descriptions that do not fit the store, before it is submitted."""
        if len(blocks) != len(keys):
            raise ConfigError(
                f"blocks describes {len(blocks)} chunks but the store has {len(keys)} keys; "
                "give one ChunkBlocks (or None) per key"
            )
        for info in blocks:
            if info is not None and not isinstance(info, ChunkBlocks):
                raise ConfigError(f"blocks holds {info!r}; give a ChunkBlocks or None per key")

    def describe(
        self, job: Hashable, keys: Sequence[OffloadKey], blocks: Sequence[ChunkBlocks | None]
    ) -> None:
        """Keep what ``blocks`` says of store ``job``'s chunks for its `BlockStored` event."""
        manager = self._manager
        if manager is None or not self._translator.self_describing:
            return  # vLLM's plain description says nothing of the blocks
        described = {k: info for k, info in zip(keys, blocks, strict=True) if info is not None}
        if described and manager.store_in_flight(job):
            self._described[job] = described
        if len(self._described) > 64 + 2 * manager.writing:
            self._described = {
                j: d for j, d in self._described.items() if manager.store_in_flight(j)
            }

    @property
    def self_describing(self) -> bool:
        """Whether stores are described beyond vLLM's default (``self_describing_kv_events``)."""
        return self._translator.self_describing

    @property
    def lost(self) -> int:
        """Events that could not be translated (a bug): logged and counted."""
        return self._lost

    @property
    def described_jobs(self) -> int:
        """Store jobs whose descriptions wait for their `ChunksStored`."""
        return len(self._described)

    # -- publishing -------------------------------------------------------------

    def publish_soon(self) -> None:
        """The manager queued a first event: publish them all at the end of this turn.

        The manager's ``on_events`` callback; a no-op until `open`.
        """
        token = self._token
        if token is None or self._scheduled:
            return
        self._scheduled = True
        token.backend_class.run_sync_soon(self.publish_pending, (), token.native_token)

    def publish_pending(self) -> None:
        """Publish the manager's queued events as one batch now (never raises)."""
        self._scheduled = False
        if self._manager is None:
            return
        try:
            self._publish(self._manager.take_events())
        except Exception:
            logger.exception("KV cache events: publishing failed")

    def publish_stored_below(
        self, keys: Sequence[OffloadKey], medium: Medium, locality: str
    ) -> None:
        """Publish that ``keys`` were written to a lower tier (``locality`` on the events),
        after the CPU tier's pending events."""
        self._publish_below(ChunksStored(keys=tuple(keys), medium=medium), locality, landed=True)

    def publish_removed_below(
        self, keys: Sequence[OffloadKey], medium: Medium, locality: str
    ) -> None:
        """Publish that ``keys`` left a lower tier (evicted, or found damaged or gone),
        after the CPU tier's pending events."""
        self._publish_below(ChunksRemoved(keys=tuple(keys), medium=medium), locality)

    def _publish_below(
        self,
        event: ChunksStored | ChunksRemoved,
        locality: str,
        *,
        landed: bool = False,
    ) -> None:
        if not event.keys:
            return
        self.publish_pending()  # first: what it lands is kept, and describes ``event`` below
        blocks = None
        if landed and self._landed:
            # Kept (bounded, oldest first out) for the next tier of a chain to describe alike.
            blocks = {k: self._landed[k] for k in event.keys if k in self._landed}
        self._send(self._below_translator(locality).translate([event], blocks))

    def _below_translator(self, locality: str) -> EventTranslator:
        translator = self._below.get(locality)
        if translator is None:
            translator = self._below[locality] = EventTranslator(
                self._translator.tokens_per_chunk,
                hash_format=self._translator.hash_format,
                locality=locality,
                self_describing=self._translator.self_describing,
            )
        return translator

    def _publish(self, events: Sequence[ChunkEvent]) -> None:
        wire: list[KVEvent] = []
        for event in events:
            blocks = None
            if isinstance(event, ChunksStored) and event.job is not None:
                blocks = self._described.pop(event.job, None)
                if blocks and self._keep_landed:  # for the lower tier's own event
                    self._landed.update(blocks)
                    while len(self._landed) > LANDED_KEPT:
                        del self._landed[next(iter(self._landed))]
            try:
                wire += self._translator.translate([event], blocks)
            except Exception:  # descriptions are checked at submission: a bug
                logger.exception("KV cache events: cannot translate %r", event)
                self._lost += 1
        self._send(wire)

    def _send(self, wire: list[KVEvent]) -> None:
        bus = self._bus
        if wire and bus is not None:
            bus.publish(KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=self._rank))

    # -- seeing state -----------------------------------------------------------

    def statistics(self) -> EventStatistics | None:
        """The bus's counts, once open; else None."""
        return self._bus.statistics() if self._bus is not None else None

    def __repr__(self) -> str:
        bus = "not open" if self._bus is None else f"{self._bus.statistics().batches_total} batches"
        return (
            f"<KVEventEmitter [{bus}; {len(self._described)} stores described, "
            f"{len(self._landed)} landed kept, {self._lost} lost]>"
        )
