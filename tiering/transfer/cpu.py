"""The ``cpu`` backend: KV tensors in host memory, copies by torch ops in worker threads.

This is the default where there is no GPU: the "GPU" KV tensors are CPU tensors
standing in for device memory, so the whole engine runs, and is measured, on a
laptop.

How pages are copied (`PageCopier`): a job pairs, per group, KV blocks with
pool slots. Python costs several microseconds per torch call, more than copying
a 16 KiB page, so the copier never loops per page. It splits the pairs into
runs that are consecutive on one side, picking per group whichever split gives
the fewest runs:

* slots consecutive (chunk ids handed out in order): the pool side is a plain
  slice; a store gathers into it with ``torch.index_select(kv, 0, blocks,
  out=slice)``, a load scatters from it with ``kv.index_copy_(0, blocks, slice)``;
* blocks consecutive: the same with the roles swapped;
* both consecutive: ``slice.copy_(slice)``.

Direct path: one op per run and tensor. When a job is many small ops, torch
copies each on one thread, so the ops are shared out over
``torch.get_num_threads()`` threads; their destinations are disjoint.

Staged path, for groups whose runs are short on both sides (under
`STAGE_BELOW_BYTES` per op and tensor on average, e.g. scattered chunk ids with
16 KiB pages): per piece of `STAGING_BYTES` and tensor, one gather of the
source pages into a contiguous staging buffer (``index_select(src, 0, ids,
out=staging)``) and one scatter from it (``dst.index_copy_(0, ids, staging)``);
a store gathers KV blocks and scatters to pool slots, a load the reverse. Each
byte then moves twice, but through a cache-sized buffer and in two large ops
(which torch itself spreads over its threads) instead of one small op per run.
Each direction has its own buffer, made on first use.

All views are words of the widest size the layout allows (16 bytes as
complex128 for 16-byte-multiple pages, else int64, ...), which copies markedly
faster than bytes. Advanced-index assignment (``kv[blocks] = ...``) is never
used: it is several times slower here.

Worst case: scattered chunk ids with small pages (16 KiB, ``blocks_per_chunk``
1 to 4) take the staged path, about half the memory bandwidth or a little more
(each byte is copied twice); runs of chunk ids (fresh slots) copy near it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tiering.errors import ResourceClosedError, SpecError
from tiering.specs import SMALL_IDS, IntArray, LoadStoreSpec
from tiering.transfer.base import DEFAULT_MAX_IN_FLIGHT, CompletionCallback
from tiering.transfer.layout import (
    GroupPlan,
    KVLayout,
    TransferDirection,
    TransferPlan,
    run_bounds,
    small_run_bounds,
)
from tiering.transfer.memory import HostMemoryPool
from tiering.transfer.worker import ThreadedBackend, ThreadedJob

__all__ = ["CpuBackend", "PageCopier"]

#: Jobs whose ops move less than this each on average are shared out over
#: ``torch.get_num_threads()`` threads: torch copies such small ops on one thread.
_PARALLEL_BELOW_BYTES = 1 << 20

#: Groups whose runs (the longer ones, of the split chosen) move less than this
#: per op and tensor on average are copied through a staging buffer instead: two
#: large ops per piece beat one small op per run there. Set by bench/transfer.py.
STAGE_BELOW_BYTES = 192 << 10

#: Size of each direction's staging buffer (a piece of a staged copy).
STAGING_BYTES = 4 << 20


class _Split(enum.Enum):
    BOTH = "both"  # runs consecutive on both sides: plain slice copies
    SLOTS = "slots"  # runs of consecutive pool slots
    BLOCKS = "blocks"  # runs of consecutive KV blocks


class PageCopier:
    """Copies the pages of a `TransferPlan` between CPU KV tensors and a host pool.

    Not thread-safe per direction: the backend gives each direction one thread
    (each direction has its own staging buffer; the helper threads are shared).
    ``staging_bytes`` and ``stage_below_bytes`` override `STAGING_BYTES` and
    `STAGE_BELOW_BYTES` (0 turns the staged path off).
    """

    def __init__(
        self,
        layout: KVLayout,
        pool: HostMemoryPool,
        *,
        staging_bytes: int | None = None,
        stage_below_bytes: int | None = None,
    ) -> None:
        if layout.device.type != "cpu":
            raise SpecError(
                f"the KV tensors are on {layout.device}; this copier needs CPU tensors "
                "(use the 'cuda' backend for GPU tensors)"
            )
        self.layout = layout
        self.num_chunks = layout.num_chunks(pool.nbytes)
        if self.num_chunks < 1:
            raise SpecError(
                f"the pool holds {pool.nbytes} bytes, less than one chunk row "
                f"({layout.row_bytes} bytes)"
            )
        words = pool.tensor[: self.num_chunks * layout.row_bytes].view(layout.word_dtype)
        self._kv = [layout.kv_view(i) for i in range(len(layout.tensors))]
        self._pool = [layout.pool_view(words, i) for i in range(len(layout.tensors))]
        self._parallelism = max(1, torch.get_num_threads())
        self._helpers: ThreadPoolExecutor | None = None
        self._helpers_lock = threading.Lock()  # the store and load threads share the helpers
        max_page = max(kv.page_bytes for kv in layout.tensors)
        staging_bytes = STAGING_BYTES if staging_bytes is None else staging_bytes
        self._staging_words = max(staging_bytes, max_page) // layout.word_bytes
        self._stage_below_bytes = (
            STAGE_BELOW_BYTES if stage_below_bytes is None else stage_below_bytes
        )
        # One staging buffer per direction, made on first use: each direction has
        # its own thread, so a store and a load never share one.
        self._staging: dict[TransferDirection, torch.Tensor] = {}

    def copy(self, plan: TransferPlan) -> None:
        """Move every page of ``plan``."""
        for group in plan.groups:
            if not len(group.blocks):
                continue
            split, bounds = _choose_split(group, plan.direction)
            tensors = self.layout.group_tensors[group.group]
            block_bytes = self.layout.group_block_bytes[group.group]
            # Bytes per op and tensor: the average run times the average page. Staging
            # costs two ops per piece, so it only pays with more than two runs.
            runs = len(bounds) - 1
            op_bytes = len(group.blocks) * block_bytes / (runs * len(tensors))
            if runs > 2 and op_bytes < self._stage_below_bytes:
                self._copy_staged(group, plan.direction)
            else:
                self._copy_group(_GroupOps(group, plan.direction, self.layout, split, bounds))

    def close(self) -> None:
        """Stop the helper threads (after the copies in progress). Idempotent."""
        with self._helpers_lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)
        self._staging.clear()

    def _copy_staged(self, group: GroupPlan, direction: TransferDirection) -> None:
        """Short runs on both sides: per piece and tensor, one gather and one scatter.

        A store gathers KV blocks into the staging buffer and scatters them to
        their pool slots; a load gathers pool slots and scatters them to KV
        blocks. Pieces are as many pages as the buffer holds, so it stays small
        (and in cache); torch spreads each of these large ops over its threads.
        """
        staging = self._staging.get(direction)
        if staging is None:
            staging = torch.empty(self._staging_words, dtype=self.layout.word_dtype)
            self._staging[direction] = staging
        store = direction is TransferDirection.STORE
        blocks, slots = _index_tensor(group.blocks), _index_tensor(group.slots)
        src_ids, dst_ids = (blocks, slots) if store else (slots, blocks)
        total = len(blocks)
        for t in self.layout.group_tensors[group.group]:
            src, dst = (self._kv[t], self._pool[t]) if store else (self._pool[t], self._kv[t])
            page_words = src.shape[1]
            rows = self._staging_words // page_words
            buffer = staging[: rows * page_words].view(rows, page_words)
            for start in range(0, total, rows):
                n = min(rows, total - start)
                piece = buffer[:n]
                torch.index_select(src, 0, src_ids[start : start + n], out=piece)
                dst.index_copy_(0, dst_ids[start : start + n], piece)

    def _copy_group(self, ops: _GroupOps) -> None:
        todo = [(t, r) for t in ops.tensors for r in range(len(ops.lengths))]
        threads = self._parallelism
        avg_bytes = ops.nbytes / max(1, len(todo))
        if threads < 2 or len(todo) < 2 * threads or avg_bytes >= _PARALLEL_BELOW_BYTES:
            self._run(ops, todo)
            return
        # Many small ops: torch runs each on one thread, so share them out. Their
        # destinations are disjoint (the plan refuses duplicate destinations).
        with self._helpers_lock:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="tiering-copy")
            helpers = self._helpers
        share = -(-len(todo) // threads)
        parts = [todo[i : i + share] for i in range(0, len(todo), share)]
        futures = [helpers.submit(self._run, ops, part) for part in parts[1:]]
        try:
            self._run(ops, parts[0])
        finally:
            # Every helper must have stopped writing before the job is reported,
            # failed or not; then the first error, if any, is raised.
            concurrent.futures.wait(futures)
            for future in futures:
                future.result()

    def _run(self, ops: _GroupOps, todo: list[tuple[int, int]]) -> None:
        lengths, firsts, idx = ops.lengths, ops.firsts, ops.idx
        for t, r in todo:
            kv, pool, n = self._kv[t], self._pool[t], lengths[r]
            if ops.split is _Split.BOTH:
                src, dst = (kv, pool) if ops.store else (pool, kv)
                b0, s0 = (ops.others[r], firsts[r]) if ops.store else (firsts[r], ops.others[r])
                dst.narrow(0, s0, n).copy_(src.narrow(0, b0, n))
                continue
            seq, ind = (pool, kv) if ops.split is _Split.SLOTS else (kv, pool)
            if ops.gather:
                torch.index_select(ind, 0, idx[r], out=seq.narrow(0, firsts[r], n))
            else:
                ind.index_copy_(0, idx[r], seq.narrow(0, firsts[r], n))


class _GroupOps:
    """One group of a job cut into runs: one torch op per run and tensor.

    ``firsts[r]`` is where run ``r`` starts on the sliced side (slots for the
    SLOTS and BOTH splits, blocks for BLOCKS); ``idx[r]`` are the matching ids
    of the other side (``others[r]``, the first of them, for BOTH).
    """

    def __init__(
        self,
        group: GroupPlan,
        direction: TransferDirection,
        layout: KVLayout,
        split: _Split,
        bounds: IntArray,
    ) -> None:
        self.split = split
        self.store = direction is TransferDirection.STORE
        self.tensors = layout.group_tensors[group.group]
        self.nbytes = len(group.blocks) * layout.group_block_bytes[group.group]
        # Lists, not numpy: a job has a few runs, and each numpy call costs
        # microseconds of this copy thread holding the GIL.
        edges = bounds.tolist()
        starts = edges[:-1]
        self.lengths: list[int] = [b - a for a, b in zip(starts, edges[1:], strict=True)]
        sliced, indexed = (
            (group.blocks, group.slots)
            if self.split is _Split.BLOCKS
            else (group.slots, group.blocks)
        )
        if len(sliced) <= SMALL_IDS:
            sliced_ids, indexed_ids = sliced.tolist(), indexed.tolist()
            self.firsts: list[int] = [sliced_ids[i] for i in starts]
            self.others: list[int] = [indexed_ids[i] for i in starts]
        else:  # many ids, few runs: index the arrays rather than list every id
            self.firsts = sliced[bounds[:-1]].tolist()
            self.others = indexed[bounds[:-1]].tolist()
        self.gather = self.store == (self.split is _Split.SLOTS)  # sliced side = destination
        self.idx: list[torch.Tensor] = []
        if self.split is not _Split.BOTH:
            index = _index_tensor(indexed)
            self.idx = [index.narrow(0, i, n) for i, n in zip(starts, self.lengths, strict=True)]


def _index_tensor(ids: IntArray) -> torch.Tensor:
    """``ids`` as an int64 tensor, sharing memory where numpy allows it."""
    return torch.from_numpy(ids if ids.flags.writeable else ids.copy())


def _choose_split(group: GroupPlan, direction: TransferDirection) -> tuple[_Split, IntArray]:
    """The split with the fewest runs; ties go to plain copies, then gathers."""
    by_slots: IntArray | list[int]
    by_blocks: IntArray | list[int]
    both: IntArray | list[int]
    if len(group.slots) <= SMALL_IDS:  # in Python: see `small_run_bounds`
        by_slots, by_blocks = small_run_bounds(group.slots), small_run_bounds(group.blocks)
        both = sorted({*by_slots, *by_blocks})
    else:
        by_slots, by_blocks = run_bounds(group.slots), run_bounds(group.blocks)
        both = np.union1d(by_slots, by_blocks)
    store = direction is TransferDirection.STORE
    gather_first = (_Split.SLOTS, by_slots) if store else (_Split.BLOCKS, by_blocks)
    scatter = (_Split.BLOCKS, by_blocks) if store else (_Split.SLOTS, by_slots)
    options = [(_Split.BOTH, both), gather_first, scatter]
    split, bounds = min(options, key=lambda o: len(o[1]))
    return split, np.asarray(bounds, dtype=np.int64)


class CpuBackend(ThreadedBackend):
    """Copies between CPU KV tensors and the host pool in two worker threads.

    ``on_complete`` (optional) is called with each result from the worker thread
    that ran the job; results then skip the `poll` queue.
    """

    name = "cpu"

    def __init__(
        self,
        layout: KVLayout,
        pool: HostMemoryPool,
        *,
        on_complete: CompletionCallback | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self._copier: PageCopier | None = PageCopier(layout, pool)
        super().__init__(on_complete=on_complete, max_in_flight=max_in_flight)

    def prepare(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> ThreadedJob:
        copier = self._live_copier()
        plan = copier.layout.plan(src, dst, copier.num_chunks)
        return ThreadedJob(job_id, plan.direction, plan, src, dst)

    def execute(self, job: ThreadedJob) -> None:
        if job.plan is not None:
            self._live_copier().copy(job.plan)

    def release_resources(self) -> None:
        if self._copier is not None:
            self._copier.close()
        self._copier = None  # drop the pool views so the pool can unmap

    def _live_copier(self) -> PageCopier:
        copier = self._copier
        if copier is None:
            raise ResourceClosedError("the cpu backend is closed")
        return copier
