"""The cuda backend: stream ordering, pinning, batching (GPU tests skip without CUDA)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import ConfigError
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import (
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferDirection,
    get_backend_class,
)
from tiering.transfer.cuda import copy_pieces

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# About 50 ms of GPU time on current parts: long enough to lose any race.
SLEEP_CYCLES = 100_000_000


def test_copy_pieces_cut_runs_at_capacity_and_pinned_pieces() -> None:
    slots = np.array([0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 3])
    assert copy_pieces(slots, max_slots=3, piece_slots=100) == [
        (0, 3),
        (3, 6),
        (6, 8),
        (8, 10),
        (10, 11),
    ]
    assert copy_pieces(slots, max_slots=100, piece_slots=4) == [(0, 4), (4, 8), (8, 10), (10, 11)]
    assert copy_pieces(np.zeros(0, dtype=np.int64), 4, 4) == []


def test_importing_the_cuda_backend_does_not_initialize_cuda() -> None:
    code = (
        "import sys, torch, tiering.transfer as t\n"
        "assert 'tiering.transfer.cuda' not in sys.modules\n"
        "t.get_backend_class('cpu'); t.get_backend_class('mock')\n"
        "assert 'tiering.transfer.cuda' not in sys.modules\n"
        "assert t.get_backend_class('cuda').name == 'cuda'\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_the_backend_refuses_with_a_message() -> None:
    layout = KVLayout([KVCacheTensor(torch.zeros(4, 64, dtype=torch.uint8), 4, 64)], 1)
    with HostMemoryPool(layout.pool_bytes(2)) as pool, pytest.raises(ConfigError, match="CUDA"):
        get_backend_class("cuda")(layout, pool)  # type: ignore[call-arg]


@pytest.fixture
def rig() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tiering.transfer.cuda import CudaBackend

    kv = torch.zeros(64, 4096, dtype=torch.uint8, device="cuda")
    layout = KVLayout([KVCacheTensor(kv, 64, 4096)], blocks_per_chunk=4)
    pool = HostMemoryPool(layout.pool_bytes(16))
    backend = CudaBackend(layout, pool)
    yield kv, pool, backend, layout
    backend.close()
    pool.close()


@gpu
@needs_cuda
def test_the_pool_is_pinned(rig: Any) -> None:
    _, _, backend, _ = rig
    assert backend.pinned


@gpu
@needs_cuda
def test_a_store_waits_for_the_kernels_writing_the_blocks(rig: Any) -> None:
    kv, pool, backend, layout = rig
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the "model" is busy ...
    kv[:4].fill_(42)  # ... then writes the blocks
    backend.submit(0, GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([5]))
    assert backend.wait([0], timeout=60)
    assert backend.poll()[0].success
    row = pool.tensor[5 * layout.row_bytes : 6 * layout.row_bytes]
    assert bool((row[: 4 * 4096] == 42).all())


@gpu
@needs_cuda
def test_a_load_waits_for_the_kernels_reading_the_blocks(rig: Any) -> None:
    kv, pool, backend, _ = rig
    kv.fill_(1)
    pool.tensor.fill_(2)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the "model" is busy ...
    seen = kv[:4].clone()  # ... then reads the blocks the load overwrites
    backend.submit(0, CPULoadStoreSpec([3]), GPULoadStoreSpec([0, 1, 2, 3]))
    assert backend.wait([0], timeout=60)
    assert backend.poll()[0].success
    torch.cuda.synchronize()
    assert bool((seen == 1).all())
    assert bool((kv[:4] == 2).all())


@gpu
@needs_cuda
def test_loads_run_on_higher_priority_streams_than_stores(rig: Any) -> None:
    _, _, backend, _ = rig
    backend.submit(0, GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([0]))
    backend.submit(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([4, 5, 6, 7]))
    assert backend.wait([0, 1], timeout=60)
    assert all(r.success for r in backend.poll())
    low, high = torch.cuda.Stream.priority_range()
    if low == high:
        pytest.skip("this device has a single stream priority")
    load_stream = backend._streams[TransferDirection.LOAD][0]
    store_stream = backend._streams[TransferDirection.STORE][0]
    assert load_stream.priority < store_stream.priority


@gpu
@needs_cuda
def test_pageable_mode_still_moves_every_byte() -> None:
    from tiering.transfer.cuda import CudaBackend

    kv = torch.randint(0, 256, (32, 1024), dtype=torch.uint8, device="cuda")
    layout = KVLayout([KVCacheTensor(kv, 32, 1024)], blocks_per_chunk=2)
    pool = HostMemoryPool(layout.pool_bytes(8))
    backend = CudaBackend(layout, pool, pin=False, staging_bytes=layout.slot_bytes)
    try:
        assert not backend.pinned
        original = kv.clone()
        backend.submit(0, GPULoadStoreSpec([7, 3, 9, 1]), CPULoadStoreSpec([6, 2]))
        backend.submit(1, CPULoadStoreSpec([6, 2]), GPULoadStoreSpec([20, 21, 22, 23]))
        assert backend.wait([0, 1], timeout=60)
        assert all(r.success for r in backend.poll())
        torch.cuda.synchronize()
        assert torch.equal(kv[20:24], original[[7, 3, 9, 1]])
    finally:
        backend.close()
        pool.close()


@gpu
@needs_cuda
def test_results_carry_event_timing(rig: Any) -> None:
    _, _, backend, _ = rig
    backend.submit(0, GPULoadStoreSpec(list(range(16))), CPULoadStoreSpec([0, 1, 2, 3]))
    assert backend.wait([0], timeout=60)
    (result,) = backend.poll()
    assert result.success
    assert result.nbytes == 16 * 4096
    assert result.seconds > 0
