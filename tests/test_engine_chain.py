"""A TieringEngine over a chain of tiers (a disk, then a shared store): write-through to
each, promotion from the first that has a chunk, attribution by tier, and the real
DiskTier below a real engine."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from tiering import ConfigError
from tiering.engine import Promotion, TieringEngine
from tiering.events import BlockRemoved, BlockStored, SequencedBatch
from tiering.secondary import Locality, MemoryStore, MemoryTier, RemoteNamespace
from tiering.secondary.disk import DiskTier
from tiering.specs import GPULoadStoreSpec

from .test_engine import CHUNK_BYTES, config, keys, kv_caches

pytestmark = pytest.mark.anyio


def chain(
    disk: MemoryStore, remote: MemoryStore, *, chunks: int = 16, seed: int = 0
) -> tuple[TieringEngine, dict[str, torch.Tensor]]:
    kv = kv_caches()
    if seed:
        gen = torch.Generator().manual_seed(seed)
        for t in kv.values():
            t.copy_(torch.randint(-(2**62), 2**62, t.shape, generator=gen))
    engine = TieringEngine(
        config(),
        kv,
        cpu_bytes=chunks * CHUNK_BYTES,
        secondary=[
            lambda ns: MemoryTier(ns, store=disk, label="disk"),
            lambda ns: MemoryTier(ns, store=remote, locality=Locality.REMOTE),
        ],
    )
    return engine, kv


async def store(engine: TieringEngine, *ids: int) -> None:
    handle = await engine.submit_store(keys(*ids), GPULoadStoreSpec(list(range(len(ids)))))
    assert (await handle).success
    with anyio.fail_after(10):
        await engine.wait_written_through()


async def test_every_landed_store_is_written_through_to_each_tier(anyio_backend: str) -> None:
    disk, remote = MemoryStore(), MemoryStore()
    engine, _ = chain(disk, remote)
    async with engine:
        await store(engine, 1, 2, 3)
        stats = engine.statistics()
        assert [t.label for t in stats.tiers] == ["disk", "remote"]
        assert stats.secondary == stats.tiers[0]
        assert [t.cascade_written for t in stats.tiers] == [3, 3]
        assert [t.cascade_max_pinned for t in stats.tiers] == [4, 4]  # half of 16, split
        assert engine.manager.statistics().pinned == 0
        assert [t.label for t in engine.tiers] == ["disk", "remote"]
    assert len(disk) == len(remote) == 3


async def test_promotion_takes_each_chunk_from_the_first_tier_that_has_it(
    anyio_backend: str,
) -> None:
    disk, remote = MemoryStore(), MemoryStore()
    first, kv_first = chain(disk, remote, seed=1)
    async with first:
        await store(first, 1, 2, 3, 4)
    # The disk lost 2 and 4 (its own eviction, say); Redis still has all four.
    for k in (2, 4):
        suffix = keys(k)[0].hex().encode() + b"}"
        del disk[next(key for key in list(disk.keys()) if key.endswith(suffix))]
    second, kv_second = chain(disk, remote, seed=2)
    async with second:
        tiers = second.tiers
        promotion = await second.promote(keys(1, 2, 3, 4, 5))
        assert promotion == Promotion(4, 4, {"disk": 2, "remote": 2})
        s = [t.tier for t in second.statistics().tiers]
        # One round trip per tier: the disk asked about all five, Redis only about its misses.
        assert [(t.contains_calls, t.hits_total + t.misses_total) for t in s] == [(1, 5), (1, 3)]
        assert [(t.read_calls, t.reads_total) for t in s] == [(1, 2), (1, 2)]
        loaded = await (
            await second.submit_load(keys(1, 2, 3, 4), GPULoadStoreSpec([8, 9, 10, 11]))
        )
        assert loaded.success
        for name in kv_second:
            assert torch.equal(kv_second[name][8:12], kv_first[name][0:4])
        # What Redis gave is written up to the disk, which lacked it.
        with anyio.fail_after(10):
            await second.wait_written_through()
        assert [t.promoted for t in second.statistics().tiers] == [2, 2]
        assert isinstance(tiers[0], MemoryTier)
    assert len(disk) == 4


async def test_labels_must_differ(anyio_backend: str) -> None:
    with pytest.raises(ConfigError, match="its own label"):
        TieringEngine(
            config(),
            kv_caches(),
            cpu_bytes=8 * CHUNK_BYTES,
            secondary=[lambda ns: MemoryTier(ns), lambda ns: MemoryTier(ns)],
        )


async def test_a_real_disk_tier_below_an_engine_survives_the_engine(
    anyio_backend: str, tmp_path: Path
) -> None:
    def disk_engine(seed: int) -> tuple[TieringEngine, dict[str, torch.Tensor]]:
        kv = kv_caches()
        gen = torch.Generator().manual_seed(seed)
        for t in kv.values():
            t.copy_(torch.randint(-(2**62), 2**62, t.shape, generator=gen))
        engine = TieringEngine(
            config(),
            kv,
            cpu_bytes=8 * CHUNK_BYTES,
            secondary=lambda ns: DiskTier(tmp_path / "disk", 1 << 20, ns),
        )
        return engine, kv

    first, kv_first = disk_engine(1)
    async with first:
        await store(first, 1, 2, 3)
        assert first.statistics().tiers[0].tier.chunks == 3
    second, kv_second = disk_engine(2)
    async with second:
        tier = second.tiers[0]
        assert isinstance(tier, DiskTier)
        assert len((await tier.open()).values) == 3
        assert await second.promote(keys(1, 2, 3)) == Promotion(3, 3, {"disk": 3})
        loaded = await (await second.submit_load(keys(1, 2, 3), GPULoadStoreSpec([5, 6, 7])))
        assert loaded.success
        for name in kv_second:
            assert torch.equal(kv_second[name][5:8], kv_first[name][0:3])
    # Closed: the folder is free for the next owner.
    DiskTier(tmp_path / "disk", 1 << 20, RemoteNamespace(model="m", dtype="d", row_bytes=8,
             blocks_per_chunk=1))  # fmt: skip


async def test_the_disk_tier_says_what_it_holds_and_what_it_evicts_as_kv_events(
    anyio_backend: str, tmp_path: Path
) -> None:
    cfg = msgspec.structs.replace(config(), enable_kv_cache_events=True)
    value = CHUNK_BYTES + 4096  # a value on disk: its row and a 4 KiB head
    engine = TieringEngine(
        cfg,
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        secondary=lambda ns: DiskTier(tmp_path / "disk", 2 * value, ns, policy="lru"),
    )
    async with engine:
        subscription = engine.subscribe()
        await store(engine, 1, 2)
        await store(engine, 3)  # the disk holds two: 1, the oldest, leaves it
        seen: list[tuple[str, str, str | None]] = []
        with anyio.fail_after(10):
            while len(seen) < 7:
                item = await subscription.__anext__()
                assert isinstance(item, SequencedBatch)
                for e in item.batch.events:
                    if isinstance(e, BlockStored | BlockRemoved):
                        seen.append((type(e).__name__, e.medium, e.locality))
    assert seen == [
        ("BlockStored", "CPU", None),
        ("BlockStored", "CPU", None),
        ("BlockStored", "STORAGE", "LOCAL"),
        ("BlockStored", "STORAGE", "LOCAL"),
        ("BlockStored", "CPU", None),
        ("BlockRemoved", "STORAGE", "LOCAL"),
        ("BlockStored", "STORAGE", "LOCAL"),
    ]
