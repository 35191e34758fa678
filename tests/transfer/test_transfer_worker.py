"""The threaded backends' shared lifecycle with copies that land later (as the cuda backend's).

A small backend whose `execute` returns a `PendingCopy` held on an event stands
in for the cuda backend, so the two-thread path (launch, then land) runs here
without a GPU.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import CopyFailedError, TransferError
from tiering.specs import GPULoadStoreSpec, LoadStoreSpec
from tiering.transfer import TransferDirection, TransferResult
from tiering.transfer.layout import job_direction
from tiering.transfer.worker import PendingCopy, ThreadedBackend, ThreadedJob

STORE = (GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))


class _Held(PendingCopy):
    def __init__(self, landed: threading.Event, error: Exception | None) -> None:
        self.landed = landed
        self.error = error

    def wait(self) -> float:
        assert self.landed.wait(60)
        if self.error is not None:
            raise self.error
        return 0.25


class LaterBackend(ThreadedBackend):
    """`execute` starts a copy that lands when the test says (`land`)."""

    name = "later"
    completes_later = True

    def __init__(self, **kwargs: Any) -> None:
        self.landed: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.raise_in_execute: dict[int, Exception] = {}
        self.raise_landing: dict[int, Exception] = {}
        self.done_at_once: set[int] = set()
        self.closing = threading.Event()
        super().__init__(**kwargs)

    def prepare(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> ThreadedJob:
        self.landed.setdefault(job_id, threading.Event())
        self.started.setdefault(job_id, threading.Event())
        return ThreadedJob(job_id, job_direction(src, dst), None, src, dst)

    def execute(self, job: ThreadedJob) -> PendingCopy | None:
        self.started[job.job_id].set()
        if job.job_id in self.raise_in_execute:
            raise self.raise_in_execute[job.job_id]
        if job.job_id in self.done_at_once:
            return None
        return _Held(self.landed[job.job_id], self.raise_landing.get(job.job_id))

    def land(self, *job_ids: int) -> None:
        for job_id in job_ids:
            self.landed[job_id].set()

    def close(self) -> None:
        self.closing.set()
        super().close()


def test_the_worker_starts_the_next_copy_while_one_is_landing_and_results_stay_in_order() -> None:
    with LaterBackend() as backend:
        backend.raise_in_execute[2] = RuntimeError("launch failed")
        backend.done_at_once.add(3)
        for job_id in (1, 2, 3):
            backend.submit(job_id, *STORE)
        # Job 3 was started while job 1 is still landing: the launcher did not wait.
        assert backend.started[3].wait(60)
        # Jobs 2 (failed at once) and 3 (nothing to wait for) are over, yet they
        # wait behind job 1: a direction's results come out in submission order.
        assert backend.poll() == []
        assert backend.statistics().in_flight == 3
        backend.land(1)
        assert backend.wait([1, 2, 3], timeout=60)
        results = backend.poll()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert results[0].seconds == 0.25  # the pending copy's own timing
    assert results[1].error == "RuntimeError: launch failed"
    assert isinstance(results[1].exception, CopyFailedError)


def test_a_copy_that_fails_landing_is_a_failed_result_holding_its_cause() -> None:
    with LaterBackend() as backend:
        cause = RuntimeError("CUDA error: an illegal memory access was encountered")
        backend.raise_landing[1] = cause
        backend.submit(1, *STORE)
        backend.land(1)
        assert backend.wait([1], timeout=60)
        (result,) = backend.poll()
    assert not result.success
    assert result.error == f"RuntimeError: {cause}"
    error = result.exception
    assert isinstance(error, CopyFailedError)
    assert error.cause is cause
    assert error.__cause__ is cause
    assert error.job_id == 1
    assert result.direction is TransferDirection.STORE


def test_close_waits_for_the_copies_still_landing() -> None:
    backend = LaterBackend()
    for job_id in (1, 2):
        backend.submit(job_id, *STORE)
    backend.submit(3, CPULoadStoreSpec([0]), GPULoadStoreSpec([0]))

    def land_once_closing() -> None:
        assert backend.closing.wait(60)
        backend.land(1, 2, 3)

    helper = threading.Thread(target=land_once_closing)
    helper.start()
    backend.close()  # returns only once every admitted job has landed
    helper.join()
    stats = backend.statistics()
    assert (stats.state, stats.succeeded, stats.in_flight) == ("closed", 3, 0)
    assert sorted(r.job_id for r in backend.poll()) == [1, 2, 3]


def test_results_come_from_the_finisher_and_it_may_close_the_backend() -> None:
    seen: list[tuple[int, str]] = []
    closed = threading.Event()
    holder: dict[str, LaterBackend] = {}

    def on_complete(result: TransferResult) -> None:
        seen.append((result.job_id, threading.current_thread().name))
        holder["backend"].close()  # from the finisher: finishes in the background
        closed.set()

    backend = LaterBackend(on_complete=on_complete)
    holder["backend"] = backend
    backend.submit(1, *STORE)
    backend.land(1)
    assert closed.wait(60)
    backend.close()  # waits for the background close
    assert seen == [(1, "tiering-later-store-done")]
    assert backend.statistics().state == "closed"


def test_a_copy_failed_error_pickles_with_its_cause() -> None:
    error = CopyFailedError("RuntimeError: boom", RuntimeError("boom"), 7)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is CopyFailedError
    assert isinstance(again, TransferError)
    assert (str(again), again.job_id, str(again.cause)) == ("RuntimeError: boom", 7, "boom")
    assert again.__cause__ is again.cause


@pytest.mark.parametrize("completes_later", [False, True])
def test_a_synchronous_backend_has_no_finishers(completes_later: bool) -> None:
    class Backend(LaterBackend):
        pass

    Backend.completes_later = completes_later
    with Backend() as backend:
        names = {t.name for t in threading.enumerate()}
        assert ("tiering-later-load-done" in names) is completes_later
        backend.done_at_once.add(1)
        backend.submit(1, *STORE)
        assert backend.wait([1], timeout=60)
        assert [r.success for r in backend.poll()] == [True]
