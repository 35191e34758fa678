"""Closing a threaded backend while another thread submits: every admitted job completes."""

from __future__ import annotations

import threading

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import ResourceClosedError
from tiering.specs import GPULoadStoreSpec
from tiering.transfer.mock import MockBackend


def test_jobs_admitted_before_close_all_complete() -> None:
    for _ in range(100):
        backend = MockBackend()
        admitted: list[int] = []

        def submit_until_closed(
            backend: MockBackend = backend, admitted: list[int] = admitted
        ) -> None:
            for job_id in range(10_000):
                try:
                    backend.submit(job_id, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
                except ResourceClosedError:
                    return
                admitted.append(job_id)

        thread = threading.Thread(target=submit_until_closed)
        thread.start()
        backend.close()
        thread.join()
        assert backend.wait(admitted, timeout=5)
        stats = backend.statistics()
        assert stats.in_flight == 0
        assert stats.succeeded == len(admitted)
