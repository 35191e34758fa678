"""The host memory pool: exact size, honest residency, refusal, shared files, close."""

from __future__ import annotations

import gc
import mmap
import os
import uuid

import pytest
import torch

from tiering.errors import CapacityError, ResourceClosedError
from tiering.transfer import HostMemoryPool, available_host_bytes

MIB = 1 << 20


def _mapping_size(addr: int) -> int | None:
    """Size of this process's mapping that starts at ``addr`` (/proc/self/maps), if any."""
    with open("/proc/self/maps", encoding="ascii") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start == addr:
                return end - start
    return None


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_the_pool_is_one_mapping_of_exactly_the_size_asked() -> None:
    nbytes = 64 * MIB + 4096 * 3
    with HostMemoryPool(nbytes) as pool:
        assert pool.tensor.numel() == nbytes
        assert pool.tensor.dtype == torch.uint8
        assert pool.data_ptr % mmap.PAGESIZE == 0
        # A shared mapping never merges with its neighbours: this is all of it.
        assert _mapping_size(pool.data_ptr) == nbytes
        assert pool.mapped_bytes == nbytes
    with HostMemoryPool(nbytes - 100) as pool:  # rounded up to the host page, no further
        assert pool.tensor.numel() == nbytes - 100
        assert _mapping_size(pool.data_ptr) == nbytes


def test_the_pool_costs_its_size_not_twice_it() -> None:
    nbytes = 96 * MIB
    with HostMemoryPool(nbytes) as pool:
        assert pool.resident_bytes() == 0  # nothing touched yet
        before = _rss()
        pool.tensor.fill_(0xAB)
        grown = _rss() - before
        assert pool.resident_bytes() == nbytes
        assert 0.9 * nbytes <= grown <= 1.1 * nbytes
        stats = pool.statistics()
        assert (stats.nbytes, stats.resident_bytes, stats.closed) == (nbytes, nbytes, False)


def test_a_pool_larger_than_the_available_memory_is_refused() -> None:
    ask = available_host_bytes() + (1 << 30)
    with pytest.raises(CapacityError, match=rf"asks for {ask} bytes .* only \d+ bytes"):
        HostMemoryPool(ask)


def test_sizes_below_one_byte_are_refused() -> None:
    with pytest.raises(CapacityError, match="at least 1 byte"):
        HostMemoryPool(0)


def test_a_shared_pool_is_a_file_in_dev_shm_that_a_second_pool_can_map() -> None:
    name = f"tiering-test-{uuid.uuid4().hex}"
    path = f"/dev/shm/{name}"
    with HostMemoryPool(4 * MIB, shm_name=name) as owner:
        assert owner.shared
        assert os.path.getsize(path) == 4 * MIB
        owner.tensor[:5].copy_(torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8))
        with HostMemoryPool(4 * MIB, shm_name=name, create=False) as other:
            assert other.tensor[:5].tolist() == [1, 2, 3, 4, 5]
            other.tensor[5] = 6
        assert int(owner.tensor[5]) == 6
        with pytest.raises(FileExistsError):
            HostMemoryPool(4 * MIB, shm_name=name)
        assert "/dev/shm" in repr(owner)
    assert not os.path.exists(path)  # the creator removes the file


def test_a_shared_pool_is_refused_when_dev_shm_has_no_room() -> None:
    ask = available_host_bytes("/dev/shm") + (1 << 30)
    with pytest.raises(CapacityError, match=r"/dev/shm space"):
        HostMemoryPool(ask, shm_name=f"tiering-test-{uuid.uuid4().hex}")


def test_close_is_idempotent_and_views_never_dangle() -> None:
    pool = HostMemoryPool(8 * MIB)
    view = pool.tensor[100:200]
    view.fill_(9)
    pool.close()
    pool.close()
    assert pool.closed
    assert pool.resident_bytes() == 0
    assert int(view.sum()) == 900  # still mapped while a view is alive
    del view
    gc.collect()
    with pytest.raises(ResourceClosedError):
        _ = pool.tensor
    assert "closed" in repr(pool)


def test_close_unmaps_the_region_when_no_view_is_left() -> None:
    pool = HostMemoryPool(8 * MIB)
    addr = pool.data_ptr
    assert _mapping_size(addr) == 8 * MIB
    pool.close()
    assert _mapping_size(addr) is None


def test_repr_and_statistics_report_live_residency() -> None:
    with HostMemoryPool(2 * MIB) as pool:
        pool.tensor[:MIB].fill_(1)
        assert pool.statistics().resident_bytes == MIB
        assert repr(pool) == "<HostMemoryPool [2.0 MiB, 1.0 MiB resident]>"
