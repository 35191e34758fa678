"""The ``mock`` backend: a real backend with scripted latency, failures and a gate.

It honours the whole contract (FIFO per direction, one result per job, failures
as failed results, close semantics) and by default really copies the bytes, so
tests of the layers above (scheduler ordering, failures, cancellation, flush)
run against it as they would against the ``cpu`` backend, deterministically:

* ``gated=True`` holds every job before it starts until `release` names it (or
  `open_gate` lets everything through), so a test decides when each job ends,
  without sleeping;
* ``fail`` (job ids, or a predicate over `MockJob`) makes jobs fail with a
  `TransferError` text;
* ``delay_s`` (seconds, or a function of the job) adds latency before the copy;
* `submitted` records every job accepted, in submission order.

Without a layout and pool it validates only the spec types and moves nothing
(``nbytes`` is then 0).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection

import msgspec

from tiering.errors import ConfigError, TransferError
from tiering.specs import LoadStoreSpec
from tiering.transfer.base import DEFAULT_MAX_IN_FLIGHT, CompletionCallback
from tiering.transfer.cpu import PageCopier
from tiering.transfer.layout import KVLayout, TransferDirection, job_direction
from tiering.transfer.memory import HostMemoryPool
from tiering.transfer.worker import ThreadedBackend, ThreadedJob

__all__ = ["SUBMITTED_KEPT", "MockBackend", "MockJob"]

#: How many of the latest accepted jobs `MockBackend.submitted` remembers.
SUBMITTED_KEPT = 1 << 16


class MockJob(msgspec.Struct, frozen=True, gc=False):
    """A job the mock backend accepted."""

    job_id: int
    direction: TransferDirection
    src: LoadStoreSpec
    dst: LoadStoreSpec


class MockBackend(ThreadedBackend):
    """Scripted transfers; see the module docstring.

    ``copy=True`` (the default when a layout and pool are given) moves the bytes
    with the cpu backend's copier, so the layout must be on the CPU. Jobs still
    held by the gate when `close` is called are released, so close never hangs.
    """

    name = "mock"

    def __init__(
        self,
        layout: KVLayout | None = None,
        pool: HostMemoryPool | None = None,
        *,
        copy: bool = True,
        delay_s: float | Callable[[MockJob], float] = 0.0,
        fail: Collection[int] | Callable[[MockJob], bool] | None = None,
        gated: bool = False,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if (layout is None) != (pool is None):
            raise ConfigError("give the mock backend both a layout and a pool, or neither")
        self.layout = layout
        self._num_chunks = 0 if layout is None or pool is None else layout.num_chunks(pool.nbytes)
        self._copier: PageCopier | None = None
        if copy and layout is not None and pool is not None:
            self._copier = PageCopier(layout, pool)
        self._delay = delay_s
        self._fail = fail
        self._gate = threading.Condition()
        self._gate_open = not gated
        self._released: set[int] = set()
        self._held: dict[int, None] = {}
        # The last jobs accepted (bounded: a long benchmark must not grow it forever).
        self._submitted: deque[MockJob] = deque(maxlen=SUBMITTED_KEPT)
        super().__init__(on_complete=on_complete, max_in_flight=max_in_flight)

    # -- scripting ------------------------------------------------------------

    @property
    def submitted(self) -> list[MockJob]:
        """The jobs accepted so far (the last `SUBMITTED_KEPT`), in submission order (a copy)."""
        return list(self._submitted)  # appended to without a lock; copying is atomic

    @property
    def held(self) -> list[int]:
        """Ids of jobs accepted while the gate was shut and not released yet."""
        with self._gate:
            return [j for j in self._held if j not in self._released]

    def release(self, *job_ids: int) -> None:
        """Let the given held jobs run (all held jobs if none is given).

        Jobs still run in FIFO order per direction: a released job waits for
        the held jobs submitted before it in its direction.
        """
        with self._gate:
            self._released.update(j for j in (job_ids or self._held) if j in self._held)
            self._gate.notify_all()

    def open_gate(self) -> None:
        """Release every held job and stop holding new ones."""
        with self._gate:
            self._gate_open = True
            self._released.update(self._held)
            self._gate.notify_all()

    def close_gate(self) -> None:
        """Hold every job submitted from now on until it is released."""
        with self._gate:
            self._gate_open = False

    # -- backend --------------------------------------------------------------

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        hold = False
        if not self._gate_open:  # an open gate costs no lock: most runs never shut it
            with self._gate:  # hold it before a worker can see it
                hold = not self._gate_open and job_id not in self._held
                if hold:
                    self._held[job_id] = None
        try:
            super().submit(job_id, src, dst)
        except BaseException:
            if hold:
                with self._gate:
                    self._held.pop(job_id, None)
            raise

    def admitted(self, job: ThreadedJob) -> None:
        self._submitted.append(MockJob(job.job_id, job.direction, job.src, job.dst))

    def prepare(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> ThreadedJob:
        if self.layout is None:
            return ThreadedJob(job_id, job_direction(src, dst), None, src, dst)
        plan = self.layout.plan(src, dst, self._num_chunks)
        work = None if self._copier is None else self._copier.compile(plan)
        return ThreadedJob(job_id, plan.direction, plan, src, dst, work)

    def execute(self, job: ThreadedJob) -> None:
        if job.job_id in self._held:  # only submit adds it, before the job is queued
            with self._gate:
                self._gate.wait_for(
                    lambda: job.job_id not in self._held or job.job_id in self._released
                )
                self._held.pop(job.job_id, None)
                self._released.discard(job.job_id)
        delay, fail = self._delay, self._fail
        if callable(delay) or callable(fail):
            mock_job = MockJob(job.job_id, job.direction, job.src, job.dst)
            delay = delay(mock_job) if callable(delay) else delay
            failing = fail(mock_job) if callable(fail) else fail is not None and job.job_id in fail
        else:
            failing = fail is not None and job.job_id in fail
        if delay > 0:
            time.sleep(delay)
        if failing:
            raise TransferError(f"scripted failure of job {job.job_id}")
        if self._copier is not None and job.plan is not None:
            self._copier.execute(job.plan, job.work)

    def close(self) -> None:
        self.open_gate()
        super().close()

    def release_resources(self) -> None:
        if self._copier is not None:
            self._copier.close()
        self._copier = None
