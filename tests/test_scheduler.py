"""The scheduler: ordering, budgets, load slices, back-pressure, cancellation.

The tests drive a `Scheduler` over a scripted backend that records every slice
it is handed and completes one only when the test says so, on the event loop
thread: which slice goes when is then exact, on asyncio and on trio.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import cast

import anyio
import anyio.lowlevel
import pytest
from anyio import wait_all_tasks_blocked
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering import make_offload_key
from tiering._types import OffloadKey, TransferDirection
from tiering.cpu.common import CPULoadStoreSpec
from tiering.cpu.manager import CPUOffloadingManager, LookupResult
from tiering.errors import CapacityError, CopyFailedError, SpecError, TransferError
from tiering.scheduler import (
    JobHandle,
    JobOutcome,
    Scheduler,
    SchedulerLimits,
    chunk_block_ranges,
    select_chunks,
)
from tiering.scheduler._plan import PlannedJob, Planner, Slice
from tiering.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec
from tiering.transfer.base import CompletionCallback, TransferResult

STORE, LOAD = TransferDirection.STORE, TransferDirection.LOAD
CHUNK = 100  # bytes of one chunk (one block of one group: blocks_per_chunk 1)


def keys(*ids: int) -> list[OffloadKey]:
    return [make_offload_key(i) for i in ids]


def spec(block_ids: Sequence[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(block_ids))


class ScriptedBackend:
    """Records every slice handed to it; completes one only when `finish` names it.

    ``capacity`` bounds the slices it holds (past it `submit` raises
    `CapacityError`, as a full backend does); ``refuse`` makes `submit` raise
    a `SpecError` for the slices it picks. Once ``auto`` is set, every slice
    completes as soon as it is handed over (for closing).
    """

    name = "scripted"

    def __init__(
        self,
        on_complete: CompletionCallback,
        *,
        capacity: int | None = None,
        refuse: Callable[[list[int]], bool] | None = None,
    ) -> None:
        self._on_complete = on_complete
        self.capacity = capacity
        self.refuse = refuse
        self.auto = False
        self.log: list[
            tuple[TransferDirection, list[int], list[int]]
        ] = []  # kind, GPU ids, CPU ids
        self.running: dict[int, TransferDirection] = {}
        self.order: list[int] = []  # backend job ids, in submission order

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        store = isinstance(src, GPULoadStoreSpec)
        gpu, cpu = cast(tuple[BlockIDsLoadStoreSpec, ...], (src, dst) if store else (dst, src))
        if self.refuse is not None and self.refuse(gpu.block_ids.tolist()):
            raise SpecError("the scripted backend refuses this spec")
        if self.capacity is not None and len(self.running) >= self.capacity:
            raise CapacityError("the scripted backend is full")
        kind = STORE if store else LOAD
        self.log.append((kind, gpu.block_ids.tolist(), cpu.block_ids.tolist()))
        self.running[job_id] = kind
        self.order.append(job_id)
        if self.auto:
            self.finish(job_id)

    def finish(self, *job_ids: int, success: bool = True, error: str | None = None) -> None:
        for job_id in job_ids:
            kind = self.running.pop(job_id)
            self._on_complete(
                TransferResult(
                    job_id=job_id,
                    success=success,
                    direction=kind,
                    nbytes=0,
                    seconds=0.0,
                    error=None if success else (error or "failed"),
                )
            )

    def finish_nth(self, n: int, **kwargs: object) -> None:
        """Complete the ``n``-th slice handed over (0-based)."""
        self.finish(self.order[n], **kwargs)  # type: ignore[arg-type]

    def sent(self) -> list[tuple[TransferDirection, list[int]]]:
        return [(kind, gpu) for kind, gpu, _ in self.log]

    def close(self) -> None:
        pass


class Rig:
    def __init__(self, scheduler: Scheduler, backend: ScriptedBackend) -> None:
        self.scheduler = scheduler
        self.backend = backend
        self.manager: CPUOffloadingManager = scheduler._manager

    async def ready(self, *ids: int) -> None:
        """Store chunks ``ids`` (from GPU blocks ``ids``) and let them land."""
        handle = self.scheduler.submit_nowait(STORE, keys(*ids), spec(ids))
        self.backend.finish(*list(self.backend.running))
        assert (await handle).success
        self.backend.log.clear()
        self.backend.order.clear()


@contextlib.asynccontextmanager
async def running(
    limits: SchedulerLimits | None = None,
    *,
    num_chunks: int = 32,
    capacity: int | None = None,
    refuse: Callable[[list[int]], bool] | None = None,
) -> AsyncIterator[Rig]:
    made: list[ScriptedBackend] = []

    def factory(on_complete: CompletionCallback) -> ScriptedBackend:
        made.append(ScriptedBackend(on_complete, capacity=capacity, refuse=refuse))
        return made[0]

    scheduler = Scheduler(
        CPUOffloadingManager(num_chunks),
        factory,  # type: ignore[arg-type]
        blocks_per_chunk=1,
        block_bytes=[CHUNK],
        group_num_blocks=[64],
        limits=limits,
    )
    scheduler.open()
    try:
        yield Rig(scheduler, made[0])
    finally:
        made[0].auto = True
        made[0].finish(*list(made[0].running))
        await scheduler.aclose()


async def settle() -> None:
    """Let the loop apply every completion the backend has reported."""
    await wait_all_tasks_blocked()


pytestmark = pytest.mark.anyio


# -- through the scheduler ----------------------------------------------------


async def test_a_load_goes_before_stores_queued_earlier(anyio_backend: str) -> None:
    async with running(SchedulerLimits(max_inflight_bytes=CHUNK)) as rig:
        await rig.ready(1, 2)
        s = rig.scheduler
        s.submit_nowait(STORE, keys(10), spec([10]))
        s.submit_nowait(STORE, keys(11), spec([11]))  # queued: the store budget is full
        s.submit_nowait(LOAD, keys(1), spec([20]))  # goes: loads have a budget of their own
        s.submit_nowait(LOAD, keys(2), spec([21]))  # queued
        assert rig.backend.sent() == [(STORE, [10]), (LOAD, [20])]
        rig.backend.finish_nth(0)  # the store first, the load next: one burst
        rig.backend.finish_nth(1)
        await settle()
        assert rig.backend.sent()[2:] == [(LOAD, [21]), (STORE, [11])]


async def test_each_direction_keeps_its_bytes_in_flight_within_its_budget(
    anyio_backend: str,
) -> None:
    async with running(SchedulerLimits(max_inflight_bytes=2 * CHUNK)) as rig:
        s = rig.scheduler
        first = s.submit_nowait(STORE, keys(1), spec([1]))
        s.submit_nowait(STORE, keys(2), spec([2]))
        s.submit_nowait(STORE, keys(3, 4), spec([3, 4]))  # 2 chunks: over the budget
        s.submit_nowait(STORE, keys(5), spec([5]))  # behind it: the queue is FIFO
        assert rig.backend.sent() == [(STORE, [1]), (STORE, [2])]
        stores = s.statistics().stores
        assert (stores.queued, stores.in_flight, stores.inflight_bytes) == (2, 2, 2 * CHUNK)
        rig.backend.finish_nth(0)
        assert (await first).success
        assert rig.backend.sent()[2:] == []  # 1 + 2 chunks would pass the budget
        rig.backend.finish_nth(1)
        await settle()
        assert rig.backend.sent()[2:] == [(STORE, [3, 4])]
        rig.backend.finish_nth(2)
        await settle()
        assert rig.backend.sent()[3:] == [(STORE, [5])]


async def test_a_job_larger_than_the_budget_goes_when_nothing_else_is_in_flight(
    anyio_backend: str,
) -> None:
    async with running(SchedulerLimits(max_inflight_bytes=CHUNK // 2)) as rig:
        s = rig.scheduler
        big = s.submit_nowait(STORE, keys(1, 2, 3), spec([1, 2, 3]))
        s.submit_nowait(STORE, keys(4), spec([4]))
        assert rig.backend.sent() == [(STORE, [1, 2, 3])]
        assert s.statistics().stores.inflight_bytes == 3 * CHUNK
        rig.backend.finish_nth(0)
        assert (await big).success
        assert rig.backend.sent()[1:] == [(STORE, [4])]


async def test_a_load_goes_in_slices_served_round_robin(anyio_backend: str) -> None:
    limits = SchedulerLimits(slice_chunks=2, max_load_slices=1)
    async with running(limits) as rig:
        await rig.ready(*range(1, 9))  # chunk ids 0..7
        s = rig.scheduler
        a = s.submit_nowait(LOAD, keys(1, 2, 3, 4), spec([20, 21, 22, 23]))
        b = s.submit_nowait(LOAD, keys(5, 6, 7), spec([30, 31, 32]))
        c = s.submit_nowait(LOAD, keys(8), spec([40]))
        assert rig.backend.log == [(LOAD, [20, 21], [0, 1])]
        for n in range(4):
            rig.backend.finish_nth(n)
            await settle()
        assert rig.backend.log == [
            (LOAD, [20, 21], [0, 1]),
            (LOAD, [22, 23], [2, 3]),  # a went back in line before b and c came
            (LOAD, [30, 31], [4, 5]),
            (LOAD, [40], [7]),
            (LOAD, [32], [6]),
        ]
        assert a.done()
        assert c.done()
        assert not b.done()
        rig.backend.finish_nth(4)
        result = await b
        assert (result.outcome, result.chunks, result.nbytes) == (JobOutcome.SUCCEEDED, 3, 300)
        assert rig.manager.statistics().pinned == 0


async def test_at_most_max_load_slices_are_at_the_backend(anyio_backend: str) -> None:
    async with running(SchedulerLimits(slice_chunks=1, max_load_slices=2)) as rig:
        await rig.ready(1, 2, 3)
        s = rig.scheduler
        s.submit_nowait(LOAD, keys(1, 2, 3), spec([20, 21, 22]))
        assert rig.backend.sent() == [(LOAD, [20]), (LOAD, [21])]
        assert s.statistics().loads.inflight_bytes == 2 * CHUNK  # the budget allows more
        s.submit_nowait(STORE, keys(9), spec([9]))  # stores are not bound by it
        assert rig.backend.sent()[2:] == [(STORE, [9])]
        rig.backend.finish_nth(0)
        await settle()
        assert rig.backend.sent()[3:] == [(LOAD, [22])]


async def test_past_max_queued_jobs_submit_nowait_would_block_and_submit_waits(
    anyio_backend: str,
) -> None:
    async with running(SchedulerLimits(max_queued_jobs=2, max_inflight_bytes=CHUNK)) as rig:
        await rig.ready(20)
        s = rig.scheduler
        for i in range(3):  # one at the backend, two queued
            s.submit_nowait(STORE, keys(i), spec([i]))
        before = rig.manager.statistics()
        with pytest.raises(anyio.WouldBlock):
            s.submit_nowait(STORE, keys(3), spec([3]))
        assert rig.manager.statistics() == before  # refused before the manager changed
        s.submit_nowait(LOAD, keys(20), spec([40]))  # loads have a queue of their own
        got: list[JobHandle] = []

        async def submit() -> None:
            got.append(await s.submit(STORE, keys(3), spec([3])))

        async with anyio.create_task_group() as tg:
            tg.start_soon(submit)
            await settle()
            assert got == []  # waiting for room
            rig.backend.finish_nth(0)  # store 0 ends, store 1 goes: room for one
            await settle()
            assert len(got) == 1
        assert s.statistics().stores.queued == 2
        assert rig.backend.sent() == [(STORE, [0]), (LOAD, [40]), (STORE, [1])]


async def test_a_queued_job_cancelled_never_runs_and_gives_its_manager_state_back(
    anyio_backend: str,
) -> None:
    async with running(SchedulerLimits(max_inflight_bytes=CHUNK)) as rig:
        await rig.ready(5)
        s = rig.scheduler
        running_store = s.submit_nowait(STORE, keys(1), spec([1]))
        queued_store = s.submit_nowait(STORE, keys(2), spec([2]))
        running_load = s.submit_nowait(LOAD, keys(5), spec([30]))
        queued_load = s.submit_nowait(LOAD, keys(5), spec([31]))
        assert rig.manager.statistics().pinned == 1
        assert repr(queued_store).endswith("[queued]>")
        assert queued_store.cancel()
        assert queued_load.cancel()
        assert not running_store.cancel()
        assert not running_load.cancel()
        assert not queued_store.cancel()  # once
        for handle in (queued_store, queued_load):
            result = await handle
            assert (result.outcome, result.nbytes) == (JobOutcome.CANCELLED, 0)
            assert result.error == "cancelled before it started"
        assert rig.manager.lookup(keys(2)[0]) is LookupResult.MISS
        stats = rig.manager.statistics()
        assert (stats.open_store_jobs, stats.open_load_jobs) == (1, 1)
        rig.backend.finish(*list(rig.backend.running))
        assert (await running_store).success
        assert (await running_load).success
        await settle()
        assert rig.backend.sent() == [(STORE, [1]), (LOAD, [30])]  # nothing else ever went
        counts = s.statistics()
        assert (counts.stores.cancelled, counts.loads.cancelled) == (1, 1)
        assert rig.manager.statistics().pinned == 0


async def test_a_started_load_is_not_cancelled_and_a_failed_slice_ends_it(
    anyio_backend: str,
) -> None:
    async with running(SchedulerLimits(slice_chunks=1, max_load_slices=1)) as rig:
        await rig.ready(1, 2, 3)
        load = rig.scheduler.submit_nowait(LOAD, keys(1, 2, 3), spec([20, 21, 22]))
        assert not load.cancel()
        assert repr(load).endswith("[running]>")
        rig.backend.finish_nth(0, success=False, error="boom")
        result = await load
        assert (result.outcome, result.error, result.nbytes) == (JobOutcome.FAILED, "boom", 0)
        assert rig.backend.sent() == [(LOAD, [20])]  # its other slices never went
        assert rig.manager.statistics().pinned == 0
        assert rig.scheduler.statistics().loads.failed == 1


async def test_a_full_backend_holds_slices_back_until_a_completion(anyio_backend: str) -> None:
    async with running(capacity=1) as rig:
        s = rig.scheduler
        first = s.submit_nowait(STORE, keys(1), spec([1]))
        second = s.submit_nowait(STORE, keys(2), spec([2]))
        assert rig.backend.sent() == [(STORE, [1])]
        assert s.statistics().stores.queued == 1
        rig.backend.finish_nth(0)
        assert (await first).success
        assert rig.backend.sent() == [(STORE, [1]), (STORE, [2])]
        rig.backend.finish_nth(1)
        assert (await second).success


# Before the planning core, a slice the backend refused at submit crashed the
# dispatch loop (an IndexError out of submit_nowait, the job left half-done).


async def test_a_backend_that_refuses_a_job_with_nothing_in_flight_fails_it(
    anyio_backend: str,
) -> None:
    async with running(capacity=0) as rig:
        handle = rig.scheduler.submit_nowait(STORE, keys(1), spec([1]))
        result = await handle
        assert result.outcome is JobOutcome.FAILED
        assert result.error == "the backend refused a job with nothing else in flight"
        assert isinstance(result.exception, TransferError)
        assert str(result.exception) == result.error
        assert rig.manager.lookup(keys(1)[0]) is LookupResult.MISS


async def test_a_slice_the_backend_refuses_fails_its_job_and_the_rest_go_on(
    anyio_backend: str,
) -> None:
    limits = SchedulerLimits(slice_chunks=1, max_load_slices=2)
    async with running(limits, refuse=lambda gpu: gpu == [21]) as rig:
        await rig.ready(1, 2, 3, 4)
        s = rig.scheduler
        bad = s.submit_nowait(LOAD, keys(1, 2, 3), spec([20, 21, 22]))
        assert rig.backend.sent() == [(LOAD, [20])]  # [21] refused, [22] dropped
        assert not bad.done()  # its first slice is still at the backend
        good = s.submit_nowait(LOAD, keys(4), spec([30]))  # the room [21] had
        last = s.submit_nowait(LOAD, keys(4), spec([31]))  # two slices at the backend: it waits
        assert rig.backend.sent() == [(LOAD, [20]), (LOAD, [30])]
        rig.backend.finish(*list(rig.backend.running))
        result = await bad
        assert result.outcome is JobOutcome.FAILED
        assert result.error == "SpecError: the scripted backend refuses this spec"
        assert isinstance(result.exception, CopyFailedError)
        assert isinstance(result.exception.cause, SpecError)
        assert (await good).success
        await settle()
        assert rig.backend.sent() == [(LOAD, [20]), (LOAD, [30]), (LOAD, [31])]
        rig.backend.finish_nth(2)
        assert (await last).success
        assert rig.manager.statistics().pinned == 0


async def test_flush_waits_for_the_stores_that_read_the_blocks(anyio_backend: str) -> None:
    async with running() as rig:
        s = rig.scheduler
        s.submit_nowait(STORE, keys(1, 2), spec([1, 2]))
        s.submit_nowait(STORE, keys(3), spec([3]))
        flushed: list[str] = []

        async def flush(name: str, blocks: list[int]) -> None:
            await s.flush(blocks)
            flushed.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(flush, "2", [2, 9])
            tg.start_soon(flush, "9", [9])
            await settle()
            assert flushed == ["9"]
            rig.backend.finish_nth(1)  # the store of block 3 does not matter
            await settle()
            assert flushed == ["9"]
            rig.backend.finish_nth(0)
        assert flushed == ["9", "2"]


async def test_close_cancels_queued_jobs_and_lets_running_ones_finish(anyio_backend: str) -> None:
    async with running(SchedulerLimits(max_inflight_bytes=CHUNK)) as rig:
        s = rig.scheduler
        first = s.submit_nowait(STORE, keys(1), spec([1]))
        queued = s.submit_nowait(STORE, keys(2), spec([2]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.aclose)
            await settle()
            assert s.statistics().state == "closing"
            assert (await queued).outcome is JobOutcome.CANCELLED
            assert not first.done()
            rig.backend.finish_nth(0)
        assert (await first).success
        assert s.statistics().state == "closed"
        assert rig.backend.sent() == [(STORE, [1])]


# -- spec arithmetic ------------------------------------------------------------


def _two_groups() -> GPULoadStoreSpec:
    # group 0: blocks 2..7 of the request (the first chunk from part-way in), group 1: 4..7
    return GPULoadStoreSpec([10, 11, 12, 13, 14, 15, 20, 21, 22, 23], [6, 4], [2, 4])


def test_chunk_block_ranges_cut_each_group_at_chunk_boundaries() -> None:
    assert chunk_block_ranges(_two_groups(), 4) == [(0, 2, 0, 2), (2, 6, 0, 4), (6, 10, 1, 4)]
    assert chunk_block_ranges(GPULoadStoreSpec([1, 2, 3], [3], [0]), 2) == [
        (0, 2, 0, 0),
        (2, 3, 0, 2),
    ]
    assert chunk_block_ranges(GPULoadStoreSpec([], [0, 0]), 4) == []


@pytest.mark.parametrize(
    ("chosen", "block_ids", "sizes", "firsts"),
    [
        ([1, 2], [12, 13, 14, 15, 20, 21, 22, 23], [4, 4], [4, 4]),
        ([0], [10, 11], [2, 0], [2, 0]),
        ([2], [20, 21, 22, 23], [0, 4], [0, 4]),
        ([], [], [0, 0], [0, 0]),
    ],
)
def test_select_chunks_keeps_the_chosen_chunks_and_where_they_start(
    chosen: list[int], block_ids: list[int], sizes: list[int], firsts: list[int]
) -> None:
    sub = select_chunks(_two_groups(), 4, chosen)
    assert sub.block_ids.tolist() == block_ids
    assert sub.group_sizes.tolist() == sizes
    assert sub.block_indices.tolist() == firsts


# -- one check of GPU specs -----------------------------------------------------

_BAD_SPECS = [
    (STORE, GPULoadStoreSpec([0, 1, 2, 3], [2, 2]), 1, "2 groups"),
    (STORE, GPULoadStoreSpec([0, 1, 2, 3], [4], [1]), 1, "starts at block 1"),
    (STORE, GPULoadStoreSpec([0, 1, 2, 3, 4]), 2, "do not end at a chunk boundary"),
    (LOAD, GPULoadStoreSpec([0, 1, 2], [3], [2]), 2, "end at block 5"),
    (STORE, GPULoadStoreSpec([0, 1, 2, 16]), 1, "block id 16 is past the end"),
    (LOAD, GPULoadStoreSpec([5, 6, 5, 7]), 1, "block id 5 more than once"),
    (STORE, GPULoadStoreSpec([0, 1, 2, 3]), 2, "2 keys for a GPU spec of 1 chunks"),
]


@pytest.mark.parametrize(("kind", "gpu", "count", "message"), _BAD_SPECS)
async def test_the_scheduler_refuses_a_bad_spec_in_the_layouts_words(
    anyio_backend: str, kind: TransferDirection, gpu: GPULoadStoreSpec, count: int, message: str
) -> None:
    import torch

    from tiering.transfer import KVCacheTensor, KVLayout

    layout = KVLayout([KVCacheTensor(torch.zeros(16, 64, dtype=torch.uint8), 16, 64)], 4)
    scheduler = Scheduler(
        CPUOffloadingManager(8),
        lambda on_complete: ScriptedBackend(on_complete),  # type: ignore[arg-type,return-value]
        blocks_per_chunk=layout.blocks_per_chunk,
        block_bytes=layout.group_block_bytes,
        group_num_blocks=layout.group_num_blocks,
    )
    scheduler.open()
    try:
        await rig_ready(scheduler, count)
        with pytest.raises(SpecError, match=message) as ours:
            scheduler.submit_nowait(kind, keys(*range(count)), gpu)
        cpu = CPULoadStoreSpec(list(range(count)))
        src, dst = (gpu, cpu) if kind is STORE else (cpu, gpu)
        with pytest.raises(SpecError) as theirs:
            layout.plan(src, dst, num_chunks=8)
        assert str(ours.value) == str(theirs.value).replace("chunk id", "key")
        stats = scheduler.statistics()
        assert (stats.stores.queued, stats.loads.queued) == (0, 0)
    finally:
        await scheduler.aclose()


async def rig_ready(scheduler: Scheduler, count: int) -> None:
    """Make chunks ``0..count-1`` ready (a load of them then fails only on its spec)."""
    manager: CPUOffloadingManager = scheduler._manager
    output = manager.prepare_store(keys(*range(count)))
    assert output is not None
    manager.complete_store(keys(*range(count)))


# -- the planning core, without an event loop -------------------------------------


class Named(PlannedJob):
    __slots__ = ("name",)

    def __init__(self, kind: TransferDirection, name: str, *sizes: int) -> None:
        super().__init__(kind)
        self.name = name
        for i, nbytes in enumerate(sizes):
            piece = Slice(gpu=GPULoadStoreSpec([i]), cpu=CPULoadStoreSpec([i]), nbytes=nbytes)
            self.slices.append(piece)


class Backend:
    """A submit function for `Planner.dispatch`: records, and refuses when told."""

    def __init__(self, planner: Planner[Named]) -> None:
        self.planner = planner
        self.log: list[str] = []
        self.at: dict[str, tuple[Named, Slice]] = {}
        self.full = False
        self.fails: set[str] = set()

    def __call__(self, job: Named, piece: Slice) -> bool:
        name = f"{job.name}{piece.gpu.block_ids[0]}"
        if self.full:
            return False
        if name in self.fails:  # refused outright: the shell fails it at once
            self.planner.complete(job, piece, ok=False, error="refused")
            return True
        self.log.append(name)
        self.at[name] = (job, piece)
        return True

    def dispatch(self) -> list[str]:
        before = len(self.log)
        self.planner.dispatch(self)
        return self.log[before:]

    def finish(self, name: str, *, ok: bool = True) -> bool:
        job, piece = self.at.pop(name)
        return self.planner.complete(job, piece, ok=ok, error=None if ok else "boom")


def planner(**limits: int) -> tuple[Planner[Named], Backend]:
    plan: Planner[Named] = Planner(
        SchedulerLimits(**limits), blocks_per_chunk=1, block_bytes=[CHUNK], group_num_blocks=[64]
    )
    return plan, Backend(plan)


def test_plan_loads_go_first_and_each_direction_has_its_budget() -> None:
    plan, backend = planner(max_inflight_bytes=200)
    for job in (
        Named(STORE, "s", 100),
        Named(STORE, "t", 100),
        Named(STORE, "u", 200),
        Named(LOAD, "l", 150),
        Named(LOAD, "m", 100),
    ):
        plan.enqueue(job)
    assert backend.dispatch() == ["l0", "s0", "t0"]  # m: 150 + 100 > 200
    assert (plan.inflight_bytes(LOAD), plan.inflight_bytes(STORE)) == (150, 200)
    assert (plan.queued(LOAD), plan.queued(STORE), plan.in_flight(STORE)) == (1, 1, 2)
    assert backend.finish("s0")
    assert backend.dispatch() == []  # 100 + 200 > 200
    backend.finish("t0")
    backend.finish("l0")
    assert backend.dispatch() == ["m0", "u0"]


def test_plan_a_slice_larger_than_the_budget_goes_alone() -> None:
    plan, backend = planner(max_inflight_bytes=50)
    plan.enqueue(Named(STORE, "a", 150))
    plan.enqueue(Named(STORE, "b", 10))
    assert backend.dispatch() == ["a0"]
    assert backend.dispatch() == []
    backend.finish("a0")
    assert backend.dispatch() == ["b0"]


def test_plan_serves_load_slices_round_robin_within_max_load_slices() -> None:
    plan, backend = planner(max_load_slices=1)
    for job in (Named(LOAD, "a", 1, 1, 1), Named(LOAD, "b", 1, 1), Named(LOAD, "c", 1)):
        plan.enqueue(job)
    order = []
    while sent := backend.dispatch():
        assert len(sent) == 1
        order += sent
        backend.finish(sent[0])
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2"]
    assert not plan.busy


def test_plan_hands_over_up_to_max_load_slices_at_once() -> None:
    plan, backend = planner(max_load_slices=2)
    plan.enqueue(Named(LOAD, "a", 1, 1, 1))
    plan.enqueue(Named(STORE, "s", 1, 1))  # a store is one slice in the shell; any number here
    assert backend.dispatch() == ["a0", "a1", "s0", "s1"]
    assert plan.inflight_slices(LOAD) == 2
    backend.finish("a1")
    assert backend.dispatch() == ["a2"]


def test_plan_has_room_while_fewer_than_max_queued_jobs_wait() -> None:
    plan, backend = planner(max_queued_jobs=2, max_load_slices=1)
    plan.enqueue(Named(LOAD, "a", 1, 1))
    plan.enqueue(Named(LOAD, "b", 1))
    assert not plan.has_room(LOAD)
    assert plan.has_room(STORE)
    assert backend.dispatch() == ["a0"]
    assert not plan.has_room(LOAD)  # a still has a slice to hand over
    backend.finish("a0")
    assert backend.dispatch() == ["b0"]
    assert plan.has_room(LOAD)


def test_plan_a_full_backend_gets_the_same_slice_again_and_the_other_direction_goes() -> None:
    plan, backend = planner(max_load_slices=4)
    a, b = Named(LOAD, "a", 10, 10), Named(LOAD, "b", 10)
    for job in (a, b, Named(STORE, "s", 10)):
        plan.enqueue(job)
    backend.full = True
    assert backend.dispatch() == []
    assert not a.started
    assert (plan.queued(LOAD), plan.inflight_bytes(LOAD), plan.in_flight(LOAD)) == (2, 0, 0)
    backend.full = False
    assert backend.dispatch() == ["a0", "b0", "a1", "s0"]

    plan, backend = planner(max_load_slices=4)
    a, b = Named(LOAD, "a", 10, 10), Named(LOAD, "b", 10)
    for job in (a, b, Named(STORE, "s", 10)):
        plan.enqueue(job)
    refuse_second = iter([True, False])
    accept = backend.__call__
    plan.dispatch(lambda job, piece: next(refuse_second, True) and accept(job, piece))
    assert backend.log == ["a0", "s0"]  # b0 refused: loads wait, stores still go
    assert (b.started, plan.inflight_bytes(LOAD), plan.in_flight(LOAD)) == (False, 10, 1)
    assert backend.dispatch() == ["b0", "a1"]  # b0 first again: the queue is as it was


def test_plan_a_slice_refused_outright_fails_its_job_and_frees_its_room() -> None:
    plan, backend = planner(max_load_slices=2)
    a, b = Named(LOAD, "a", 1, 1, 1), Named(LOAD, "b", 1)
    plan.enqueue(a)
    plan.enqueue(b)
    backend.fails.add("b0")
    assert backend.dispatch() == ["a0", "a1"]
    backend.fails = {"a2"}
    backend.finish("a0")
    assert backend.dispatch() == []  # b0 was refused; a2 refused and a failed
    assert a.error == "refused"
    assert b.error == "refused"
    assert not a.slices
    assert plan.queued(LOAD) == 0
    assert backend.finish("a1")  # a ends with its last slice at the backend


def test_plan_a_failed_slice_drops_the_rest_of_its_job() -> None:
    plan, backend = planner(max_load_slices=1)
    a = Named(LOAD, "a", 1, 1, 1)
    plan.enqueue(a)
    plan.enqueue(Named(LOAD, "b", 1))
    assert backend.dispatch() == ["a0"]
    assert backend.finish("a0", ok=False)  # the job has ended: nothing else of it runs
    assert a.error == "boom"
    assert backend.dispatch() == ["b0"]


def test_plan_cancels_only_jobs_not_started() -> None:
    plan, backend = planner(max_load_slices=1)
    a, b, c = Named(LOAD, "a", 1, 1), Named(LOAD, "b", 1), Named(STORE, "c", 1)
    for job in (a, b):
        plan.enqueue(job)
    backend.dispatch()
    assert plan.unstarted() == [b]
    assert not plan.cancel(a)
    assert not plan.cancel(c)  # never queued
    assert plan.cancel(b)
    assert not plan.cancel(b)
    assert plan.queued(LOAD) == 1  # a, with a slice to go


def test_plan_abandon_forgets_every_job() -> None:
    plan, backend = planner(max_load_slices=1)
    a, b = Named(LOAD, "a", 1, 1), Named(STORE, "b", 1)
    plan.enqueue(a)
    plan.enqueue(b)
    backend.dispatch()
    assert {job.name for job in plan.abandon([a, b])} == {"a", "b"}
    assert not plan.busy
    assert (plan.in_flight(LOAD), plan.inflight_bytes(STORE)) == (0, 0)
    assert (a.pending, len(a.slices)) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(1, 300), min_size=1, max_size=4)),
        min_size=1,
        max_size=12,
    ),
    picks=st.lists(st.integers(0, 1 << 16), max_size=80),
    budget=st.integers(1, 400),
    most=st.integers(1, 3),
)
def test_plan_keeps_its_bounds_and_runs_every_slice_once_in_order(
    jobs: list[tuple[bool, list[int]]], picks: list[int], budget: int, most: int
) -> None:
    plan, backend = planner(max_inflight_bytes=budget, max_load_slices=most)
    made = [
        Named(LOAD if load else STORE, f"j{i}.", *sizes) for i, (load, sizes) in enumerate(jobs)
    ]
    for job in made:
        plan.enqueue(job)
    picks_left = iter(picks)
    while True:
        sent = backend.dispatch()
        kinds = [backend.at[name][0].kind for name in sent]
        assert kinds == sorted(kinds, key=lambda k: k is STORE)  # loads first
        for kind in (LOAD, STORE):
            at = [job for job, _ in backend.at.values() if job.kind is kind]
            total = sum(piece.nbytes for job, piece in backend.at.values() if job.kind is kind)
            assert plan.inflight_bytes(kind) == total
            assert total <= budget or len(at) == 1  # over the budget only alone
        assert plan.inflight_slices(LOAD) <= most
        if not backend.at:
            break
        names = sorted(backend.at)
        backend.finish(names[next(picks_left, 0) % len(names)])
    assert not plan.busy
    for i, (_, sizes) in enumerate(jobs):  # every slice once, each job's in order
        assert [name for name in backend.log if name.startswith(f"j{i}.")] == [
            f"j{i}.{n}" for n in range(len(sizes))
        ]


async def test_a_failed_job_holds_the_backends_error_with_its_type(anyio_backend: str) -> None:
    """The backend's failure crosses into the job's result as the `TransferError` it
    raised (a `CopyFailedError` carries the torch error as ``cause``), not only as text."""
    from tiering.engine import TieringEngine

    from .test_engine import CHUNK_BYTES, config, keys, kv_caches, spec

    engine = TieringEngine(
        config(),
        kv_caches(),
        cpu_bytes=8 * CHUNK_BYTES,
        backend="mock",
        backend_options={"fail": {0}},  # the backend's first job fails
    )
    async with engine:
        result = await (await engine.submit_store(keys(1), spec([0])))
        assert result.outcome is JobOutcome.FAILED
        assert isinstance(result.exception, TransferError)
        assert result.error is not None
        assert str(result.exception) in result.error
        ok = await (await engine.submit_store(keys(2), spec([1])))
        assert ok.success
        assert ok.exception is None


async def test_a_job_failed_at_submit_keeps_nothing_alive(anyio_backend: str) -> None:
    """A refusal's exception has a traceback whose frames hold the job, and the job
    holds its result, which holds the exception: a cycle only the garbage collector
    can free, so the result must be one it tracks."""
    import gc
    import weakref

    async with running(refuse=lambda gpu: True) as rig:
        result = await rig.scheduler.submit_nowait(STORE, keys(1), spec([1]))
        assert isinstance(result.exception, CopyFailedError)
        scheduler = weakref.ref(rig.scheduler)
    del rig, result
    # A callback the closing left on the loop may still hold the backend (and through
    # it the scheduler) until the loop runs it: give the loop its turns, boundedly.
    for _ in range(100):
        gc.collect()
        if scheduler() is None:
            break
        await anyio.sleep(0.01)
    assert scheduler() is None
