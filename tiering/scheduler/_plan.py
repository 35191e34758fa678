"""The scheduler's planning core: queues, budgets and load slices, with no I/O.

`Planner` decides which slice of which job goes to the backend next; the
scheduler's shell (`tiering.scheduler._scheduler`) carries out what it decides
and reports back. Nothing here awaits, locks, reads a clock or touches a
backend: the same calls in the same order give the same decisions, and the
tests drive it without an event loop.

Design note: ordering, budgets and the convoy.

- Loads are on the time-to-first-token path: `Planner.dispatch` serves the load
  queue before the store queue, and each direction has its own budget of bytes
  in flight, so a burst of stores never delays a load.
- A slice goes while its direction's bytes in flight plus its own stay within
  ``max_inflight_bytes``. A slice larger than the whole budget still goes when
  nothing else of its direction is in flight, so nothing waits forever.
- Convoy: a load is cut into slices of at most ``slice_chunks`` chunks, and the
  load queue is served round-robin, one slice per job per turn. The backend runs
  a direction in order, so a load slice handed over is one every later load
  waits for: at most ``max_load_slices`` load slices are at the backend at once.
  A small load submitted behind a large one (two requests sharing a prefix, say)
  waits for a slice or two of it, not for the whole job.
- Bounded: each direction queues at most ``max_queued_jobs`` jobs not yet fully
  handed over (`Planner.has_room`); the shell raises or waits past that.
- Only the backend knows when it is full, and a slice it refuses outright fails
  its job at once (which frees budget for the next). So `Planner.dispatch` takes
  the shell's submit function and hands it one slice at a time, each counted in
  flight before the call: ``False`` from it (the backend is full) puts that slice
  back exactly as it was and ends the direction's turn.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

import msgspec

from tiering._checks import check_int
from tiering._types import OffloadKey, TransferDirection
from tiering.cpu.common import CPULoadStoreSpec
from tiering.specs import GPULoadStoreSpec, KVCacheShape, chunk_block_ranges, select_chunks

__all__ = ["PlannedJob", "Planner", "SchedulerLimits", "Slice"]

_STORE, _LOAD = TransferDirection.STORE, TransferDirection.LOAD


class SchedulerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds of the scheduler (read from ``extra_config`` by the engine)."""

    max_queued_jobs: int = 1024  # per direction, not yet fully dispatched
    max_inflight_bytes: int = 256 << 20  # per direction, handed to the backend
    slice_chunks: int = 16  # chunks per load slice (the convoy bound)
    max_load_slices: int = 2  # load slices at the backend at once (the convoy bound)

    def __post_init__(self) -> None:
        for name in ("max_queued_jobs", "max_inflight_bytes", "slice_chunks", "max_load_slices"):
            check_int(f"scheduler {name}", getattr(self, name), minimum=1)


class Slice(msgspec.Struct, gc=False):
    """One piece of a job the backend runs: its GPU blocks, CPU chunks and bytes."""

    gpu: GPULoadStoreSpec
    cpu: CPULoadStoreSpec
    nbytes: int


class PlannedJob:
    """What the planner keeps of a job: the slices still to hand over, and how it runs.

    ``pending`` counts slices at the backend; ``started`` is set once a slice
    has been handed over (the job can no longer be cancelled); ``error`` is the
    first failure of any slice.
    """

    __slots__ = ("error", "kind", "pending", "slices", "started")

    def __init__(self, kind: TransferDirection) -> None:
        self.kind = kind
        self.slices: deque[Slice] = deque()
        self.pending = 0
        self.started = False
        self.error: str | None = None


J = TypeVar("J", bound=PlannedJob)


class _Lane(Generic[J]):
    """The queue and budget of one direction."""

    __slots__ = ("in_flight", "inflight_bytes", "queue", "slices")

    def __init__(self) -> None:
        self.queue: deque[J] = deque()  # jobs with slices still to hand over
        self.in_flight = 0  # jobs started and not ended
        self.slices = 0  # slices at the backend
        self.inflight_bytes = 0


class Planner(Generic[J]):
    """The queues and budgets of both directions; see the module docstring.

    The KV cache has ``group_num_blocks[g]`` blocks of ``block_bytes[g]`` bytes
    in group ``g``, cut into chunks of ``blocks_per_chunk`` blocks.
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        *,
        blocks_per_chunk: int,
        block_bytes: Sequence[int],
        group_num_blocks: Sequence[int],
    ) -> None:
        self.limits = limits
        self._max_queued = limits.max_queued_jobs
        self._bpc = blocks_per_chunk
        self._kv = KVCacheShape(
            blocks_per_chunk=blocks_per_chunk,
            group_num_blocks=tuple(group_num_blocks),
            group_block_bytes=tuple(block_bytes),
        )
        self._lanes: dict[TransferDirection, _Lane[J]] = {k: _Lane() for k in TransferDirection}

    # -- admission -------------------------------------------------------------

    def has_room(self, kind: TransferDirection) -> bool:
        """Whether direction ``kind`` may queue another job."""
        return len(self._lanes[kind].queue) < self._max_queued

    def check(self, kind: TransferDirection, gpu: GPULoadStoreSpec, num_keys: int) -> int:
        """Refuse a GPU spec that does not fit the KV cache or ``num_keys`` keys; its bytes."""
        return self._kv.check(gpu, kind, count=num_keys, what="key")

    def store_slice(
        self,
        gpu: GPULoadStoreSpec,
        keys: Sequence[OffloadKey],
        stored: Sequence[OffloadKey],
        cpu: CPULoadStoreSpec,
        nbytes: int,
    ) -> Slice:
        """The one slice of a store: the chunks of ``gpu`` whose keys are ``stored``.

        ``keys`` has one key per chunk of ``gpu`` (``nbytes`` bytes in all);
        ``stored`` are those the manager gave the slots ``cpu``, in order.
        """
        if len(stored) == len(keys):
            return Slice(gpu=gpu, cpu=cpu, nbytes=nbytes)
        index: dict[OffloadKey, int] = {}
        for i, key in enumerate(keys):
            index.setdefault(key, i)
        sub = select_chunks(gpu, self._bpc, [index[key] for key in stored])
        return Slice(gpu=sub, cpu=cpu, nbytes=self._kv.nbytes(sub))

    def slice_load(self, job: J, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec, nbytes: int) -> int:
        """Give ``job`` the slices of a load of ``gpu`` from ``cpu`` (co-indexed chunks).

        Slices hold at most ``slice_chunks`` chunks each. Returns the bytes of
        them all (``nbytes``, the bytes of ``gpu``).
        """
        step = self.limits.slice_chunks
        count = len(cpu.block_ids)
        if count <= step:
            job.slices.append(Slice(gpu=gpu, cpu=cpu, nbytes=nbytes))
            return nbytes
        chunks = chunk_block_ranges(gpu, self._bpc)  # once for every slice
        for lo in range(0, count, step):
            span = range(lo, min(lo + step, count))
            sub = select_chunks(gpu, self._bpc, span, chunks=chunks)
            part = CPULoadStoreSpec.from_valid_ids(cpu.block_ids[lo : lo + step].tolist())
            job.slices.append(Slice(gpu=sub, cpu=part, nbytes=self._kv.nbytes(sub)))
        return nbytes  # the slices cover the spec's chunks exactly

    def enqueue(self, job: J) -> None:
        """Queue ``job`` (its slices made) behind the others of its direction."""
        self._lanes[job.kind].queue.append(job)

    # -- dispatch and completion ------------------------------------------------

    def dispatch(self, submit: Callable[[J, Slice], bool]) -> None:
        """Hand ``submit`` every slice the queues and budgets let go now, in order.

        Loads first, then stores; within a direction, round-robin over its jobs.
        Each slice is counted in flight before ``submit`` is called, so a
        ``submit`` that fails the slice at once may call `complete` for it.
        ``submit`` returns ``False`` when the backend is full: that slice goes
        back where it was and its direction waits for the next call.
        """
        budget = self.limits.max_inflight_bytes
        for kind in (_LOAD, _STORE):
            lane = self._lanes[kind]
            queue = lane.queue
            most = self.limits.max_load_slices if kind is _LOAD else None
            while queue:
                job = queue[0]
                piece = job.slices[0]
                if lane.inflight_bytes and lane.inflight_bytes + piece.nbytes > budget:
                    break
                if most is not None and lane.slices >= most:
                    break
                queue.popleft()
                job.slices.popleft()
                requeued = bool(job.slices)
                if requeued:
                    queue.append(job)  # round-robin: one slice per job per turn
                first = not job.started
                if first:
                    job.started = True
                    lane.in_flight += 1
                lane.inflight_bytes += piece.nbytes
                lane.slices += 1
                job.pending += 1
                if not submit(job, piece):  # the backend is full: undo, exactly
                    job.pending -= 1
                    lane.slices -= 1
                    lane.inflight_bytes -= piece.nbytes
                    if first:
                        job.started = False
                        lane.in_flight -= 1
                    if requeued:
                        queue.pop()
                    job.slices.appendleft(piece)
                    queue.appendleft(job)
                    break

    def complete(self, job: J, piece: Slice, ok: bool, error: str | None = None) -> bool:
        """Slice ``piece`` of ``job`` has ended; ``True`` when the whole job has.

        A failure fails the job: its slices not handed over yet are dropped
        (those at the backend still end). The job ends when no slice of it is
        left, at the backend or to hand over.
        """
        lane = self._lanes[job.kind]
        lane.inflight_bytes -= piece.nbytes
        lane.slices -= 1
        job.pending -= 1
        if not ok and job.error is None:
            job.error = error or "transfer failed"
            if job.slices:
                job.slices.clear()
                with contextlib.suppress(ValueError):
                    lane.queue.remove(job)
        if job.pending or job.slices:
            return False
        lane.in_flight -= 1
        return True

    def cancel(self, job: J) -> bool:
        """Take ``job`` out of its queue if nothing of it has been handed over."""
        if job.started:
            return False
        try:
            self._lanes[job.kind].queue.remove(job)
        except ValueError:
            return False
        return True

    def unstarted(self) -> list[J]:
        """The queued jobs of which nothing has been handed over, loads first."""
        return [
            job for kind in (_LOAD, _STORE) for job in self._lanes[kind].queue if not job.started
        ]

    def abandon(self, in_flight: Iterable[J]) -> list[J]:
        """Forget every job: those queued and ``in_flight`` (the shell's); returns them all."""
        jobs: dict[int, J] = {id(job): job for job in in_flight}
        for lane in self._lanes.values():
            jobs.update((id(job), job) for job in lane.queue)
            lane.queue.clear()
            lane.in_flight = lane.slices = lane.inflight_bytes = 0
        for job in jobs.values():
            job.slices.clear()
            job.pending = 0
        return list(jobs.values())

    # -- seeing state -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether any job is queued or any slice is at the backend."""
        return any(lane.queue or lane.slices for lane in self._lanes.values())

    def queued(self, kind: TransferDirection) -> int:
        """Jobs of ``kind`` with slices still to hand over."""
        return len(self._lanes[kind].queue)

    def in_flight(self, kind: TransferDirection) -> int:
        """Jobs of ``kind`` started and not ended."""
        return self._lanes[kind].in_flight

    def inflight_bytes(self, kind: TransferDirection) -> int:
        """Bytes of the slices of ``kind`` at the backend."""
        return self._lanes[kind].inflight_bytes

    def inflight_slices(self, kind: TransferDirection) -> int:
        """Slices of ``kind`` at the backend."""
        return self._lanes[kind].slices

    def __repr__(self) -> str:
        s, ld = self._lanes[_STORE], self._lanes[_LOAD]
        return (
            f"<Planner [loads: {len(ld.queue)} queued, {ld.slices} slices in flight; "
            f"stores: {len(s.queue)} queued, {s.slices} slices in flight]>"
        )
