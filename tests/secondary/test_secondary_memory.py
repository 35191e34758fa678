"""MemoryTier: the in-process secondary tier the engine tests use, with scripted faults.

What every tier guarantees is tests/secondary/test_secondary_contract.py; here,
what is the memory tier's own: shared stores, capacity, scripted faults."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

from tiering._types import Medium
from tiering.errors import ConfigError
from tiering.secondary import (
    Locality,
    MemoryStore,
    MemoryTier,
    RemoteNamespace,
    SecondaryTier,
)

pytestmark = pytest.mark.anyio


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


async def test_what_it_says_it_is(namespace: RemoteNamespace) -> None:
    async with MemoryTier(namespace) as tier:
        assert isinstance(tier, SecondaryTier)
        assert (tier.medium, tier.locality, tier.name) == (Medium.STORAGE, Locality.LOCAL, "memory")
    assert tier.statistics().state == "closed"
    with pytest.raises(ConfigError):
        MemoryTier(namespace, timeout_s=0)


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


async def test_a_call_waiting_on_a_paused_tier_answers_when_it_resumes(
    namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    async with MemoryTier(namespace, timeout_s=30.0) as tier:
        tier.pause()
        results: list[list[bool]] = []

        async def ask() -> None:
            results.append(await tier.contains(keys))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            assert results == []
            tier.resume()
        assert results == [[False]]
        s = tier.statistics()
        assert (s.state, s.timeouts_total, s.errors_total) == ("up", 0, 0)
