"""TieringEngine and its scheduler, on asyncio and trio, with the mock and cpu backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch
from anyio import wait_all_tasks_blocked

from tiering import (
    CapacityError,
    ChunkStateError,
    ConfigError,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    ResourceClosedError,
    SpecError,
    make_offload_key,
)
from tiering.engine import PrefixLookup, TieringEngine
from tiering.scheduler import LATENCY_BUCKETS, JobOutcome, SchedulerLimits
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import KVCacheTensor, KVLayout
from tiering.transfer.mock import MockBackend

pytestmark = pytest.mark.anyio

PAGE_WORDS = 512  # 4 KiB pages
NUM_BLOCKS = 256


def config(blocks_per_chunk: int = 1, **extra: Any) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("k", "v")),),
        worker_kv_bytes_per_block=2 * PAGE_WORDS * 8,
        engine_id="test",
        extra_config=extra,
        model=OffloadingModelConfig(name="m", dtype="int64"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
    )


def kv_caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randint(-(2**62), 2**62, (NUM_BLOCKS, PAGE_WORDS), generator=gen)
        for name in ("k", "v")
    }


def keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big")) for i in ids]


def spec(blocks: Sequence[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(blocks))


CHUNK_BYTES = 2 * PAGE_WORDS * 8


@pytest.fixture
async def mock_engine() -> AsyncIterator[TieringEngine]:
    engine = TieringEngine(
        config(),
        kv_caches(),
        cpu_bytes=16 * CHUNK_BYTES,
        backend="mock",
        backend_options={"gated": True},
        limits=SchedulerLimits(max_queued_jobs=2, max_inflight_bytes=CHUNK_BYTES, slice_chunks=2),
    )
    async with engine:
        try:
            yield engine
        finally:
            mock(engine).open_gate()


def mock(engine: TieringEngine) -> MockBackend:
    backend = engine.backend
    assert isinstance(backend, MockBackend)
    return backend


async def test_round_trip_on_the_cpu_backend(anyio_backend: str) -> None:
    kv = kv_caches()
    original = {n: t.clone() for n, t in kv.items()}
    async with TieringEngine(config(2), kv, cpu_bytes=1 << 20) as engine:
        assert engine.backend_name == "cpu"
        stored = await (await engine.submit_store(keys(1, 2, 3), spec(range(6))))
        assert stored.outcome is JobOutcome.SUCCEEDED
        assert (stored.chunks, stored.nbytes) == (3, 6 * CHUNK_BYTES)
        assert engine.lookup(keys(1, 2, 3, 4)) == PrefixLookup(ready=3, pending=0, missing=1)
        for t in kv.values():
            t.zero_()
        # The GPU holds the first block of chunk 2 already: load from part-way in.
        loaded = await (
            await engine.submit_load(keys(2, 3), GPULoadStoreSpec([50, 51, 52], [3], [3]))
        )
        assert loaded.success
        assert loaded.nbytes == 3 * CHUNK_BYTES
        for name in kv:
            assert torch.equal(kv[name][50:53], original[name][3:6])
        stats = engine.statistics()
        assert (stats.manager.pinned, stats.scheduler.loads.succeeded) == (0, 1)
        assert "chunks: 3/" in repr(engine)


async def test_stores_skip_present_keys_and_report_no_room(anyio_backend: str) -> None:
    async with TieringEngine(config(), kv_caches(), cpu_bytes=2 * CHUNK_BYTES) as engine:
        assert (await (await engine.submit_store(keys(1), spec([0])))).chunks == 1
        again = await (await engine.submit_store(keys(1, 2), spec([0, 1])))
        assert (again.outcome, again.chunks, again.nbytes) == (JobOutcome.SUCCEEDED, 1, CHUNK_BYTES)
        load = await engine.submit_load(keys(1, 2), spec([5, 6]))
        # Both chunks pinned by the load, which may land at any checkpoint: no await between.
        full = await engine.submit_store_nowait(keys(3), spec([3]))
        assert full.outcome is JobOutcome.NO_ROOM
        assert "no room" in (full.error or "")
        assert (await load).success
        assert (await (await engine.submit_store(keys(3), spec([3])))).success
        stores = engine.statistics().scheduler.stores
        # The three stores that reached the backend are in the latency
        # histogram; the one that found no room is not.
        assert (stores.succeeded, stores.no_room, sum(stores.latency_buckets)) == (3, 1, 3)
        assert len(stores.latency_buckets) == len(LATENCY_BUCKETS) + 1
        assert stores.latency_seconds > 0


def test_engines_are_named_by_their_config_or_by_the_caller() -> None:
    engine = TieringEngine(config(), kv_caches(), cpu_bytes=CHUNK_BYTES)
    assert engine.engine_id == config().engine_id == "test"  # the config's engine_id
    named = TieringEngine(config(), kv_caches(), cpu_bytes=CHUNK_BYTES, engine_id="rank-3")
    assert named.engine_id == "rank-3"
    assert repr(named).startswith("<TieringEngine rank-3 [new;")
    for bad in ("", 3):
        with pytest.raises(ConfigError, match=f"engine_id must be a non-empty string, got {bad!r}"):
            TieringEngine(config(), kv_caches(), cpu_bytes=CHUNK_BYTES, engine_id=bad)  # type: ignore[arg-type]


async def test_loads_go_before_queued_stores(mock_engine: TieringEngine) -> None:
    engine = mock_engine
    mock(engine).open_gate()
    with anyio.fail_after(10):
        assert (await (await engine.submit_store(keys(9), spec([9])))).success
    mock(engine).close_gate()
    s1 = engine.submit_store_nowait(keys(1), spec([1]))  # at the backend, held by the gate
    s2 = engine.submit_store_nowait(keys(2), spec([2]))  # queued: the store budget is full
    load = engine.submit_load_nowait(keys(9), spec([10]))
    directions = [j.direction.value for j in mock(engine).submitted]
    assert directions[-2:] == ["store", "load"]  # the load went ahead of the queued store
    stats = engine.statistics().scheduler
    assert (stats.stores.queued, stats.loads.queued, stats.loads.in_flight) == (1, 0, 1)
    mock(engine).open_gate()
    with anyio.fail_after(10):
        for handle in (load, s1, s2):
            assert (await handle).success


async def test_a_small_load_does_not_wait_for_a_large_one(mock_engine: TieringEngine) -> None:
    engine = mock_engine
    mock(engine).open_gate()
    await (await engine.submit_store(keys(*range(100, 110)), spec(range(10))))
    await (await engine.submit_store(keys(7), spec([20])))
    mock(engine).close_gate()
    seen = len(mock(engine).submitted)
    # Two requests share the tier: a large load (5 slices of 2 chunks) and a
    # small one submitted just after it. The budget lets one slice run at a time.
    large = engine.submit_load_nowait(keys(*range(100, 110)), spec(range(30, 40)))
    small = engine.submit_load_nowait(keys(7), spec([50]))
    mock(engine).open_gate()
    assert (await small).success
    assert (await large).success
    # The backend runs a direction in order, so this is also the order they ran in.
    loads = [len(j.src) for j in mock(engine).submitted[seen:]]  # type: ignore[arg-type]
    assert loads == [2, 2, 1, 2, 2, 2]  # round-robin: it waited for one slice, not five


async def test_backpressure_waits_for_room(mock_engine: TieringEngine) -> None:
    engine = mock_engine
    first = engine.submit_store_nowait(keys(1), spec([1]))  # running
    queued = [engine.submit_store_nowait(keys(i), spec([i])) for i in (2, 3)]
    with pytest.raises(anyio.WouldBlock):
        engine.submit_store_nowait(keys(4), spec([4]))
    late: list[Any] = []

    async def submit_late() -> None:
        late.append(await engine.submit_store(keys(4), spec([4])))

    async with anyio.create_task_group() as tg:
        tg.start_soon(submit_late)
        await wait_all_tasks_blocked()
        assert late == []  # waiting for room, not raising
        mock(engine).open_gate()
    for handle in (first, *queued, *late):
        assert (await handle).success


async def test_cancel_a_queued_job_frees_its_slots(mock_engine: TieringEngine) -> None:
    engine = mock_engine
    running = engine.submit_store_nowait(keys(1), spec([1]))
    queued = engine.submit_store_nowait(keys(2), spec([2]))
    assert engine.manager.statistics().writing == 2
    assert queued.cancel() is True
    assert queued.cancel() is False
    result = await queued
    assert result.outcome is JobOutcome.CANCELLED
    assert engine.lookup(keys(2)) == PrefixLookup(0, 0, 1)
    assert running.cancel() is False  # already at the backend: it finishes
    mock(engine).open_gate()
    assert (await running).success
    assert engine.manager.statistics().writing == 0
    assert engine.statistics().scheduler.stores.cancelled == 1


async def test_failed_jobs_free_slots_and_unpin_and_the_engine_serves_on(
    anyio_backend: str,
) -> None:
    fail = {"next": True}

    def scripted(job: Any) -> bool:
        failing, fail["next"] = fail["next"], False
        return failing

    async with TieringEngine(
        config(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock",
        backend_options={"fail": scripted},
    ) as engine:  # fmt: skip
        failed = await (await engine.submit_store(keys(1, 2), spec([1, 2])))
        assert failed.outcome is JobOutcome.FAILED
        assert "scripted failure" in (failed.error or "")
        assert engine.lookup(keys(1)) == PrefixLookup(0, 0, 1)
        assert engine.manager.statistics().used == 0
        assert (await (await engine.submit_store(keys(1, 2), spec([1, 2])))).success
        fail["next"] = True
        bad_load = await (await engine.submit_load(keys(1, 2), spec([5, 6])))
        assert bad_load.outcome is JobOutcome.FAILED
        stats = engine.manager.statistics()
        assert (stats.pinned, stats.ready) == (0, 2)  # unpinned, still there
        assert (await (await engine.submit_load(keys(1, 2), spec([5, 6])))).success
        assert engine.statistics().scheduler.stores.failed == 1


async def test_flush_waits_for_stores_reading_the_blocks(mock_engine: TieringEngine) -> None:
    engine = mock_engine
    store = engine.submit_store_nowait(keys(1), spec([4]))
    await engine.flush([5, 6])  # not read by any store: returns at once
    flushed = anyio.Event()

    async def flush() -> None:
        await engine.flush([4, 9])
        flushed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(flush)
        await wait_all_tasks_blocked()
        assert not flushed.is_set()
        assert not store.done()
        mock(engine).release()
    assert store.done()
    assert (await store).success


async def test_close_cancels_queued_and_finishes_running(anyio_backend: str) -> None:
    engine = TieringEngine(
        config(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock",
        backend_options={"gated": True},
        limits=SchedulerLimits(max_inflight_bytes=CHUNK_BYTES),
    )  # fmt: skip
    async with engine:
        running = engine.submit_store_nowait(keys(1), spec([1]))
        queued = engine.submit_store_nowait(keys(2), spec([2]))
        closed = anyio.Event()

        async def close() -> None:
            await engine.aclose()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            await wait_all_tasks_blocked()
            assert (await queued).outcome is JobOutcome.CANCELLED
            assert not closed.is_set()  # the running job holds the close
            mock(engine).release()
        assert (await running).success
        await engine.aclose()  # idempotent
    assert engine.statistics().state == "closed"
    assert engine.statistics().pool is not None
    assert engine.statistics().pool.closed
    with pytest.raises(ResourceClosedError):
        engine.submit_store_nowait(keys(3), spec([3]))


def test_cpu_bytes_is_checked_first() -> None:
    with pytest.raises(ConfigError, match="cpu_bytes must be a positive integer"):
        TieringEngine(config(), kv_caches(), cpu_bytes=0, engine_id="")
    with pytest.raises(ConfigError, match="cpu_bytes"):
        TieringEngine(config(), kv_caches(), cpu_bytes=0)
    second = TieringEngine(config(), kv_caches(), cpu_bytes=1 << 20, backend="mock")
    refused = ""  # a numpy integer: refused naming cpu_bytes, or taken as the int it is
    try:
        engine = TieringEngine(config(), kv_caches(), cpu_bytes=np.int64(1 << 20), backend="mock")
    except ConfigError as exc:
        refused = str(exc)
    else:
        assert engine.manager.capacity == second.manager.capacity
    assert not refused or refused.startswith("cpu_bytes")


async def test_bad_input_is_refused_before_anything_moves(anyio_backend: str) -> None:
    with pytest.raises(CapacityError, match="holds no chunk"):
        TieringEngine(config(), kv_caches(), cpu_bytes=100)
    with pytest.raises(ConfigError, match="cpu_bytes"):
        TieringEngine(config(), kv_caches(), cpu_bytes=0)
    with pytest.raises(ConfigError, match="'x'"):
        TieringEngine(config(), {**kv_caches(), "x": torch.zeros(4, 4)}, cpu_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_queued_jobs"):
        TieringEngine(config(max_queued_jobs=0), kv_caches(), cpu_bytes=1 << 20)
    with pytest.raises(ConfigError, match="backend 'gpu'"):
        TieringEngine(config(), kv_caches(), cpu_bytes=1 << 20, backend="gpu")
    engine = TieringEngine(config(), kv_caches(), cpu_bytes=1 << 20)
    with pytest.raises(ResourceClosedError, match="new"):
        engine.submit_store_nowait(keys(1), spec([1]))
    async with engine:
        with pytest.raises(SpecError, match="2 keys for a GPU spec of 3 chunks"):
            engine.submit_store_nowait(keys(1, 2), spec([1, 2, 3]))
        with pytest.raises(SpecError, match="block id 256"):
            engine.submit_store_nowait(keys(1), spec([256]))
        with pytest.raises(ChunkStateError):
            engine.submit_load_nowait(keys(9), spec([1]))
        assert engine.manager.statistics().used == 0


async def test_the_loop_stays_responsive_during_a_large_transfer(anyio_backend: str) -> None:
    blocks = 2048
    kv = {n: torch.ones((blocks, 16384), dtype=torch.int64) for n in ("k", "v")}  # 256 MiB each
    chunk = 2 * 16384 * 8
    async with TieringEngine(config(), kv, cpu_bytes=blocks * chunk) as engine:
        ticks = 0
        job = await engine.submit_store(keys(*range(blocks)), spec(range(blocks)))
        while not job.done():
            await anyio.sleep(0.001)
            ticks += 1
        result = await job
        assert result.success
        # Completion is pushed from the worker thread; the loop ran all along.
        assert ticks >= 5, f"the event loop ticked only {ticks} times during the copy"


def test_engine_statistics_nest_the_parts() -> None:
    engine = TieringEngine(config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES)
    stats = engine.statistics()
    assert stats.state == "new"
    assert stats.manager.capacity == 4
    assert stats.backend is None
    assert stats.pool is None
    assert engine.info.cpu_num_chunks == 4
    assert np.isclose(engine.info.cpu_kv_cache_size_bytes or 0, 4 * engine.layout.row_bytes)


async def test_a_full_backend_holds_jobs_back_instead_of_failing_them(anyio_backend: str) -> None:
    async with TieringEngine(
        config(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock",
        backend_options={"gated": True, "max_in_flight": 2},
    ) as engine:  # fmt: skip
        handles = [engine.submit_store_nowait(keys(i), spec([i])) for i in range(5)]
        assert len(mock(engine).submitted) == 2  # the rest wait in the queue
        mock(engine).open_gate()
        with anyio.fail_after(10):
            for handle in handles:
                assert (await handle).success


async def test_a_cancelled_close_still_finishes_running_jobs(anyio_backend: str) -> None:
    engine = TieringEngine(
        config(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock",
        backend_options={"gated": True},
        limits=SchedulerLimits(slice_chunks=1, max_load_slices=1),
    )  # fmt: skip
    async with anyio.create_task_group() as tg:
        await engine.__aenter__()
        mock(engine).open_gate()
        with anyio.fail_after(10):
            await (await engine.submit_store(keys(1, 2, 3), spec([1, 2, 3])))
        mock(engine).close_gate()
        load = engine.submit_load_nowait(keys(1, 2, 3), spec([5, 6, 7]))  # 3 slices, 1 at a time
        backend = mock(engine)

        async def close_cancelled() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await engine.aclose()

        tg.start_soon(close_cancelled)
        await wait_all_tasks_blocked()
        backend.open_gate()
    with anyio.fail_after(10):
        result = await load
    assert result.success
    assert engine.manager.statistics().pinned == 0
    assert engine.statistics().state == "closed"


async def test_a_spec_the_layout_refuses_changes_nothing(anyio_backend: str) -> None:
    async with TieringEngine(config(2), kv_caches(), cpu_bytes=2 * CHUNK_BYTES * 2) as engine:
        with anyio.fail_after(10):
            await (await engine.submit_store(keys(1, 2), spec(range(4))))
        with pytest.raises(SpecError, match=r"end.* chunk boundary"):
            engine.submit_store_nowait(keys(3, 4), spec([10, 11, 12]))
        with pytest.raises(SpecError, match="starts at block 1"):
            engine.submit_store_nowait(keys(3), GPULoadStoreSpec([10], [1], [1]))
        with pytest.raises(SpecError, match="more than once"):
            engine.submit_load_nowait(keys(1), spec([20, 20]))
        with pytest.raises(SpecError, match="2 groups"):
            engine.submit_store_nowait(keys(3), GPULoadStoreSpec([10, 11], [1, 1]))
        stats = engine.manager.statistics()
        assert (stats.ready, stats.evictions_total, stats.pinned) == (2, 0, 0)


async def test_with_default_limits_a_small_load_overtakes_a_large_one(anyio_backend: str) -> None:
    async with TieringEngine(
        config(), kv_caches(), cpu_bytes=128 * CHUNK_BYTES, backend="mock",
        backend_options={"gated": True},
    ) as engine:  # fmt: skip
        mock(engine).open_gate()
        with anyio.fail_after(10):
            await (await engine.submit_store(keys(*range(64)), spec(range(64))))
            await (await engine.submit_store(keys(99), spec([99])))
        mock(engine).close_gate()
        seen = len(mock(engine).submitted)
        large = engine.submit_load_nowait(keys(*range(64)), spec(range(100, 164)))
        small = engine.submit_load_nowait(keys(99), spec([200]))
        mock(engine).open_gate()
        with anyio.fail_after(10):
            assert (await small).success
            assert (await large).success
        # The backend runs a direction in order: the small load ran after three
        # slices of the large one, not after all four.
        sizes = [len(j.src) for j in mock(engine).submitted[seen:]]  # type: ignore[arg-type]
        assert sizes == [16, 16, 16, 1, 16]


# --- what kv_caches may be ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "described"),
    [
        (lambda kv: list(kv.values()), r"a list of 2 items \(torch\.Tensor\)"),
        (lambda kv: tuple(kv.values()), r"a tuple of 2 items \(torch\.Tensor\)"),
        (lambda kv: np.stack([t.numpy() for t in kv.values()]), r"a numpy\.ndarray"),
        (lambda kv: kv["k"], r"a torch\.Tensor"),
    ],
)
def test_kv_caches_that_map_no_layer_are_refused(given: Any, described: str) -> None:
    expected = (
        r"kv_caches must map each layer name to its KV cache tensor \(\{layer name: "
        rf"torch\.Tensor\}} for the layers \['k', 'v'\]\), or be a list of KVCacheTensor; "
        rf"got {described}$"
    )
    with pytest.raises(ConfigError, match=expected):
        TieringEngine(config(), given(kv_caches()), cpu_bytes=1 << 20)


def test_a_list_of_kv_cache_tensors_is_taken_as_it_is() -> None:
    registered = list(KVLayout.from_kv_caches(config(), kv_caches()).tensors)
    engine = TieringEngine(config(), registered, cpu_bytes=1 << 20)
    mapped = TieringEngine(config(), kv_caches(), cpu_bytes=1 << 20)
    assert engine.layout.row_bytes == mapped.layout.row_bytes == CHUNK_BYTES
    assert [t.tensor for t in engine.layout.tensors] == [t.tensor for t in registered]


def test_the_layout_is_built_from_the_configs_groups() -> None:
    kv = kv_caches()
    layout = KVLayout.from_kv_caches(config(2), kv)
    assert layout.blocks_per_chunk == 2
    assert [t.tensor for t in layout.tensors] == [kv["k"], kv["v"]]  # the groups' order
    assert layout.row_bytes == 2 * CHUNK_BYTES
    with pytest.raises(ConfigError, match=r"no KV cache tensor for layer 'v' of group 0"):
        KVLayout.from_kv_caches(config(), {"k": kv["k"]})
    with pytest.raises(ConfigError, match=r"tensors \['w'\] belong to no group"):
        KVLayout.from_kv_caches(config(), {**kv, "w": kv["k"]})


def test_a_layer_that_is_no_tensor_is_refused() -> None:
    kv: dict[str, Any] = {**kv_caches(), "v": np.zeros((NUM_BLOCKS, PAGE_WORDS), dtype=np.int64)}
    with pytest.raises(ConfigError, match=r"tensor 'v' is a numpy\.ndarray; give a torch\.Tensor"):
        TieringEngine(config(), kv, cpu_bytes=1 << 20)


def test_a_transposed_tensor_is_refused_as_not_contiguous() -> None:
    kv = {**kv_caches(), "k": torch.zeros((PAGE_WORDS, NUM_BLOCKS), dtype=torch.int64).t()}
    with pytest.raises(
        ConfigError,
        match=rf"tensor 'k' is not contiguous \(shape \({NUM_BLOCKS}, {PAGE_WORDS}\), "
        rf"strides \(1, {NUM_BLOCKS}\)\): a transposed or strided view",
    ):
        TieringEngine(config(), kv, cpu_bytes=1 << 20)


def test_a_tensor_of_another_dtype_than_the_configs_is_refused() -> None:
    kv = {**kv_caches(), "v": torch.zeros((NUM_BLOCKS, PAGE_WORDS), dtype=torch.float64)}
    pattern = r"'v' has dtype float64 but the config's model\.dtype is 'int64'; give KV tensors"
    with pytest.raises(ConfigError, match=pattern):
        TieringEngine(config(), kv, cpu_bytes=1 << 20)
    listed = [KVCacheTensor(t, NUM_BLOCKS, PAGE_WORDS * 8) for t in kv.values()]
    with pytest.raises(ConfigError, match=r"kv_caches\[1\]\.tensor has dtype float64"):
        TieringEngine(config(), listed, cpu_bytes=1 << 20)


def test_a_vllm_quantized_cache_takes_tensors_of_its_size() -> None:
    fp8 = msgspec.structs.replace(config(), model=OffloadingModelConfig(name="m", dtype="fp8_e4m3"))
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.int8):  # bytes, as backends view them
        kv = {n: torch.zeros((NUM_BLOCKS, 64), dtype=dtype) for n in ("k", "v")}
        assert TieringEngine(fp8, kv, cpu_bytes=1 << 20).layout.tensors[1].tensor is kv["v"]
    kv = {n: torch.zeros((NUM_BLOCKS, 64), dtype=torch.float16) for n in ("k", "v")}
    with pytest.raises(ConfigError, match=r"model\.dtype is 'fp8_e4m3' \(stored as uint8\)"):
        TieringEngine(fp8, kv, cpu_bytes=1 << 20)
