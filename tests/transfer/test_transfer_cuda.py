"""The cuda backend: stream ordering, pinning, batching (GPU tests skip without CUDA)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
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
from tiering.transfer import cuda as cuda_module
from tiering.transfer.staging import StagedCopies, copy_pieces

DIRECTIONS = tuple(TransferDirection)
cpu = CPULoadStoreSpec

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


def _staged_rig(stage_slots: int, piece_slots: int) -> Any:
    """CPU KV tensors of two groups, a pool, and `StagedCopies` over CPU buffers."""
    rng = np.random.default_rng(5)
    pages = [(0, 4096), (0, 1024), (1, 2048)]
    kv = [torch.from_numpy(rng.integers(0, 256, (32, p), dtype=np.uint8)) for _, p in pages]
    layout = KVLayout([KVCacheTensor(t, 32, p, g) for t, (g, p) in zip(kv, pages, strict=True)], 4)
    pool = HostMemoryPool(layout.pool_bytes(16))
    host = pool.tensor[: 16 * layout.row_bytes].view(layout.word_dtype)
    slot_words = layout.slot_bytes // layout.word_bytes
    copies = StagedCopies(
        layout,
        host,
        {d: torch.empty(stage_slots * slot_words, dtype=layout.word_dtype) for d in DIRECTIONS},
        {d: torch.empty(StagedCopies.max_blocks(layout), dtype=torch.int64) for d in DIRECTIONS},
        stage_slots=stage_slots,
        piece_slots=piece_slots,
    )
    return kv, layout, pool, host, copies, rng


def _run_program(copies: StagedCopies, plan: Any) -> None:
    program = copies.compile(plan)
    assert program.index is not None
    assert program.index_host is not None
    program.index.copy_(program.index_host)
    for call in program.calls:
        call()


def test_a_staged_store_naming_blocks_more_than_once_copies_each() -> None:
    """More block ids than the KV cache has blocks (stores may repeat a block, as the
    cpu backend takes them): the job gets an index of its own, not the shared one."""
    kv = torch.from_numpy(np.random.default_rng(3).integers(0, 256, (8, 1024), dtype=np.uint8))
    layout = KVLayout([KVCacheTensor(kv, 8, 1024)], 1)
    pool = HostMemoryPool(layout.pool_bytes(24))
    try:
        host = pool.tensor[: 24 * layout.row_bytes].view(layout.word_dtype)
        words = layout.slot_bytes // layout.word_bytes
        copies = StagedCopies(
            layout,
            host,
            {d: torch.empty(4 * words, dtype=layout.word_dtype) for d in DIRECTIONS},
            {
                d: torch.empty(StagedCopies.max_blocks(layout), dtype=torch.int64)
                for d in DIRECTIONS
            },
            stage_slots=4,
            piece_slots=1000,
        )
        ids = list(range(8)) * 3  # 24 ids for 8 blocks
        store = layout.plan(GPULoadStoreSpec(ids), cpu(list(range(24))), 24)
        _run_program(copies, store)
        got = layout.pool_view(host, 0)[torch.arange(24)].view(torch.uint8)
        assert torch.equal(got, kv[torch.tensor(ids)])
    finally:
        pool.close()


@pytest.mark.parametrize(("stage_slots", "piece_slots"), [(1, 1000), (3, 8), (64, 4), (64, 1000)])
def test_staged_copies_move_the_pages_of_every_tensor(stage_slots: int, piece_slots: int) -> None:
    # The cuda backend's copies, run on CPU tensors: runs cut at the staging
    # capacity and at pinned-piece boundaries still land every page in its slot.
    kv, layout, pool, host, copies, rng = _staged_rig(stage_slots, piece_slots)
    try:
        blocks = [rng.permutation(32)[:12].tolist(), rng.permutation(32)[:8].tolist()]
        chunks = [5, 6, 7, 1, 9]  # a run, across a piece boundary at slot 24, then scattered
        store = layout.plan(GPULoadStoreSpec(blocks[0] + blocks[1], [12, 8]), cpu(chunks), 16)
        _run_program(copies, store)
        original = [t.clone() for t in kv]
        for group in store.groups:
            slots = torch.from_numpy(group.slots)
            for t in layout.group_tensors[group.group]:
                got = layout.pool_view(host, t)[slots].view(torch.uint8)
                want = layout.kv_view(t)[torch.from_numpy(group.blocks)].view(torch.uint8)
                assert torch.equal(got, want), (group.group, t)

        for t in kv:  # scribble, then load chunks 6, 7 | 9 back into other blocks, skipping 1
            t.copy_(torch.from_numpy(rng.integers(0, 256, t.shape, dtype=np.uint8)))
        before = [t.clone() for t in kv]
        dst = [[20, 21, 22, 23, 24, 25, 26], [0, 1, 2, 3]]
        load = layout.plan(cpu([6, 7, 9]), GPULoadStoreSpec(dst[0] + dst[1], [7, 4], [1, 0]), 16)
        _run_program(copies, load)
        sources = [blocks[0][5:12], blocks[1][4:8]]
        for g in range(2):
            for t in layout.group_tensors[g]:
                assert torch.equal(kv[t][dst[g]], original[t][sources[g]]), (g, t)
                untouched = [b for b in range(32) if b not in dst[g]]
                assert torch.equal(kv[t][untouched], before[t][untouched])
    finally:
        pool.close()


def test_an_empty_job_compiles_to_no_copies() -> None:
    _, layout, pool, _, copies, _ = _staged_rig(4, 8)
    try:
        program = copies.compile(layout.plan(GPULoadStoreSpec([], [0, 0]), cpu([]), 16))
        assert (program.index, program.calls) == (None, [])
    finally:
        pool.close()


def _torch_cuda_names() -> set[str]:
    tree = ast.parse(Path(cuda_module.__file__).read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "cuda"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "torch"
    }


def test_the_torch_cuda_names_the_backend_uses_exist_in_this_torch() -> None:
    # The GPU check runs this on the device's torch (2.11), where nothing else
    # of the backend can be checked before a GPU runs it.
    names = _torch_cuda_names()
    assert {"Event", "Stream", "cudart", "stream", "device"} <= names
    missing = sorted(n for n in names if not hasattr(torch.cuda, n))
    assert missing == [], f"torch {torch.__version__} lacks torch.cuda.{missing}"
    methods = [(torch.cuda.Event, "record"), (torch.cuda.Event, "synchronize")]
    methods += [(torch.cuda.Event, "elapsed_time"), (torch.cuda.Stream, "wait_event")]
    # The rest a CUDA build has, without initializing CUDA (a CPU build has none).
    if torch.version.cuda is not None:
        methods += [(torch.cuda.Stream, "priority"), (torch.cuda.Stream, "priority_range")]
        cudart = torch._C._cudart
        for fn in ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString", "cudaError"):
            assert hasattr(cudart, fn), fn
    assert [f"{c.__name__}.{m}" for c, m in methods if not hasattr(c, m)] == []


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
