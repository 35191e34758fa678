"""The scheduler's async shell: the manager, the backend and the event loop.

Design note: what the shell does, and what it leaves to the planner.

- `Planner` (`tiering.scheduler._plan`) decides: which queue a job joins, when
  a direction has room, which slice goes next. The shell does what it decides:
  it prepares and completes the jobs' chunks in the manager, hands slices to
  the backend, turns completions into results, and wakes whoever waits.
- Everything here runs on the event loop thread, without locks. A backend
  completes jobs in its own threads and drops each result in an inbox, waking
  the loop with its ``run_sync_soon`` (non-blocking on asyncio and trio; one
  wake-up per burst); `_drain_inbox` then completes the slices and dispatches
  again. No task polls.
- Dispatch is synchronous: `submit_nowait` and every burst of completions ask
  the planner to dispatch, so a job goes out as soon as the budgets allow.
- Back-pressure: `submit_nowait` raises `anyio.WouldBlock` when the direction's
  queue is full; `submit` waits for room instead. A full backend holds slices
  back (the next completion dispatches again); a slice the backend refuses with
  nothing else in flight, or refuses outright, fails its job.
- Cancelling a job that has not started removes it and undoes its manager
  state; a job with bytes in flight finishes, and its result stays consistent.
- Every awaitable is a checkpoint, even on its fast path (trio's rule), and a
  submission checkpoints *before* it queues and never awaits after: a
  cancellation either queues nothing or returns the handle.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import numpy as np

from tiering._closing import AsyncLifecycle
from tiering._state import ResourceState
from tiering._types import OffloadKey, TransferDirection
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import (
    CapacityError,
    ResourceClosedError,
    TransferError,
    failure_text,
    transfer_error,
)
from tiering.hints import Hint
from tiering.scheduler._jobs import (
    DirectionStatistics,
    JobHandle,
    JobOutcome,
    SchedulerStatistics,
    _Counts,
    _Job,
    manager_job,
)
from tiering.scheduler._plan import Planner, SchedulerLimits, Slice
from tiering.specs import GPULoadStoreSpec, IntArray

if TYPE_CHECKING:  # the backend is passed in: importing tiering.transfer would load torch
    from tiering.transfer.base import CompletionCallback, TransferBackend, TransferResult

__all__ = ["Scheduler"]

logger = logging.getLogger(__name__)

_NO_ROOM = "no room in the CPU tier: every chunk is pinned, being written or offered by this store"


class Scheduler:
    """Queues store and load jobs and runs them on a transfer backend.

    ``backend_factory`` is called once, at `open`, with the completion
    callback the backend must call for every result. ``on_stored`` (if given)
    is called with the keys every store job wrote, once they are ready, and the
    hint it was submitted with (never for a store that failed). ``block_bytes[g]``
    is the size of one block of group ``g`` over all its tensors (for the budget).
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
        on_stored: Callable[[tuple[OffloadKey, ...], Hint | None], object] | None = None,
    ) -> None:
        self._manager = manager
        self._on_stored = on_stored
        self._backend_factory = backend_factory
        self._backend: TransferBackend | None = None
        self.limits = limits or SchedulerLimits()
        self._plan: Planner[_Job] = Planner(
            self.limits,
            blocks_per_chunk=blocks_per_chunk,
            block_bytes=block_bytes,
            group_num_blocks=group_num_blocks,
        )
        self._counts = {kind: _Counts() for kind in TransferDirection}
        self._room = {
            kind: anyio.Event() for kind in TransferDirection
        }  # set when a queue has room
        self._waiting = 0  # submitters waiting for room
        self._job_ids = itertools.count()
        self._slice_ids = itertools.count()
        self._running: dict[int, tuple[_Job, Slice]] = {}  # backend job id -> slice
        self._stores: dict[int, _Job] = {}  # store jobs not finished (for flush)
        self._life = AsyncLifecycle("the scheduler")
        self._idle = anyio.Event()  # set when no slice is at the backend
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._inbox: deque[TransferResult] = deque()  # results from backend threads
        self._wakeup_pending = False

    @property
    def busy(self) -> bool:
        """Whether any job is queued or running."""
        return bool(self._running) or self._plan.busy

    @property
    def backend(self) -> TransferBackend:
        if self._backend is None:
            raise ResourceClosedError("the scheduler is not open")
        return self._backend

    # -- life -----------------------------------------------------------------

    def open(self) -> None:
        """Start: build the backend, bound to the running event loop."""
        if self._life.state is not ResourceState.NEW:
            raise ResourceClosedError("a scheduler is opened once; build a new one")
        self._token = anyio.lowlevel.current_token()
        self._backend = self._backend_factory(self._from_backend)
        self._life.open()

    async def aclose(self) -> None:
        """Cancel queued jobs, let running ones finish, close the backend. Idempotent."""
        was_open = self._life.is_open
        if not await self._life.begin_aclose():
            return
        if not was_open:  # never opened: nothing runs, nothing is held
            self._life.end_close()
            return
        try:
            for job in self._plan.unstarted():
                self._cancel(job)
            for room in self._room.values():
                room.set()
            self._pump()  # started loads still have slices to hand over
            with anyio.CancelScope(shield=True):  # running jobs finish, even on cancellation
                while self.busy:
                    self._idle = anyio.Event()
                    await self._idle.wait()
        finally:
            backend, self._backend = self._backend, None
            if backend is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(backend.close)
            self._drain_inbox()
            self._abandon("the scheduler closed before the job could finish")
            self._life.end_close()

    def _abandon(self, reason: str) -> None:
        """End every job still unfinished as failed, undoing its manager state."""
        running = [job for job, _ in self._running.values()]
        self._running.clear()
        for job in self._plan.abandon(running):
            if job.result is None:
                self._end(job, ok=False, error=reason)
        for room in self._room.values():
            room.set()

    # -- submission ----------------------------------------------------------

    def _check_open(self) -> None:
        self._life.check_open("no new jobs")

    def submit_nowait(
        self,
        kind: TransferDirection,
        keys: Sequence[OffloadKey],
        gpu: GPULoadStoreSpec,
        *,
        hint: Hint | None = None,
    ) -> JobHandle:
        """Queue a store or load of ``keys`` (one per chunk of ``gpu``); never waits.

        A store's ``hint`` (checked by the caller) is handed to ``on_stored``
        with the keys it wrote.

        Raises `anyio.WouldBlock` when the direction's queue is full, `SpecError`
        for a spec that does not fit the keys or the KV cache, the manager's
        errors for loads of chunks that are not ready, `ResourceClosedError`
        after close. A store of keys all present, or one that finds no room,
        returns an already finished handle.
        """
        self._check_open()
        plan = self._plan
        if not plan.has_room(kind):
            raise anyio.WouldBlock
        nbytes = plan.check(kind, gpu, len(keys))
        job = _Job(next(self._job_ids), kind, tuple(keys), hint)
        handle = JobHandle(job, self)
        if kind is TransferDirection.STORE:
            output = self._manager.prepare_store(keys, job=manager_job(job.id))
            if output is None:
                self._finish(job, JobOutcome.NO_ROOM, _NO_ROOM)
                return handle
            if not output.keys_to_store:
                self._finish(job, JobOutcome.SUCCEEDED)
                return handle
            piece = plan.store_slice(gpu, keys, output.keys_to_store, output.store_spec, nbytes)
            job.keys = output.keys_to_store
            job.blocks = piece.gpu.block_ids
            job.chunks = len(job.keys)
            job.nbytes = piece.nbytes
            job.slices.append(piece)
            self._stores[job.id] = job
        else:
            cpu = self._manager.prepare_load(keys, job=manager_job(job.id))
            job.chunks = len(keys)
            job.nbytes = plan.slice_load(job, gpu, cpu, nbytes)
        plan.enqueue(job)
        self._pump()
        return handle

    async def submit(
        self, kind: TransferDirection, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec
    ) -> JobHandle:
        """As `submit_nowait`, but waits for room in the queue instead of raising.

        Always a checkpoint, taken before the job is queued: a cancellation
        raises and queues nothing; once queued, the handle is returned without
        another await (so no cancellation, of any kind, can lose it).
        """
        return await self.submit_waiting(kind, lambda: self.submit_nowait(kind, keys, gpu))

    async def submit_waiting(
        self, kind: TransferDirection, submit: Callable[[], JobHandle]
    ) -> JobHandle:
        """Call ``submit`` (a `submit_nowait` of direction ``kind``) until it finds room.

        For owners that do more than `submit_nowait` at submission (the engine
        describes a store's blocks before anything can complete it).
        """
        # Yield first: a job that ends at submission (keys present, no room)
        # must still let the loop run; after a successful submit nothing is
        # awaited (asyncio's own cancellation passes through anyio's shields).
        await anyio.lowlevel.checkpoint()
        while True:
            try:
                return submit()
            except anyio.WouldBlock:
                room = self._room[kind]
                if room.is_set():
                    room = self._room[kind] = anyio.Event()
                self._waiting += 1
                try:
                    await room.wait()
                finally:
                    self._waiting -= 1

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
        """Hand the backend what the planner lets go; wake submitters if there is room."""
        if self._backend is None:
            return
        self._plan.dispatch(self._dispatch)
        if self._waiting:
            for kind, room in self._room.items():
                if self._plan.has_room(kind):
                    room.set()

    def _dispatch(self, job: _Job, piece: Slice) -> bool:
        """Hand ``piece`` to the backend; ``False`` (and nothing done) if it is full."""
        backend = self._backend
        if backend is None:  # closed under us (by a hook): hold the slice back
            return False
        slice_id = next(self._slice_ids)
        src, dst = (
            (piece.gpu, piece.cpu)
            if job.kind is TransferDirection.STORE
            else (piece.cpu, piece.gpu)
        )
        error: str | None = None
        failure: TransferError | None = None
        try:
            backend.submit(slice_id, src, dst)
        except CapacityError:
            if self._running:
                return False  # back-pressure from the backend, not a failure
            error = "the backend refused a job with nothing else in flight"
            failure = TransferError(error)
        except Exception as exc:  # a spec the backend refuses: the job fails, we go on
            error = failure_text(exc)
            failure = transfer_error(exc, slice_id)
        self._running[slice_id] = (job, piece)
        if error is not None:
            self._complete_slice(
                slice_id, success=False, seconds=0.0, error=error, exception=failure
            )
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
                        exception=result.exception,
                    )
                except Exception:  # a bug: say so, keep every other job going
                    logger.exception("scheduler: completing transfer %d failed", result.job_id)
            self._pump()
        except Exception:
            logger.exception("scheduler: dispatching after a completion failed")

    def _complete_slice(
        self,
        slice_id: int,
        *,
        success: bool,
        seconds: float,
        error: str | None,
        exception: TransferError | None = None,
    ) -> None:
        entry = self._running.pop(slice_id, None)
        if entry is None:
            return
        job, piece = entry
        job.seconds += seconds
        if not success and job.error is None:  # the planner keeps the first failure's text
            job.exception = exception
        if self._plan.complete(job, piece, success, error):
            self._end(job, ok=job.error is None, error=job.error)
        if not self._running:
            self._idle.set()

    def _end(self, job: _Job, *, ok: bool, error: str | None) -> None:
        """Release a started job's manager state and finish it."""
        if job.kind is TransferDirection.STORE:
            self._manager.complete_store(job=manager_job(job.id), success=ok)
            if ok and self._on_stored is not None:
                try:
                    self._on_stored(job.keys, job.hint)
                except Exception:  # the owner's hook: say so, never lose the job
                    logger.exception("scheduler: on_stored hook failed for job %d", job.id)
        else:
            self._manager.complete_load(job=manager_job(job.id))
        self._finish(job, JobOutcome.SUCCEEDED if ok else JobOutcome.FAILED, error)

    def _finish(self, job: _Job, outcome: JobOutcome, error: str | None = None) -> None:
        self._stores.pop(job.id, None)
        self._counts[job.kind].add(job.finish(outcome, error), job.started)

    def _cancel(self, job: _Job) -> bool:
        if not self._plan.cancel(job):
            return False
        if job.kind is TransferDirection.STORE:
            self._manager.complete_store(job=manager_job(job.id), success=False)
        else:
            self._manager.complete_load(job=manager_job(job.id))
        self._finish(job, JobOutcome.CANCELLED, "cancelled before it started")
        self._room[job.kind].set()
        return True

    # -- seeing state ---------------------------------------------------------

    def _direction(self, kind: TransferDirection) -> DirectionStatistics:
        plan = self._plan
        return self._counts[kind].statistics(
            queued=plan.queued(kind),
            in_flight=plan.in_flight(kind),
            inflight_bytes=plan.inflight_bytes(kind),
        )

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            state=self._life.state.value,
            stores=self._direction(TransferDirection.STORE),
            loads=self._direction(TransferDirection.LOAD),
        )

    def __repr__(self) -> str:
        plan, store, load = self._plan, TransferDirection.STORE, TransferDirection.LOAD
        return (
            f"<Scheduler [{self._life.state.value}; loads: {plan.queued(load)} queued, "
            f"{plan.in_flight(load)} running; stores: {plan.queued(store)} queued, "
            f"{plan.in_flight(store)} running]>"
        )
