"""The ``cpu`` backend: KV tensors in host memory, copies by torch ops in worker threads.

This is the default where there is no GPU: the "GPU" KV tensors are CPU tensors
standing in for device memory, so the whole engine runs, and is measured, on a
laptop.

How pages are copied (`PageCopier`): a job pairs, per group, KV blocks with
pool slots. Python costs several microseconds per torch call, more than copying
a 16 KiB page, so the copier never loops per page. It splits the pairs into
runs that are consecutive on one side and issues one op per run and tensor:

* slots consecutive (chunk ids handed out in order): the pool side is a plain
  slice; a store gathers into it with ``torch.index_select(kv, 0, blocks,
  out=slice)``, a load scatters from it with ``kv.index_copy_(0, blocks, slice)``;
* blocks consecutive: the same with the roles swapped;
* both consecutive: ``slice.copy_(slice)``.

It picks, per group, whichever split gives the fewest runs. When a job is many
small ops (chunk ids scattered over the pool), torch copies each on one thread,
so the ops are shared out over ``torch.get_num_threads()`` threads; their
destinations are disjoint. All views are words of the widest size the layout
allows (16 bytes as complex128 for 16-byte-multiple pages, else int64, ...),
which copies markedly faster than bytes. Advanced-index assignment
(``kv[blocks] = ...``) is never used: it is several times slower here.

Worst case: scattered chunk ids with one small page per op (16 KiB pages,
``blocks_per_chunk`` 1 to 4) are bound by Python's cost per op, about half the
memory bandwidth at best; runs of chunk ids (fresh slots) copy near it.
"""

from __future__ import annotations

import enum
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tiering.errors import ResourceClosedError, SpecError
from tiering.specs import IntArray, LoadStoreSpec
from tiering.transfer.base import DEFAULT_MAX_IN_FLIGHT, CompletionCallback
from tiering.transfer.layout import (
    GroupPlan,
    KVLayout,
    TransferDirection,
    TransferPlan,
    run_bounds,
)
from tiering.transfer.memory import HostMemoryPool
from tiering.transfer.worker import ThreadedBackend, ThreadedJob

__all__ = ["CpuBackend", "PageCopier"]

#: Jobs whose ops move less than this each on average are shared out over
#: ``torch.get_num_threads()`` threads: torch copies such small ops on one thread.
_PARALLEL_BELOW_BYTES = 1 << 20


class _Split(enum.Enum):
    BOTH = "both"  # runs consecutive on both sides: plain slice copies
    SLOTS = "slots"  # runs of consecutive pool slots
    BLOCKS = "blocks"  # runs of consecutive KV blocks


class PageCopier:
    """Copies the pages of a `TransferPlan` between CPU KV tensors and a host pool.

    Not thread-safe per direction: the backend gives each direction one thread.
    """

    def __init__(self, layout: KVLayout, pool: HostMemoryPool) -> None:
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

    def copy(self, plan: TransferPlan) -> None:
        """Move every page of ``plan``."""
        for group in plan.groups:
            if len(group.blocks):
                self._copy_group(_GroupOps(group, plan.direction, self.layout))

    def close(self) -> None:
        """Stop the helper threads (after the copies in progress). Idempotent."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None

    def _copy_group(self, ops: _GroupOps) -> None:
        todo = [(t, r) for t in ops.tensors for r in range(len(ops.lengths))]
        threads = self._parallelism
        avg_bytes = ops.nbytes / max(1, len(todo))
        if threads < 2 or len(todo) < 2 * threads or avg_bytes >= _PARALLEL_BELOW_BYTES:
            self._run(ops, todo)
            return
        # Many small ops: torch runs each on one thread, so share them out. Their
        # destinations are disjoint (the plan refuses duplicate destinations).
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="tiering-copy")
        share = -(-len(todo) // threads)
        parts = [todo[i : i + share] for i in range(0, len(todo), share)]
        futures = [self._helpers.submit(self._run, ops, part) for part in parts[1:]]
        try:
            self._run(ops, parts[0])
        finally:
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

    def __init__(self, group: GroupPlan, direction: TransferDirection, layout: KVLayout) -> None:
        self.split, bounds = _choose_split(group, direction)
        self.store = direction is TransferDirection.STORE
        self.tensors = layout.group_tensors[group.group]
        self.nbytes = len(group.blocks) * layout.group_block_bytes[group.group]
        starts = bounds[:-1]
        self.lengths: list[int] = np.diff(bounds).tolist()
        sliced, indexed = (
            (group.blocks, group.slots)
            if self.split is _Split.BLOCKS
            else (group.slots, group.blocks)
        )
        self.firsts: list[int] = sliced[starts].tolist()
        self.others: list[int] = indexed[starts].tolist()
        self.gather = self.store == (self.split is _Split.SLOTS)  # sliced side = destination
        self.idx: list[torch.Tensor] = []
        if self.split is not _Split.BOTH:
            index = torch.from_numpy(indexed if indexed.flags.writeable else indexed.copy())
            self.idx = [
                index.narrow(0, i, n) for i, n in zip(starts.tolist(), self.lengths, strict=True)
            ]


def _choose_split(group: GroupPlan, direction: TransferDirection) -> tuple[_Split, IntArray]:
    """The split with the fewest runs; ties go to plain copies, then gathers."""
    by_slots = run_bounds(group.slots)
    by_blocks = run_bounds(group.blocks)
    both = np.union1d(by_slots, by_blocks)
    gather_first = (
        (_Split.SLOTS, by_slots)
        if direction is TransferDirection.STORE
        else (_Split.BLOCKS, by_blocks)
    )
    scatter = (
        (_Split.BLOCKS, by_blocks)
        if direction is TransferDirection.STORE
        else (_Split.SLOTS, by_slots)
    )
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
