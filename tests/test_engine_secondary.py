"""A TieringEngine over a secondary tier: cascade, promotion, bounds and faults (MemoryTier)."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch

from tiering import ConfigError
from tiering.engine import Promotion, TieringEngine
from tiering.errors import ChunkStateError, SpecError
from tiering.events import BlockStored, ChunkBlocks, SequencedBatch
from tiering.scheduler import JobOutcome
from tiering.secondary import CascadeLimits, Locality, MemoryStore, MemoryTier, RemoteNamespace
from tiering.specs import GPULoadStoreSpec

from .test_engine import CHUNK_BYTES, config, keys, kv_caches

pytestmark = pytest.mark.anyio


def engine_over(
    store: MemoryStore, *, chunks: int = 8, seed: int = 0, **kwargs: object
) -> tuple[TieringEngine, dict[str, torch.Tensor]]:
    kv = kv_caches()
    if seed:
        gen = torch.Generator().manual_seed(seed)
        for t in kv.values():
            t.copy_(torch.randint(-(2**62), 2**62, t.shape, generator=gen))
    tiers: list[MemoryTier] = []

    def build(namespace: RemoteNamespace) -> MemoryTier:
        tiers.append(MemoryTier(namespace, store=store, locality=Locality.REMOTE))
        return tiers[-1]

    engine = TieringEngine(
        kwargs.pop("cfg", config()),  # type: ignore[arg-type]
        kv,
        cpu_bytes=chunks * CHUNK_BYTES,
        secondary=build,
        **kwargs,  # type: ignore[arg-type]
    )
    return engine, kv


def memory_tier(engine: TieringEngine) -> MemoryTier:
    tier = engine.tiers[0]
    assert isinstance(tier, MemoryTier)
    return tier


async def settle(engine: TieringEngine, written: int) -> None:
    """Wait until the write-throughs of the landed stores have ended: ``written`` chunks."""
    with anyio.fail_after(10):
        await engine.wait_written_through()
    stats = engine.statistics().secondary
    assert stats is not None
    assert stats.cascade_written + stats.cascade_failed >= written
    assert stats.cascade_pinned == 0


async def written_through(*ids: int) -> MemoryStore:
    """A store into which a first engine wrote the chunks ``ids`` through (then closed)."""
    store = MemoryStore()
    first, _ = engine_over(store)
    async with first:
        result = await first.submit_store(keys(*ids), GPULoadStoreSpec(list(range(len(ids)))))
        assert (await result).success
        await settle(first, len(ids))
    return store


async def test_a_second_engine_loads_what_the_first_wrote_through(anyio_backend: str) -> None:
    store = MemoryStore()
    first, kv_first = engine_over(store, seed=1)
    async with first:
        result = await (await first.submit_store(keys(1, 2, 3), GPULoadStoreSpec([0, 1, 2])))
        assert result.success
        await settle(first, 3)
        stats = first.statistics().secondary
        assert stats is not None
        assert (stats.cascade_written, stats.cascade_dropped, stats.tier.writes_total) == (3, 0, 3)
        assert first.manager.statistics().pinned == 0  # unpinned once written
    second, kv_second = engine_over(store, seed=2)
    async with second:
        assert second.lookup(keys(1, 2, 3, 4)).ready == 0
        assert await second.promote(keys(1, 2, 3, 4)) == Promotion(
            3, 3, {"remote": 3}
        )  # one round trip
        assert second.lookup(keys(1, 2, 3, 4)).ready == 3
        loaded = await (await second.submit_load(keys(1, 2, 3), GPULoadStoreSpec([10, 11, 12])))
        assert loaded.success
        for name in kv_second:
            assert torch.equal(kv_second[name][10:13], kv_first[name][0:3])
        stats = second.statistics().secondary
        assert stats is not None
        assert (stats.promoted, stats.tier.contains_calls, stats.tier.hits_total) == (3, 1, 3)
        assert second.manager.statistics().loaded_total == 3  # the load, not the promotion


async def test_promotion_starts_after_the_cpu_hits_and_stops_at_a_gap(anyio_backend: str) -> None:
    store = await written_through(1, 2, 4)
    second, _ = engine_over(store)
    async with second:
        assert (await (await second.submit_store(keys(1), GPULoadStoreSpec([0])))).success
        # 1 is in the CPU tier; 2 is remote; 3 is nowhere, so 4 cannot be a prefix hit.
        assert await second.promote(keys(1, 2, 3, 4), start=1) == Promotion(1, 1, {"remote": 1})
        assert second.lookup(keys(1, 2, 3, 4)).ready == 2
        assert not second.manager.holds(keys(4)[0])


async def test_a_slow_tier_drops_cascades_and_never_slows_stores(anyio_backend: str) -> None:
    store = MemoryStore()
    engine, _ = engine_over(store, chunks=16, cascade_queue=1)
    async with engine:
        tier = memory_tier(engine)
        tier.pause()  # writes wait (until the tier's timeout) as a slow store would
        try:
            for i in range(4):
                result = await (await engine.submit_store(keys(i), GPULoadStoreSpec([i])))
                assert result.success  # the GPU side does not wait for the tier
            stats = engine.statistics().secondary
            assert stats is not None
            # One write runs, one waits in the queue, the other two are dropped.
            assert stats.cascade_dropped == 2
            assert engine.manager.statistics().pinned == 2  # held while they wait
        finally:
            tier.resume()
        await settle(engine, 2)
        assert engine.manager.statistics().pinned == 0


async def test_cascades_pin_at_most_their_share_of_the_tier(anyio_backend: str) -> None:
    """A stalled tier never pins the CPU tier full: stores go on evicting the rest."""
    engine, _ = engine_over(MemoryStore(), chunks=8)  # cascade_chunks: half, 4
    async with engine:
        tier = memory_tier(engine)
        tier.pause()
        try:
            for i in range(16):  # twice the tier: every store must find room
                result = await (await engine.submit_store(keys(i), GPULoadStoreSpec([i % 4])))
                assert result.success, f"store {i}: {result.outcome}"
                assert engine.manager.statistics().pinned <= 4
            stats = engine.statistics().secondary
            assert stats is not None
            assert stats.cascade_queued == 4
            assert stats.cascade_dropped == 12
            assert (stats.cascade_pinned, stats.cascade_max_pinned) == (4, 4)
        finally:
            tier.resume()
        await settle(engine, 4)
        assert engine.manager.statistics().pinned == 0


async def test_cascade_chunks_can_be_set_and_is_checked(anyio_backend: str) -> None:
    for bad in (0, 9, True, 2.0):
        with pytest.raises(ConfigError, match=r"cascade_chunks must be an integer from 1 to"):
            engine_over(MemoryStore(), chunks=8, cascade_chunks=bad)
    engine, _ = engine_over(MemoryStore(), chunks=8, cascade_chunks=2)
    async with engine:
        tier = memory_tier(engine)
        tier.pause()
        try:
            for i in range(4):
                assert (await (await engine.submit_store(keys(i), GPULoadStoreSpec([i])))).success
            assert engine.manager.statistics().pinned == 2
        finally:
            tier.resume()
        await settle(engine, 2)


def test_cascade_queue_is_checked_and_the_limits_are_one_record() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match=r"cascade_queue must be a positive integer"):
            engine_over(MemoryStore(), cascade_queue=bad)
    assert CascadeLimits(cascade_chunks=3).max_pinned(8) == 3
    assert CascadeLimits().max_pinned(8) == 4  # half the CPU tier
    assert CascadeLimits().max_pinned(1) == 1
    with pytest.raises(ConfigError, match=r"from 1 to the CPU tier's 8 chunks, got 9"):
        CascadeLimits(cascade_chunks=9).max_pinned(8)
    engine, _ = engine_over(MemoryStore(), chunks=8, cascade_queue=3, cascade_chunks=2)
    assert engine._chain is not None
    (cascade,) = engine._chain.cascades
    assert cascade.limits == CascadeLimits(cascade_queue=3, cascade_chunks=2)
    assert "0/2 pinned" in repr(cascade)


async def test_a_chunk_being_written_through_is_not_evicted(anyio_backend: str) -> None:
    engine, _ = engine_over(MemoryStore(), chunks=1)
    async with engine:
        tier = memory_tier(engine)
        tier.pause()
        try:
            assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
            blocked = await (await engine.submit_store(keys(2), GPULoadStoreSpec([1])))
            assert blocked.outcome is JobOutcome.NO_ROOM  # chunk 1 is pinned by its cascade
        finally:
            tier.resume()
        await settle(engine, 1)
        assert (await (await engine.submit_store(keys(2), GPULoadStoreSpec([1])))).success


async def test_a_tier_that_is_down_misses_and_the_engine_serves_on(anyio_backend: str) -> None:
    store = MemoryStore()
    engine, _ = engine_over(store)
    async with engine:
        tier = memory_tier(engine)
        tier.set_available(False)
        assert (await (await engine.submit_store(keys(1, 2), GPULoadStoreSpec([0, 1])))).success
        await settle(engine, 2)
        assert await engine.promote(keys(5, 6)) == Promotion(0, 0)
        stats = engine.statistics().secondary
        assert stats is not None
        assert (stats.cascade_failed, stats.tier.state) == (2, "down")
        assert engine.lookup(keys(1, 2)).ready == 2  # the CPU tier serves on


async def test_writes_through_are_announced_as_remote(anyio_backend: str) -> None:
    cfg = msgspec.structs.replace(config(), enable_kv_cache_events=True)
    engine, _ = engine_over(MemoryStore(), cfg=cfg)
    async with engine:
        subscription = engine.subscribe()
        assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
        seen: list[BlockStored] = []
        with anyio.fail_after(10):
            while len(seen) < 2:
                item = await subscription.__anext__()
                assert isinstance(item, SequencedBatch)
                seen += [e for e in item.batch.events if isinstance(e, BlockStored)]
        assert [(e.medium, e.locality) for e in seen] == [("CPU", None), ("STORAGE", "REMOTE")]


def test_a_tier_of_another_row_size_is_refused() -> None:
    namespace = RemoteNamespace(model="m", dtype="int64", row_bytes=64, blocks_per_chunk=1)
    with pytest.raises(ConfigError, match="rows of 64 bytes"):
        TieringEngine(config(), kv_caches(), cpu_bytes=CHUNK_BYTES, secondary=MemoryTier(namespace))


async def test_without_a_secondary_tier_promote_is_a_no_op(anyio_backend: str) -> None:
    async with TieringEngine(config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES) as engine:
        assert await engine.promote(keys(1, 2)) == Promotion(0, 0)
        with pytest.raises(SpecError, match="start"):
            await engine.promote(keys(1, 2), start=3)
        assert engine.statistics().secondary is None


async def test_metrics_show_the_remote_tier(anyio_backend: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tiering.metrics import render_metrics

    engine, _ = engine_over(MemoryStore())
    async with engine:
        assert (await (await engine.submit_store(keys(1, 2), GPULoadStoreSpec([0, 1])))).success
        await settle(engine, 2)
        assert await engine.promote(keys(3)) == Promotion(0, 0)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(render_metrics(engine).decode())
            for s in family.samples
        }

    def value(name: str, **labels: str) -> float:
        key = (
            name,
            tuple(sorted({"engine": engine.engine_id, "tier": "remote", **labels}.items())),
        )
        return samples[key]

    row = engine.layout.row_bytes
    assert value("tiering_transfer_bytes_total", direction="store") == 2 * row
    assert value("tiering_jobs_total", direction="store", outcome="ok") == 2
    assert value("tiering_lookups_total", result="miss") == 1


async def test_promotion_never_evicts_the_requests_own_head(anyio_backend: str) -> None:
    store = await written_through(1, 2, 3)
    second, _ = engine_over(store, chunks=2)
    async with second:
        assert (await (await second.submit_store(keys(1), GPULoadStoreSpec([0])))).success
        # Room for one more chunk only: 2 comes in (a shorter run than asked for),
        # and 1, the request's head, stays.
        promotion = await second.promote(keys(1, 2, 3), start=1)
        assert promotion == Promotion(1, 1, {"remote": 1})
        assert second.manager.holds(keys(1)[0], ready=True)
        # The longer run it tried first found no room: not an allocation failure.
        assert second.manager.statistics().allocation_failures_total == 0
        loaded = await second.submit_load(
            keys(1, 2, 3)[: 1 + promotion.ready], GPULoadStoreSpec(list(range(1 + promotion.ready)))
        )
        assert (await loaded).success
        # The tier holds only the request's head, which is never evicted for it: no room.
        assert await second.promote(keys(1, 2, 3), start=2) == Promotion(0, 0)
        assert second.manager.statistics().allocation_failures_total == 1


async def test_a_reset_waits_for_write_throughs(anyio_backend: str) -> None:
    engine, _ = engine_over(MemoryStore())
    async with engine:
        tier = memory_tier(engine)
        tier.pause()
        try:
            assert (await (await engine.submit_store(keys(1), GPULoadStoreSpec([0])))).success
            with pytest.raises(ChunkStateError, match="written through"):
                engine.reset()
            await anyio.wait_all_tasks_blocked()  # the write has started, and waits
            assert tier.statistics().write_calls == 1
            with pytest.raises(ChunkStateError, match="written through"):
                engine.reset(force=True)  # a write in progress reads the tier's rows
        finally:
            tier.resume()
        await settle(engine, 1)
        engine.reset()
        assert engine.manager.statistics().used == 0


async def test_closing_from_another_task_and_cancelling_release_every_pin(
    anyio_backend: str,
) -> None:
    engine, _ = engine_over(MemoryStore(), chunks=16)
    closed = anyio.Event()
    async with engine:
        tier = memory_tier(engine)
        tier.pause()
        for i in range(3):
            assert (await (await engine.submit_store(keys(i), GPULoadStoreSpec([i])))).success

        async def close_elsewhere() -> None:
            await engine.aclose()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_elsewhere)
            await anyio.wait_all_tasks_blocked()  # the close waits for the paused writes
            assert not closed.is_set()
            tier.resume()
        assert closed.is_set()
    stats = engine.statistics().secondary
    assert stats is not None
    assert stats.cascade_written + stats.cascade_failed + stats.cascade_dropped == 3
    assert engine.manager.statistics().pinned == 0


async def test_a_cancelled_owner_releases_every_pin(anyio_backend: str) -> None:
    engine, _ = engine_over(MemoryStore(), chunks=16)
    with anyio.CancelScope() as owner:
        async with engine:
            tier = memory_tier(engine)
            tier.pause()  # writes wait for their timeout; the owner is cancelled first
            for i in range(4):
                assert (await (await engine.submit_store(keys(i), GPULoadStoreSpec([i])))).success
            await anyio.wait_all_tasks_blocked()  # a write waits on the paused tier
            owner.cancel()
            await anyio.sleep_forever()
    stats = engine.statistics().secondary
    assert stats is not None
    assert engine.statistics().state == "closed"
    assert stats.cascade_queued == stats.cascade_written + stats.cascade_failed
    assert engine.manager.statistics().pinned == 0


async def test_a_described_chunk_is_announced_alike_in_both_tiers(anyio_backend: str) -> None:
    base = config()
    cfg = msgspec.structs.replace(
        base,
        enable_kv_cache_events=True,  # described stores need vLLM's self-describing events
        extra_config={**base.extra_config, "self_describing_kv_events": True},
    )
    engine, _ = engine_over(MemoryStore(), cfg=cfg)
    async with engine:
        subscription = engine.subscribe()
        described = [ChunkBlocks(block_hashes=[111], block_size=16, token_ids=list(range(16)))]
        handle = await engine.submit_store(keys(1), GPULoadStoreSpec([0]), blocks=described)
        assert (await handle).success
        seen: list[BlockStored] = []
        with anyio.fail_after(10):
            while len(seen) < 2:
                item = await subscription.__anext__()
                assert isinstance(item, SequencedBatch)
                seen += [e for e in item.batch.events if isinstance(e, BlockStored)]
        assert [(e.block_hashes, e.locality) for e in seen] == [([111], None), ([111], "REMOTE")]
        assert seen[1].token_ids == list(range(16))
