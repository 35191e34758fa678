"""The ``cuda`` backend: copies between GPU KV tensors and the pinned host pool.

This is the only module of `tiering` that touches ``torch.cuda``; it is imported
only when the ``cuda`` backend is asked for by name. It runs on torch 2.11 and
later (``scripts/gpu_check.sh`` checks it on a GPU).

Design note: threads
--------------------
The backend is a `ThreadedBackend` with ``completes_later``: it shares the
threaded backends' admission, state, close and failed results. Per direction,
a *launcher* thread queues each job's copies on a stream and returns at once,
and a *finisher* thread sleeps on the job's end event (blocking-sync: no
spinning) and completes the job, in order. Nothing on the submitting thread
(the caller's event loop) launches a kernel or copies a byte: `submit` only
builds the job's bound torch calls (views, no CUDA call) and records one event
on the compute stream. Building them there leaves the launcher only the
launches: every torch call gives up the GIL and must take it back, which beside
a busy event loop can wait a whole switch interval (see the ``cpu`` backend,
which does the same). The two threads share no lock: the launcher takes
streams and events from per-direction pools that the finisher refills
(``deque`` appends and pops are atomic). Pageable copies (see Pinning) block
their launcher thread, never the caller.

Design note: stream ordering
----------------------------
Each job runs on a stream of its own, taken from a per-direction pool (loads on
higher-priority streams than stores: loads are on the time-to-first-token
path). Before its first copy, a job's stream waits on:

1. the caller's current stream (the *compute* stream) as of `submit`, in both
   directions: `submit` records an event there, the launcher makes the job's
   stream wait for it. A store must not read KV blocks the model is still
   writing; a load must not overwrite blocks that kernels already queued still
   read. Work the caller queues *after* `submit` is not waited for: a caller
   that reuses blocks must wait for the job first (that is the engine's ``flush``).
2. the end event of the previous job of the same direction, so jobs of one
   direction run in submission order (FIFO) and can share one staging buffer
   and one device index buffer. Stores and loads do not wait on each other;
   the manager never lets a load read a chunk that is still being written.

Each job records a start and an end event (timing, blocking-sync so the
finisher sleeps). A job whose launch raised part-way still records its end
event, so what it queued finishes before the next job of its direction starts
and before it is reported (failed).

Batching (`staging`): per run of consecutive pool slots, a store gathers every
tensor's pages on the GPU into a staging buffer laid out like the pool rows
(one ``index_select`` kernel per tensor), then copies the run to host memory
with one contiguous ``cudaMemcpyAsync``; a load does the reverse. A slot holds
the pages of *every* tensor of the group, so even a single-slot run is one
large DMA: small pages never mean small copies. The block ids go to the GPU
once per job. The staging and index buffers cost about ``2 x staging_bytes``
of device memory.

Pinning: the pool (one anonymous mapping, see `memory`) is registered with
``cudaHostRegister`` in pieces of at most ``pin_piece_bytes`` (whole rows), in
a helper thread so a failure cannot leave a stale CUDA error on the caller's
thread. If registration fails, the backend logs once and runs pageable: copies
are then synchronous with respect to the launcher thread, and slower.

Errors: anything a launch or a wait raises (a torch ``RuntimeError``, a CUDA
error) fails that job only: its result holds a `CopyFailedError` from it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tiering.errors import ConfigError, SpecError
from tiering.specs import LoadStoreSpec
from tiering.transfer.base import DEFAULT_MAX_IN_FLIGHT, CompletionCallback
from tiering.transfer.layout import KVLayout, TransferDirection
from tiering.transfer.memory import HostMemoryPool
from tiering.transfer.staging import StagedCopies, StagedProgram
from tiering.transfer.worker import PendingCopy, ThreadedBackend, ThreadedJob

__all__ = ["CudaBackend", "HostRegistration"]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_PIN_PIECE_BYTES = 1 << 30
_CUDA_HOST_REGISTER_PORTABLE = 1
_LOAD_PRIORITY = -1  # lower is higher; clamped by the driver to its range
_STORE_PRIORITY = 0

_warned_pageable = False


class HostRegistration:
    """``cudaHostRegister`` over ``[ptr, ptr + nbytes)`` in pieces of at most ``piece_bytes``.

    ``pinned`` tells whether every piece is registered; on any failure, pieces
    already registered are unregistered and the region stays pageable. Calls
    run in a short-lived helper thread bound to ``device``: a failing runtime
    call leaves its error in that thread, not in one that torch checks later.
    """

    def __init__(self, ptr: int, nbytes: int, piece_bytes: int, device: torch.device) -> None:
        self.pieces: list[tuple[int, int]] = []
        self.error: str | None = None
        self._device = device
        self._in_thread(lambda: self._register(ptr, nbytes, max(1, piece_bytes)))
        if not self.pieces and self.error is None:
            self.error = "nothing was registered"

    @property
    def pinned(self) -> bool:
        return self.error is None and bool(self.pieces)

    def close(self) -> None:
        """Unregister every piece. Idempotent."""
        if self.pieces:
            self._in_thread(self._unregister)

    def _in_thread(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                # A new thread starts on device 0: use ours, not a stray context there.
                torch.cuda.set_device(self._device)
                fn()
            except Exception as exc:
                self.error = self.error or f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=run, name="tiering-cuda-pin")
        worker.start()
        worker.join()

    def _register(self, ptr: int, nbytes: int, piece_bytes: int) -> None:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for offset in range(0, nbytes, piece_bytes):
            size = min(piece_bytes, nbytes - offset)
            err = int(cudart.cudaHostRegister(ptr + offset, size, _CUDA_HOST_REGISTER_PORTABLE))
            if err != 0:
                text = cudart.cudaGetErrorString(cudart.cudaError(err))
                self.error = f"cudaHostRegister of {size} bytes at offset {offset}: {text}"
                self._unregister()
                return
            self.pieces.append((ptr + offset, size))

    def _unregister(self) -> None:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        while self.pieces:
            ptr, size = self.pieces.pop()
            err = int(cudart.cudaHostUnregister(ptr))
            if err != 0:
                logger.warning("cudaHostUnregister of %d bytes failed: error %d", size, err)


class _CudaWork:
    """A job's staged copies, and the event `CudaBackend.admitted` recorded on the
    compute stream for it (``error``: what recording it raised)."""

    __slots__ = ("error", "program", "ready")

    def __init__(self, program: StagedProgram) -> None:
        self.program = program
        self.ready: torch.cuda.Event | None = None
        self.error: Exception | None = None


@dataclasses.dataclass(eq=False, slots=True)
class _CudaCopy(PendingCopy):
    """A job queued on its stream; `wait` sleeps on its end event, then recycles both."""

    backend: CudaBackend
    direction: TransferDirection
    stream: torch.cuda.Stream
    start: torch.cuda.Event
    end: torch.cuda.Event
    error: Exception | None

    def wait(self) -> float:
        backend = self.backend
        # A thread's CUDA calls go to device 0 unless told: stay on ours.
        with torch.cuda.device(backend.device):
            self.end.synchronize()  # blocking-sync event: sleeps, GIL released
            seconds = float(self.start.elapsed_time(self.end)) / 1e3
        # Landed: the stream and events are free (a wait that raised drops them).
        backend.recycle(self.direction, self.stream, self.start, self.end)
        if self.error is not None:
            raise self.error
        return seconds


class CudaBackend(ThreadedBackend):
    """Copies between CUDA KV tensors and a host pool over per-job streams.

    See the module docstring for threads, ordering, batching and pinning. Jobs
    are ordered after ``compute_stream`` if given, else after the submitting
    thread's current stream (torch streams are per thread: submit from the
    thread that runs the model, or pass its stream). ``on_complete`` is called
    from a finisher thread. `close` waits for every job, then unregisters the
    pool: close the backend before the pool.
    """

    name = "cuda"
    completes_later = True

    def __init__(
        self,
        layout: KVLayout,
        pool: HostMemoryPool,
        *,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        pin: bool = True,
        pin_piece_bytes: int = DEFAULT_PIN_PIECE_BYTES,
        compute_stream: torch.cuda.Stream | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            # CPU-only torch raises AssertionError/RuntimeError from streams, events,
            # devices and pinning: refuse here, with a message, instead.
            raise ConfigError(
                "the cuda backend needs a CUDA device, and torch sees none "
                f"(torch {torch.__version__}); use the 'cpu' backend"
            )
        if layout.device.type != "cuda":
            raise SpecError(f"the KV tensors are on {layout.device}; the cuda backend needs CUDA")
        index = layout.device.index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.layout = layout
        self._compute_stream = compute_stream
        self.num_chunks = layout.pool_chunks(pool.nbytes)
        pool_bytes = self.num_chunks * layout.row_bytes
        piece_rows = max(1, pin_piece_bytes // layout.row_bytes)
        self._registration: HostRegistration | None = None
        if pin:
            self._registration = HostRegistration(
                pool.data_ptr, pool_bytes, piece_rows * layout.row_bytes, self.device
            )
            if not self._registration.pinned:
                _warn_pageable(self._registration.error)
        try:
            stage_slots = max(1, staging_bytes // layout.slot_bytes)
            slot_words = layout.slot_bytes // layout.word_bytes
            max_blocks = StagedCopies.max_blocks(layout)
            with torch.cuda.device(self.device):
                staging = {
                    d: torch.empty(
                        stage_slots * slot_words, dtype=layout.word_dtype, device=self.device
                    )
                    for d in TransferDirection
                }
                index_buffers = {
                    d: torch.empty(max_blocks, dtype=torch.int64, device=self.device)
                    for d in TransferDirection
                }
            self._copies: StagedCopies | None = StagedCopies(
                layout,
                pool.tensor[:pool_bytes].view(layout.word_dtype),
                staging,
                index_buffers,
                stage_slots=stage_slots,
                piece_slots=piece_rows * layout.blocks_per_chunk,
            )
        except BaseException:
            if self._registration is not None:
                self._registration.close()
            raise
        self._priority = {
            TransferDirection.LOAD: _LOAD_PRIORITY,
            TransferDirection.STORE: _STORE_PRIORITY,
        }
        # Free streams and start/end events, per direction: the launcher pops,
        # the finisher appends (no lock: deque appends and pops are atomic).
        self._streams: dict[TransferDirection, deque[torch.cuda.Stream]] = {
            d: deque() for d in TransferDirection
        }
        self._events: dict[TransferDirection, deque[torch.cuda.Event]] = {
            d: deque() for d in TransferDirection
        }
        self._ready: deque[torch.cuda.Event] = deque()  # compute-stream marks, any submitter
        # Written and read by the direction's launcher thread only.
        self._last_end: dict[TransferDirection, torch.cuda.Event | None]
        self._last_end = dict.fromkeys(TransferDirection)
        super().__init__(on_complete=on_complete, max_in_flight=max_in_flight)

    @property
    def pinned(self) -> bool:
        """Whether the pool is registered with CUDA (else copies are pageable)."""
        return self._registration is not None and self._registration.pinned

    # -- submitting thread: no launch, no copy ---------------------------------

    def prepare(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> ThreadedJob:
        copies = self._copies
        if copies is None:  # closed meanwhile: admission refuses it next
            return ThreadedJob(job_id, TransferDirection.STORE, None, src, dst)
        plan = self.layout.plan(src, dst, self.num_chunks)
        work = _CudaWork(copies.compile(plan))
        return ThreadedJob(job_id, plan.direction, plan, src, dst, work)

    def admitted(self, job: ThreadedJob) -> None:
        """Mark the compute stream: the job's copies wait for the work queued there so far."""
        work = job.work
        if not isinstance(work, _CudaWork):
            return
        try:
            try:
                ready = self._ready.pop()
            except IndexError:
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self._compute_stream or torch.cuda.current_stream(self.device))
            work.ready = ready
        except Exception as exc:  # the job is admitted: it fails in order, in the launcher
            work.error = exc

    # -- launcher thread ------------------------------------------------------

    def execute(self, job: ThreadedJob) -> PendingCopy | None:
        work = job.work
        if not isinstance(work, _CudaWork):
            return None
        if work.error is not None:
            raise work.error
        d = job.direction
        with torch.cuda.device(self.device):
            stream = self._take_stream(d)
            if work.ready is not None:
                stream.wait_event(work.ready)
                self._ready.append(work.ready)  # re-recording it cannot undo the wait
            previous = self._last_end[d]
            if previous is not None:
                stream.wait_event(previous)
            start, end = self._take_event(d), self._take_event(d)
            error: Exception | None = None
            with torch.cuda.stream(stream):
                start.record(stream)
                try:
                    self._enqueue(work.program)
                except Exception as exc:  # what was queued still runs; the job fails
                    error = exc
                finally:
                    end.record(stream)
            self._last_end[d] = end
        return _CudaCopy(self, d, stream, start, end, error)

    def _enqueue(self, program: StagedProgram) -> None:
        """Queue the copies of ``program`` on the current stream."""
        if program.index is not None and program.index_host is not None:
            ids = program.index_host
            if self.pinned:  # else a pageable copy, which the driver stages at once
                ids = ids.pin_memory()
            program.index.copy_(ids, non_blocking=True)
        for call in program.calls:
            call()

    def _take_stream(self, d: TransferDirection) -> torch.cuda.Stream:
        try:
            return self._streams[d].pop()
        except IndexError:
            return torch.cuda.Stream(self.device, self._priority[d])  # type: ignore[no-untyped-call]

    def _take_event(self, d: TransferDirection) -> torch.cuda.Event:
        try:
            return self._events[d].pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]

    # -- finisher thread --------------------------------------------------------

    def recycle(
        self,
        d: TransferDirection,
        stream: torch.cuda.Stream,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
    ) -> None:
        """Give a landed job's stream and events back to direction ``d``'s pools."""
        self._streams[d].append(stream)
        self._events[d].extend((start, end))

    # -- close ----------------------------------------------------------------

    def release_resources(self) -> None:
        # Every job has landed and both threads of each direction have stopped.
        self._copies = None
        self._last_end = dict.fromkeys(TransferDirection)
        for streams in self._streams.values():
            streams.clear()
        for events in self._events.values():
            events.clear()
        self._ready.clear()
        if self._registration is not None:
            self._registration.close()


def _warn_pageable(reason: str | None) -> None:
    global _warned_pageable
    if not _warned_pageable:
        _warned_pageable = True
        logger.warning(
            "could not pin the CPU tier with cudaHostRegister (%s); running pageable: "
            "transfers will be slower and synchronous",
            reason,
        )
