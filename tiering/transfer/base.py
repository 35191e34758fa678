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
fails inside the backend (any exception) is a failed result carrying the error's
text, never an exception out of the backend, and the backend stays usable.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import ClassVar

import msgspec

from tiering.errors import CapacityError, ResourceClosedError, SpecError
from tiering.specs import LoadStoreSpec
from tiering.transfer.layout import TransferDirection

__all__ = [
    "BackendState",
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
    text of the failure, ``None`` on success.
    """

    job_id: int
    success: bool
    direction: TransferDirection
    nbytes: int
    seconds: float
    error: str | None = None


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


class BackendState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


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
    __slots__ = ("bytes", "failed", "in_flight", "seconds", "succeeded")

    def __init__(self) -> None:
        self.in_flight = self.succeeded = self.failed = self.bytes = 0
        self.seconds = 0.0

    def snapshot(self) -> DirectionStatistics:
        return DirectionStatistics(
            in_flight=self.in_flight,
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
    """

    def __init__(
        self,
        backend: str,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise CapacityError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.backend = backend
        self.max_in_flight = max_in_flight
        self._on_complete = on_complete
        self._cond = threading.Condition()
        self._in_flight: dict[int, TransferDirection] = {}
        self._results: deque[TransferResult] = deque()
        self._counts = {d: _Counts() for d in TransferDirection}
        self._state = BackendState.OPEN

    @property
    def state(self) -> BackendState:
        return self._state

    def admit(self, job_id: int, direction: TransferDirection) -> None:
        """Record job ``job_id`` as in flight, or raise why it cannot be."""
        with self._cond:
            if self._state is not BackendState.OPEN:
                raise ResourceClosedError(f"the {self.backend} backend is {self._state.value}")
            if job_id in self._in_flight:
                raise SpecError(f"job id {job_id} is already in flight; give every job a fresh id")
            if len(self._in_flight) >= self.max_in_flight:
                raise CapacityError(
                    f"the {self.backend} backend already has {len(self._in_flight)} jobs in "
                    f"flight (max_in_flight={self.max_in_flight}); wait for some to complete"
                )
            self._in_flight[job_id] = direction
            self._counts[direction].in_flight += 1

    def complete(self, result: TransferResult) -> None:
        """Record ``result``; hand it to the callback (outside the lock) or queue it for poll."""
        with self._cond:
            direction = self._in_flight.pop(result.job_id, None)
            if direction is None:
                logger.warning("%s backend: result for unknown job %d", self.backend, result.job_id)
                return
            counts = self._counts[direction]
            counts.in_flight -= 1
            if result.success:
                counts.succeeded += 1
                counts.bytes += result.nbytes
                counts.seconds += result.seconds
            else:
                counts.failed += 1
            if self._on_complete is None:
                self._results.append(result)
            self._cond.notify_all()
        if self._on_complete is not None:
            try:
                self._on_complete(result)
            except Exception:
                logger.exception("%s backend: on_complete callback failed", self.backend)

    def poll(self) -> list[TransferResult]:
        with self._cond:
            out = list(self._results)
            self._results.clear()
            return out

    def is_in_flight(self, job_id: int) -> bool:
        with self._cond:
            return job_id in self._in_flight

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        ids = set(job_ids)
        with self._cond:
            return self._cond.wait_for(lambda: ids.isdisjoint(self._in_flight), timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout)

    def begin_close(self) -> bool:
        """Stop admitting jobs; ``True`` for the one caller that should do the closing."""
        with self._cond:
            if self._state is not BackendState.OPEN:
                return False
            self._state = BackendState.CLOSING
            return True

    def finish_close(self) -> None:
        with self._cond:
            self._state = BackendState.CLOSED
            self._cond.notify_all()

    def wait_closed(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._state is BackendState.CLOSED, timeout)

    def statistics(self) -> BackendStatistics:
        with self._cond:
            return BackendStatistics(
                backend=self.backend,
                state=self._state.value,
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
    """The result of a job whose copy raised ``exc``."""
    return TransferResult(
        job_id=job_id,
        success=False,
        direction=direction,
        nbytes=nbytes,
        seconds=time.perf_counter() - started,
        error=f"{type(exc).__name__}: {exc}",
    )
