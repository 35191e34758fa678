"""The KV layout: where every page of a job lives, on the KV side and in the pool.

The caller registers its KV cache tensors (`KVCacheTensor`): one per layer, or one
cross-layer tensor holding every layer of a block, each tagged with its KV-cache
group. Each is viewed, without copying, as ``(num_blocks, page_bytes)`` bytes, so
block ``b`` of tensor ``t`` is one *page* of ``page_bytes`` bytes.

Pool geometry (the choice made here, and why)::

    row (chunk c)   = blocks_per_chunk slots of `slot_bytes` each, page-aligned
    slot (block j)  = the pages of block j of every tensor of the group, in
                      registration order, then padding up to `slot_bytes`

All groups share one pool and one chunk-id space (the manager hands out chunk ids
without knowing the group), so the row size is set by the largest group; a
smaller group leaves the tail of each slot unused. ``slot_bytes`` is
``row_bytes / blocks_per_chunk``, which makes slot ``s = c * blocks_per_chunk + j``
start at byte ``s * slot_bytes`` for every group. Each tensor therefore has a
uniform, non-overlapping strided view of the pool, ``(num_slots, page_bytes)``
with row stride ``slot_bytes``, and consecutive chunk ids are consecutive slots:
a run of chunks is one run of pages, which is what lets a backend copy many pages
with a single torch op.

Jobs (`KVLayout.plan`): a *store* copies whole chunks; group ``g``'s block ids are
split into chunks of ``blocks_per_chunk`` blocks, so their number must be a whole
number of chunks and ``block_indices[g]`` a multiple of ``blocks_per_chunk``. A
*load* may start part-way into its first chunk: ``block_indices[g] %
blocks_per_chunk`` leading pages of that chunk are skipped; it must end at a
chunk boundary. The CPU spec lists the chunk ids of every group, group after
group, co-indexed with those chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np
import torch

from tiering._checks import check_int
from tiering._types import TransferDirection
from tiering.config import OffloadingConfig
from tiering.cpu.common import CPULoadStoreSpec
from tiering.errors import ConfigError, SpecError
from tiering.specs import (
    SMALL_IDS,
    GPULoadStoreSpec,
    IntArray,
    KVCacheShape,
    LoadStoreSpec,
    first_duplicate,
    id_bounds,
)

__all__ = [
    "GroupPlan",
    "KVCacheTensor",
    "KVLayout",
    "TransferDirection",
    "TransferPlan",
    "job_direction",
    "list_run_bounds",
    "run_bounds",
    "small_run_bounds",
]

#: Rows start on host page boundaries (DMA-friendly; fits O_DIRECT for later tiers).
ROW_ALIGNMENT = 4096

#: Copy words, widest first. A 16-byte word is viewed as complex128: torch has no
#: wider integer, and its copy kernels move complex values as plain bits (no
#: arithmetic, so NaN payloads and denormals survive; the round-trip tests check
#: random bytes). Wider words mean fewer elements per page, which takes torch's
#: CPU index kernels onto their faster paths (bench/transfer.py measures the gain).
_WORD_DTYPES = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


@dataclass(frozen=True)
class KVCacheTensor:
    """One registered KV cache tensor: ``num_blocks`` pages of ``page_bytes`` bytes.

    The tensor must be contiguous and hold exactly ``num_blocks * page_bytes``
    bytes, block-major. A cache laid out ``(2, num_blocks, ...)`` registers
    ``t[0]`` and ``t[1]`` as two tensors of the same group.
    """

    tensor: torch.Tensor
    num_blocks: int
    page_bytes: int
    group: int = 0


class GroupPlan(msgspec.Struct, frozen=True, gc=False):
    """The pages of one KV-cache group in a job: ``blocks[i]`` <-> pool slot ``slots[i]``."""

    group: int
    blocks: IntArray
    slots: IntArray


class TransferPlan(msgspec.Struct, frozen=True, gc=False):
    """A validated job: per group, which KV block goes to or comes from which slot."""

    direction: TransferDirection
    groups: tuple[GroupPlan, ...]
    nbytes: int

    @property
    def num_blocks(self) -> int:
        return sum(len(g.blocks) for g in self.groups)


def job_direction(src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferDirection:
    """``STORE`` for GPU -> CPU specs, ``LOAD`` for CPU -> GPU; any other pair is a `SpecError`."""
    if isinstance(src, GPULoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
        return TransferDirection.STORE
    if isinstance(src, CPULoadStoreSpec) and isinstance(dst, GPULoadStoreSpec):
        return TransferDirection.LOAD
    raise SpecError(
        "a job copies GPULoadStoreSpec -> CPULoadStoreSpec (store) or "
        "CPULoadStoreSpec -> GPULoadStoreSpec (load), got "
        f"{type(src).__name__} -> {type(dst).__name__}"
    )


def run_bounds(ids: IntArray) -> IntArray:
    """Bounds of the maximal runs of consecutive ids: run ``k`` is ``ids[b[k]:b[k+1]]``."""
    if len(ids) <= SMALL_IDS:
        return np.array(small_run_bounds(ids), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return np.concatenate(([0], breaks, [len(ids)])).astype(np.int64)


def small_run_bounds(ids: IntArray) -> list[int]:
    """`run_bounds` of a few ids, as a list, computed in Python.

    Most jobs name a few dozen ids, where numpy's diff, flatnonzero and
    concatenate cost several microseconds each (in a copy thread, holding the
    GIL the event loop needs), and a Python loop a fraction of that.
    """
    return list_run_bounds(ids.tolist())


def list_run_bounds(values: list[int]) -> list[int]:
    """`run_bounds` of a list of ids (one consecutive run is checked in one comparison)."""
    n = len(values)
    if not n:
        return [0]
    first = values[0]
    if values[-1] - first == n - 1 and values == list(range(first, first + n)):
        return [0, n]
    return [0, *[i for i in range(1, n) if values[i] != values[i - 1] + 1], n]


class KVLayout:
    """The registered KV tensors and the chunk-row geometry of the pool.

    Guarantees: every registered tensor has a zero-copy word view
    `kv_view` of shape ``(num_blocks, page_bytes / word_bytes)``; `pool_view`
    gives the matching strided view into a pool of ``num_chunks * row_bytes``
    bytes; `plan` validates a job completely (raising `SpecError` naming the
    offending value) before any byte moves.
    """

    def __init__(self, tensors: Sequence[KVCacheTensor], blocks_per_chunk: int) -> None:
        check_int("blocks_per_chunk", blocks_per_chunk, minimum=1, error=SpecError)
        if not tensors:
            raise SpecError("register at least one KV cache tensor")
        self.blocks_per_chunk = blocks_per_chunk
        self._chunk_pages = np.arange(blocks_per_chunk, dtype=np.int64)  # pages of a chunk row
        self.tensors: tuple[KVCacheTensor, ...] = tuple(tensors)
        self.device: torch.device = self.tensors[0].tensor.device
        for i, kv in enumerate(self.tensors):
            _check_tensor(i, kv, self.device)
        groups = sorted({kv.group for kv in self.tensors})
        if groups != list(range(len(groups))):
            raise SpecError(f"groups must be numbered 0..n-1 without gaps, got {groups}")
        self.num_groups = len(groups)
        #: Indices into `tensors` of each group's tensors, in registration order.
        self.group_tensors: tuple[tuple[int, ...], ...] = tuple(
            tuple(i for i, kv in enumerate(self.tensors) if kv.group == g) for g in groups
        )
        self.group_num_blocks: tuple[int, ...] = tuple(
            _group_num_blocks(g, [self.tensors[i] for i in idx])
            for g, idx in enumerate(self.group_tensors)
        )
        #: Bytes of one block of each group (its pages over all its tensors).
        self.group_block_bytes: tuple[int, ...] = tuple(
            sum(self.tensors[i].page_bytes for i in idx) for idx in self.group_tensors
        )
        self._kv = KVCacheShape(
            blocks_per_chunk=blocks_per_chunk,
            group_num_blocks=self.group_num_blocks,
            group_block_bytes=self.group_block_bytes,
        )
        self.word_bytes = _word_bytes(self.tensors)
        self.word_dtype = _WORD_DTYPES[self.word_bytes]
        unit = math.lcm(ROW_ALIGNMENT, blocks_per_chunk * self.word_bytes)
        need = blocks_per_chunk * max(self.group_block_bytes)
        #: Bytes of one chunk row of the pool (a multiple of the host page size).
        self.row_bytes = -(-need // unit) * unit
        #: Bytes between consecutive slots (blocks) of a row, for every group.
        self.slot_bytes = self.row_bytes // blocks_per_chunk
        #: Byte offset of each tensor's page inside a slot.
        self.page_offsets: tuple[int, ...] = tuple(
            sum(self.tensors[j].page_bytes for j in self.group_tensors[kv.group] if j < i)
            for i, kv in enumerate(self.tensors)
        )

    # -- views ----------------------------------------------------------------

    def kv_view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` as ``(num_blocks, page_bytes / word_bytes)`` words, zero-copy."""
        kv = self.tensors[index]
        flat = kv.tensor.reshape(-1).view(torch.uint8)
        return flat.view(self.word_dtype).view(kv.num_blocks, kv.page_bytes // self.word_bytes)

    def pool_view(self, pool_words: torch.Tensor, index: int) -> torch.Tensor:
        """Tensor ``index``'s pages in the pool: ``(num_slots, page_words)``, row stride a slot.

        ``pool_words`` is the whole pool as a flat tensor of `word_dtype`.
        """
        kv = self.tensors[index]
        num_slots = self.num_chunks(pool_words.numel() * self.word_bytes) * self.blocks_per_chunk
        w = self.word_bytes
        return pool_words.as_strided(
            (num_slots, kv.page_bytes // w),
            (self.slot_bytes // w, 1),
            pool_words.storage_offset() + self.page_offsets[index] // w,
        )

    # -- sizing ---------------------------------------------------------------

    def pool_bytes(self, num_chunks: int) -> int:
        """Exact bytes of a pool holding ``num_chunks`` chunk rows."""
        check_int("num_chunks", num_chunks, minimum=1, error=SpecError)
        return num_chunks * self.row_bytes

    def num_chunks(self, pool_bytes: int) -> int:
        """How many whole chunk rows fit in ``pool_bytes`` bytes."""
        return pool_bytes // self.row_bytes

    def pool_chunks(self, pool_bytes: int) -> int:
        """The chunk rows of a backend's pool of ``pool_bytes`` bytes; `SpecError` when it
        holds not even one."""
        num_chunks = self.num_chunks(pool_bytes)
        if num_chunks < 1:
            raise SpecError(
                f"the pool holds {pool_bytes} bytes, less than one chunk row "
                f"({self.row_bytes} bytes)"
            )
        return num_chunks

    # -- jobs -----------------------------------------------------------------

    def plan(self, src: LoadStoreSpec, dst: LoadStoreSpec, num_chunks: int) -> TransferPlan:
        """Validate a job against this layout and a pool of ``num_chunks`` chunks.

        Raises `SpecError`, naming the value, when the specs are not a
        (GPU, CPU) store or (CPU, GPU) load, when the GPU spec does not fit
        the KV cache or the CPU spec's chunks (`tiering.specs.check_gpu_spec`,
        the scheduler's own check), when a chunk id is past the pool, or when a
        destination chunk is named twice.
        """
        direction = job_direction(src, dst)
        store = direction is TransferDirection.STORE
        gpu = cast(GPULoadStoreSpec, src if store else dst)
        cpu = cast(CPULoadStoreSpec, dst if store else src)
        chunk_ids = cpu.block_ids
        num_ids = len(chunk_ids)
        nbytes = self._kv.check(gpu, direction, count=num_ids, what="chunk id")
        if num_ids:
            low, high = id_bounds(chunk_ids)
            if low < 0:
                raise SpecError(f"chunk id {low} is negative")
            if high >= num_chunks:
                bad = int(chunk_ids[int(np.argmax(chunk_ids >= num_chunks))])
                raise SpecError(f"chunk id {bad} is past the pool, which has {num_chunks} chunks")
            if store:
                _check_unique(chunk_ids, "chunk id", "the destination")
        bpc = self.blocks_per_chunk
        sizes = gpu.group_sizes.tolist()
        firsts = gpu.block_indices.tolist()
        whole = len(sizes) == 1  # one group: its blocks and chunks are the whole arrays
        groups: list[GroupPlan] = []
        start = used_chunks = 0
        for g, n in enumerate(sizes):
            blocks = gpu.block_ids if whole else gpu.block_ids[start : start + n]
            start += n
            skip = firsts[g] % bpc if n else 0
            k = (skip + n) // bpc
            chunks = chunk_ids if whole else chunk_ids[used_chunks : used_chunks + k]
            used_chunks += k
            if bpc == 1:
                slots = chunks
            else:
                slots = (chunks[:, None] * bpc + self._chunk_pages).reshape(-1)[skip : skip + n]
            groups.append(GroupPlan(group=g, blocks=blocks, slots=slots))
        return TransferPlan(direction=direction, groups=tuple(groups), nbytes=nbytes)

    def __repr__(self) -> str:
        return (
            f"<KVLayout [{len(self.tensors)} tensors in {self.num_groups} groups, "
            f"{self.blocks_per_chunk} blocks/chunk, {self.row_bytes} bytes/row, {self.device}]>"
        )

    @classmethod
    def from_kv_caches(
        cls,
        config: OffloadingConfig,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor],
    ) -> KVLayout:
        """The layout of the per-layer tensors named by the config's groups, block-major.

        ``kv_caches`` maps each layer name of the groups to its tensor: the first
        dimension is its number of blocks and one block's elements are contiguous
        (a ``(num_blocks, ...)`` layout; a ``(2, num_blocks, ...)`` K/V layout is
        registered as two `KVCacheTensor` by the caller instead, and a sequence of
        `KVCacheTensor` is taken as it is). Every tensor has the config's dtype
        (``model.dtype``; for a vLLM quantized cache dtype such as ``fp8``, any
        dtype of the size vLLM stores it in, as attention backends view those
        bytes as they need). Anything else is a `ConfigError`. Chunks hold the
        config's ``cache.blocks_per_chunk`` blocks.
        """
        if not isinstance(kv_caches, Mapping):
            return cls(_given_tensors(config, kv_caches), config.cache.blocks_per_chunk)
        named = {name for group in config.groups for name in group.layer_names}
        extra = sorted(set(kv_caches) - named)
        if extra:
            raise ConfigError(
                f"KV cache tensors {extra} belong to no group of the config; "
                f"the groups name {sorted(named)}"
            )
        tensors = []
        for g, group in enumerate(config.groups):
            for name in group.layer_names:
                tensor = kv_caches.get(name)
                if tensor is None:
                    raise ConfigError(f"no KV cache tensor for layer {name!r} of group {g}")
                where = f"KV cache tensor {name!r}"
                if not isinstance(tensor, torch.Tensor):
                    raise ConfigError(
                        f"{where} is a {_type_name(tensor)}; give a torch.Tensor, block-major "
                        "(num_blocks, ...)"
                    )
                if tensor.dim() < 1 or tensor.shape[0] < 1:
                    raise ConfigError(
                        f"{where} must be block-major (num_blocks, ...) with at least one "
                        f"block, got shape {tuple(tensor.shape)}"
                    )
                if not tensor.is_contiguous():
                    raise ConfigError(
                        f"{where} is not contiguous (shape {tuple(tensor.shape)}, strides "
                        f"{tuple(tensor.stride())}): a transposed or strided view; give the "
                        "tensor the cache is stored in, block-major (num_blocks, ...) with each "
                        "block's elements contiguous"
                    )
                _check_dtype(config, where, tensor)
                page_bytes = tensor[0].numel() * tensor.element_size()
                tensors.append(KVCacheTensor(tensor, int(tensor.shape[0]), page_bytes, group=g))
        return cls(tensors, config.cache.blocks_per_chunk)


def _given_tensors(config: OffloadingConfig, kv_caches: object) -> list[KVCacheTensor]:
    """A sequence of `KVCacheTensor`, checked; anything else is refused, naming the mapping."""
    items: list[object] | None = None
    if isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        items = list(kv_caches)
    tensors = [item for item in items or () if isinstance(item, KVCacheTensor)]
    if items is None or len(tensors) != len(items):
        given = f"a {_type_name(kv_caches)}"
        if items is not None:
            kinds = sorted({_type_name(item) for item in items})
            given += f" of {len(items)} items ({', '.join(kinds)})" if kinds else " of no items"
        layers = [name for group in config.groups for name in group.layer_names]
        raise ConfigError(
            f"kv_caches must map each layer name to its KV cache tensor "
            f"({{layer name: torch.Tensor}} for the layers {layers}), or be a list of "
            f"KVCacheTensor; got {given}"
        )
    for index, kv in enumerate(tensors):
        _check_dtype(config, f"kv_caches[{index}].tensor", kv.tensor)
    return tensors


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _check_dtype(config: OffloadingConfig, where: str, tensor: torch.Tensor) -> None:
    """Refuse a KV tensor whose dtype is not the config's (see `KVLayout.from_kv_caches`)."""
    dtype, storage = config.model.dtype, config.model.storage_dtype
    expected = getattr(torch, storage, None)
    if not isinstance(expected, torch.dtype):
        raise ConfigError(
            f"the config's model.dtype={dtype!r} is not a dtype of torch {torch.__version__}"
        )
    if tensor.dtype == expected:
        return
    if dtype != storage and tensor.element_size() == expected.itemsize:
        return  # a vLLM quantized cache: its bytes, viewed as a backend needs
    stored = f" (stored as {storage})" if dtype != storage else ""
    raise ConfigError(
        f"{where} has dtype {str(tensor.dtype).removeprefix('torch.')} but the config's "
        f"model.dtype is {dtype!r}{stored}; give KV tensors of that dtype, or set model.dtype "
        "to theirs"
    )


def _check_tensor(i: int, kv: KVCacheTensor, device: torch.device) -> None:
    if kv.num_blocks < 1 or kv.page_bytes < 1:
        raise SpecError(
            f"tensor {i}: num_blocks and page_bytes must be positive, "
            f"got num_blocks={kv.num_blocks}, page_bytes={kv.page_bytes}"
        )
    if kv.group < 0:
        raise SpecError(f"tensor {i}: group must be non-negative, got {kv.group}")
    t = kv.tensor
    if t.device != device:
        raise SpecError(f"tensor {i} is on {t.device}, but tensor 0 is on {device}")
    if not t.is_contiguous():
        raise SpecError(
            f"tensor {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not contiguous; "
            "register each contiguous block-major part as its own tensor"
        )
    nbytes = t.numel() * t.element_size()
    if nbytes != kv.num_blocks * kv.page_bytes:
        raise SpecError(
            f"tensor {i} holds {nbytes} bytes, but num_blocks={kv.num_blocks} x "
            f"page_bytes={kv.page_bytes} = {kv.num_blocks * kv.page_bytes}"
        )


def _group_num_blocks(group: int, tensors: Sequence[KVCacheTensor]) -> int:
    counts = sorted({kv.num_blocks for kv in tensors})
    if len(counts) != 1:
        raise SpecError(f"group {group}: its tensors disagree on num_blocks: {counts}")
    return counts[0]


def _word_bytes(tensors: Sequence[KVCacheTensor]) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) that divides every page and tensor address."""
    for w in (16, 8, 4, 2):
        if all(kv.page_bytes % w == 0 and kv.tensor.data_ptr() % w == 0 for kv in tensors):
            return w
    return 1


def _check_unique(ids: IntArray, what: str, side: str) -> None:
    dup = first_duplicate(ids)
    if dup is not None:
        raise SpecError(f"{what} {dup} appears twice in {side} of the job")
