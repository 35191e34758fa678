"""The KV layout: zero-copy views, row geometry, and job validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import SpecError
from tiering.specs import SMALL_IDS, GPULoadStoreSpec
from tiering.transfer import (
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferDirection,
    create_backend,
)
from tiering.transfer.layout import ROW_ALIGNMENT, run_bounds, small_run_bounds


def _layout(pages: list[tuple[int, int]], bpc: int = 4, num_blocks: int = 16) -> KVLayout:
    return KVLayout(
        [
            KVCacheTensor(torch.zeros(num_blocks, p, dtype=torch.uint8), num_blocks, p, group=g)
            for g, p in pages
        ],
        blocks_per_chunk=bpc,
    )


def test_views_share_memory_with_the_registered_tensors() -> None:
    kv = torch.zeros(8, 2, 16, 32, dtype=torch.bfloat16)  # 8 blocks of 2 KiB
    layout = KVLayout([KVCacheTensor(kv, num_blocks=8, page_bytes=2048)], blocks_per_chunk=2)
    view = layout.kv_view(0)
    assert view.shape == (8, 2048 // layout.word_bytes)
    assert view.data_ptr() == kv.data_ptr()
    view[3].zero_()
    kv[5].fill_(1.5)
    assert kv[3].abs().sum() == 0
    assert torch.equal(view[5], layout.kv_view(0)[5])
    assert not torch.equal(view[5], view[4])


def test_rows_are_page_aligned_and_sized_by_the_largest_group() -> None:
    layout = _layout([(0, 4096), (0, 1024), (1, 2048)], bpc=4)
    assert layout.group_block_bytes == (5120, 2048)
    assert layout.row_bytes % ROW_ALIGNMENT == 0
    assert layout.row_bytes >= 4 * 5120
    assert layout.slot_bytes * 4 == layout.row_bytes
    assert layout.page_offsets == (0, 4096, 0)
    assert layout.pool_bytes(10) == 10 * layout.row_bytes
    assert layout.num_chunks(layout.pool_bytes(10) + 5) == 10
    # a block count that does not divide the alignment still gets equal slots
    odd = _layout([(0, 24)], bpc=3)
    assert odd.row_bytes % ROW_ALIGNMENT == 0
    assert odd.row_bytes % 3 == 0


def test_a_store_puts_every_tensor_of_a_chunk_into_its_row() -> None:
    layout = _layout([(0, 4096), (0, 1024), (1, 2048)], bpc=2)
    for i, kv in enumerate(layout.tensors):
        kv.tensor.copy_(
            torch.arange(kv.tensor.numel(), dtype=torch.int64).view(kv.tensor.shape) * 7 + i
        )
    pool = HostMemoryPool(layout.pool_bytes(8))
    with create_backend("cpu", layout, pool) as backend:
        blocks = [[9, 3, 4, 11], [6, 1]]
        backend.submit(
            0,
            GPULoadStoreSpec([*blocks[0], *blocks[1]], [4, 2]),
            CPULoadStoreSpec([5, 2, 7]),
        )
        assert backend.wait([0])
        assert backend.poll()[0].success
    raw = pool.tensor
    chunk_of = {0: [5, 5, 2, 2], 1: [7, 7]}
    for t, kv in enumerate(layout.tensors):
        for i, block in enumerate(blocks[kv.group]):
            chunk, j = chunk_of[kv.group][i], i % 2
            start = chunk * layout.row_bytes + j * layout.slot_bytes + layout.page_offsets[t]
            assert torch.equal(raw[start : start + kv.page_bytes], kv.tensor[block]), (t, i)
    pool.close()


def test_plan_maps_blocks_to_slots_and_skips_into_the_first_chunk() -> None:
    layout = _layout([(0, 64), (1, 64)], bpc=4)
    store = layout.plan(
        GPULoadStoreSpec([3, 1, 2, 0, 9, 8, 7, 6], [4, 4]),
        CPULoadStoreSpec([5, 1]),
        num_chunks=8,
    )
    assert store.direction is TransferDirection.STORE
    assert store.groups[0].slots.tolist() == [20, 21, 22, 23]
    assert store.groups[1].slots.tolist() == [4, 5, 6, 7]
    assert store.nbytes == 8 * 64
    load = layout.plan(
        CPULoadStoreSpec([5, 6, 1]),
        GPULoadStoreSpec([10, 11, 12, 13, 14, 15, 4], [6, 1], [2, 7]),
        num_chunks=8,
    )
    assert load.direction is TransferDirection.LOAD
    assert load.groups[0].slots.tolist() == [22, 23, 24, 25, 26, 27]
    assert load.groups[1].slots.tolist() == [7]
    assert load.num_blocks == 7


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        (GPULoadStoreSpec([0, 1, 2, 16]), CPULoadStoreSpec([0]), "block id 16 is past the end"),
        (GPULoadStoreSpec([0, 1, 2, 3]), CPULoadStoreSpec([8]), "chunk id 8 is past the pool"),
        (
            GPULoadStoreSpec([0, 1, 2, 3]),
            CPULoadStoreSpec([0, 1]),
            "2 chunk ids for a GPU spec of 1 ",
        ),
        (GPULoadStoreSpec([0, 1, 2, 3, 4]), CPULoadStoreSpec([0, 1]), "chunk boundary"),
        (GPULoadStoreSpec([0, 1, 2, 3], [4], [1]), CPULoadStoreSpec([0]), "start at a chunk"),
        (CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 1, 2], [3], [2]), "do not end"),
        (GPULoadStoreSpec([0, 1, 2, 3], [2, 2]), CPULoadStoreSpec([0]), "2 groups"),
        (GPULoadStoreSpec([0, 1, 2, 3]), GPULoadStoreSpec([0]), "GPULoadStoreSpec -> GPU"),
        (CPULoadStoreSpec([0]), GPULoadStoreSpec([5, 6, 5, 7]), "block id 5 appears twice"),
    ],
)
def test_plan_refuses_what_does_not_fit_naming_the_value(
    src: object, dst: object, message: str
) -> None:
    layout = _layout([(0, 64)], bpc=4)
    with pytest.raises(SpecError, match=message):
        layout.plan(src, dst, num_chunks=8)  # type: ignore[arg-type]


def test_an_empty_group_is_nothing_to_check_wherever_it_starts() -> None:
    # The scheduler accepted an empty group at any block index and the layout did
    # not; with one check (tiering.specs.check_gpu_spec) both accept it.
    layout = _layout([(0, 64), (1, 64)], bpc=4)
    store = layout.plan(GPULoadStoreSpec([0, 1, 2, 3], [4, 0], [0, 3]), CPULoadStoreSpec([5]), 8)
    assert [g.slots.tolist() for g in store.groups] == [[20, 21, 22, 23], []]
    load = layout.plan(CPULoadStoreSpec([5]), GPULoadStoreSpec([7], [0, 1], [1, 3]), 8)
    assert [g.slots.tolist() for g in load.groups] == [[], [23]]
    assert load.nbytes == 64


def test_the_same_block_id_in_two_groups_is_two_blocks() -> None:
    layout = _layout([(0, 64), (1, 64)], bpc=1)
    plan = layout.plan(CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([3, 3], [1, 1]), num_chunks=4)
    assert [g.blocks.tolist() for g in plan.groups] == [[3], [3]]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([KVCacheTensor(torch.zeros(4, 64, dtype=torch.uint8), 4, 32)], "holds 256 bytes"),
        ([KVCacheTensor(torch.zeros(64, 4, dtype=torch.uint8).t(), 4, 64)], "not contiguous"),
        ([KVCacheTensor(torch.zeros(4, 64, dtype=torch.uint8), 4, 64, group=1)], "without gaps"),
        (
            [
                KVCacheTensor(torch.zeros(4, 64, dtype=torch.uint8), 4, 64),
                KVCacheTensor(torch.zeros(8, 64, dtype=torch.uint8), 8, 64),
            ],
            "disagree on num_blocks",
        ),
        ([KVCacheTensor(torch.zeros(0, 64, dtype=torch.uint8), 0, 64)], "must be positive"),
        ([], "at least one"),
    ],
)
def test_registration_refuses_tensors_that_do_not_fit(
    tensors: list[KVCacheTensor], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        KVLayout(tensors, blocks_per_chunk=2)


def test_blocks_per_chunk_must_be_positive() -> None:
    with pytest.raises(SpecError, match="blocks_per_chunk"):
        _layout([(0, 64)], bpc=0)


def test_word_size_is_the_widest_that_divides_every_page() -> None:
    assert _layout([(0, 64)]).word_dtype == torch.complex128
    assert _layout([(0, 64), (0, 24)]).word_dtype == torch.int64
    assert _layout([(0, 64), (0, 6)]).word_dtype == torch.int16
    assert _layout([(0, 13)]).word_dtype == torch.uint8


def test_run_bounds_cut_at_every_break_in_consecutive_ids() -> None:
    ids = np.array([4, 5, 6, 9, 10, 2, 3, 3])
    assert run_bounds(ids).tolist() == [0, 3, 5, 7, 8]
    assert run_bounds(np.zeros(0, dtype=np.int64)).tolist() == [0]


@pytest.mark.parametrize("size", [1, 2, 40, SMALL_IDS, SMALL_IDS + 1, 1000])
def test_run_bounds_in_python_and_in_numpy_agree(size: int) -> None:
    rng = np.random.default_rng(size)
    for _ in range(20):
        steps = rng.choice([1, 1, 1, 2, -5, 0], size=size)  # mostly runs, some breaks
        ids = np.cumsum(steps).astype(np.int64) + 10 * size
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        expected = [0, *breaks.tolist(), size]
        assert run_bounds(ids).tolist() == expected
        assert small_run_bounds(ids) == expected


def test_negative_ids_are_refused_before_any_byte_moves() -> None:
    layout = KVLayout([KVCacheTensor(torch.zeros(8, 64, dtype=torch.int64), 8, 512)], 1)
    with pytest.raises(SpecError, match="chunk id -1 is negative"):
        layout.plan(GPULoadStoreSpec([1]), CPULoadStoreSpec.from_valid_ids([-1]), 4)
    gpu = GPULoadStoreSpec([1])
    gpu.block_ids = np.array([-2], dtype=np.int64)  # as a trusting caller could build it
    with pytest.raises(SpecError, match="block id -2 is negative"):
        layout.plan(CPULoadStoreSpec([1]), gpu, 4)


def test_a_spec_from_an_int64_array_owns_its_ids_and_refuses_negatives() -> None:
    ids = np.array([5, 6, 7], dtype=np.int64)
    spec = GPULoadStoreSpec(ids[1:])
    ids[1] = 99  # the caller reuses its array: the spec keeps what it was given
    assert spec.block_ids.tolist() == [6, 7]
    with pytest.raises(SpecError, match="block_ids must be non-negative, got -3"):
        GPULoadStoreSpec(np.array([4, -3], dtype=np.int64))
    with pytest.raises(SpecError, match="block_ids must be non-negative, got -1"):
        CPULoadStoreSpec(np.array([-1], dtype=np.int64))
