"""The ``cuda`` backend: copies between GPU KV tensors and the pinned host pool.

This is the only module of `tiering` that touches ``torch.cuda``; it is imported
only when the ``cuda`` backend is asked for by name.

Design note: stream ordering
----------------------------
Each job runs on a stream of its own, taken from a per-direction pool (loads on
higher-priority streams than stores: loads are on the time-to-first-token
path). Before its first copy, a job's stream waits on:

1. the caller's current stream (the *compute* stream) as of `submit`, in both
   directions. A store must not read KV blocks the model is still writing; a
   load must not overwrite blocks that kernels already queued still read.
   Work the caller queues *after* `submit` is not waited for: a caller that
   reuses blocks must wait for the job first (that is the engine's ``flush``).
2. the end event of the previous job of the same direction, so jobs of one
   direction run in submission order (FIFO) and can share one staging buffer.
   Stores and loads do not wait on each other; the manager never lets a load
   read a chunk that is still being written.

Each job records a start and an end event (timing, blocking-sync so waiting
threads sleep instead of spinning). A watcher thread per direction sleeps on
the oldest job's end event and completes jobs in order; `poll` also reaps
finished jobs with non-blocking ``query()``, so neither path busy-waits.

Batching: per run of consecutive pool slots (a run of chunk ids), a store
gathers every tensor's pages on the GPU into a staging buffer laid out exactly
like the pool rows (one ``index_select`` kernel per tensor), then copies the run
to host memory with one contiguous ``cudaMemcpyAsync``; a load does the
reverse (one copy in, one ``index_copy_`` kernel per tensor). A slot holds the
pages of *every* tensor of the group, so even a single-slot run is one large
DMA: small pages never mean small copies. Runs are cut at the staging capacity
and at the boundaries of the pinned pieces, so no copy spans two registrations.
The staging buffers cost ``2 x staging_bytes`` of device memory.

Pinning: the pool (one anonymous mapping, see `memory`) is registered with
``cudaHostRegister`` in pieces of at most ``pin_piece_bytes`` (whole rows), in
a helper thread so a failure cannot leave a stale CUDA error on the caller's
thread. If registration fails, the backend logs once and runs pageable: copies
are then synchronous with respect to the submitting thread and slower.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiering.errors import ConfigError, ResourceClosedError, SpecError
from tiering.specs import IntArray, LoadStoreSpec
from tiering.transfer.base import (
    DEFAULT_MAX_IN_FLIGHT,
    BackendState,
    BackendStatistics,
    CompletionCallback,
    JobTracker,
    TransferBackend,
    TransferResult,
)
from tiering.transfer.layout import KVLayout, TransferDirection, TransferPlan, run_bounds
from tiering.transfer.memory import HostMemoryPool

__all__ = ["CudaBackend", "HostRegistration", "copy_pieces"]

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


def copy_pieces(slots: IntArray, max_slots: int, piece_slots: int) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``slots`` that are single DMA copies.

    Each range is consecutive in the pool, at most ``max_slots`` long, and does
    not cross a multiple of ``piece_slots`` (a pinned-piece boundary).
    """
    bounds = run_bounds(slots)
    if len(slots):
        bounds = np.union1d(bounds, np.flatnonzero(slots % piece_slots == 0))
    out: list[tuple[int, int]] = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        out.extend((s, min(b, s + max_slots)) for s in range(a, b, max_slots))
    return out


@dataclass
class _CudaJob:
    job_id: int
    direction: TransferDirection
    nbytes: int
    stream: torch.cuda.Stream
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None


class CudaBackend(TransferBackend):
    """Copies between CUDA KV tensors and a host pool over per-job streams.

    See the module docstring for ordering, batching and pinning. Jobs are
    ordered after ``compute_stream`` if given, else after the submitting
    thread's current stream (torch streams are per thread: submit from the
    thread that runs the model, or pass its stream). ``on_complete`` is called
    from a watcher thread. `close` waits for every job, then unregisters the
    pool: close the backend before the pool.
    """

    name = "cuda"

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
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.layout = layout
        self._compute_stream = compute_stream
        self.num_chunks = layout.num_chunks(pool.nbytes)
        if self.num_chunks < 1:
            raise SpecError(
                f"the pool holds {pool.nbytes} bytes, less than one chunk row "
                f"({layout.row_bytes} bytes)"
            )
        pool_bytes = self.num_chunks * layout.row_bytes
        w = layout.word_bytes
        self._slot_words = layout.slot_bytes // w
        self._host = pool.tensor[:pool_bytes].view(layout.word_dtype)
        piece_rows = max(1, pin_piece_bytes // layout.row_bytes)
        self._piece_slots = piece_rows * layout.blocks_per_chunk
        self._registration: HostRegistration | None = None
        if pin:
            self._registration = HostRegistration(
                pool.data_ptr, pool_bytes, piece_rows * layout.row_bytes, self._device
            )
            if not self._registration.pinned:
                _warn_pageable(self._registration.error)
        self._kv = [layout.kv_view(i) for i in range(len(layout.tensors))]
        self._stage_slots = max(1, staging_bytes // layout.slot_bytes)
        with torch.cuda.device(self._device):
            self._staging = {
                d: torch.empty(
                    self._stage_slots * self._slot_words,
                    dtype=layout.word_dtype,
                    device=self._device,
                )
                for d in TransferDirection
            }
        self._priority = {
            TransferDirection.LOAD: _LOAD_PRIORITY,
            TransferDirection.STORE: _STORE_PRIORITY,
        }
        self._lock = threading.Condition()
        self._streams: dict[TransferDirection, list[torch.cuda.Stream]] = {
            d: [] for d in TransferDirection
        }
        self._events: list[torch.cuda.Event] = []
        self._launched: dict[TransferDirection, deque[_CudaJob]] = {
            d: deque() for d in TransferDirection
        }
        self._last_end: dict[TransferDirection, torch.cuda.Event | None]
        self._last_end = dict.fromkeys(TransferDirection)
        self._reap_locks = {d: threading.RLock() for d in TransferDirection}
        self._stopping = False
        self._tracker = JobTracker(self.name, on_complete, max_in_flight)
        self._watchers = {
            d: threading.Thread(
                target=self._watch, args=(d,), name=f"tiering-cuda-{d.value}", daemon=True
            )
            for d in TransferDirection
        }
        for t in self._watchers.values():
            t.start()

    @property
    def pinned(self) -> bool:
        """Whether the pool is registered with CUDA (else copies are pageable)."""
        return self._registration is not None and self._registration.pinned

    # -- contract -------------------------------------------------------------

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        if self._tracker.state is not BackendState.OPEN:
            raise ResourceClosedError(f"the cuda backend is {self._tracker.state.value}")
        plan = self.layout.plan(src, dst, self.num_chunks)
        self._tracker.admit(job_id, plan.direction)
        try:
            with self._lock:
                job = self._launch(job_id, plan)
                self._launched[plan.direction].append(job)
                self._lock.notify_all()
        except Exception as exc:  # nothing was queued: the job ends now, failed
            self._tracker.complete(
                TransferResult(
                    job_id=job_id,
                    success=False,
                    direction=plan.direction,
                    nbytes=plan.nbytes,
                    seconds=0.0,
                    error=f"{type(exc).__name__}: {exc}",
                )
            )

    def poll(self) -> list[TransferResult]:
        for d in TransferDirection:
            self._reap(d)
        return self._tracker.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        return self._tracker.wait(job_ids, timeout)

    def statistics(self) -> BackendStatistics:
        return self._tracker.statistics()

    def close(self) -> None:
        """Wait for every job, stop the watchers, unregister the pool. Idempotent."""
        on_watcher = any(t is threading.current_thread() for t in self._watchers.values())
        if not self._tracker.begin_close():
            if not on_watcher:
                self._tracker.wait_closed()
            return
        if on_watcher:
            threading.Thread(target=self._finish_close, name="tiering-cuda-close").start()
        else:
            self._finish_close()

    def __repr__(self) -> str:
        return f"<CudaBackend {self._tracker.describe()}>"

    # -- launching (under self._lock) -----------------------------------------

    def _launch(self, job_id: int, plan: TransferPlan) -> _CudaJob:
        d = plan.direction
        streams = self._streams[d]
        with torch.cuda.device(self._device):
            stream = (
                streams.pop() if streams else torch.cuda.Stream(self._device, self._priority[d])  # type: ignore[no-untyped-call]
            )
            start, end = self._event(), self._event()
            job = _CudaJob(job_id, d, plan.nbytes, stream, start, end)
            compute = self._compute_stream or torch.cuda.current_stream(self._device)
            stream.wait_stream(compute)
            previous = self._last_end[d]
            if previous is not None:
                stream.wait_event(previous)
            with torch.cuda.stream(stream):
                start.record(stream)
                try:
                    job.keep = self._enqueue(plan)
                except Exception as exc:  # what was queued still runs; the job fails
                    job.error = f"{type(exc).__name__}: {exc}"
                finally:
                    end.record(stream)
        self._last_end[d] = end
        return job

    def _event(self) -> torch.cuda.Event:
        if self._events:
            return self._events.pop()
        return torch.cuda.Event(enable_timing=True, blocking=True)  # type: ignore[no-untyped-call]

    def _enqueue(self, plan: TransferPlan) -> list[torch.Tensor]:
        """Queue the copies of ``plan`` on the current stream; returns tensors to keep alive."""
        all_blocks = np.concatenate([g.blocks for g in plan.groups] or [np.zeros(0, np.int64)])
        if len(all_blocks) == 0:
            return []
        index_host = torch.from_numpy(all_blocks)
        if self.pinned:
            index_host = index_host.pin_memory()
        index = index_host.to(self._device, non_blocking=True)
        stage_all = self._staging[plan.direction]
        store = plan.direction is TransferDirection.STORE
        sw = self._slot_words
        w = self.layout.word_bytes
        first = 0
        for group in plan.groups:
            blocks = index.narrow(0, first, len(group.blocks))
            first += len(group.blocks)
            tensors = [
                (self._kv[t], self.layout.page_offsets[t] // w, self._kv[t].shape[1])
                for t in self.layout.group_tensors[group.group]
            ]
            slots = group.slots
            for a, b in copy_pieces(slots, self._stage_slots, self._piece_slots):
                n = b - a
                stage = stage_all.narrow(0, 0, n * sw)
                rows = stage.view(n, sw)
                host = self._host.narrow(0, int(slots[a]) * sw, n * sw)
                ids = blocks.narrow(0, a, n)
                if store:
                    for kv, off, words in tensors:
                        torch.index_select(kv, 0, ids, out=rows.narrow(1, off, words))
                    host.copy_(stage, non_blocking=True)
                else:
                    stage.copy_(host, non_blocking=True)
                    for kv, off, words in tensors:
                        kv.index_copy_(0, ids, rows.narrow(1, off, words))
        return [index_host, index]

    # -- completion -----------------------------------------------------------

    def _watch(self, d: TransferDirection) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._launched[d]) or self._stopping)
                if not self._launched[d]:
                    return
                job = self._launched[d][0]
            try:
                job.end.synchronize()  # blocking-sync event: sleeps, GIL released
            except Exception as exc:
                job.error = job.error or f"{type(exc).__name__}: {exc}"
            self._reap(d, head_done=job)

    def _reap(self, d: TransferDirection, head_done: _CudaJob | None = None) -> None:
        """Complete the finished jobs at the head of direction ``d``, in order."""
        with self._reap_locks[d]:
            while True:
                with self._lock:
                    queue = self._launched[d]
                    if not queue:
                        return
                    job = queue[0]
                    if job is not head_done and not _query(job):
                        return
                    queue.popleft()
                    seconds = _elapsed(job)
                    if self._last_end[d] is job.end:
                        self._last_end[d] = None
                    self._streams[d].append(job.stream)
                    self._events += [job.start, job.end]
                    job.keep.clear()
                self._tracker.complete(
                    TransferResult(
                        job_id=job.job_id,
                        success=job.error is None,
                        direction=d,
                        nbytes=job.nbytes,
                        seconds=seconds,
                        error=job.error,
                    )
                )

    def _finish_close(self) -> None:
        try:
            self._tracker.wait_idle()
            with self._lock:
                self._stopping = True
                self._lock.notify_all()
            for t in self._watchers.values():
                if t is not threading.current_thread():
                    t.join()
            self._staging.clear()
            self._kv.clear()
            self._streams.clear()
            self._events.clear()
            if self._registration is not None:
                self._registration.close()
            del self._host
        finally:
            self._tracker.finish_close()


def _query(job: _CudaJob) -> bool:
    try:
        return bool(job.end.query())  # type: ignore[no-untyped-call]
    except Exception as exc:  # a CUDA error: the job is over, and failed
        job.error = job.error or f"{type(exc).__name__}: {exc}"
        return True


def _elapsed(job: _CudaJob) -> float:
    try:
        return float(job.start.elapsed_time(job.end)) / 1e3
    except Exception:
        return 0.0


def _warn_pageable(reason: str | None) -> None:
    global _warned_pageable
    if not _warned_pageable:
        _warned_pageable = True
        logger.warning(
            "could not pin the CPU tier with cudaHostRegister (%s); running pageable: "
            "transfers will be slower and synchronous",
            reason,
        )
