"""The mock backend's scripting: gate, failures, latency hooks and records."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import (
    CapacityError,
    ConfigError,
    ResourceClosedError,
    SpecError,
    TransferError,
)
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import (
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferDirection,
    TransferResult,
)
from tiering.transfer.mock import MockBackend, MockJob


def store(block: int = 0, chunk: int = 0) -> tuple[Any, Any]:
    return GPULoadStoreSpec([block]), CPULoadStoreSpec([chunk])


def load(chunk: int = 0, block: int = 0) -> tuple[Any, Any]:
    return CPULoadStoreSpec([chunk]), GPULoadStoreSpec([block])


def test_a_gated_job_waits_until_released() -> None:
    with MockBackend(gated=True) as mock:
        mock.submit(1, *store())
        mock.submit(2, *load())
        assert mock.held == [1, 2]
        assert not mock.wait([1, 2], timeout=0)
        assert mock.statistics().in_flight == 2
        mock.release(2)
        assert mock.wait([2])
        assert [r.job_id for r in mock.poll()] == [2]
        assert mock.held == [1]
        mock.release()
        assert mock.wait([1])
        assert [r.job_id for r in mock.poll()] == [1]


def test_a_released_job_still_waits_for_earlier_jobs_of_its_direction() -> None:
    with MockBackend(gated=True) as mock:
        mock.submit(1, *store())
        mock.submit(2, *store())
        mock.release(2)
        assert not mock.wait([2], timeout=0.05)  # FIFO: job 1 is still held
        mock.release(1)
        assert mock.wait([1, 2])
        assert [r.job_id for r in mock.poll()] == [1, 2]


def test_open_and_close_gate() -> None:
    with MockBackend(gated=True) as mock:
        mock.submit(1, *store())
        mock.open_gate()
        assert mock.wait([1])
        mock.submit(2, *store())  # not held any more
        assert mock.wait([2])
        mock.close_gate()
        mock.submit(3, *store())
        assert mock.held == [3]
        mock.release(99)  # naming an unknown job releases nothing
        assert mock.held == [3]


def test_close_releases_held_jobs_so_it_never_hangs() -> None:
    mock = MockBackend(gated=True)
    mock.submit(1, *store())
    mock.close()
    assert [r.job_id for r in mock.poll()] == [1]
    with pytest.raises(ResourceClosedError):
        mock.submit(2, *store())


@pytest.mark.parametrize("fail", [{2}, lambda job: job.job_id == 2])
def test_scripted_failures_are_failed_results(fail: Any) -> None:
    with MockBackend(fail=fail) as mock:
        for job_id in (1, 2, 3):
            mock.submit(job_id, *store(chunk=job_id))
        assert mock.wait([1, 2, 3])
        results = {r.job_id: r for r in mock.poll()}
        assert [results[j].success for j in (1, 2, 3)] == [True, False, True]
        assert results[2].error == "TransferError: scripted failure of job 2"
        # The scripted failure is itself the TransferError: nothing to wrap.
        assert type(results[2].exception) is TransferError
        assert str(results[2].exception) == "scripted failure of job 2"
        assert results[1].exception is None
        assert mock.statistics().failed == 1


def test_delay_can_depend_on_the_job() -> None:
    asked: list[MockJob] = []

    def delay(job: MockJob) -> float:
        asked.append(job)
        return 0.0

    with MockBackend(delay_s=delay) as mock:
        mock.submit(7, *load())
        assert mock.wait([7])
    assert [(j.job_id, j.direction) for j in asked] == [(7, TransferDirection.LOAD)]


def test_it_records_what_it_was_asked_to_do() -> None:
    with MockBackend() as mock:
        src, dst = store(block=3, chunk=4)
        mock.submit(5, src, dst)
        mock.submit(6, *load())
        assert mock.wait([5, 6])
        jobs = mock.submitted
    assert [(j.job_id, j.direction) for j in jobs] == [
        (5, TransferDirection.STORE),
        (6, TransferDirection.LOAD),
    ]
    assert jobs[0].src is src
    assert jobs[0].dst is dst


def test_without_a_layout_only_the_spec_types_are_checked() -> None:
    with MockBackend() as mock:
        with pytest.raises(SpecError, match="GPULoadStoreSpec -> GPULoadStoreSpec"):
            mock.submit(1, GPULoadStoreSpec([0]), GPULoadStoreSpec([1]))
        mock.submit(2, *store(block=10**6, chunk=10**6))
        assert mock.wait([2])
        (result,) = mock.poll()
        assert result.success
        assert result.nbytes == 0
        assert mock.submitted[0].job_id == 2  # refused jobs are not recorded


def test_a_job_id_in_flight_cannot_be_reused() -> None:
    with MockBackend(gated=True) as mock:
        mock.submit(1, *store())
        with pytest.raises(SpecError, match="job id 1 is already in flight"):
            mock.submit(1, *store(chunk=1))
        assert mock.held == [1]  # the refused duplicate did not disturb the held job
        mock.open_gate()
        assert mock.wait([1])
        mock.submit(1, *store())  # completed ids may be used again
        assert mock.wait([1])


def test_in_flight_jobs_are_bounded() -> None:
    with MockBackend(gated=True, max_in_flight=2) as mock:
        mock.submit(1, *store())
        mock.submit(2, *store())
        with pytest.raises(CapacityError, match="max_in_flight=2"):
            mock.submit(3, *store())


def test_a_callback_may_close_the_backend() -> None:
    closed = threading.Event()
    holder: dict[str, MockBackend] = {}

    def on_complete(result: TransferResult) -> None:
        holder["mock"].close()  # from the worker thread: finishes in the background
        closed.set()

    mock = MockBackend(on_complete=on_complete)
    holder["mock"] = mock
    mock.submit(1, *store())
    assert closed.wait(60)
    mock.close()  # from here it waits until the background close is done
    assert mock.statistics().state == "closed"


def test_layout_without_pool_is_a_config_error() -> None:
    layout = KVLayout([KVCacheTensor(torch.zeros(4, 64, dtype=torch.uint8), 4, 64)], 1)
    with pytest.raises(ConfigError, match="both a layout and a pool"):
        MockBackend(layout)


def test_copy_false_validates_but_moves_nothing() -> None:
    kv = torch.full((4, 64), 5, dtype=torch.uint8)
    layout = KVLayout([KVCacheTensor(kv, 4, 64)], 1)
    pool = HostMemoryPool(layout.pool_bytes(2))
    with MockBackend(layout, pool, copy=False) as mock:
        with pytest.raises(SpecError, match="chunk id 2"):
            mock.submit(1, *store(chunk=2))
        mock.submit(2, *store(chunk=1))
        assert mock.wait([2])
        (result,) = mock.poll()
        assert result.nbytes == 64
    assert int(pool.tensor.sum()) == 0
    pool.close()
