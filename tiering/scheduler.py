"""The async shell around the chunk manager and a transfer backend.

Design note: back-pressure, ordering and the convoy.

- Everything here runs on the event loop thread, without locks. A backend
  completes jobs in its own threads and drops each result in an inbox, waking
  the loop with its ``run_sync_soon`` (non-blocking on asyncio and trio; one
  wake-up per burst); `_drain_inbox` then updates the manager and wakes the
  waiters. No task polls.
- Dispatch is synchronous: `submit_nowait` and every completion call `_pump`,
  which hands queued work to the backend while the direction's budget of bytes
  in flight allows. A job larger than the whole budget still goes when nothing
  else of its direction is in flight, so nothing waits forever.
- Loads are on the time-to-first-token path: `_pump` serves the load queue
  before the store queue, and the two directions have separate budgets, so a
  burst of stores never delays a load.
- Convoy: a load is cut into slices of at most ``slice_chunks`` chunks, and the
  load queue is served round-robin, one slice per job per turn. A small load
  submitted behind a large one (two requests sharing a prefix, say) waits for
  one slice of it, not for the whole job.
- Bounded: each direction queues at most ``max_queued_jobs`` jobs not yet fully
  dispatched; `submit_nowait` raises `anyio.WouldBlock` past that and `submit`
  waits for room.
- Cancelling a job that has not started removes it and undoes its manager
  state; a job with bytes in flight finishes, and its result stays consistent.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import numpy as np

from tiering._types import OffloadKey
from tiering.cpu.common import CPULoadStoreSpec
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import CapacityError, ConfigError, ResourceClosedError, SpecError
from tiering.specs import GPULoadStoreSpec, IntArray, first_duplicate, id_bounds
from tiering.transfer.base import CompletionCallback, TransferBackend, TransferResult
from tiering.transfer.layout import TransferDirection

__all__ = [
    "LATENCY_BUCKETS",
    "DirectionStatistics",
    "JobHandle",
    "JobKind",
    "JobOutcome",
    "JobResult",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerStatistics",
    "chunk_block_ranges",
    "manager_job",
    "select_chunks",
]

JobKind = TransferDirection

logger = logging.getLogger(__name__)

_NO_ROOM = "no room in the CPU tier: every chunk is pinned, being written or offered by this store"


class JobOutcome(enum.StrEnum):
    """How a job ended."""

    SUCCEEDED = "succeeded"  # every byte landed (or there was nothing to copy)
    FAILED = "failed"  # the backend reported a failure; see ``error``
    NO_ROOM = "no_room"  # a store found no room in the tier: nothing was copied
    CANCELLED = "cancelled"  # removed before any byte moved (by the caller or by close)


class JobResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The result of a store or load job."""

    job_id: int
    kind: JobKind
    outcome: JobOutcome
    chunks: int  # chunks the job copied (or would have)
    nbytes: int  # bytes moved on success
    seconds: float  # time spent copying (sum over the job's slices)
    latency: float  # from submission to completion
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.outcome is JobOutcome.SUCCEEDED


class SchedulerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds of the scheduler (read from ``extra_config`` by the engine)."""

    max_queued_jobs: int = 1024  # per direction, not yet fully dispatched
    max_inflight_bytes: int = 256 << 20  # per direction, handed to the backend
    slice_chunks: int = 16  # chunks per load slice (the convoy bound)
    max_load_slices: int = 2  # load slices at the backend at once (the convoy bound)

    def __post_init__(self) -> None:
        for name in ("max_queued_jobs", "max_inflight_bytes", "slice_chunks", "max_load_slices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"scheduler {name} must be a positive integer, got {value!r}")


#: Upper bounds (seconds) of the job latency histogram's buckets; the last
#: bucket of `DirectionStatistics.latency_buckets` counts everything above.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


class DirectionStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Counts of one direction. ``latency_buckets`` holds, per bucket of
    `LATENCY_BUCKETS` (and one more for anything slower), how many started jobs
    ended (succeeded or failed) with a latency from submission in that bucket;
    ``latency_seconds`` is the sum of those latencies."""

    queued: int
    in_flight: int
    inflight_bytes: int
    succeeded: int
    failed: int
    cancelled: int
    no_room: int
    bytes: int
    seconds: float
    latency_buckets: tuple[int, ...]
    latency_seconds: float


class SchedulerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    state: str
    stores: DirectionStatistics
    loads: DirectionStatistics


class _State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _Slice(msgspec.Struct, gc=False):
    gpu: GPULoadStoreSpec
    cpu: CPULoadStoreSpec
    nbytes: int


class _Job:
    __slots__ = (
        "blocks",
        "chunks",
        "done",
        "error",
        "id",
        "keys",
        "kind",
        "nbytes",
        "pending",
        "result",
        "seconds",
        "slices",
        "started",
        "submitted",
    )

    def __init__(self, job_id: int, kind: JobKind, keys: tuple[OffloadKey, ...]) -> None:
        self.id = job_id
        self.kind = kind
        self.keys = keys
        self.slices: deque[_Slice] = deque()
        self.blocks: IntArray | None = None  # GPU blocks a store reads (for flush)
        self.chunks = 0
        self.nbytes = 0
        self.pending = 0  # slices handed to the backend and not completed
        self.started = False
        self.seconds = 0.0
        self.error: str | None = None
        self.submitted = time.perf_counter()
        self.done: anyio.Event | None = None  # made when someone waits (most never do)
        self.result: JobResult | None = None

    async def wait(self) -> JobResult:
        if self.result is None:
            if self.done is None:
                self.done = anyio.Event()
            await self.done.wait()
        else:
            # A checkpoint even when finished (trio's rule): a task awaiting a
            # stream of jobs that end at submission must let the loop run the
            # completions (and every other task).
            await anyio.lowlevel.checkpoint()
        assert self.result is not None  # set before done is
        return self.result


class JobHandle:
    """A submitted job. ``await handle`` gives its `JobResult`."""

    __slots__ = ("_job", "_scheduler")

    def __init__(self, job: _Job, scheduler: Scheduler) -> None:
        self._job = job
        self._scheduler = scheduler

    @property
    def job_id(self) -> int:
        return self._job.id

    @property
    def kind(self) -> JobKind:
        return self._job.kind

    def done(self) -> bool:
        return self._job.result is not None

    def result(self) -> JobResult:
        """The result of a finished job; `RuntimeError` if it has not finished."""
        if self._job.result is None:
            raise RuntimeError(f"job {self._job.id} has not finished; await it first")
        return self._job.result

    def cancel(self) -> bool:
        """Remove the job if no byte of it has been handed to the backend yet.

        Returns ``True`` if it was cancelled (its result says so), ``False`` if
        it is already running or finished.
        """
        if self._job.started or self._job.result is not None:
            return False
        return self._scheduler._cancel(self._job)

    async def wait(self) -> JobResult:
        """The job's result, once it has finished (returns at once if it has)."""
        return await self._job.wait()

    def __await__(self) -> Generator[Any, None, JobResult]:
        return self._job.wait().__await__()

    def __repr__(self) -> str:
        job = self._job
        if job.result is not None:
            state = job.result.outcome.value
        else:
            state = "running" if job.started else "queued"
        return f"<JobHandle {job.kind.value} #{job.id} [{state}]>"


class _Direction:
    """Queue, budget and counters of one direction."""

    __slots__ = (
        "bytes",
        "cancelled",
        "failed",
        "in_flight",
        "inflight_bytes",
        "latency",
        "latency_seconds",
        "no_room",
        "queue",
        "room",
        "seconds",
        "slices",
        "succeeded",
    )

    def __init__(self) -> None:
        self.queue: deque[_Job] = deque()
        self.room = anyio.Event()  # set when the queue shrinks; replaced after
        self.in_flight = 0  # jobs with at least one slice at the backend
        self.slices = 0  # slices at the backend
        self.inflight_bytes = 0
        self.succeeded = self.failed = self.cancelled = self.no_room = self.bytes = 0
        self.seconds = 0.0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_seconds = 0.0

    def statistics(self) -> DirectionStatistics:
        return DirectionStatistics(
            queued=len(self.queue),
            in_flight=self.in_flight,
            inflight_bytes=self.inflight_bytes,
            succeeded=self.succeeded,
            failed=self.failed,
            cancelled=self.cancelled,
            no_room=self.no_room,
            bytes=self.bytes,
            seconds=self.seconds,
            latency_buckets=tuple(self.latency),
            latency_seconds=self.latency_seconds,
        )


def manager_job(job_id: int) -> tuple[str, int]:
    """The id under which the scheduler's job ``job_id`` holds state in the manager."""
    return ("scheduler", job_id)


def chunk_block_ranges(
    spec: GPULoadStoreSpec, blocks_per_chunk: int
) -> list[tuple[int, int, int, int]]:
    """Every chunk of ``spec``, group after group: ``(start, stop, group, first)``.

    ``spec.block_ids[start:stop]`` are the chunk's blocks and ``first`` the
    position in the request of its first block. Group ``g``'s first chunk
    holds ``blocks_per_chunk - block_indices[g] % blocks_per_chunk`` blocks
    (fewer if the group has fewer).
    """
    chunks = []
    start = 0
    sizes, firsts = spec.group_sizes.tolist(), spec.block_indices.tolist()
    for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
        pos, stop = start, start + size
        while pos < stop:
            end = min(pos + blocks_per_chunk - first % blocks_per_chunk, stop)
            chunks.append((pos, end, group, first))
            first += end - pos
            pos = end
        start = stop
    return chunks


def select_chunks(
    spec: GPULoadStoreSpec, blocks_per_chunk: int, chosen: Sequence[int]
) -> GPULoadStoreSpec:
    """The sub-spec of ``spec`` holding its chunks ``chosen`` (indices, in order)."""
    chunks = chunk_block_ranges(spec, blocks_per_chunk)
    num_groups = len(spec.group_sizes)
    sizes = [0] * num_groups
    firsts = [0] * num_groups
    parts = []
    for i in chosen:
        start, stop, group, first = chunks[i]
        if sizes[group] == 0:
            firsts[group] = first
        sizes[group] += stop - start
        parts.append(spec.block_ids[start:stop])
    block_ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return GPULoadStoreSpec(block_ids, sizes, firsts)


class Scheduler:
    """Queues store and load jobs and runs them on a transfer backend.

    ``backend_factory`` is called once, at `open`, with the completion
    callback the backend must call for every result. ``on_stored`` (if given)
    is called with the keys of every store job that landed, once they are
    ready. ``block_bytes[g]`` is the size of one block of group ``g`` over all
    its tensors (for the budget).
    Must be used from one event loop; `open` and `aclose` bracket its life.
    """

    def __init__(
        self,
        manager: CPUOffloadingManager,
        backend_factory: Callable[[CompletionCallback], TransferBackend],
        *,
        blocks_per_chunk: int,
        block_bytes: Sequence[int],
        group_num_blocks: Sequence[int],
        limits: SchedulerLimits | None = None,
        on_stored: Callable[[tuple[OffloadKey, ...]], object] | None = None,
    ) -> None:
        self._manager = manager
        self._on_stored = on_stored
        self._backend_factory = backend_factory
        self._backend: TransferBackend | None = None
        self._bpc = blocks_per_chunk
        self._block_bytes = tuple(block_bytes)
        self._group_num_blocks = tuple(group_num_blocks)
        self.limits = limits or SchedulerLimits()
        self._dirs = {kind: _Direction() for kind in JobKind}
        self._job_ids = itertools.count()
        self._slice_ids = itertools.count()
        self._running: dict[int, tuple[_Job, _Slice]] = {}  # backend job id -> slice
        self._stores: dict[int, _Job] = {}  # store jobs not finished (for flush)
        self._state = _State.CLOSED
        self._opened = False
        self._idle = anyio.Event()  # set when no slice is at the backend
        self._closed = anyio.Event()
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._inbox: deque[TransferResult] = deque()  # results from backend threads
        self._wakeup_pending = False

    @property
    def busy(self) -> bool:
        """Whether any job is queued or running."""
        return bool(self._running) or any(d.queue for d in self._dirs.values())

    @property
    def backend(self) -> TransferBackend:
        if self._backend is None:
            raise ResourceClosedError("the scheduler is not open")
        return self._backend

    # -- life -----------------------------------------------------------------

    def open(self) -> None:
        """Start: build the backend, bound to the running event loop."""
        if self._opened:
            raise ResourceClosedError("a scheduler is opened once; build a new one")
        self._opened = True
        self._token = anyio.lowlevel.current_token()
        self._backend = self._backend_factory(self._from_backend)
        self._state = _State.OPEN

    async def aclose(self) -> None:
        """Cancel queued jobs, let running ones finish, close the backend. Idempotent."""
        if self._state is not _State.OPEN:
            if self._state is _State.CLOSING:
                await self._closed.wait()
            else:
                await anyio.lowlevel.checkpoint()
            return
        self._state = _State.CLOSING
        try:
            for direction in self._dirs.values():
                for job in [j for j in direction.queue if not j.started]:
                    self._cancel(job)
                direction.room.set()
            self._pump()  # started loads still have slices to hand over
            with anyio.CancelScope(shield=True):  # running jobs finish, even on cancellation
                while self._running or any(d.queue for d in self._dirs.values()):
                    self._idle = anyio.Event()
                    await self._idle.wait()
        finally:
            backend, self._backend = self._backend, None
            if backend is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(backend.close)
            self._drain_inbox()
            self._abandon("the scheduler closed before the job could finish")
            self._state = _State.CLOSED
            self._closed.set()

    def _abandon(self, reason: str) -> None:
        """End every job still unfinished as failed, undoing its manager state."""
        jobs = {id(job): job for job, _ in self._running.values()}
        for direction in self._dirs.values():
            jobs.update((id(job), job) for job in direction.queue)
            direction.queue.clear()
            direction.room.set()
        self._running.clear()
        for job in jobs.values():
            job.slices.clear()
            job.pending = 0
            if job.result is None:
                self._end(job, ok=False, error=reason)

    # -- submission ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ResourceClosedError(f"the scheduler is {self._state.value}; no new jobs")

    def _check_spec(self, kind: JobKind, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec) -> int:
        """Refuse a spec the layout would refuse, before the manager changes anything.

        Returns the bytes the spec covers (for the in-flight budget).
        """
        sizes = gpu.group_sizes.tolist()
        if len(sizes) != len(self._group_num_blocks):
            raise SpecError(
                f"the GPU spec has {len(sizes)} groups but the KV cache has "
                f"{len(self._group_num_blocks)}; give one group size per KV-cache group"
            )
        bpc = self._bpc
        store = kind is JobKind.STORE
        whole = len(sizes) == 1  # one group: its ids are the whole array
        chunks = nbytes = start = 0
        for g, first in enumerate(gpu.block_indices.tolist()):
            size = sizes[g]
            if not size:
                continue
            if store and first % bpc:
                raise SpecError(
                    f"a store of group {g} starts at block {first}, inside a chunk of {bpc} "
                    "blocks; stores copy whole chunks"
                )
            if (first + size) % bpc:
                raise SpecError(
                    f"group {g}'s blocks end at block {first + size}, inside a chunk of {bpc} "
                    "blocks; a job ends on a chunk boundary"
                )
            chunks += -(-(first % bpc + size) // bpc)
            nbytes += size * self._block_bytes[g]
            ids = gpu.block_ids if whole else gpu.block_ids[start : start + size]
            top = id_bounds(ids)[1]
            if top >= self._group_num_blocks[g]:
                raise SpecError(
                    f"GPU block id {top} of group {g} is past the end of the KV cache "
                    f"({self._group_num_blocks[g]} blocks)"
                )
            if not store and (dup := first_duplicate(ids)) is not None:
                raise SpecError(
                    f"a load names GPU block id {dup} of group {g} more than once; "
                    "every destination block must be distinct"
                )
            start += size
        if chunks != len(keys):
            raise SpecError(
                f"{len(keys)} keys for a GPU spec of {chunks} chunks "
                f"({len(gpu.block_ids)} blocks, group_sizes {sizes}, "
                f"{self._bpc} blocks per chunk); give one key per chunk"
            )
        return nbytes

    def _bytes_of(self, gpu: GPULoadStoreSpec) -> int:
        return sum(n * b for n, b in zip(gpu.group_sizes.tolist(), self._block_bytes, strict=False))

    def submit_nowait(
        self, kind: JobKind, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec
    ) -> JobHandle:
        """Queue a store or load of ``keys`` (one per chunk of ``gpu``); never waits.

        Raises `anyio.WouldBlock` when the direction's queue is full, `SpecError`
        for a spec that does not fit the keys or the KV cache, the manager's
        errors for loads of chunks that are not ready, `ResourceClosedError`
        after close. A store of keys all present, or one that finds no room,
        returns an already finished handle.
        """
        self._check_open()
        direction = self._dirs[kind]
        if len(direction.queue) >= self.limits.max_queued_jobs:
            raise anyio.WouldBlock
        nbytes = self._check_spec(kind, keys, gpu)
        job = _Job(next(self._job_ids), kind, tuple(keys))
        handle = JobHandle(job, self)
        if kind is JobKind.STORE:
            output = self._manager.prepare_store(keys, job=manager_job(job.id))
            if output is None:
                self._finish(job, JobOutcome.NO_ROOM, _NO_ROOM)
                return handle
            if not output.keys_to_store:
                self._finish(job, JobOutcome.SUCCEEDED)
                return handle
            if len(output.keys_to_store) == len(keys):
                sub = gpu
                job.nbytes = nbytes
            else:
                index: dict[OffloadKey, int] = {}
                for i, key in enumerate(keys):
                    index.setdefault(key, i)
                chosen = [index[key] for key in output.keys_to_store]
                sub = select_chunks(gpu, self._bpc, chosen)
                job.nbytes = self._bytes_of(sub)
            job.keys = output.keys_to_store
            job.blocks = sub.block_ids
            job.chunks = len(job.keys)
            job.slices.append(_Slice(gpu=sub, cpu=output.store_spec, nbytes=job.nbytes))
            self._stores[job.id] = job
        else:
            cpu = self._manager.prepare_load(keys, job=manager_job(job.id))
            job.chunks = len(keys)
            step = self.limits.slice_chunks
            if len(keys) <= step:
                job.slices.append(_Slice(gpu=gpu, cpu=cpu, nbytes=nbytes))
            else:
                for lo in range(0, len(keys), step):
                    span = range(lo, min(lo + step, len(keys)))
                    sub = select_chunks(gpu, self._bpc, span)
                    part = CPULoadStoreSpec.from_valid_ids(cpu.chunk_ids[lo : lo + step].tolist())
                    job.slices.append(_Slice(gpu=sub, cpu=part, nbytes=self._bytes_of(sub)))
            job.nbytes = sum(s.nbytes for s in job.slices)
        direction.queue.append(job)
        self._pump()
        return handle

    async def submit(
        self, kind: JobKind, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec
    ) -> JobHandle:
        """As `submit_nowait`, but waits for room in the queue instead of raising.

        Always a checkpoint, taken before the job is queued: a cancellation
        raises and queues nothing; once queued, the handle is returned without
        another await (so no cancellation, of any kind, can lose it).
        """
        return await self.submit_waiting(kind, lambda: self.submit_nowait(kind, keys, gpu))

    async def submit_waiting(self, kind: JobKind, submit: Callable[[], JobHandle]) -> JobHandle:
        """Call ``submit`` (a `submit_nowait` of direction ``kind``) until it finds room.

        For owners that do more than `submit_nowait` at submission (the engine
        describes a store's blocks before anything can complete it).
        """
        # Yield first: a job that ends at submission (keys present, no room)
        # must still let the loop run; after a successful submit nothing is
        # awaited (asyncio's own cancellation passes through anyio's shields).
        await anyio.lowlevel.checkpoint()
        direction = self._dirs[kind]
        while True:
            try:
                return submit()
            except anyio.WouldBlock:
                if direction.room.is_set():
                    direction.room = anyio.Event()
                await direction.room.wait()

    async def flush(self, block_ids: Sequence[int] | IntArray) -> None:
        """Return once no store submitted before this call still reads ``block_ids``.

        Always a checkpoint, even when no store reads them.
        """
        if not self._stores:
            await anyio.lowlevel.checkpoint()
            return
        # A set, and each store's blocks as a list: numpy's isin costs tens of
        # microseconds per call whatever the size, and a flush follows every request.
        wanted = set(np.asarray(block_ids, dtype=np.int64).tolist())
        waiting = [
            job
            for job in self._stores.values()
            if job.blocks is not None and not wanted.isdisjoint(job.blocks.tolist())
        ]
        if not waiting:
            await anyio.lowlevel.checkpoint()
        for job in waiting:
            await job.wait()

    # -- dispatch and completion ---------------------------------------------

    def _pump(self) -> None:
        backend = self._backend
        if backend is None:
            return
        budget = self.limits.max_inflight_bytes
        for kind in (JobKind.LOAD, JobKind.STORE):  # loads first
            direction = self._dirs[kind]
            queue = direction.queue
            # The backend runs a direction in order: a load slice handed over
            # is a slice every later load waits for, so loads keep few there.
            most = self.limits.max_load_slices if kind is JobKind.LOAD else None
            shrunk = False
            while queue:
                job = queue[0]
                piece = job.slices[0]
                if direction.inflight_bytes and direction.inflight_bytes + piece.nbytes > budget:
                    break
                if most is not None and direction.slices >= most:
                    break
                if not self._dispatch(backend, direction, job, piece):
                    break  # the backend is full: the next completion pumps again
                queue.popleft()
                job.slices.popleft()
                if job.slices:
                    queue.append(job)  # round-robin: one slice per job per turn
                else:
                    shrunk = True
            if shrunk:
                direction.room.set()

    def _dispatch(
        self, backend: TransferBackend, direction: _Direction, job: _Job, piece: _Slice
    ) -> bool:
        """Hand ``piece`` to the backend; ``False`` (and nothing done) if it is full."""
        slice_id = next(self._slice_ids)
        src, dst = (piece.gpu, piece.cpu) if job.kind is JobKind.STORE else (piece.cpu, piece.gpu)
        error: str | None = None
        try:
            backend.submit(slice_id, src, dst)
        except CapacityError:
            if self._running:
                return False  # back-pressure from the backend, not a failure
            error = "the backend refused a job with nothing else in flight"
        except Exception as exc:  # a spec the backend refuses: the job fails, we go on
            error = f"{type(exc).__name__}: {exc}"
        if not job.started:
            job.started = True
            direction.in_flight += 1
        self._running[slice_id] = (job, piece)
        direction.inflight_bytes += piece.nbytes
        direction.slices += 1
        job.pending += 1
        if error is not None:
            self._complete_slice(slice_id, success=False, seconds=0.0, error=error)
        return True

    def _from_backend(self, result: TransferResult) -> None:
        """The backend's completion callback: runs in a backend thread.

        Results go to an inbox (``deque.append`` is atomic); the loop is woken
        only when no wake-up is already pending, so a burst of completions
        costs one wake-up. Clearing the flag before draining means a result
        appended during a drain schedules another: none is ever stranded.
        """
        self._inbox.append(result)
        if not self._wakeup_pending:
            self._wakeup_pending = True
            token = self._token
            if token is not None:
                token.backend_class.run_sync_soon(self._drain_inbox, (), token.native_token)

    def _drain_inbox(self) -> None:
        """Apply the results in the inbox (a loop callback: it must never raise)."""
        self._wakeup_pending = False
        inbox = self._inbox
        try:
            while inbox:
                result = inbox.popleft()
                try:
                    self._complete_slice(
                        result.job_id,
                        success=result.success,
                        seconds=result.seconds,
                        error=result.error,
                    )
                except Exception:  # a bug: say so, keep every other job going
                    logger.exception("scheduler: completing transfer %d failed", result.job_id)
            self._pump()
        except Exception:
            logger.exception("scheduler: dispatching after a completion failed")

    def _complete_slice(
        self, slice_id: int, *, success: bool, seconds: float, error: str | None
    ) -> None:
        entry = self._running.pop(slice_id, None)
        if entry is None:
            return
        job, piece = entry
        direction = self._dirs[job.kind]
        direction.inflight_bytes -= piece.nbytes
        direction.slices -= 1
        job.pending -= 1
        job.seconds += seconds
        if not success and job.error is None:
            job.error = error or "transfer failed"
            if job.slices:  # the job has failed: its remaining slices need not run
                job.slices.clear()
                with contextlib.suppress(ValueError):
                    direction.queue.remove(job)
                direction.room.set()
        if job.pending == 0 and not job.slices:
            self._end(job, ok=job.error is None, error=job.error)
        if not self._running:
            self._idle.set()

    def _end(self, job: _Job, *, ok: bool, error: str | None) -> None:
        """Release a started job's manager state and finish it."""
        self._dirs[job.kind].in_flight -= 1
        if job.kind is JobKind.STORE:
            self._manager.complete_store(job=manager_job(job.id), success=ok)
            if ok and self._on_stored is not None:
                try:
                    self._on_stored(job.keys)
                except Exception:  # the owner's hook: say so, never lose the job
                    logger.exception("scheduler: on_stored hook failed for job %d", job.id)
        else:
            self._manager.complete_load(job=manager_job(job.id))
        self._finish(job, JobOutcome.SUCCEEDED if ok else JobOutcome.FAILED, error)

    def _finish(self, job: _Job, outcome: JobOutcome, error: str | None = None) -> None:
        direction = self._dirs[job.kind]
        if outcome is JobOutcome.SUCCEEDED:
            direction.succeeded += 1
            direction.bytes += job.nbytes
            direction.seconds += job.seconds
        elif outcome is JobOutcome.FAILED:
            direction.failed += 1
        elif outcome is JobOutcome.CANCELLED:
            direction.cancelled += 1
        else:
            direction.no_room += 1
        self._stores.pop(job.id, None)
        latency = time.perf_counter() - job.submitted
        if job.started:
            direction.latency[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
            direction.latency_seconds += latency
        job.result = JobResult(
            job_id=job.id,
            kind=job.kind,
            outcome=outcome,
            chunks=job.chunks,
            nbytes=job.nbytes if outcome is JobOutcome.SUCCEEDED else 0,
            seconds=job.seconds,
            latency=latency,
            error=error,
        )
        if job.done is not None:
            job.done.set()

    def _cancel(self, job: _Job) -> bool:
        direction = self._dirs[job.kind]
        try:
            direction.queue.remove(job)
        except ValueError:
            return False
        if job.kind is JobKind.STORE:
            self._manager.complete_store(job=manager_job(job.id), success=False)
        else:
            self._manager.complete_load(job=manager_job(job.id))
        self._finish(job, JobOutcome.CANCELLED, "cancelled before it started")
        direction.room.set()
        return True

    # -- seeing state ---------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            state=self._state.value,
            stores=self._dirs[JobKind.STORE].statistics(),
            loads=self._dirs[JobKind.LOAD].statistics(),
        )

    def __repr__(self) -> str:
        s, ld = self._dirs[JobKind.STORE], self._dirs[JobKind.LOAD]
        return (
            f"<Scheduler [{self._state.value}; loads: {len(ld.queue)} queued, {ld.in_flight} "
            f"running; stores: {len(s.queue)} queued, {s.in_flight} running]>"
        )
