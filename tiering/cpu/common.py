"""CPU-tier specs and sizing (filled in by the config work)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tiering._types import Medium
from tiering.specs import BlockIDsLoadStoreSpec, IntArray

__all__ = ["CPULoadStoreSpec"]


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Chunk slots of the CPU tier; ``block_ids`` are chunk ids (``chunk_ids`` is an alias)."""

    __slots__ = ()

    def __init__(self, chunk_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        super().__init__(chunk_ids)

    @property
    def chunk_ids(self) -> IntArray:
        return self.block_ids

    @staticmethod
    def medium() -> Medium:
        return Medium.CPU
