"""Jobs as the scheduler's callers see them: handles, results, counts."""

from __future__ import annotations

import bisect
import enum
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import msgspec

from tiering._types import OffloadKey, TransferDirection
from tiering.errors import TransferError
from tiering.hints import Hint
from tiering.scheduler._plan import PlannedJob
from tiering.specs import IntArray

if TYPE_CHECKING:
    from tiering.scheduler._scheduler import Scheduler

# No ``__all__``: `tiering.scheduler` lists the names of this module that it exposes.


class JobOutcome(enum.StrEnum):
    """How a job ended."""

    SUCCEEDED = "succeeded"  # every byte landed (or there was nothing to copy)
    FAILED = "failed"  # the backend reported a failure; see ``error``
    NO_ROOM = "no_room"  # a store found no room in the tier: nothing was copied
    CANCELLED = "cancelled"  # removed before any byte moved (by the caller or by close)


class JobResult(msgspec.Struct, frozen=True, kw_only=True):
    # Tracked by the garbage collector: ``exception`` may hold a traceback whose
    # frames hold the job, and so this result (a cycle only the collector frees).
    """The result of a store or load job."""

    job_id: int
    kind: TransferDirection
    outcome: JobOutcome
    chunks: int  # chunks the job copied (or would have)
    nbytes: int  # bytes moved on success
    seconds: float  # time spent copying (sum over the job's slices)
    latency: float  # from submission to completion
    error: str | None = None
    #: A failed job's first failure as the backend raised it: a `TransferError`
    #: (a `CopyFailedError` holds the torch or CUDA error as ``cause``); ``None``
    #: when the job did not fail in a backend (no room, cancelled, closed).
    exception: TransferError | None = None

    @property
    def success(self) -> bool:
        return self.outcome is JobOutcome.SUCCEEDED


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


def manager_job(job_id: int) -> tuple[str, int]:
    """The id under which the scheduler's job ``job_id`` holds state in the manager."""
    return ("scheduler", job_id)


class _Job(PlannedJob):
    """A job: its planning state, what it copies, and its result once it has ended."""

    __slots__ = (
        "blocks",
        "chunks",
        "done",
        "exception",
        "hint",
        "id",
        "keys",
        "nbytes",
        "result",
        "seconds",
        "submitted",
    )

    def __init__(
        self,
        job_id: int,
        kind: TransferDirection,
        keys: tuple[OffloadKey, ...],
        hint: Hint | None = None,
    ) -> None:
        PlannedJob.__init__(self, kind)  # not super(): a job is made per submission
        self.id = job_id
        self.keys = keys  # a store's: once prepared, those it writes (not those present)
        self.hint = hint  # a store's retention hint, for the tiers below (`on_stored`)
        self.blocks: IntArray | None = None  # GPU blocks a store reads (for flush)
        self.chunks = 0
        self.nbytes = 0
        self.seconds = 0.0
        self.submitted = time.perf_counter()
        self.done: anyio.Event | None = None  # made when someone waits (most never do)
        self.result: JobResult | None = None
        self.exception: TransferError | None = None  # the first failure, as raised

    def finish(self, outcome: JobOutcome, error: str | None) -> JobResult:
        """Set the job's result and wake whoever waits for it."""
        self.result = JobResult(
            job_id=self.id,
            kind=self.kind,
            outcome=outcome,
            chunks=self.chunks,
            nbytes=self.nbytes if outcome is JobOutcome.SUCCEEDED else 0,
            seconds=self.seconds,
            latency=time.perf_counter() - self.submitted,
            error=error,
            exception=self.exception if outcome is JobOutcome.FAILED else None,
        )
        if self.done is not None:
            self.done.set()
        return self.result

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
    def kind(self) -> TransferDirection:
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


class _Counts:
    """How the jobs of one direction ended, and how long started ones took."""

    __slots__ = (
        "bytes",
        "cancelled",
        "failed",
        "latency",
        "latency_seconds",
        "no_room",
        "seconds",
        "succeeded",
    )

    def __init__(self) -> None:
        self.succeeded = self.failed = self.cancelled = self.no_room = self.bytes = 0
        self.seconds = 0.0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_seconds = 0.0

    def add(self, result: JobResult, started: bool) -> None:
        """Count a job that has ended; ``started`` jobs count in the latency histogram."""
        outcome = result.outcome
        if outcome is JobOutcome.SUCCEEDED:
            self.succeeded += 1
            self.bytes += result.nbytes
            self.seconds += result.seconds
        elif outcome is JobOutcome.FAILED:
            self.failed += 1
        elif outcome is JobOutcome.CANCELLED:
            self.cancelled += 1
        else:
            self.no_room += 1
        if started:
            self.latency[bisect.bisect_left(LATENCY_BUCKETS, result.latency)] += 1
            self.latency_seconds += result.latency

    def statistics(
        self, *, queued: int, in_flight: int, inflight_bytes: int
    ) -> DirectionStatistics:
        return DirectionStatistics(
            queued=queued,
            in_flight=in_flight,
            inflight_bytes=inflight_bytes,
            succeeded=self.succeeded,
            failed=self.failed,
            cancelled=self.cancelled,
            no_room=self.no_room,
            bytes=self.bytes,
            seconds=self.seconds,
            latency_buckets=tuple(self.latency),
            latency_seconds=self.latency_seconds,
        )
