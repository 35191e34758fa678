"""The engine's life: the order it closes its pieces in, and the order of its last events.

Closing runs: the scheduler (running jobs finish, landing their last stores),
then the secondary tier's write-throughs (they read pool rows, so they end
before the pool does), then the pool, then the last events (what the last
completions changed), then the event bus. A write-through's own event comes
after the CPU tier's events still pending, so a subscriber never hears of a
chunk in a lower tier before it heard of it in the CPU tier.

The pieces are instrumented by wrapping their methods; every wait is on an
event the test sets, never on the clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import msgspec
import pytest
from anyio import wait_all_tasks_blocked

from tiering.config import OffloadingConfig
from tiering.engine import TieringEngine
from tiering.errors import ResourceClosedError
from tiering.events import BlockStored, KVEventBatch, SequencedBatch
from tiering.events.bus import EventBus
from tiering.secondary import Locality, MemoryTier, RemoteNamespace, WriteItem
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import HostMemoryPool

from .test_engine import CHUNK_BYTES, config, keys, kv_caches, mock

pytestmark = pytest.mark.anyio

Log = list[tuple[object, ...]]


class GatedTier(MemoryTier):
    """A memory tier whose writes wait at a gate, logging when they end and when it closes."""

    def __init__(self, namespace: RemoteNamespace, log: Log) -> None:
        super().__init__(namespace, locality=Locality.REMOTE)
        self.log = log
        self.gate = anyio.Event()
        self.writing = anyio.Event()  # set once a write waits at the gate
        self.after_write: Callable[[], None] = lambda: None

    async def write(self, items: Sequence[WriteItem]) -> int:
        self.writing.set()
        # Bounded: a close that waits for this write before the gate opens (the
        # wrong order) shows as a write that ended first, not as a hang.
        with anyio.move_on_after(5):
            await self.gate.wait()
        written = await super().write(items)  # reads the rows now, after the gate
        self.log.append(("written", written))
        self.after_write()
        return written

    async def aclose(self) -> None:
        self.log.append(("tier closed",))
        await super().aclose()


def events_on() -> OffloadingConfig:
    return msgspec.structs.replace(config(), enable_kv_cache_events=True)


def instrument(monkeypatch: pytest.MonkeyPatch, engine: TieringEngine, log: Log) -> None:
    """Log the scheduler's close, the pool's close, every published batch and the bus's close.

    When the pool closes, the tier is reset: an event queued at the last moment,
    which only the close's own last publish can send.
    """
    scheduler_close = engine.scheduler.aclose

    async def close_scheduler() -> None:
        log.append(("closing",))
        await scheduler_close()
        log.append(("scheduler closed",))
        tier = next(iter(engine.tiers), None)
        if isinstance(tier, GatedTier):
            tier.gate.set()  # the write-throughs go on only now

    pool_close = HostMemoryPool.close

    def close_pool(pool: HostMemoryPool) -> None:
        pool_close(pool)
        log.append(("pool closed",))
        engine.manager.reset(force=True)

    publish = EventBus.publish

    def publish_logged(bus: EventBus, batch: KVEventBatch) -> int:
        log.append(
            ("published", *[(type(e).__name__, getattr(e, "medium", None)) for e in batch.events])
        )
        return publish(bus, batch)

    bus_close = EventBus.aclose

    async def close_bus(bus: EventBus) -> None:
        log.append(("bus closed",))
        await bus_close(bus)

    monkeypatch.setattr(engine.scheduler, "aclose", close_scheduler)
    monkeypatch.setattr(HostMemoryPool, "close", close_pool)
    monkeypatch.setattr(EventBus, "publish", publish_logged)
    monkeypatch.setattr(EventBus, "aclose", close_bus)


def from_close(log: Log) -> Log:
    """The log from the start of the close on, less the stores' own events (they are
    published at the end of the turn their store landed in, which may be later)."""
    stored = ("published", ("BlockStored", "CPU"))
    return [entry for entry in log[log.index(("closing",)) + 1 :] if entry != stored]


async def test_closing_ends_the_scheduler_then_write_throughs_then_pool_then_events(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: Log = []
    engine = TieringEngine(
        events_on(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        secondary=lambda namespace: GatedTier(namespace, log),
    )
    instrument(monkeypatch, engine, log)
    async with engine:
        tier = next(iter(engine.tiers), None)
        assert isinstance(tier, GatedTier)
        for i in (1, 2):
            assert (await (await engine.submit_store(keys(i), GPULoadStoreSpec([i])))).success
        with anyio.fail_after(10):
            await tier.writing.wait()  # 1 waits at the gate, 2 is queued behind it
    stored_below = ("published", ("BlockStored", "STORAGE"))
    assert from_close(log) == [
        ("scheduler closed",),
        ("written", 1),
        stored_below,
        ("written", 1),  # what was queued is written before the pool goes
        stored_below,
        ("tier closed",),
        ("pool closed",),
        ("published", ("BlockRemoved", "CPU")),  # what the tier held, as the pool closed
        ("bus closed",),
    ]
    stats = engine.statistics()
    assert stats.secondary is not None
    assert stats.secondary.cascade_written == 2
    assert stats.manager.pinned == 0


async def test_without_a_secondary_tier_the_pool_closes_before_the_last_events(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: Log = []
    engine = TieringEngine(events_on(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock")
    instrument(monkeypatch, engine, log)
    async with engine:
        assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
    assert from_close(log) == [
        ("scheduler closed",),
        ("pool closed",),
        ("published", ("BlockRemoved", "CPU")),  # never a medium-less AllBlocksCleared
        ("bus closed",),
    ]


async def test_the_cpu_tiers_pending_events_go_before_a_write_throughs_own(
    anyio_backend: str,
) -> None:
    log: Log = []
    engine = TieringEngine(
        events_on(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        secondary=lambda namespace: GatedTier(namespace, log),
    )
    async with engine:
        tier = next(iter(engine.tiers), None)
        assert isinstance(tier, GatedTier)
        manager = engine.manager

        def land_another_store() -> None:
            # A store lands in the CPU tier as the write-through ends, in the same
            # turn: its event is queued, not published yet.
            (nine,) = keys(9)
            assert manager.prepare_store([nine]) is not None
            manager.complete_store([nine])

        tier.after_write = land_another_store
        subscription = engine.subscribe()
        assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
        tier.gate.set()
        seen: list[tuple[str, int]] = []
        with anyio.fail_after(10):
            while len(seen) < 3:
                item = await subscription.__anext__()
                assert isinstance(item, SequencedBatch)
                seen += [
                    (e.medium, e.block_hashes[-1])
                    for e in item.batch.events
                    if isinstance(e, BlockStored) and isinstance(e.block_hashes[-1], int)
                ]
        assert seen == [("CPU", 1), ("CPU", 9), ("STORAGE", 1)]


@pytest.mark.parametrize("secondary", [False, True], ids=["cpu-tier", "secondary-tier"])
async def test_an_engine_closes_from_another_task(anyio_backend: str, secondary: bool) -> None:
    log: Log = []
    engine = TieringEngine(
        events_on(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        secondary=(lambda namespace: GatedTier(namespace, log)) if secondary else None,
    )
    closed = anyio.Event()

    async def close() -> None:
        await engine.aclose()
        closed.set()

    async with engine:
        subscription = engine.subscribe()
        assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await wait_all_tasks_blocked()
            tier = next(iter(engine.tiers), None)
            if isinstance(tier, GatedTier):
                # The close waits for the write-through at the gate; let it through.
                assert not closed.is_set()
                assert engine.statistics().state == "closing"
                tier.gate.set()
        assert closed.is_set()
        assert engine.statistics().state == "closed"
        with anyio.fail_after(10):
            async for _ in subscription:  # the bus has closed: the subscription ends
                pass
    stats = engine.statistics()
    assert stats.manager.pinned == 0
    assert stats.pool is not None
    assert stats.pool.closed
    if stats.secondary is not None:
        assert stats.secondary.cascade_written == 1
        assert log[-1] == ("tier closed",)


async def test_an_error_in_the_body_closes_the_engine_and_passes_through(
    anyio_backend: str,
) -> None:
    engine = TieringEngine(
        events_on(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock", secondary=MemoryTier
    )

    async def body() -> None:
        async with engine:
            assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
            raise LookupError("from the body")

    with pytest.raises(LookupError, match="from the body"):
        await body()
    stats = engine.statistics()
    assert stats.state == "closed"
    assert stats.manager.pinned == 0
    assert stats.secondary is not None
    assert stats.secondary.cascade_queued == stats.secondary.cascade_written == 1


async def test_a_store_that_lands_while_closing_is_not_written_through(anyio_backend: str) -> None:
    engine = TieringEngine(
        config(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        backend_options={"gated": True},
        secondary=MemoryTier,
    )
    async with engine:
        backend = mock(engine)
        handle = await engine.submit_store(keys(1), GPULoadStoreSpec([0]))  # held at the gate
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.aclose)
            await wait_all_tasks_blocked()  # the close waits for the running store
            assert engine.statistics().state == "closing"
            backend.open_gate()
        assert (await handle).success  # it landed, as the scheduler closed
    stats = engine.statistics().secondary
    assert stats is not None
    assert (stats.cascade_queued, stats.cascade_dropped, stats.cascade_written) == (0, 1, 0)
    assert engine.manager.statistics().pinned == 0


@pytest.mark.parametrize("secondary", [False, True], ids=["cpu-tier", "secondary-tier"])
async def test_an_open_that_fails_releases_what_it_took_and_raises_as_it_came(
    anyio_backend: str, secondary: bool
) -> None:
    engine = TieringEngine(
        events_on(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        backend_options={"no_such_option": 1},  # the backend, built last, refuses it
        secondary=MemoryTier if secondary else None,
    )

    async def open_it() -> None:
        async with engine:
            pytest.fail("the body of a failed open ran")

    with pytest.raises(TypeError, match="no_such_option"):  # not wrapped in a group
        await open_it()
    stats = engine.statistics()
    assert stats.state == "closed"  # an engine opens once: a retry is refused, not half-done
    assert stats.pool is not None
    assert stats.pool.closed
    with pytest.raises(ResourceClosedError, match="opens once"):
        await open_it()
    assert stats.events is not None
    with pytest.raises(ResourceClosedError):
        engine.subscribe()
    if secondary:
        assert stats.secondary is not None
        assert stats.secondary.tier.state == "closed"
    await engine.aclose()
    assert engine.statistics().state == "closed"
