"""The transfer backend contract, its result record, and the bookkeeping backends share.

A backend moves the bytes of *jobs*. A job is a pair of specs: a store copies
GPU blocks to CPU chunk slots (`GPULoadStoreSpec` -> `CPULoadStoreSpec`), a load
copies them back (`CPULoadStoreSpec` -> `GPULoadStoreSpec`). The contract has
five methods::

    submit(job_id, src, dst)      validate and start a job (never waits for bytes)
    poll()                        completed results not yet returned
    wait(job_ids, timeout=None)   block until those jobs have completed
    close()                       finish in-flight jobs, release everything; idempotent
    statistics()                  an immutable snapshot

Every submitted job completes exactly once with a `TransferResult`. A copy that
fails inside the backend (any exception) is a failed result, never an exception
out of the backend, and the backend stays usable. The result keeps the failure
twice: as text (``error``, ``"RuntimeError: ..."``) and as a `TransferError`
(``exception``): a `CopyFailedError` whose ``cause`` is the torch or CUDA
error, or the `TransferError` the backend raised itself (the mock's scripted
failures).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import ClassVar

import msgspec

from tiering._checks import check_int
from tiering._exports import RESOURCE_STATE, deprecations
from tiering._state import Lifecycle, ResourceState
from tiering.errors import (
    CapacityError,
    SpecError,
    TransferError,
    failure_text,
    transfer_error,
)
from tiering.specs import LoadStoreSpec
from tiering.transfer.layout import TransferDirection

__all__ = [
    "BackendStatistics",
    "CompletionCallback",
    "DirectionStatistics",
    "JobTracker",
    "TransferBackend",
    "TransferResult",
]

logger = logging.getLogger(__name__)

#: Default bound on jobs submitted and not yet completed, per backend.
DEFAULT_MAX_IN_FLIGHT = 4096


class TransferResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one job ended.

    ``nbytes`` is the size of the job (the bytes it moves when it succeeds; for
    a failed job, how many of them landed is unknown). ``seconds`` is the time
    the copy itself took, not the time it waited in a queue. ``error`` is the
    text of the failure, ``None`` on success; ``exception`` is the failure
    itself (a `CopyFailedError` whose ``cause`` is what the copy raised), for
    callers that act on its type. Results stay in memory, not on a wire: only
    ``error`` is meant to be serialized.
    """

    job_id: int
    success: bool
    direction: TransferDirection
    nbytes: int
    seconds: float
    error: str | None = None
    exception: TransferError | None = None


#: Called with each result, from a backend thread (never the submitting one);
#: it must be quick and thread-safe (e.g. ``loop.call_soon_threadsafe``).
CompletionCallback = Callable[[TransferResult], object]


class DirectionStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """Counts of one direction; ``bytes`` and ``seconds`` add up successful jobs."""

    in_flight: int = 0
    succeeded: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0


class BackendStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a backend."""

    backend: str
    state: str
    stores: DirectionStatistics
    loads: DirectionStatistics

    @property
    def in_flight(self) -> int:
        return self.stores.in_flight + self.loads.in_flight

    @property
    def succeeded(self) -> int:
        return self.stores.succeeded + self.loads.succeeded

    @property
    def failed(self) -> int:
        return self.stores.failed + self.loads.failed


class TransferBackend(ABC):
    """Moves the bytes of store and load jobs. See the module docstring.

    Guarantees of every backend: jobs of one direction run in submission order
    (FIFO); `submit` validates the job against the layout and raises
    `SpecError` before any byte moves; after `close` (or during it), `submit`
    raises `ResourceClosedError`; every admitted job yields exactly one result.
    If an ``on_complete`` callback is given to the backend, results are
    delivered to it (from a backend thread) instead of being kept for `poll`.
    """

    name: ClassVar[str]

    @abstractmethod
    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        """Start job ``job_id`` copying ``src`` to ``dst``; returns without waiting for bytes.

        Raises `SpecError` (bad specs, or ``job_id`` already in flight),
        `CapacityError` (too many jobs in flight) or `ResourceClosedError`.
        """

    @abstractmethod
    def poll(self) -> list[TransferResult]:
        """Results completed since the last call, in completion order; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is in flight; ``False`` if ``timeout`` ran out.

        Ids that are unknown or already completed count as done. Results stay
        available to `poll`.
        """

    @abstractmethod
    def close(self) -> None:
        """Let in-flight jobs finish, then release threads and device resources. Idempotent."""

    @abstractmethod
    def statistics(self) -> BackendStatistics:
        """An immutable snapshot of counts by direction."""

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Counts:
    """Counts of one direction. ``admitted`` is written under the admission lock,
    the others under the completion lock, so neither side waits for the other."""

    __slots__ = ("admitted", "bytes", "completed", "failed", "seconds", "succeeded")

    def __init__(self) -> None:
        self.admitted = self.completed = self.succeeded = self.failed = self.bytes = 0
        self.seconds = 0.0

    def snapshot(self) -> DirectionStatistics:
        completed = self.completed  # read first: admitted >= completed at any instant
        return DirectionStatistics(
            in_flight=self.admitted - completed,
            succeeded=self.succeeded,
            failed=self.failed,
            bytes=self.bytes,
            seconds=self.seconds,
        )


class JobTracker:
    """Thread-safe bookkeeping of one backend's jobs: admission, results, waiting, state.

    Bounded: at most ``max_in_flight`` jobs are admitted and not completed
    (`admit` raises `CapacityError` beyond that); completed results wait in a
    queue until `poll`, unless ``on_complete`` takes them.

    Submitters and completers take different locks: a submitting thread never
    queues behind a worker completing a job (a contended lock costs a thread
    switch, more than the rest of a small job). The in-flight table is a dict
    that admission only adds to and completion only removes from; CPython's
    dict operations are atomic, so the admission bound stays conservative.
    """

    def __init__(
        self,
        backend: str,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        check_int("max_in_flight", max_in_flight, minimum=1, error=CapacityError)
        self.backend = backend
        self.max_in_flight = max_in_flight
        self._on_complete = on_complete
        self._admit_lock = threading.Lock()  # admission and state changes
        self._done_lock = threading.Lock()  # completion and results (taken raw: cheaper)
        self._done = threading.Condition(self._done_lock)  # waiting for completions
        self._waiters = 0  # threads inside a wait on ``_done``
        self._in_flight: dict[int, TransferDirection] = {}
        self._results: deque[TransferResult] = deque()
        self._counts = {d: _Counts() for d in TransferDirection}
        self._life = Lifecycle(f"the {backend} backend", opened=True)  # under _admit_lock

    @property
    def state(self) -> ResourceState:
        return self._life.state

    def check_open(self) -> None:
        """Raise `ResourceClosedError` ("the cpu backend is closing") unless open."""
        self._life.check_open()

    def admit(self, job_id: int, direction: TransferDirection) -> None:
        """Record job ``job_id`` as in flight, or raise why it cannot be."""
        with self._admit_lock:
            self._life.check_open()
            in_flight = self._in_flight
            if job_id in in_flight:
                raise SpecError(f"job id {job_id} is already in flight; give every job a fresh id")
            if len(in_flight) >= self.max_in_flight:
                raise CapacityError(
                    f"the {self.backend} backend already has {len(in_flight)} jobs in "
                    f"flight (max_in_flight={self.max_in_flight}); wait for some to complete"
                )
            in_flight[job_id] = direction
            self._counts[direction].admitted += 1

    def complete(self, result: TransferResult) -> None:
        """Record ``result``; hand it to the callback (outside the lock) or queue it for poll."""
        with self._done_lock:
            direction = self._in_flight.pop(result.job_id, None)
            if direction is None:
                logger.warning("%s backend: result for unknown job %d", self.backend, result.job_id)
                return
            counts = self._counts[direction]
            if result.success:
                counts.succeeded += 1
                counts.bytes += result.nbytes
                counts.seconds += result.seconds
            else:
                counts.failed += 1
            counts.completed += 1
            if self._on_complete is None:
                self._results.append(result)
            if self._waiters:
                self._done.notify_all()
        if self._on_complete is not None:
            try:
                self._on_complete(result)
            except Exception:
                logger.exception("%s backend: on_complete callback failed", self.backend)

    def poll(self) -> list[TransferResult]:
        with self._done:
            out = list(self._results)
            self._results.clear()
            return out

    def is_in_flight(self, job_id: int) -> bool:
        return job_id in self._in_flight

    def _wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        with self._done:
            self._waiters += 1
            try:
                return self._done.wait_for(predicate, timeout)
            finally:
                self._waiters -= 1

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        ids = set(job_ids)
        in_flight = self._in_flight  # admission may add to it meanwhile: test key by key
        return self._wait_for(lambda: all(j not in in_flight for j in ids), timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._wait_for(lambda: not self._in_flight, timeout)

    def begin_close(self) -> bool:
        """Stop admitting jobs; ``True`` for the one caller that should do the closing."""
        with self._admit_lock:
            return self._life.begin_close()

    def finish_close(self) -> None:
        with self._admit_lock, self._done:
            self._life.end_close()
            self._done.notify_all()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._wait_for(lambda: self._life.state is ResourceState.CLOSED, timeout)

    def statistics(self) -> BackendStatistics:
        with self._done:
            return BackendStatistics(
                backend=self.backend,
                state=self._life.state.value,
                stores=self._counts[TransferDirection.STORE].snapshot(),
                loads=self._counts[TransferDirection.LOAD].snapshot(),
            )

    def describe(self) -> str:
        s = self.statistics()
        closed = "" if s.state == "open" else f"{s.state}, "
        return f"[{closed}jobs: {s.in_flight} in flight, {s.succeeded} done, {s.failed} failed]"


def failed_result(
    job_id: int, direction: TransferDirection, nbytes: int, exc: BaseException, started: float
) -> TransferResult:
    """The result of a job whose copy raised ``exc`` (see `transfer_error`)."""
    failure = transfer_error(exc, job_id)
    return TransferResult(
        job_id=job_id,
        success=False,
        direction=direction,
        nbytes=nbytes,
        seconds=time.perf_counter() - started,
        error=failure_text(exc),
        exception=failure,
    )


__getattr__ = deprecations(__name__, {"BackendState": RESOURCE_STATE})
