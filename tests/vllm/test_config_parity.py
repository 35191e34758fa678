"""tiering's config against vLLM 0.33's own, on real vLLM objects.

Three things, each on a real ``VllmConfig`` and ``KVCacheConfig``:

- `from_vllm_offloading_config` keeps every field of what vLLM's own
  ``build_offloading_config`` returns (its dataclasses walked field by field);
- the seed's ``tokens_per_hash`` is what vLLM's ``resolve_kv_cache_block_sizes``
  resolves;
- each row of docs/vllm.md's table of where the seed's ``build_offloading_config``
  and vLLM 0.33's differ: one test per row calls both on the same objects and
  asserts the difference the row states.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import KVEventsConfig, VllmConfig
from vllm.config.cache import CacheDType
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config as vllm_build_offloading_config,
)
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)

from tiering.config import OffloadingConfig, OffloadingModelConfig
from tiering.errors import ConfigError
from tiering.integrations.vllm import build_offloading_config, from_vllm_offloading_config

from .harness import LAYERS, MODEL, attention_spec, build_kv_cache_config, build_vllm_config
from .harness import write_model as write_model_folder

HEADS, HEAD_SIZE = MODEL["num_key_value_heads"], MODEL["head_dim"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    """One VllmConfig for the module (building its ModelConfig is slow); tests copy it."""
    model = write_model_folder(Path(tmp_path_factory.mktemp("parity")) / "model")
    return build_vllm_config(model, {})


def variant(base: VllmConfig, extra: Mapping[str, Any] | None = None, **parallel: Any) -> Any:
    """A copy of ``base`` with this ``kv_connector_extra_config`` and parallel fields."""
    config = copy.deepcopy(base)
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config = dict(extra or {})
    for name, value in parallel.items():
        setattr(config.parallel_config, name, value)
    return config


def sliding(block_size: int = 16, window: int = 128, **fields: Any) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=window,
        **fields,
    )


def mamba(block_size: int, mode: str) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((4, 64),),
        dtypes=(torch.float16,),
        mamba_cache_mode=mode,
    )


def kv_cache(*specs: KVCacheSpec, num_blocks: int = 0, **groups: Any) -> KVCacheConfig:
    """One group per spec (layers ``g<i>.l0``), on the scheduler side unless told."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[f"g{i}.l0"], kv_cache_spec=spec, **groups)
            for i, spec in enumerate(specs)
        ],
    )


def both(vllm_config: Any, kv_cache_config: KVCacheConfig) -> tuple[Any, OffloadingConfig]:
    return (
        vllm_build_offloading_config(vllm_config, kv_cache_config),
        build_offloading_config(vllm_config, kv_cache_config),
    )


# --- from_vllm_offloading_config: every field of vLLM's config, kept --------------------


def assert_same(theirs: Any, ours: Any, path: str = "config") -> None:
    """Every field of vLLM's dataclass ``theirs`` has the same name and value in ``ours``."""
    if dataclasses.is_dataclass(theirs):
        names = [field.name for field in dataclasses.fields(theirs)]
        assert isinstance(ours, msgspec.Struct), path
        assert sorted(ours.__struct_fields__) == sorted(names), f"{path}: the fields differ"
        for name in names:
            assert_same(getattr(theirs, name), getattr(ours, name), f"{path}.{name}")
    elif isinstance(theirs, tuple):
        assert isinstance(ours, tuple), path
        assert len(ours) == len(theirs), path
        for index, (their, our) in enumerate(zip(theirs, ours, strict=True)):
            assert_same(their, our, f"{path}[{index}]")
    elif isinstance(theirs, Mapping):
        assert ours == dict(theirs), path
    else:
        assert (type(ours), ours) == (type(theirs), theirs), path


def _one_full_group(base: VllmConfig) -> tuple[Any, KVCacheConfig]:
    config = variant(base, {"blocks_per_chunk": 2, "cpu_bytes_to_use": 1 << 28})
    return config, build_kv_cache_config(config, 2048)


def _sliding_and_full(base: VllmConfig) -> tuple[Any, KVCacheConfig]:
    config = variant(base, {"block_size": 64, "spec_name": "TieringSpec"})
    return config, kv_cache(attention_spec(), sliding(window=200))


def _kv_events(base: VllmConfig) -> tuple[Any, KVCacheConfig]:
    config = variant(base, {"self_describing_kv_events": True})
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    return config, build_kv_cache_config(config, 2048)


def _blocks_per_chunk(base: VllmConfig) -> tuple[Any, KVCacheConfig]:
    config = variant(base, {"blocks_per_chunk": "4", "canonical_layout": True})
    return config, kv_cache(attention_spec(), mamba(16, "align"))


def _data_and_tensor_parallel(base: VllmConfig) -> tuple[Any, KVCacheConfig]:
    config = variant(
        base,
        {"blocks_per_chunk": 1},
        tensor_parallel_size=2,
        world_size=2,
        rank=1,
        data_parallel_size=4,
        data_parallel_rank=3,
        data_parallel_index=3,
        data_parallel_rank_local=1,
    )
    spec = dataclasses.replace(attention_spec(), num_kv_heads=HEADS // 2)  # heads over TP 2
    return config, kv_cache(spec, num_blocks=0)


SHAPES = {
    "one full-attention group": _one_full_group,
    "sliding window and full attention": _sliding_and_full,
    "kv events on": _kv_events,
    "blocks_per_chunk and canonical layout, Mamba in align mode": _blocks_per_chunk,
    "data and tensor parallel": _data_and_tensor_parallel,
}


@pytest.mark.parametrize("shape", SHAPES)
def test_from_vllm_keeps_every_field_of_vllms_config(base: VllmConfig, shape: str) -> None:
    vllm_config, kv_cache_config = SHAPES[shape](base)
    theirs = vllm_build_offloading_config(vllm_config, kv_cache_config)
    ours = from_vllm_offloading_config(theirs)
    assert_same(theirs, ours)


def test_the_shapes_set_what_they_say(base: VllmConfig) -> None:
    """The round trip above covers non-default values, not only defaults."""
    configs = {shape: vllm_build_offloading_config(*build(base)) for shape, build in SHAPES.items()}
    assert configs["one full-attention group"].worker_kv_bytes_per_block == 16384
    assert configs["one full-attention group"].kv_cache_layout == "LBNHC"
    assert configs["sliding window and full attention"].groups[1].sliding_window_size_in_chunks
    assert configs["kv events on"].enable_kv_cache_events is True
    assert configs["blocks_per_chunk and canonical layout, Mamba in align mode"].cache == type(
        configs["kv events on"].cache
    )(tokens_per_hash=16, blocks_per_chunk=4)
    assert configs["blocks_per_chunk and canonical layout, Mamba in align mode"].canonical_layout
    parallel = configs["data and tensor parallel"].parallel
    assert (parallel.rank, parallel.tp_size, parallel.data_parallel_size) == (1, 2, 4)
    assert (parallel.data_parallel_index, parallel.data_parallel_rank_local) == (3, 1)
    assert parallel.is_parallelism_agnostic is True


def test_every_vllm_cache_dtype_is_taken_and_stored_as_vllm_stores_it() -> None:
    dtypes = [dtype for dtype in CacheDType.__args__ if dtype != "auto"]  # type: ignore[attr-defined]
    for dtype in dtypes:
        storage = str(STR_DTYPE_TO_TORCH_DTYPE[dtype]).removeprefix("torch.")
        assert OffloadingModelConfig(name="m", dtype=dtype).storage_dtype == storage, dtype


# --- the seed's tokens_per_hash: vLLM's resolve_kv_cache_block_sizes as the oracle -------


def _hash_shapes() -> dict[str, tuple[dict[str, Any], tuple[KVCacheSpec, ...]]]:
    """name -> (cache_config fields, group specs)."""
    return {
        "one group": ({}, (attention_spec(),)),
        "one group, prefix_match_unit = its block": (
            {"prefix_match_unit": 16},
            (attention_spec(),),
        ),
        "full 16 and window 32": ({}, (attention_spec(16), sliding(32))),
        "two groups, prefix_match_unit 8": (
            {"prefix_match_unit": 8},
            (attention_spec(16), sliding(16)),
        ),
        "full 16 and Mamba 64 in align mode": ({}, (attention_spec(16), mamba(64, "align"))),
        "full 64 and Mamba 64 outside align mode": ({}, (attention_spec(64), mamba(64, "none"))),
        "full 16 and Mamba 64 outside align mode": ({}, (attention_spec(16), mamba(64, "all"))),
    }


@pytest.mark.parametrize("shape", _hash_shapes())
def test_tokens_per_hash_is_vllms(base: VllmConfig, shape: str) -> None:
    cache_fields, specs = _hash_shapes()[shape]
    vllm_config = variant(base)
    for name, value in cache_fields.items():
        setattr(vllm_config.cache_config, name, value)
    kv_cache_config = kv_cache(*specs)
    _, expected = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    if all(spec.block_size % expected == 0 for spec in specs):
        assert build_offloading_config(vllm_config, kv_cache_config).cache.tokens_per_hash == (
            expected
        )
    else:  # vLLM's offloading asserts here too; the seed says which hash block it found
        with pytest.raises(ConfigError, match=rf"tokens_per_hash={expected}\b"):
            build_offloading_config(vllm_config, kv_cache_config)


def test_the_oracle_covers_the_cases_that_were_wrong(base: VllmConfig) -> None:
    vllm_config = variant(base)
    vllm_config.cache_config.prefix_match_unit = 8
    two = kv_cache(attention_spec(16), sliding(16))
    assert resolve_kv_cache_block_sizes(two, vllm_config)[1] == 8
    assert build_offloading_config(vllm_config, two).cache.tokens_per_hash == 8
    align = kv_cache(attention_spec(16), mamba(64, "align"))
    assert build_offloading_config(variant(base), align).cache.tokens_per_hash == 16


# --- docs/vllm.md: where the seed's translation and vLLM 0.33's differ, row by row ---------


def test_row_sliding_window_with_extra_retained_tokens(base: VllmConfig) -> None:
    # a 128-token window, 16 tokens kept past it, 16-token chunks
    theirs, ours = both(
        variant(base), kv_cache(attention_spec(), sliding(extra_retained_tokens=16))
    )
    assert ours.groups[1].sliding_window_size_in_chunks == 8  # ceil(128 / 16)
    assert theirs.groups[1].sliding_window_size_in_chunks == 9  # ceil((128 - 1 + 16) / 16)


def test_row_a_group_without_kv_transfer(base: VllmConfig) -> None:
    kv_cache_config = kv_cache(attention_spec(), sliding())
    kv_cache_config.kv_cache_groups[1].enable_kv_transfer = False
    theirs, ours = both(variant(base), kv_cache_config)
    assert [group.group_id for group in ours.groups] == [0, 1]  # kept
    assert [group.group_id for group in theirs.groups] == [0]  # dropped


def test_row_chunked_local_attention(base: VllmConfig) -> None:
    spec = ChunkedLocalAttentionSpec(
        block_size=16,
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
        attention_chunk_size=256,
    )
    kv_cache_config = kv_cache(attention_spec(), spec)
    theirs = vllm_build_offloading_config(variant(base), kv_cache_config)
    assert theirs.groups[1].sliding_window_size_in_chunks == 16  # 256 / 16
    with pytest.raises(ConfigError, match=r"kv_cache_groups\[1\]\.kv_cache_spec is a Chunked"):
        build_offloading_config(variant(base), kv_cache_config)


def test_row_hybrid_groups_with_decode_context_parallelism(base: VllmConfig) -> None:
    vllm_config = variant(
        base, decode_context_parallel_size=2, tensor_parallel_size=2, world_size=2
    )
    kv_cache_config = kv_cache(attention_spec(), sliding())
    theirs = vllm_build_offloading_config(vllm_config, kv_cache_config)
    assert [group.tokens_per_block for group in theirs.groups] == [32, 32]
    with pytest.raises(ConfigError, match=r"2 KV-cache groups .*decode_context_parallel_size=2"):
        build_offloading_config(vllm_config, kv_cache_config)


def test_row_prefill_context_parallelism(base: VllmConfig) -> None:
    vllm_config = variant(base, prefill_context_parallel_size=2, world_size=2)
    theirs, ours = both(vllm_config, kv_cache(attention_spec()))
    assert (ours.groups[0].tokens_per_block, ours.cache.tokens_per_hash) == (32, 32)
    assert (theirs.groups[0].tokens_per_block, theirs.cache.tokens_per_hash) == (16, 16)


def test_row_tensors_without_a_block_stride(base: VllmConfig) -> None:
    vllm_config = variant(base)
    kv_cache_config = build_kv_cache_config(vllm_config, 2048)
    (tensor,) = kv_cache_config.kv_cache_tensors  # one allocation for both layers
    kv_cache_config.kv_cache_tensors = [
        KVCacheTensor(size=tensor.size, layers=[layer], layer_stride=0, block_stride=0)
        for layer in LAYERS
    ]
    theirs, ours = both(vllm_config, kv_cache_config)
    assert ours.worker_kv_bytes_per_block == 32768  # the sizes summed, over 2048 blocks
    assert theirs.worker_kv_bytes_per_block == 16384  # the first size: the whole allocation


def test_row_a_fractional_blocks_per_chunk(base: VllmConfig) -> None:
    vllm_config = variant(base, {"blocks_per_chunk": 2.7})
    theirs = vllm_build_offloading_config(vllm_config, kv_cache(attention_spec()))
    assert theirs.cache.blocks_per_chunk == 2  # int(2.7)
    with pytest.raises(ConfigError, match=r"\['blocks_per_chunk'\] must be an integer, got 2\.7"):
        build_offloading_config(vllm_config, kv_cache(attention_spec()))
    # and tiering does not take vLLM's config that carries it either
    with pytest.raises(ConfigError, match=r"extra_config\['blocks_per_chunk'\] must be a positive"):
        from_vllm_offloading_config(theirs)


def test_row_canonical_layout_as_a_string(base: VllmConfig) -> None:
    vllm_config = variant(base, {"canonical_layout": "false"})
    theirs = vllm_build_offloading_config(vllm_config, kv_cache(attention_spec()))
    assert theirs.canonical_layout is True  # bool("false")
    with pytest.raises(ConfigError, match=r"\['canonical_layout'\] must be true or false"):
        build_offloading_config(vllm_config, kv_cache(attention_spec()))


def test_row_canonical_layout_widens_parallelism_agnostic(base: VllmConfig) -> None:
    vllm_config = variant(base, {"canonical_layout": True})
    theirs, ours = both(vllm_config, kv_cache(attention_spec(), sliding()))
    assert (theirs.canonical_layout, ours.canonical_layout) == (True, True)
    assert ours.parallel.is_parallelism_agnostic is False  # two groups
    assert theirs.parallel.is_parallelism_agnostic is True  # every layer certifiable


def test_row_a_lone_mamba_group_under_decode_context_parallelism(base: VllmConfig) -> None:
    vllm_config = variant(
        base, decode_context_parallel_size=2, tensor_parallel_size=2, world_size=2
    )
    theirs, ours = both(vllm_config, kv_cache(mamba(16, "align")))
    assert ours.groups[0].tokens_per_block == 32  # every group x DCP
    assert theirs.groups[0].tokens_per_block == 16  # a Mamba state is not sharded by DCP
