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

Threads and the GIL: `CpuBackend.prepare`, on the submitting thread, compiles a
job into its bound torch calls (`PageCopier.compile`: index tensors, views, one
call per op); the copy thread only makes those calls. Every torch call gives up
the GIL and takes it back after, and beside an event loop running Python that
wait is up to the interpreter's switch interval, so a copy thread that built
its own views and index tensors spent most of each job waiting.

Worst case: scattered chunk ids with small pages (16 KiB, ``blocks_per_chunk``
1 to 4) take the staged path, about half the memory bandwidth or a little more
(each byte is copied twice); runs of chunk ids (fresh slots) copy near it.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

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
    list_run_bounds,
    run_bounds,
)
from tiering.transfer.memory import HostMemoryPool
from tiering.transfer.worker import ThreadedBackend, ThreadedJob

__all__ = ["CopyProgram", "CpuBackend", "PageCopier"]

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

    Programs of one direction must run one at a time, in order (the backend
    gives each direction one thread): they share that direction's staging
    buffer. `compile` may run on another thread meanwhile; the helper threads
    are shared by both directions.
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
        self.num_chunks = layout.pool_chunks(pool.nbytes)
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
        # One staging buffer per direction, made by the first compile that needs
        # it: each direction runs its programs in order, so a store and a load
        # never share one.
        self._staging: dict[TransferDirection, torch.Tensor] = {}

    def copy(self, plan: TransferPlan) -> None:
        """Move every page of ``plan`` (`compile` then `run`, on this thread)."""
        self.run(self.compile(plan))

    def compile(self, plan: TransferPlan) -> CopyProgram:
        """Every torch call ``plan`` needs, bound and ready, moving nothing yet.

        Call it on the submitting thread and `run` the program on the copy
        thread: then the copy thread makes no torch call but the copies. Every
        torch call releases the GIL and must take it back after, and while the
        event loop runs Python that takes up to the interpreter's switch
        interval: a copy thread making four calls per job (index tensors,
        views, the copy) copies far slower beside a busy loop (bench/transfer.py
        shows by how much). Building the calls costs the submitting thread
        little, and it would have spent that time waiting for the GIL.
        """
        steps: list[_Step] = []
        for group in plan.groups:
            if not len(group.blocks):
                continue
            # A few ids: listed once, for the split and the ops (see `SMALL_IDS`).
            ids = (
                (group.slots.tolist(), group.blocks.tolist())
                if len(group.slots) <= SMALL_IDS
                else None
            )
            split, bounds = _choose_split(group, plan.direction, ids)
            tensors = self.layout.group_tensors[group.group]
            block_bytes = self.layout.group_block_bytes[group.group]
            # Bytes per op and tensor: the average run times the average page. Staging
            # costs two ops per piece, so it only pays with more than two runs.
            runs = len(bounds) - 1
            op_bytes = len(group.blocks) * block_bytes / (runs * len(tensors))
            if runs > 2 and op_bytes < self._stage_below_bytes:
                steps.append((self._copy_staged(group, plan.direction), False))
            else:
                ops = _GroupOps(group, plan.direction, self.layout, split, bounds, ids)
                steps.append(self._copy_group(ops))
        return CopyProgram(steps)

    def execute(self, plan: TransferPlan, work: object) -> None:
        """Run ``work``, the program `compile` made for ``plan``; without one, compile it now."""
        self.run(work if isinstance(work, CopyProgram) else self.compile(plan))

    def run(self, program: CopyProgram) -> None:
        """Make the copies of ``program``, sharing out the steps marked shared."""
        for ops, shared in program.steps:
            if shared:
                self._share_out(ops)
            else:
                for op in ops:
                    op()

    def close(self) -> None:
        """Stop the helper threads (after the copies in progress). Idempotent."""
        with self._helpers_lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)
        self._staging.clear()

    def _copy_staged(self, group: GroupPlan, direction: TransferDirection) -> list[_Op]:
        """Short runs on both sides: per piece and tensor, one gather and one scatter.

        A store gathers KV blocks into the staging buffer and scatters them to
        their pool slots; a load gathers pool slots and scatters them to KV
        blocks. Pieces are as many pages as the buffer holds, so it stays small
        (and in cache); torch spreads each of these large ops over its threads.
        The ops run in order: each piece's scatter reads what its gather wrote.
        """
        staging = self._staging.get(direction)
        if staging is None:
            staging = torch.empty(self._staging_words, dtype=self.layout.word_dtype)
            self._staging[direction] = staging
        store = direction is TransferDirection.STORE
        blocks, slots = _index_tensor(group.blocks), _index_tensor(group.slots)
        src_ids, dst_ids = (blocks, slots) if store else (slots, blocks)
        total = len(blocks)
        ops: list[_Op] = []
        for t in self.layout.group_tensors[group.group]:
            src, dst = (self._kv[t], self._pool[t]) if store else (self._pool[t], self._kv[t])
            page_words = src.shape[1]
            rows = self._staging_words // page_words
            buffer = staging[: rows * page_words].view(rows, page_words)
            for start in range(0, total, rows):
                n = min(rows, total - start)
                piece = buffer[:n]
                end = start + n
                ops.append(partial(torch.index_select, src, 0, src_ids[start:end], out=piece))
                ops.append(partial(dst.index_copy_, 0, dst_ids[start:end], piece))
        return ops

    def _copy_group(self, ops: _GroupOps) -> _Step:
        """One op per run and tensor; shared out over threads when they are many and small."""
        calls: list[_Op] = []
        for t in ops.tensors:
            kv, pool = self._kv[t], self._pool[t]
            for r, n in enumerate(ops.lengths):
                if ops.split is _Split.BOTH:
                    src, dst = (kv, pool) if ops.store else (pool, kv)
                    b0, s0 = (
                        (ops.others[r], ops.firsts[r])
                        if ops.store
                        else (ops.firsts[r], ops.others[r])
                    )
                    calls.append(partial(dst[s0 : s0 + n].copy_, src[b0 : b0 + n]))
                    continue
                seq, ind = (pool, kv) if ops.split is _Split.SLOTS else (kv, pool)
                first = ops.firsts[r]
                if ops.gather:
                    out = seq[first : first + n]
                    calls.append(partial(torch.index_select, ind, 0, ops.idx[r], out=out))
                else:
                    calls.append(partial(ind.index_copy_, 0, ops.idx[r], seq[first : first + n]))
        threads = self._parallelism
        avg_bytes = ops.nbytes / max(1, len(calls))
        # Many small ops: torch runs each on one thread, so they are shared out.
        shared = threads > 1 and len(calls) >= 2 * threads and avg_bytes < _PARALLEL_BELOW_BYTES
        return calls, shared

    def _share_out(self, ops: list[_Op]) -> None:
        """Run ``ops`` over this thread and the helpers; their destinations are disjoint."""
        threads = self._parallelism
        with self._helpers_lock:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="tiering-copy")
            helpers = self._helpers
        share = -(-len(ops) // threads)
        parts = [ops[i : i + share] for i in range(0, len(ops), share)]
        futures = [helpers.submit(_run_all, part) for part in parts[1:]]
        try:
            _run_all(parts[0])
        finally:
            # Every helper must have stopped writing before the job is reported,
            # failed or not; then the first error, if any, is raised.
            concurrent.futures.wait(futures)
            for future in futures:
                future.result()


#: A bound torch call of a copy.
_Op = Callable[[], object]
#: Ops in order, and whether they may instead be shared out over threads.
_Step = tuple[list[_Op], bool]


class CopyProgram:
    """A job's copies as bound torch calls (`PageCopier.compile`); run by `PageCopier.run`."""

    __slots__ = ("steps",)

    def __init__(self, steps: list[_Step]) -> None:
        self.steps = steps


def _run_all(ops: list[_Op]) -> None:
    for op in ops:
        op()


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
        bounds: IntArray | list[int],
        ids: tuple[list[int], list[int]] | None = None,
    ) -> None:
        self.split = split
        self.store = direction is TransferDirection.STORE
        self.tensors = layout.group_tensors[group.group]
        self.nbytes = len(group.blocks) * layout.group_block_bytes[group.group]
        # Lists, not numpy: a job has a few runs, and each numpy call costs
        # microseconds holding the GIL that the other threads need.
        edges = bounds if isinstance(bounds, list) else bounds.tolist()
        starts = edges[:-1]
        self.lengths: list[int] = [b - a for a, b in zip(starts, edges[1:], strict=True)]
        by_blocks = self.split is _Split.BLOCKS
        sliced, indexed = (group.blocks, group.slots) if by_blocks else (group.slots, group.blocks)
        if ids is not None:  # ``(slots, blocks)`` as lists: a few ids
            sliced_ids, indexed_ids = (ids[1], ids[0]) if by_blocks else ids
            self.firsts: list[int] = [sliced_ids[i] for i in starts]
            self.others: list[int] = [indexed_ids[i] for i in starts]
        else:  # many ids, few runs: index the arrays rather than list every id
            heads = np.asarray(starts, dtype=np.int64)
            self.firsts = sliced[heads].tolist()
            self.others = indexed[heads].tolist()
        self.gather = self.store == (self.split is _Split.SLOTS)  # sliced side = destination
        self.idx: list[torch.Tensor] = []
        if self.split is not _Split.BOTH:
            index = _index_tensor(indexed)
            if len(starts) == 1:
                self.idx = [index]
            else:
                self.idx = [index[i : i + n] for i, n in zip(starts, self.lengths, strict=True)]


def _index_tensor(ids: IntArray) -> torch.Tensor:
    """``ids`` as an int64 tensor, sharing memory where numpy allows it."""
    return torch.from_numpy(ids if ids.flags.writeable else ids.copy())


def _choose_split(
    group: GroupPlan,
    direction: TransferDirection,
    ids: tuple[list[int], list[int]] | None = None,
) -> tuple[_Split, IntArray | list[int]]:
    """The split with the fewest runs; ties go to plain copies, then gathers.

    With ``ids`` (the slots and blocks as lists: a few ids) the bounds are
    found, and returned, as a list; otherwise with numpy, as an array.
    """
    by_slots: IntArray | list[int]
    by_blocks: IntArray | list[int]
    both: IntArray | list[int]
    if ids is not None:  # in Python: see `small_run_bounds`
        by_slots, by_blocks = list_run_bounds(ids[0]), list_run_bounds(ids[1])
        if len(by_blocks) == 2:  # one run of blocks: the union is the slots' bounds
            both = by_slots
        elif len(by_slots) == 2:
            both = by_blocks
        else:
            both = sorted({*by_slots, *by_blocks})
    else:
        by_slots, by_blocks = run_bounds(group.slots), run_bounds(group.blocks)
        both = np.union1d(by_slots, by_blocks)
    store = direction is TransferDirection.STORE
    gather_first = (_Split.SLOTS, by_slots) if store else (_Split.BLOCKS, by_blocks)
    scatter = (_Split.BLOCKS, by_blocks) if store else (_Split.SLOTS, by_slots)
    options = [(_Split.BOTH, both), gather_first, scatter]
    return min(options, key=lambda o: len(o[1]))


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
        # The torch calls are made here, not in the copy thread: see `PageCopier.compile`.
        return ThreadedJob(job_id, plan.direction, plan, src, dst, copier.compile(plan))

    def execute(self, job: ThreadedJob) -> None:
        if job.plan is not None:
            self._live_copier().execute(job.plan, job.work)

    def release_resources(self) -> None:
        if self._copier is not None:
            self._copier.close()
        self._copier = None  # drop the pool views so the pool can unmap

    def _live_copier(self) -> PageCopier:
        copier = self._copier
        if copier is None:
            raise ResourceClosedError("the cpu backend is closed")
        return copier
