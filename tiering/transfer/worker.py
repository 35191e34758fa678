"""Backends whose jobs run in worker threads: one thread and one FIFO per direction.

Stores and loads proceed independently (a long store never delays a load), while
jobs of one direction run in submission order. Torch copy ops release the GIL, so
the two directions, and the caller, really run at the same time. Completion is
pushed from a backend thread: to the ``on_complete`` callback if there is one,
else into the queue `poll` drains; `wait` sleeps on a condition, never spins.

Two kinds of backends share this lifecycle (admission, state, close, failed
results). A synchronous one (``cpu``, ``mock``) moves the bytes in `execute`,
and the job is complete when it returns. An asynchronous one (``cuda``) sets
``completes_later``: its `execute` only *starts* the copy (queues it on a
device) and returns a `PendingCopy`; a second thread per direction, the
finisher, waits for each pending copy in order and completes its job. So the
worker can start job N+1 while job N's bytes are still moving, and every
result of a direction, failed or not, still comes out in submission order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar, Generic, TypeAlias, TypeVar

import msgspec

from tiering.specs import LoadStoreSpec
from tiering.transfer.base import (
    DEFAULT_MAX_IN_FLIGHT,
    BackendStatistics,
    CompletionCallback,
    JobTracker,
    TransferBackend,
    TransferResult,
    failed_result,
)
from tiering.transfer.layout import TransferDirection, TransferPlan

__all__ = ["DirectionWorker", "PendingCopy", "ThreadedBackend", "ThreadedJob"]

logger = logging.getLogger(__name__)

J = TypeVar("J")


class DirectionWorker(Generic[J]):
    """A daemon thread running ``run(job)`` for each job put, in order."""

    def __init__(self, name: str, run: Callable[[J], None]) -> None:
        self._run = run
        self._queue: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, job: J) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Run the jobs already put, then end the thread (joined unless called from it)."""
        self._queue.put(None)
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._run(job)
            except BaseException:  # a bug in run(); keep serving later jobs
                logger.exception("transfer worker %s: job crashed", self.thread.name)


class ThreadedJob(msgspec.Struct, frozen=True, gc=False):
    """A job admitted to a `ThreadedBackend`; ``plan`` is ``None`` for layout-less mocks.

    ``work`` is whatever `ThreadedBackend.prepare` made ready for `ThreadedBackend.execute`
    (the cpu backend's bound copy calls).
    """

    job_id: int
    direction: TransferDirection
    plan: TransferPlan | None
    src: LoadStoreSpec
    dst: LoadStoreSpec
    work: object = None

    @property
    def nbytes(self) -> int:
        return 0 if self.plan is None else self.plan.nbytes


class PendingCopy(ABC):
    """A copy that `ThreadedBackend.execute` started and that has not landed yet."""

    @abstractmethod
    def wait(self) -> float | None:
        """Block until the bytes have landed, then release what the copy held.

        Returns the seconds the copy took (``None``: the time since `execute`
        began counts), or raises why it failed. Called once, in the finisher
        thread of the job's direction.
        """


#: What `execute` left of a job: nothing (done), a copy under way, or what it raised.
_Outcome: TypeAlias = PendingCopy | Exception | None
#: A job on its way to a finisher: the job, its outcome, when `execute` began.
_Landing: TypeAlias = tuple[ThreadedJob, _Outcome, float]


class ThreadedBackend(TransferBackend):
    """A `TransferBackend` that runs `execute` for each job in its direction's worker thread.

    Subclasses provide `prepare` (validate, before admission) and `execute` (move
    the bytes, or with ``completes_later`` start moving them; any exception
    becomes a failed result).
    """

    #: Whether `execute` may return a `PendingCopy`; the backend then has a
    #: finisher thread per direction (see the module docstring).
    completes_later: ClassVar[bool] = False

    def __init__(
        self,
        *,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self._tracker = JobTracker(self.name, on_complete, max_in_flight)
        self._finishers: dict[TransferDirection, DirectionWorker[_Landing]] = {}
        if self.completes_later:
            self._finishers = {
                d: DirectionWorker[_Landing](f"tiering-{self.name}-{d.value}-done", self._land)
                for d in TransferDirection
            }
        self._workers = {
            d: DirectionWorker[ThreadedJob](f"tiering-{self.name}-{d.value}", self._run)
            for d in TransferDirection
        }

    @abstractmethod
    def prepare(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> ThreadedJob:
        """Validate a job (raising `SpecError`) and describe it; no byte moves here."""

    @abstractmethod
    def execute(self, job: ThreadedJob) -> PendingCopy | None:
        """Move the bytes of ``job``, in its worker thread; raise to fail it.

        A backend with ``completes_later`` may instead start the copy and return
        a `PendingCopy`; others return ``None``.
        """

    def release_resources(self) -> None:
        """Drop resources once every job has completed (called once, by `close`)."""

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self._tracker.check_open()
        job = self.prepare(job_id, src, dst)
        self._tracker.admit(job_id, job.direction)
        self.admitted(job)
        self._workers[job.direction].put(job)

    def admitted(self, job: ThreadedJob) -> None:
        """Called in `submit` once ``job`` is admitted, before a worker can run it."""

    def _run(self, job: ThreadedJob) -> None:
        started = time.perf_counter()
        outcome: _Outcome
        try:
            outcome = self.execute(job)
        except Exception as exc:
            outcome = exc
        finisher = self._finishers.get(job.direction)
        if finisher is None:
            self._land((job, outcome, started))
        else:  # even a job that is over goes behind the copies still landing: FIFO
            finisher.put((job, outcome, started))

    def _land(self, landing: _Landing) -> None:
        job, outcome, started = landing
        seconds: float | None = None
        try:
            if isinstance(outcome, Exception):
                raise outcome
            if outcome is not None:
                seconds = outcome.wait()
        except Exception as exc:
            result = failed_result(job.job_id, job.direction, job.nbytes, exc, started)
        else:
            result = TransferResult(
                job_id=job.job_id,
                success=True,
                direction=job.direction,
                nbytes=job.nbytes,
                seconds=time.perf_counter() - started if seconds is None else seconds,
            )
        self._tracker.complete(result)

    def poll(self) -> list[TransferResult]:
        return self._tracker.poll()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        return self._tracker.wait(job_ids, timeout)

    def statistics(self) -> BackendStatistics:
        return self._tracker.statistics()

    def close(self) -> None:
        """Finish every admitted job, stop the workers, release resources. Idempotent.

        Called from a worker thread (an ``on_complete`` callback), it returns at
        once and the closing finishes in the background.
        """
        threads = [w.thread for w in self._workers.values()]
        threads += [f.thread for f in self._finishers.values()]
        on_worker = threading.current_thread() in threads
        if not self._tracker.begin_close():
            if not on_worker:
                self._tracker.wait_closed()
            return
        if on_worker:
            threading.Thread(target=self._finish_close, name=f"tiering-{self.name}-close").start()
        else:
            self._finish_close()

    def _finish_close(self) -> None:
        # A submit that passed admission just before close began may not have
        # queued its job yet: wait for every admitted job before stopping the
        # workers, or that job would sit behind the stop signal forever.
        self._tracker.wait_idle()
        for worker in self._workers.values():
            worker.stop()
        for finisher in self._finishers.values():  # after the workers: they feed them
            finisher.stop()
        try:
            self.release_resources()
        finally:
            self._tracker.finish_close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._tracker.describe()}>"
