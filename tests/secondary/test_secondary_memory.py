"""MemoryTier: the in-process secondary tier the engine tests use, with scripted faults."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from tiering._types import Medium
from tiering.errors import ConfigError, ResourceClosedError, SpecError
from tiering.secondary import (
    ChunkCodec,
    Locality,
    MemoryStore,
    MemoryTier,
    RemoteNamespace,
    SecondaryTier,
)

pytestmark = pytest.mark.anyio


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


async def test_write_contains_read_byte_for_byte(namespace: RemoteNamespace, chunks: Any) -> None:
    keys, rows = chunks.keys(4), chunks.rows(4)
    async with MemoryTier(namespace) as tier:
        assert isinstance(tier, SecondaryTier)
        assert await tier.contains(keys) == [False] * 4
        assert await tier.write(items(keys[:3], rows[:3])) == 3
        assert await tier.contains(keys) == [True, True, True, False]
        buffers = chunks.buffers(4)
        assert await tier.read(items(keys, buffers)) == [True, True, True, False]
        for row, buffer in zip(rows[:3], buffers, strict=False):
            assert np.array_equal(row, buffer)
        assert await tier.contains([]) == []
        assert await tier.write([]) == 0
        assert await tier.read([]) == []
        s = tier.statistics()
        assert (s.state, s.contains_calls, s.hits_total, s.misses_total) == ("up", 3, 3, 5)
        assert (s.reads_total, s.read_misses_total, s.rejected_total) == (3, 1, 0)
        assert (s.writes_total, s.write_bytes_total) == (3, 3 * namespace.row_bytes)
        assert s.read_bytes_total == 3 * namespace.row_bytes
        assert s.errors_total == s.write_errors_total == 0
        assert "3 written" in repr(tier)
    assert tier.statistics().state == "closed"
    assert (tier.medium, tier.locality, tier.name) == (Medium.STORAGE, Locality.LOCAL, "memory")


async def test_tiers_sharing_a_store_share_chunks_of_their_namespace_only(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    store = MemoryStore()
    other = RemoteNamespace(
        model=namespace.model,
        dtype="float8",
        row_bytes=namespace.row_bytes,
        blocks_per_chunk=namespace.blocks_per_chunk,
    )
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with (
        MemoryTier(namespace, store=store, locality=Locality.REMOTE) as first,
        MemoryTier(namespace, store=store) as second,
        MemoryTier(other, store=store) as foreign,
    ):
        assert first.locality is Locality.REMOTE
        await first.write(items(keys, rows))
        buffers = chunks.buffers(2)
        assert await second.read(items(keys, buffers)) == [True, True]
        assert np.array_equal(buffers[1], rows[1])
        assert await foreign.contains(keys) == [False, False]
    assert len(store) == 2


async def test_a_foreign_or_damaged_value_under_a_valid_key_is_rejected(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(3), chunks.rows(3)
    codec = ChunkCodec(namespace)
    async with MemoryTier(namespace) as tier:
        await tier.write(items(keys, rows))
        store = tier.store
        store[codec.remote_key(keys[0])] = b"not a chunk at all"
        store[codec.remote_key(keys[1])] = codec.encode(keys[2], rows[2])  # another chunk's
        damaged = bytearray(store[codec.remote_key(keys[2])])
        damaged[-1] ^= 0x40
        store[codec.remote_key(keys[2])] = bytes(damaged)
        assert await tier.contains(keys) == [True] * 3  # existence is only a hint
        assert await tier.read(items(keys, chunks.buffers(3))) == [False] * 3
        s = tier.statistics()
        assert (s.rejected_total, s.reads_total, s.errors_total) == (3, 0, 0)
        assert s.last_rejection is not None
        assert s.last_rejection.startswith("bad_checksum for key ")


async def test_capacity_evicts_the_least_recently_used(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(3), chunks.rows(3)
    async with MemoryTier(namespace, capacity=2) as tier:
        await tier.write(items(keys[:2], rows[:2]))
        await tier.read(items(keys[:1], chunks.buffers(1)))  # keys[0] is now the most recent
        await tier.write(items(keys[2:], rows[2:]))
        assert await tier.contains(keys) == [True, False, True]
        assert tier.store.evictions == 1
        assert "1 evicted" in repr(tier.store)
    with pytest.raises(ConfigError):
        MemoryTier(namespace, store=MemoryStore(), capacity=3)
    with pytest.raises(ConfigError):
        MemoryStore(capacity=0)


async def test_down_means_misses_and_dropped_writes_then_it_comes_back(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with MemoryTier(namespace) as tier:
        await tier.write(items(keys[:1], rows[:1]))
        tier.set_available(False)
        assert tier.statistics().state == "down"
        assert await tier.contains(keys) == [False, False]
        assert await tier.write(items(keys, rows)) == 0
        assert await tier.read(items(keys, chunks.buffers(2))) == [False, False]
        s = tier.statistics()
        assert (s.unavailable_total, s.write_errors_total, s.read_misses_total) == (3, 2, 2)
        assert s.round_trips_total == 1  # nothing reached the store while down
        tier.set_available(True)
        assert await tier.contains(keys) == [True, False]
        s = tier.statistics()
        assert (s.state, s.reconnects_total) == ("up", 1)


async def test_injected_failures_are_counted_errors(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with MemoryTier(namespace) as tier:
        tier.fail_next(2, "ConnectionError: injected")
        assert await tier.write(items(keys, rows)) == 0
        assert await tier.contains(keys) == [False, False]
        s = tier.statistics()
        assert (s.state, s.errors_total, s.write_errors_total) == ("down", 2, 2)
        assert s.last_error == "ConnectionError: injected"
        assert await tier.write(items(keys, rows)) == 2
        assert tier.statistics().reconnects_total == 1


async def test_a_paused_tier_times_out_and_a_resumed_one_answers(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    async with MemoryTier(namespace, timeout_s=0.05) as tier:
        tier.pause()
        with anyio.fail_after(10):
            assert await tier.contains(keys) == [False]
        s = tier.statistics()
        assert (s.timeouts_total, s.errors_total, s.state) == (1, 1, "down")
        results: list[list[bool]] = []

        async def ask() -> None:
            results.append(await tier.contains(keys))

        async with anyio.create_task_group() as tg:
            tier.timeout_s = 30.0
            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            assert results == []
            tier.resume()
        assert results == [[False]]
        assert tier.statistics().state == "up"


async def test_misuse_raises(namespace: RemoteNamespace, chunks: Any) -> None:
    keys = chunks.keys(1)
    tier = MemoryTier(namespace)
    with pytest.raises(SpecError, match="writable"):
        await tier.read([(keys[0], memoryview(bytes(namespace.row_bytes)))])
    with pytest.raises(SpecError, match="exactly one row"):
        await tier.read([(keys[0], memoryview(bytearray(10)))])
    with pytest.raises(SpecError, match="one row"):
        await tier.write([(keys[0], b"short")])
    assert tier.statistics().write_calls == 0  # refused before anything was counted
    await tier.aclose()
    await tier.aclose()
    with pytest.raises(ResourceClosedError):
        await tier.contains(keys)
    with pytest.raises(ConfigError):
        MemoryTier(namespace, timeout_s=0)


async def test_every_chunk_not_written_is_counted_once_by_reason(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(3), chunks.rows(3)
    async with MemoryTier(namespace, timeout_s=5.0) as tier:
        tier.pause()
        with anyio.CancelScope() as scope:  # the caller gives up on a hung store
            scope.cancel()
            await tier.write(items(keys, rows))
        tier.resume()
        tier.fail_next(1, "injected")
        assert await tier.write(items(keys[:2], rows[:2])) == 0
        tier.set_available(False)
        assert await tier.write(items(keys[:1], rows[:1])) == 0
        s = tier.statistics()
        assert s.write_errors_by_reason == {"cancelled": 3, "failed": 2, "down": 1}
        assert s.write_errors_total == sum(s.write_errors_by_reason.values())
        assert (s.errors_total, s.refused_total) == (1, 0)  # the injected failure, once
