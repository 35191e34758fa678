"""CPU-tier specs and sizing.

`CPULoadStoreSpec` names chunk slots of the CPU tier. `CPUOffloadingInfo` is the
static record of how big the tier is, in chunks, bytes and tokens; metrics and
the command line show it. `_kv_cache_size_tokens` converts a chunk count into
tokens for requests of the model's longest length, taking sliding-window and
Mamba groups (which keep only their last chunks) into account.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from tiering._checks import is_int
from tiering._types import Medium
from tiering.config import OffloadingConfig
from tiering.errors import CapacityError, ConfigError
from tiering.specs import BlockIDsLoadStoreSpec, IntArray

__all__ = ["CPULoadStoreSpec", "CPUOffloadingInfo"]


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


def _check_count(name: str, value: object, *, optional: bool = False) -> None:
    """Raise a `CapacityError` unless ``value`` is a non-negative int (or None if optional)."""
    if optional and value is None:
        return
    if not (is_int(value) and isinstance(value, int)):  # a field keeps it: numpy's won't encode
        raise CapacityError(
            f"{name} must be a non-negative integer, got {value!r} of type {type(value).__name__}"
        )
    if value < 0:
        raise CapacityError(f"{name} must be >= 0, got {value}")


def _kv_cache_size_tokens(config: OffloadingConfig, num_chunks: int) -> int | None:
    """Tokens a tier of ``num_chunks`` chunks holds for requests of ``max_model_len`` tokens.

    One request of ``L = config.model.max_model_len`` tokens needs, in every
    group, ``ceil(L / (tokens_per_block * blocks_per_chunk))`` chunks, capped
    at the group's ``sliding_window_size_in_chunks`` (the older chunks of a
    sliding-window or Mamba group age out). The tier then holds
    ``num_chunks / chunks_per_request`` such requests, that is
    ``num_chunks * L // chunks_per_request`` tokens.

    Returns None when the longest request is not known (``max_model_len <= 0``)
    or the engine has no KV-cache groups. Raises `CapacityError` for a negative
    or non-integer ``num_chunks``.
    """
    _check_count("num_chunks", num_chunks)
    max_model_len = config.model.max_model_len
    if max_model_len <= 0 or not config.groups:
        return None
    chunks_per_request = 0
    for group, tokens_per_chunk in zip(config.groups, config.tokens_per_chunk, strict=True):
        chunks = -(-max_model_len // tokens_per_chunk)
        window = group.sliding_window_size_in_chunks
        if window is not None:
            chunks = min(chunks, window)
        chunks_per_request += chunks
    return num_chunks * max_model_len // chunks_per_request


class CPUOffloadingInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Static facts about the CPU tier of one engine.

    - ``cpu_num_chunks``: chunk slots in the tier (chunks, not GPU blocks);
    - ``cpu_blocks_per_chunk``: GPU blocks per chunk, the chunk-to-block factor;
    - ``cpu_kv_cache_size_bytes``: exact bytes of the tier (chunks × bytes per
      chunk), or None when the caller does not know the chunk size;
    - ``cpu_kv_cache_size_tokens``: tokens the tier holds for requests of the
      model's longest length (see `_kv_cache_size_tokens`), or None when that
      length is not known or there are no KV-cache groups.
    """

    cpu_num_chunks: int
    cpu_blocks_per_chunk: int
    cpu_kv_cache_size_bytes: int | None
    cpu_kv_cache_size_tokens: int | None

    def __post_init__(self) -> None:
        _check_count("CPUOffloadingInfo.cpu_num_chunks", self.cpu_num_chunks)
        blocks = self.cpu_blocks_per_chunk
        if not (is_int(blocks) and isinstance(blocks, int)) or blocks < 1:
            raise ConfigError(
                f"CPUOffloadingInfo.cpu_blocks_per_chunk must be an integer >= 1, got {blocks!r}"
            )
        _check_count(
            "CPUOffloadingInfo.cpu_kv_cache_size_bytes", self.cpu_kv_cache_size_bytes, optional=True
        )
        _check_count(
            "CPUOffloadingInfo.cpu_kv_cache_size_tokens",
            self.cpu_kv_cache_size_tokens,
            optional=True,
        )

    @classmethod
    def from_config(
        cls, config: OffloadingConfig, num_chunks: int, kv_bytes_per_chunk: int | None
    ) -> CPUOffloadingInfo:
        """The facts of a tier of ``num_chunks`` chunks of ``kv_bytes_per_chunk`` bytes each.

        ``kv_bytes_per_chunk`` may be None when the caller does not know it;
        the size in bytes is then None too (never 0, which would read as an
        empty tier). Raises `CapacityError` for negative or non-integer sizes.
        """
        _check_count("num_chunks", num_chunks)
        _check_count("kv_bytes_per_chunk", kv_bytes_per_chunk, optional=True)
        return cls(
            cpu_num_chunks=num_chunks,
            cpu_blocks_per_chunk=config.cache.blocks_per_chunk,
            cpu_kv_cache_size_bytes=(
                None if kv_bytes_per_chunk is None else num_chunks * kv_bytes_per_chunk
            ),
            cpu_kv_cache_size_tokens=_kv_cache_size_tokens(config, num_chunks),
        )
