"""The cpu copier's staged path (gather into a staging buffer, scatter from it), byte for byte."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.specs import SMALL_IDS, GPULoadStoreSpec
from tiering.transfer import HostMemoryPool, KVCacheTensor, KVLayout, TransferDirection
from tiering.transfer.cpu import PageCopier

# Two tensors in group 0, one in group 1; a staging buffer of 8 KiB holds two
# 4 KiB pages, so every job below is several pieces.
PAGES = ((0, 4096), (0, 1024), (1, 2048))
STAGING = 8192
NUM_BLOCKS = 48


def _rig(bpc: int, num_chunks: int) -> tuple[KVLayout, HostMemoryPool, list[torch.Tensor]]:
    kv = [torch.zeros(NUM_BLOCKS, page, dtype=torch.uint8) for _, page in PAGES]
    layout = KVLayout(
        [
            KVCacheTensor(t, num_blocks=NUM_BLOCKS, page_bytes=page, group=g)
            for t, (g, page) in zip(kv, PAGES, strict=True)
        ],
        blocks_per_chunk=bpc,
    )
    return layout, HostMemoryPool(layout.pool_bytes(num_chunks)), kv


def _randomize(rng: np.random.Generator, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.view(-1).copy_(torch.from_numpy(rng.integers(0, 256, t.numel(), dtype=np.uint8)))


def _spy(copier: PageCopier, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which path each group of each job takes."""
    calls: list[str] = []
    staged, direct = copier._copy_staged, copier._copy_group

    def spy_staged(*args: Any) -> Any:
        calls.append("staged")
        return staged(*args)

    def spy_direct(*args: Any) -> Any:
        calls.append("direct")
        return direct(*args)

    monkeypatch.setattr(copier, "_copy_staged", spy_staged)
    monkeypatch.setattr(copier, "_copy_group", spy_direct)
    return calls


@pytest.mark.parametrize("bpc", [1, 4])
def test_staged_round_trip_is_byte_exact(bpc: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    chunks_per_group = 16 // bpc * 2  # 32 blocks per group: many pieces of the buffer
    n = chunks_per_group * bpc
    num_chunks = 2 * chunks_per_group + 3
    layout, pool, kv = _rig(bpc, num_chunks)
    # The same job through the direct path, into a second pool, as the reference.
    ref_pool = HostMemoryPool(layout.pool_bytes(num_chunks))
    staged = PageCopier(layout, pool, staging_bytes=STAGING, stage_below_bytes=1 << 30)
    direct = PageCopier(layout, ref_pool, stage_below_bytes=0)
    calls = _spy(staged, monkeypatch)
    try:
        assert n * 4096 > STAGING
        _randomize(rng, kv)
        pool.tensor.fill_(0xA5)
        ref_pool.tensor.fill_(0xA5)
        # Scattered on both sides: shuffled blocks, shuffled chunk ids.
        src = [rng.permutation(NUM_BLOCKS)[:n].tolist() for _ in range(2)]
        chunks = rng.permutation(num_chunks)[: 2 * chunks_per_group].tolist()
        store = layout.plan(
            GPULoadStoreSpec(src[0] + src[1], [n, n]), CPULoadStoreSpec(chunks), num_chunks
        )
        assert store.direction is TransferDirection.STORE
        staged.copy(store)
        direct.copy(store)
        assert calls == ["staged", "staged"]
        # Every pool byte, padding included, is what the direct path wrote.
        assert torch.equal(pool.tensor, ref_pool.tensor)
        original = [t.clone() for t in kv]

        # Load into other blocks, starting part-way into the first chunk when it can.
        skip = bpc - 1
        _randomize(rng, kv)
        before = [t.clone() for t in kv]
        dst = [rng.permutation(NUM_BLOCKS)[: n - skip].tolist() for _ in range(2)]
        load = layout.plan(
            CPULoadStoreSpec(chunks),
            GPULoadStoreSpec(dst[0] + dst[1], [n - skip] * 2, [skip, skip]),
            num_chunks,
        )
        calls.clear()
        staged.copy(load)
        assert calls == ["staged", "staged"]
        for t, (g, _) in enumerate(PAGES):
            assert torch.equal(kv[t][dst[g]], original[t][src[g][skip:]])
            untouched = sorted(set(range(NUM_BLOCKS)) - set(dst[g]))
            assert torch.equal(kv[t][untouched], before[t][untouched])
    finally:
        staged.close()
        direct.close()
        pool.close()
        ref_pool.close()


def test_path_is_chosen_by_run_length(monkeypatch: pytest.MonkeyPatch) -> None:
    layout, pool, _ = _rig(1, 8)
    copier = PageCopier(layout, pool, staging_bytes=STAGING, stage_below_bytes=8192)
    calls = _spy(copier, monkeypatch)

    def store(blocks: list[int], chunks: list[int]) -> None:
        spec = GPULoadStoreSpec(blocks, [len(blocks), 0])
        copier.copy(layout.plan(spec, CPULoadStoreSpec(chunks), 8))

    try:
        store([3, 4, 5, 6], [0, 1, 2, 3])  # consecutive on both sides: slice copies
        store([3, 2, 1, 0], [4, 5, 6, 7])  # one run of 4 slots: 4 * (4096 + 1024) / 2 per op
        store([9, 3, 7, 1], [6, 1, 4, 2])  # runs of one page: 2560 bytes per op
        assert calls == ["direct", "direct", "staged"]
    finally:
        copier.close()
        pool.close()


@pytest.mark.parametrize("blocks", [40, SMALL_IDS + 72])  # the Python and the numpy run split
def test_direct_round_trip_of_long_runs_is_byte_exact(
    blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(blocks)
    kv = torch.zeros(2 * blocks, 512, dtype=torch.uint8)
    layout = KVLayout([KVCacheTensor(kv, num_blocks=2 * blocks, page_bytes=512)], 1)
    pool = HostMemoryPool(layout.pool_bytes(2 * blocks))
    copier = PageCopier(layout, pool)
    calls = _spy(copier, monkeypatch)
    try:
        _randomize(rng, [kv])
        want = kv.clone()
        # Three long runs of blocks to three long runs of slots, in another order.
        third = blocks // 3
        src = np.concatenate(
            [
                np.arange(0, third),
                np.arange(blocks, blocks + third),
                np.arange(third, blocks - third),
            ]
        )
        slots = np.concatenate(
            [np.arange(blocks, blocks + 2 * third), np.arange(0, blocks - 2 * third)]
        )
        store = layout.plan(
            GPULoadStoreSpec(src), CPULoadStoreSpec(slots), layout.num_chunks(pool.nbytes)
        )
        copier.copy(store)
        kv.zero_()
        dst = np.arange(2 * blocks - len(src), 2 * blocks)[::-1].copy()  # one run, reversed
        load = layout.plan(
            CPULoadStoreSpec(slots), GPULoadStoreSpec(dst), layout.num_chunks(pool.nbytes)
        )
        copier.copy(load)
        assert torch.equal(kv[torch.from_numpy(dst)], want[torch.from_numpy(src)])
        assert calls == ["direct", "direct"]
    finally:
        copier.close()
        pool.close()


@pytest.mark.parametrize("stage_below", [0, 1 << 30], ids=["direct", "staged"])
def test_a_compiled_job_runs_only_its_copies(
    stage_below: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile` makes every index tensor and view; `run` makes only the copy calls.

    Each torch call in the copy thread gives up the GIL and waits to take it
    back, up to a switch interval while the event loop runs Python, so the
    copy thread must not build anything.
    """
    rng = np.random.default_rng(3)
    layout, pool, kv = _rig(1, 16)
    ref_pool = HostMemoryPool(layout.pool_bytes(16))
    copier = PageCopier(layout, pool, staging_bytes=STAGING, stage_below_bytes=stage_below)
    reference = PageCopier(layout, ref_pool, stage_below_bytes=0)
    try:
        _randomize(rng, kv)
        # Group 0: seven runs of one page on both sides; group 1: one run on both.
        spec = GPULoadStoreSpec([9, 3, 7, 1, 0, 5, 11, 4, 5], [7, 2])
        plan = layout.plan(spec, CPULoadStoreSpec([12, 3, 7, 1, 14, 0, 9, 5, 6]), 16)
        program = copier.compile(plan)
        assert not pool.tensor.any()  # compiling moves nothing
        ops = [op for step, _ in program.steps for op in step]
        if stage_below:  # group 0 per tensor: pieces of the 8 KiB buffer, two ops each
            assert len(ops) == 2 * 4 + 2 * 1 + 1
        else:  # one op per run and tensor
            assert len(ops) == 7 * 2 + 1

        def built(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the copy thread built a tensor")

        with monkeypatch.context() as m:
            m.setattr(torch, "from_numpy", built)
            m.setattr(torch.Tensor, "narrow", built)
            m.setattr(torch.Tensor, "__getitem__", built)
            copier.run(program)
        reference.copy(plan)
        assert torch.equal(pool.tensor, ref_pool.tensor)
        assert pool.tensor.any()
    finally:
        copier.close()
        reference.close()
        pool.close()
        ref_pool.close()
