"""Load/store specs: where the bytes of a job come from and go to.

A job copies chunks between two media; each side is described by a
`LoadStoreSpec`. The GPU side names GPU block ids, split by KV-cache group; the
CPU side (`tiering.cpu.common.CPULoadStoreSpec`) names chunk slots of the tier.
Specs are validated when built, so a backend can trust their shapes.

Chunk arithmetic over a GPU spec lives here too, in plain numbers (no torch):
`chunk_block_ranges` and `select_chunks` cut a spec into its chunks, and
`check_gpu_spec` is the one check of a GPU spec against a KV cache (a `KVCacheShape`),
used by the scheduler at submission and by the transfer layout before any byte moves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Self, cast

import msgspec
import numpy as np
import numpy.typing as npt

from tiering._types import (
    Medium,
    OffloadKey,
    TransferDirection,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tiering.errors import SpecError

__all__ = [
    "BlockIDsLoadStoreSpec",
    "GPULoadStoreSpec",
    "KVCacheShape",
    "LoadStoreSpec",
    "OffloadKey",
    "check_gpu_spec",
    "chunk_block_ranges",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "select_chunks",
]

IntArray = npt.NDArray[np.int64]

_INT64 = np.dtype(np.int64)


def as_id_array(values: Sequence[int] | npt.NDArray[np.integer], what: str) -> IntArray:
    """``values`` as a 1-D int64 array of non-negative ids, or a `SpecError` naming ``what``."""
    # The common case, a short list of ints, checked in Python: a numpy
    # reduction costs microseconds on any size, and specs are made per job.
    if (
        type(values) in (list, tuple)
        and all(type(v) is int for v in values)
        and (not values or min(values) >= 0)
    ):
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass  # past int64: the checks below say so
    if type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1:
        own = cast(IntArray, values.copy())  # a caller's later writes don't leak in
        if len(own) and (low := id_bounds(own)[0]) < 0:
            raise SpecError(f"{what} must be non-negative, got {low}")
        return own
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise SpecError(f"{what} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise SpecError(f"{what} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=True)  # the spec's own: a caller's later writes don't leak in
    if int(arr.min()) < 0:
        raise SpecError(f"{what} must be non-negative, got {int(arr.min())}")
    return arr


#: Below this many ids, checks run on a Python list: a numpy reduction costs a
#: few microseconds whatever the size, and most jobs name a few dozen ids.
SMALL_IDS = 128


def id_bounds(ids: IntArray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty id array."""
    if len(ids) <= SMALL_IDS:
        values = ids.tolist()
        return min(values), max(values)
    return int(ids.min()), int(ids.max())


def first_duplicate(ids: IntArray) -> int | None:
    """An id that appears more than once in ``ids``, or ``None``."""
    if len(ids) < 2:
        return None
    if len(ids) <= SMALL_IDS:
        values = ids.tolist()
        if len(set(values)) == len(values):
            return None
        seen: set[int] = set()
        for v in values:
            if v in seen:
                return int(v)
            seen.add(v)
    ordered = np.sort(ids)
    dup = np.flatnonzero(ordered[1:] == ordered[:-1])
    return int(ordered[dup[0]]) if len(dup) else None


class LoadStoreSpec(ABC):
    """Where the bytes of one side of a transfer job are."""

    @staticmethod
    @abstractmethod
    def medium() -> Medium:
        """The medium this spec addresses."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec that names blocks (or chunk slots) by integer id."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        self.block_ids: IntArray = as_id_array(block_ids, "block_ids")

    @classmethod
    def from_valid_ids(cls, ids: Sequence[int]) -> Self:
        """A spec over ``ids`` known to be valid (non-negative ints), skipping the checks."""
        spec = cls.__new__(cls)
        spec.block_ids = np.array(ids, dtype=np.int64)
        return spec

    def __len__(self) -> int:
        return int(self.block_ids.size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_ids={self.block_ids.tolist()!r})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of a job, one consecutive run per KV-cache group.

    ``block_ids`` holds every group's block ids, group after group;
    ``group_sizes[g]`` says how many belong to group ``g`` and
    ``block_indices[g]`` is the position in the request of group ``g``'s first
    block. A load whose first block sits part-way into a chunk
    (``block_indices[g] % blocks_per_chunk != 0``) skips that chunk's leading
    pages. Without ``group_sizes``, all blocks belong to group 0 from index 0.
    """

    __slots__ = ("block_indices", "group_sizes")

    def __init__(
        self,
        block_ids: Sequence[int] | npt.NDArray[np.integer],
        group_sizes: Sequence[int] | npt.NDArray[np.integer] | None = None,
        block_indices: Sequence[int] | npt.NDArray[np.integer] | None = None,
    ) -> None:
        super().__init__(block_ids)
        n = len(self.block_ids)
        sizes = as_id_array([n] if group_sizes is None else group_sizes, "group_sizes")
        total = sum(sizes.tolist())  # one entry per group: Python beats a numpy reduction
        if total != n:
            raise SpecError(
                f"group_sizes {sizes.tolist()} add up to {total}, "
                f"but there are {n} block_ids; they must add up to the number of block ids"
            )
        if block_indices is None:
            indices = np.zeros(len(sizes), dtype=np.int64)
        else:
            indices = as_id_array(block_indices, "block_indices")
        if len(indices) != len(sizes):
            raise SpecError(
                f"block_indices has {len(indices)} entries but group_sizes has {len(sizes)}; "
                "give one first-block index per group"
            )
        self.group_sizes: IntArray = sizes
        self.block_indices: IntArray = indices

    @staticmethod
    def medium() -> Medium:
        return Medium.GPU

    def group_block_ids(self, group: int) -> IntArray:
        """The block ids of ``group``."""
        sizes = self.group_sizes.tolist()
        start = sum(sizes[:group])
        return self.block_ids[start : start + sizes[group]]

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={self.block_ids.tolist()!r}, "
            f"group_sizes={self.group_sizes.tolist()!r}, "
            f"block_indices={self.block_indices.tolist()!r})"
        )


def chunk_block_ranges(
    spec: GPULoadStoreSpec, blocks_per_chunk: int
) -> list[tuple[int, int, int, int]]:
    """Every chunk of ``spec``, group after group: ``(start, stop, group, first)``.

    ``spec.block_ids[start:stop]`` are the chunk's blocks and ``first`` the
    position in the request of its first block. Group ``g``'s first chunk
    holds ``blocks_per_chunk - block_indices[g] % blocks_per_chunk`` blocks
    (fewer if the group has fewer).
    """
    chunks = []
    start = 0
    sizes, firsts = spec.group_sizes.tolist(), spec.block_indices.tolist()
    for group, (size, first) in enumerate(zip(sizes, firsts, strict=True)):
        pos, stop = start, start + size
        while pos < stop:
            end = min(pos + blocks_per_chunk - first % blocks_per_chunk, stop)
            chunks.append((pos, end, group, first))
            first += end - pos
            pos = end
        start = stop
    return chunks


def select_chunks(
    spec: GPULoadStoreSpec,
    blocks_per_chunk: int,
    chosen: Sequence[int],
    *,
    chunks: Sequence[tuple[int, int, int, int]] | None = None,
) -> GPULoadStoreSpec:
    """The sub-spec of ``spec`` holding its chunks ``chosen`` (indices, in order).

    ``chunks`` is ``chunk_block_ranges(spec, blocks_per_chunk)`` when the caller
    has it already (cutting one spec into many sub-specs: cut it once).
    """
    if chunks is None:
        chunks = chunk_block_ranges(spec, blocks_per_chunk)
    num_groups = len(spec.group_sizes)
    sizes = [0] * num_groups
    firsts = [0] * num_groups
    parts = []
    for i in chosen:
        start, stop, group, first = chunks[i]
        if sizes[group] == 0:
            firsts[group] = first
        sizes[group] += stop - start
        parts.append(spec.block_ids[start:stop])
    block_ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return GPULoadStoreSpec(block_ids, sizes, firsts)


class KVCacheShape(msgspec.Struct, frozen=True, kw_only=True):
    """What a GPU spec is checked against: the KV cache has ``group_num_blocks[g]``
    blocks of ``group_block_bytes[g]`` bytes in group ``g``, cut into chunks of
    ``blocks_per_chunk`` blocks. The scheduler's planner and the transfer layout
    each hold one, so both check a spec the same way."""

    blocks_per_chunk: int
    group_num_blocks: tuple[int, ...]
    group_block_bytes: tuple[int, ...]

    def check(
        self, gpu: GPULoadStoreSpec, direction: TransferDirection, *, count: int, what: str
    ) -> int:
        """`check_gpu_spec` against this KV cache: refuse ``gpu``, or return its bytes."""
        return check_gpu_spec(
            gpu,
            direction,
            blocks_per_chunk=self.blocks_per_chunk,
            group_num_blocks=self.group_num_blocks,
            group_block_bytes=self.group_block_bytes,
            count=count,
            what=what,
        )

    def nbytes(self, gpu: GPULoadStoreSpec) -> int:
        """The bytes of the blocks of ``gpu`` (one checked against this KV cache)."""
        sizes = gpu.group_sizes.tolist()
        return sum(n * b for n, b in zip(sizes, self.group_block_bytes, strict=False))


def check_gpu_spec(
    gpu: GPULoadStoreSpec,
    direction: TransferDirection,
    *,
    blocks_per_chunk: int,
    group_num_blocks: Sequence[int],
    group_block_bytes: Sequence[int],
    count: int,
    what: str,
) -> int:
    """Refuse a GPU spec that does not fit the KV cache; return the bytes it covers.

    The KV cache has ``group_num_blocks[g]`` blocks of ``group_block_bytes[g]``
    bytes in group ``g``. The spec must have one group size per group; a store
    starts every non-empty group at a chunk boundary (a load may start part-way
    into its first chunk); every group ends at a chunk boundary; its block ids
    are in the KV cache; a load names each of them once; and it covers exactly
    ``count`` chunks, as many as there are of ``what`` (``"key"`` for the
    scheduler, ``"chunk id"`` for the layout). The `SpecError` names the value.
    """
    sizes = gpu.group_sizes.tolist()
    if len(sizes) != len(group_num_blocks):
        raise SpecError(
            f"the GPU spec has {len(sizes)} groups (group_sizes={sizes}) but the KV cache has "
            f"{len(group_num_blocks)}; give one group size per KV-cache group"
        )
    bpc = blocks_per_chunk
    store = direction is TransferDirection.STORE
    firsts = gpu.block_indices.tolist()
    whole = len(sizes) == 1  # one group: its ids are the whole array (no slice: a numpy call)
    chunks = nbytes = start = 0
    for g, size in enumerate(sizes):
        if not size:
            continue
        first = firsts[g]
        if store and first % bpc:
            raise SpecError(
                f"group {g}: a store starts at block {first} (block_indices[{g}]), inside a "
                f"chunk of {bpc} blocks; a store must start at a chunk boundary: it copies "
                "whole chunks"
            )
        if (first + size) % bpc:
            raise SpecError(
                f"group {g}: {size} blocks from block {first} do not end at a chunk boundary: "
                f"they end at block {first + size}, inside a chunk of {bpc} blocks; a job "
                "moves whole chunks"
            )
        ids = gpu.block_ids if whole else gpu.block_ids[start : start + size]
        start += size
        low, high = id_bounds(ids)
        if low < 0:
            raise SpecError(f"group {g}: GPU block id {low} is negative")
        limit = group_num_blocks[g]
        if high >= limit:
            bad = int(ids[int(np.argmax(ids >= limit))])
            raise SpecError(
                f"group {g}: GPU block id {bad} is past the end of the KV cache ({limit} blocks)"
            )
        if not store and (dup := first_duplicate(ids)) is not None:
            raise SpecError(
                f"group {g}: a load names GPU block id {dup} more than once (block id {dup} "
                "appears twice in its destination); every destination block must be distinct"
            )
        chunks += (first % bpc + size) // bpc
        nbytes += size * group_block_bytes[g]
    if chunks != count:
        raise SpecError(
            f"{count} {what}s for a GPU spec of {chunks} chunks (group_sizes={sizes} from "
            f"block_indices={firsts} at blocks_per_chunk={bpc} covers {chunks} chunks); "
            f"give one {what} per chunk"
        )
    return nbytes
