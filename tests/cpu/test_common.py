from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tiering._types import Medium
from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from tiering.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo, _kv_cache_size_tokens
from tiering.errors import CapacityError, ConfigError


def make_config(
    groups: list[tuple[int, int | None]], blocks_per_chunk: int, max_model_len: int
) -> OffloadingConfig:
    """A config with one group per ``(tokens_per_block, sliding_window_size_in_chunks)``."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=tokens,
                layer_names=(f"layer.{index}",),
                sliding_window_size_in_chunks=window,
            )
            for index, (tokens, window) in enumerate(groups)
        ),
        worker_kv_bytes_per_block=131072,
        engine_id="e0",
        model=OffloadingModelConfig(name="m", dtype="bfloat16", max_model_len=max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
    )


# Full attention + a sliding window of 63 chunks, 16-token blocks, 4 blocks (64 tokens)
# per chunk, requests of up to 32768 tokens.
HYBRID = make_config([(16, None), (16, 63)], blocks_per_chunk=4, max_model_len=32768)


@pytest.mark.parametrize(
    ("config", "num_chunks", "expected"),
    [
        # one full-attention group: 8192 / 64 = 128 chunks a request; 1000 * 8192 // 128
        (make_config([(16, None)], 4, 8192), 1000, 64000),
        # hybrid: 32768 / 64 = 512 full-attention chunks + min(512, 63) window chunks = 575;
        # 10000 * 32768 // 575 = 327_680_000 // 575 = 569_878 (575 * 569_878 = 327_679_850)
        (HYBRID, 10000, 569878),
        # a length that is not a whole number of chunks rounds up: ceil(1000 / 64) = 16 in
        # each group (the window of 63 does not bite); 100 * 1000 // 32 = 3125
        (make_config([(16, None), (16, 63)], 4, 1000), 100, 3125),
        # attention (32 tokens x 2 = 64 per chunk) + Mamba (window of one chunk):
        # 4096 / 64 + 1 = 65 chunks a request; 650 * 4096 // 65 = 40960
        (make_config([(32, None), (64, 1)], 2, 4096), 650, 40960),
        # an empty tier holds nothing
        (HYBRID, 0, 0),
        # the longest request is unknown: no token count
        (make_config([(16, None)], 4, 0), 1000, None),
        # an attention-free engine has no groups: no token count
        (make_config([], 4, 8192), 1000, None),
    ],
)
def test_kv_cache_size_tokens(
    config: OffloadingConfig, num_chunks: int, expected: int | None
) -> None:
    assert _kv_cache_size_tokens(config, num_chunks) == expected


@pytest.mark.parametrize(
    ("num_chunks", "pattern"),
    [
        (-1, r"num_chunks must be >= 0, got -1"),
        (True, r"num_chunks must be a non-negative integer, got True of type bool"),
        (2.5, r"num_chunks must be a non-negative integer, got 2.5 of type float"),
    ],
)
def test_kv_cache_size_tokens_rejects(num_chunks: Any, pattern: str) -> None:
    with pytest.raises(CapacityError, match=pattern):
        _kv_cache_size_tokens(HYBRID, num_chunks)


def test_info_from_config() -> None:
    info = CPUOffloadingInfo.from_config(HYBRID, num_chunks=10000, kv_bytes_per_chunk=524288)
    assert info == CPUOffloadingInfo(
        cpu_num_chunks=10000,
        cpu_blocks_per_chunk=4,
        cpu_kv_cache_size_bytes=5_242_880_000,
        cpu_kv_cache_size_tokens=569878,
    )


def test_info_unknown_chunk_size_is_none_not_zero() -> None:
    info = CPUOffloadingInfo.from_config(HYBRID, num_chunks=10, kv_bytes_per_chunk=None)
    assert info.cpu_kv_cache_size_bytes is None
    # 10 * 32768 // 575 = 569
    assert info.cpu_kv_cache_size_tokens == 569


def test_info_without_max_model_len() -> None:
    config = make_config([(16, None)], 1, 0)
    info = CPUOffloadingInfo.from_config(config, num_chunks=3, kv_bytes_per_chunk=100)
    assert info == CPUOffloadingInfo(
        cpu_num_chunks=3,
        cpu_blocks_per_chunk=1,
        cpu_kv_cache_size_bytes=300,
        cpu_kv_cache_size_tokens=None,
    )


@pytest.mark.parametrize(
    ("num_chunks", "kv_bytes_per_chunk", "pattern"),
    [
        (-5, 1024, r"num_chunks must be >= 0, got -5"),
        (5, -1024, r"kv_bytes_per_chunk must be >= 0, got -1024"),
        (5, "1024", r"kv_bytes_per_chunk must be a non-negative integer, got '1024'"),
    ],
)
def test_info_from_config_rejects(num_chunks: Any, kv_bytes_per_chunk: Any, pattern: str) -> None:
    with pytest.raises(CapacityError, match=pattern):
        CPUOffloadingInfo.from_config(HYBRID, num_chunks, kv_bytes_per_chunk)


@pytest.mark.parametrize(
    ("fields", "error", "pattern"),
    [
        ({"cpu_num_chunks": -1}, CapacityError, r"cpu_num_chunks must be >= 0, got -1"),
        ({"cpu_blocks_per_chunk": 0}, ConfigError, r"cpu_blocks_per_chunk must be .*>= 1, got 0"),
        ({"cpu_kv_cache_size_bytes": -8}, CapacityError, r"cpu_kv_cache_size_bytes .*got -8"),
        ({"cpu_kv_cache_size_tokens": -3}, CapacityError, r"cpu_kv_cache_size_tokens .*got -3"),
    ],
)
def test_info_rejects_impossible_fields(
    fields: dict[str, int], error: type[Exception], pattern: str
) -> None:
    values: dict[str, Any] = {
        "cpu_num_chunks": 1,
        "cpu_blocks_per_chunk": 1,
        "cpu_kv_cache_size_bytes": None,
        "cpu_kv_cache_size_tokens": None,
    }
    values.update(fields)
    with pytest.raises(error, match=pattern):
        CPUOffloadingInfo(**values)


def test_info_is_frozen() -> None:
    info = CPUOffloadingInfo.from_config(HYBRID, num_chunks=1, kv_bytes_per_chunk=1)
    with pytest.raises(AttributeError):
        info.cpu_num_chunks = 2  # type: ignore[misc]


def test_cpu_load_store_spec_names_chunks() -> None:
    spec = CPULoadStoreSpec([3, 1, 2])
    assert spec.medium() is Medium.CPU
    assert spec.chunk_ids.tolist() == [3, 1, 2]
    assert spec.chunk_ids is spec.block_ids
    assert spec.chunk_ids.dtype == np.int64
    assert len(spec) == 3


def test_a_numpy_integer_is_refused_as_before() -> None:
    # The record keeps the value, and msgspec cannot encode numpy's integers.
    with pytest.raises(CapacityError, match=r"cpu_num_chunks must be a non-negative integer"):
        CPUOffloadingInfo(
            cpu_num_chunks=np.int64(5),
            cpu_blocks_per_chunk=2,
            cpu_kv_cache_size_bytes=None,
            cpu_kv_cache_size_tokens=None,
        )
    with pytest.raises(ConfigError, match=r"cpu_blocks_per_chunk must be an integer >= 1"):
        CPUOffloadingInfo(
            cpu_num_chunks=5,
            cpu_blocks_per_chunk=np.int64(2),
            cpu_kv_cache_size_bytes=None,
            cpu_kv_cache_size_tokens=None,
        )
