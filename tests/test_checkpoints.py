"""Every awaitable of the engine, the scheduler and the secondary tiers is a checkpoint.

Trio's rule, which anyio follows: an ``async`` function of a library always
yields to the event loop (and is a cancellation point), even on a fast path
that has nothing to wait for. Otherwise a caller's loop of awaits that each
end at once never lets another task run, nor the loop's own callbacks (the
backend's completions among them).

Each test runs a second task that counts its turns (a ``sleep(0)`` loop) while
the awaitable under test is awaited `CALLS` times on its fast path; without a
checkpoint the counter task gets no turn at all.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch

from tiering import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    make_offload_key,
)
from tiering.engine import TieringEngine
from tiering.scheduler import JobOutcome
from tiering.secondary import MemoryTier, RemoteNamespace, SecondaryTier
from tiering.specs import GPULoadStoreSpec
from tiering.transfer.mock import MockBackend

from .conftest import turns_during

pytestmark = pytest.mark.anyio

CALLS = 40
PAGE_WORDS = 256  # two 2 KiB pages: a 4 KiB row
NUM_BLOCKS = 32
ROW_BYTES = 2 * PAGE_WORDS * 8


def _config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("k", "v")),),
        worker_kv_bytes_per_block=ROW_BYTES,
        engine_id="test",
        model=OffloadingModelConfig(name="m", dtype="int64"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
    )


def _kv() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(NUM_BLOCKS, PAGE_WORDS, dtype=torch.int64) for name in ("k", "v")}


def _keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big")) for i in ids]


def _namespace() -> RemoteNamespace:
    return RemoteNamespace(model="m", dtype="int64", row_bytes=ROW_BYTES, blocks_per_chunk=1)


async def _turns_during(step: Callable[[], Awaitable[Any]], calls: int = CALLS) -> int:
    return await turns_during(step, calls)


def _assert_yields(counted: int, calls: int = CALLS) -> None:
    # One turn per call on asyncio; on trio at least one per two calls (a batch
    # of runnable tasks runs in random order). Without a checkpoint: 0.
    assert counted >= calls // 2, f"the counting task got {counted} turns in {calls} awaits"


@pytest.fixture
async def engine() -> AsyncIterator[TieringEngine]:
    async with TieringEngine(
        _config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock", prefault=False
    ) as engine:
        yield engine


async def test_a_store_of_keys_already_present_yields(engine: TieringEngine) -> None:
    first = await engine.submit_store(_keys(1), GPULoadStoreSpec([0]))
    assert (await first).success

    async def again() -> None:
        handle = await engine.submit_store(_keys(1), GPULoadStoreSpec([0]))
        assert handle.done()
        assert (await handle).outcome is JobOutcome.SUCCEEDED
        await engine.flush([0])

    _assert_yields(await _turns_during(again), 3 * CALLS)


async def test_a_store_that_finds_no_room_yields(engine: TieringEngine) -> None:
    # Fill the tier with chunks that stay pinned by a gated load: no room after.
    filled = await engine.submit_store(_keys(1, 2, 3, 4), GPULoadStoreSpec([0, 1, 2, 3]))
    assert (await filled).success
    cpu = engine.manager.prepare_load(_keys(1, 2, 3, 4))  # pinned: nothing evictable

    async def no_room() -> None:
        handle = await engine.submit_store(_keys(9), GPULoadStoreSpec([9]))
        assert (await handle.wait()).outcome is JobOutcome.NO_ROOM

    _assert_yields(await _turns_during(no_room))
    assert len(cpu.chunk_ids) == 4
    engine.manager.complete_load(_keys(1, 2, 3, 4))


async def test_the_scheduler_awaitables_yield(engine: TieringEngine) -> None:
    scheduler = engine.scheduler
    assert (await (await engine.submit_store(_keys(5), GPULoadStoreSpec([5])))).success

    _assert_yields(await _turns_during(lambda: scheduler.flush([1, 2, 3])))  # none reads them

    async def load() -> None:
        # Few: with the counting task always runnable, trio's loop holds the GIL
        # and the backend thread completes each load slowly.
        handle = await engine.submit_load(_keys(5), GPULoadStoreSpec([6]))
        await handle

    _assert_yields(await _turns_during(load, 6), 6)


async def test_flush_with_no_store_in_flight_yields(engine: TieringEngine) -> None:
    _assert_yields(await _turns_during(lambda: engine.flush([0, 1])))


async def test_promote_without_a_secondary_tier_yields(engine: TieringEngine) -> None:
    _assert_yields(await _turns_during(lambda: engine.promote(_keys(1, 2))))


async def test_waiting_for_write_throughs_when_none_is_queued_yields() -> None:
    async with TieringEngine(
        _config(),
        _kv(),
        cpu_bytes=4 * ROW_BYTES,
        backend="mock",
        prefault=False,
        secondary=MemoryTier,
    ) as engine:
        _assert_yields(await _turns_during(engine.wait_written_through))
    engine = TieringEngine(_config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock")
    _assert_yields(await _turns_during(engine.wait_written_through))


async def test_closing_again_yields() -> None:
    engine = TieringEngine(_config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock")
    await engine.aclose()  # never opened
    _assert_yields(await _turns_during(engine.aclose))
    async with TieringEngine(
        _config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock", prefault=False
    ) as opened:
        pass
    _assert_yields(await _turns_during(opened.aclose))
    _assert_yields(await _turns_during(opened.scheduler.aclose))


async def test_a_loop_of_stores_that_end_at_submission_lets_a_deadline_fire(
    engine: TieringEngine,
) -> None:
    """The issue's symptom: a ``fail_after`` around such a loop never fired."""
    assert (await (await engine.submit_store(_keys(1), GPULoadStoreSpec([0])))).success
    with anyio.move_on_after(0.05) as scope:
        for _ in range(200_000):  # bounded: without a checkpoint the deadline never fires
            await (await engine.submit_store(_keys(1), GPULoadStoreSpec([0])))
            await engine.flush([0])
    assert scope.cancelled_caught


async def test_flush_of_blocks_no_store_in_flight_reads_yields() -> None:
    async with TieringEngine(
        _config(),
        _kv(),
        cpu_bytes=4 * ROW_BYTES,
        backend="mock",
        backend_options={"gated": True},
        prefault=False,
    ) as engine:
        held = await engine.submit_store(_keys(1), GPULoadStoreSpec([0]))  # held at the gate
        assert not held.done()
        _assert_yields(await _turns_during(lambda: engine.flush([5, 6])))
        assert isinstance(engine.backend, MockBackend)
        engine.backend.open_gate()
        assert (await held).success


@pytest.mark.parametrize("secondary", [None, MemoryTier])
async def test_a_cancelled_open_leaves_the_engine_new_and_nothing_acquired(
    secondary: Any,
) -> None:
    engine = TieringEngine(
        _config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock", secondary=secondary
    )
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with engine:
            pytest.fail("the body of a cancelled open ran")
    assert engine.statistics().state == "new"
    assert engine.statistics().pool is None
    await engine.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("kind", ["store", "load"])
async def test_asyncio_cancellation_never_loses_a_queued_job(anyio_backend: str, kind: str) -> None:
    """asyncio's own cancellation (``asyncio.timeout``, ``task.cancel``) passes through
    anyio's shields: a submission either raises with nothing queued, or returns its
    handle; never a job queued whose handle the caller lost."""
    import asyncio

    async with TieringEngine(
        _config(), _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock", prefault=False
    ) as engine:
        assert (await (await engine.submit_store(_keys(1), GPULoadStoreSpec([0])))).success
        handle = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0):
                if kind == "store":
                    handle = await engine.submit_store(_keys(2), GPULoadStoreSpec([1]))
                else:
                    handle = await engine.submit_load(_keys(1), GPULoadStoreSpec([2]))
        stats = engine.statistics()
        if handle is None:  # cancelled: nothing was queued
            assert (stats.manager.open_store_jobs, stats.manager.open_load_jobs) == (0, 0)
            assert stats.scheduler.stores.succeeded + stats.scheduler.loads.succeeded == 1
        else:
            await handle


async def test_promote_of_chunks_held_by_the_cpu_tier_yields() -> None:
    async with TieringEngine(
        _config(),
        _kv(),
        cpu_bytes=4 * ROW_BYTES,
        backend="mock",
        prefault=False,
        secondary=MemoryTier,
    ) as engine:
        assert (await (await engine.submit_store(_keys(1), GPULoadStoreSpec([0])))).success
        # Key 1 is in the CPU tier: nothing to ask the secondary tier.
        _assert_yields(await _turns_during(lambda: engine.promote(_keys(1), 0)))


def _memory_tier(available: bool) -> SecondaryTier:
    tier = MemoryTier(_namespace())
    tier.set_available(available)
    return tier


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


def _redis_tier() -> SecondaryTier:
    pytest.importorskip("redis")
    from tiering.secondary.redis import RedisTier

    # Nothing listens on the port: the first call takes the tier down, and
    # later calls are answered at once, without I/O, until the retry time.
    return RedisTier(
        f"redis://127.0.0.1:{_closed_port()}/0",
        _namespace(),
        timeout_s=0.5,
        backoff_s=(60.0, 60.0),
    )


@pytest.mark.parametrize(
    "make_tier",
    [
        pytest.param(lambda: _memory_tier(True), id="memory"),
        pytest.param(lambda: _memory_tier(False), id="memory-down"),
        pytest.param(_redis_tier, id="redis-down"),
    ],
)
async def test_every_secondary_tier_call_yields(make_tier: Callable[[], SecondaryTier]) -> None:
    tier = make_tier()
    row = np.zeros(ROW_BYTES, dtype=np.uint8)
    keys = _keys(1, 2)
    try:
        await tier.contains(keys)  # a Redis tier goes down here
        for step in (
            lambda: tier.contains([]),
            lambda: tier.write([]),
            lambda: tier.read([]),
            lambda: tier.contains(keys),
            lambda: tier.write([(keys[0], memoryview(row))]),
            lambda: tier.read([(keys[0], memoryview(row))]),
        ):
            _assert_yields(await _turns_during(step))
    finally:
        await tier.aclose()
    _assert_yields(await _turns_during(tier.aclose))


async def test_reading_buffered_event_batches_yields() -> None:
    config = msgspec.structs.replace(_config(), enable_kv_cache_events=True)
    async with TieringEngine(
        config, _kv(), cpu_bytes=4 * ROW_BYTES, backend="mock", prefault=False
    ) as engine:
        subscription = engine.subscribe()
        for i in range(CALLS):
            assert (await (await engine.submit_store(_keys(i), GPULoadStoreSpec([0])))).success
        await engine.flush([0])
        await anyio.wait_all_tasks_blocked()
        assert subscription.pending >= CALLS // 2  # batches at hand: no wait needed
        _assert_yields(await _turns_during(subscription.__anext__, CALLS // 2), CALLS // 2)
        await subscription.aclose()
        _assert_yields(await _turns_during(subscription.aclose))
