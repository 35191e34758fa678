"""Staged copies: a job as bound torch calls through fixed staging and index buffers.

The ``cuda`` backend's batching, apart from its streams: per run of consecutive
pool slots, a store gathers every tensor's pages into a staging buffer laid out
like the pool rows (one ``index_select`` per tensor) and copies the run to the
pool in one contiguous copy; a load does the reverse (one copy in, one
``index_copy_`` per tensor). Runs are cut at the staging capacity and at the
boundaries of the pinned pieces (`copy_pieces`), so no copy spans two
registrations. A job's block ids go to the device once, into the direction's
index buffer; consecutive jobs of a direction may share both buffers only if
each runs after the previous one has finished (the backend's FIFO per direction).

Device-agnostic: compiling makes views and binds calls, no device call, so the
submitting thread can do it, and a test runs the calls on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from tiering.specs import IntArray
from tiering.transfer.layout import KVLayout, TransferDirection, TransferPlan, run_bounds

__all__ = ["StagedCopies", "StagedProgram", "copy_pieces"]


def copy_pieces(slots: IntArray, max_slots: int, piece_slots: int) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges of ``slots`` that are single DMA copies.

    Each range is consecutive in the pool, at most ``max_slots`` long, and does
    not cross a multiple of ``piece_slots`` (a pinned-piece boundary).
    """
    bounds = run_bounds(slots)
    if len(slots):
        bounds = np.union1d(bounds, np.flatnonzero(slots % piece_slots == 0))
    out: list[tuple[int, int]] = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        out.extend((s, min(b, s + max_slots)) for s in range(a, b, max_slots))
    return out


#: A bound torch call of a job.
_Call = Callable[[], object]


class StagedProgram:
    """A job's copies as bound torch calls (`StagedCopies.compile`), moving nothing yet.

    To run it: copy ``index_host`` (the job's block ids, on the host) into
    ``index`` (a view of the direction's index buffer), then make the ``calls``
    in order, all on one stream. Both are ``None`` for an empty job.
    """

    __slots__ = ("calls", "index", "index_host")

    def __init__(
        self, index_host: torch.Tensor | None, index: torch.Tensor | None, calls: list[_Call]
    ) -> None:
        self.index_host = index_host
        self.index = index
        self.calls = calls


class StagedCopies:
    """Compiles jobs into staged copies over fixed buffers (see the module docstring).

    ``host`` is the pool as a flat
    tensor of the layout's words; ``staging`` and ``index`` hold, per direction,
    a buffer of ``stage_slots`` slots and one of at least `max_blocks` int64 ids.
    """

    def __init__(
        self,
        layout: KVLayout,
        host: torch.Tensor,
        staging: dict[TransferDirection, torch.Tensor],
        index: dict[TransferDirection, torch.Tensor],
        *,
        stage_slots: int,
        piece_slots: int,
    ) -> None:
        self.layout = layout
        self._host = host
        self._staging = staging
        self._index = index
        self._stage_slots = stage_slots
        self._piece_slots = piece_slots
        self._slot_words = layout.slot_bytes // layout.word_bytes
        self._kv = [layout.kv_view(i) for i in range(len(layout.tensors))]
        w, sw = layout.word_bytes, self._slot_words
        # Each tensor's columns of the staging rows: its pages, as in a pool slot.
        self._columns = {
            d: [
                buffer[: stage_slots * sw]
                .view(stage_slots, sw)
                .narrow(1, layout.page_offsets[t] // w, kv.shape[1])
                for t, kv in enumerate(self._kv)
            ]
            for d, buffer in staging.items()
        }

    @staticmethod
    def max_blocks(layout: KVLayout) -> int:
        """The most block ids one job can name (each block of each group once)."""
        return sum(layout.group_num_blocks)

    def compile(self, plan: TransferPlan) -> StagedProgram:
        """The copies of ``plan`` as bound calls, moving nothing yet."""
        groups = [g for g in plan.groups if len(g.blocks)]
        if not groups:
            return StagedProgram(None, None, [])
        d = plan.direction
        ids = np.concatenate([g.blocks for g in groups]).astype(np.int64, copy=False)
        buffer = self._index[d]
        if len(ids) <= buffer.numel():
            index = buffer.narrow(0, 0, len(ids))
        else:  # a store naming a block more than once: more ids than the cache has blocks
            index = torch.empty(len(ids), dtype=buffer.dtype, device=buffer.device)
        staging, columns = self._staging[d], self._columns[d]
        store = d is TransferDirection.STORE
        sw = self._slot_words
        calls: list[_Call] = []
        first = 0
        for group in groups:
            blocks = index.narrow(0, first, len(group.blocks))
            first += len(group.blocks)
            tensors = self.layout.group_tensors[group.group]
            slots = group.slots
            for a, b in copy_pieces(slots, self._stage_slots, self._piece_slots):
                n = b - a
                stage = staging.narrow(0, 0, n * sw)
                host = self._host.narrow(0, int(slots[a]) * sw, n * sw)
                piece = blocks.narrow(0, a, n)
                if store:
                    for t in tensors:
                        out = columns[t].narrow(0, 0, n)
                        calls.append(partial(torch.index_select, self._kv[t], 0, piece, out=out))
                    calls.append(partial(host.copy_, stage, non_blocking=True))
                else:
                    calls.append(partial(stage.copy_, host, non_blocking=True))
                    for t in tensors:
                        calls.append(
                            partial(self._kv[t].index_copy_, 0, piece, columns[t].narrow(0, 0, n))
                        )
        return StagedProgram(torch.from_numpy(ids), index, calls)
