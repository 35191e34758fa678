"""build_offloading_config against stand-ins shaped like vLLM's objects (vLLM is not imported)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from tiering.cpu.common import CPUOffloadingInfo
from tiering.errors import ConfigError
from tiering.integrations.vllm import (
    build_offloading_config,
    from_vllm_offloading_config,
    is_kv_cache_tensor_packed,
)

# --- stand-ins named like vLLM's classes (vllm/v1/kv_cache_interface.py) --------------


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int = 8
    head_size: int = 128


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    mamba_cache_mode: str = "align"


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):  # with bounded replay: not prefix-cacheable
    prefix_cacheable: bool = False


@dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    kv_cache_specs: Mapping[str, KVCacheSpec] = field(default_factory=dict)


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]
    block_stride: int = 0


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]


class ModelConfig(SimpleNamespace):
    def get_total_num_kv_heads(self) -> int:
        return int(self.total_num_kv_heads)


def make_vllm_config(
    *,
    extra: dict[str, Any] | None = None,
    engine_id: str | None = "engine-0",
    block_size: int = 16,
    dcp: int = 1,
    pcp: int = 1,
    tp: int = 1,
    total_kv_heads: int = 8,
    cache_dtype: Any = "auto",
    events: bool | None = None,
    **top: Any,
) -> SimpleNamespace:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            engine_id=engine_id,
            kv_connector_extra_config={} if extra is None else extra,
        ),
        parallel_config=SimpleNamespace(
            rank=0,
            world_size=tp,
            tensor_parallel_size=tp,
            pipeline_parallel_size=1,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
            data_parallel_index=0,
        ),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
        model_config=ModelConfig(
            model="meta-llama/Llama-3.1-8B-Instruct",
            dtype="torch.bfloat16",
            max_model_len=8192,
            total_num_kv_heads=total_kv_heads,
        ),
        kv_events_config=None if events is None else SimpleNamespace(enable_kv_cache_events=events),
        use_v2_model_runner=False,
    )
    for name, value in top.items():
        setattr(config, name, value)
    return config


def llama_kv_cache_config(num_blocks: int = 1000, num_layers: int = 32) -> KVCacheConfig:
    """32 full-attention layers, 16-token blocks, 8 KV heads of 128 in bf16.

    One page per layer: 2 (K and V) x 16 x 8 x 128 x 2 bytes = 65536 bytes.
    """
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * 65536, shared_by=[n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, FullAttentionSpec(block_size=16))],
    )


def hybrid_kv_cache_config(window: int = 4000, num_blocks: int = 500) -> KVCacheConfig:
    """Full attention (layers 0, 2) and a sliding window (layers 1, 3), 16-token blocks.

    vLLM shares each tensor between one layer of each group: 2 tensors of
    ``num_blocks`` pages of 65536 bytes.
    """
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * 65536, shared_by=["l.0", "l.1"]),
            KVCacheTensor(size=num_blocks * 65536, shared_by=["l.2", "l.3"]),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["l.0", "l.2"], FullAttentionSpec(block_size=16)),
            KVCacheGroupSpec(
                ["l.1", "l.3"], SlidingWindowSpec(block_size=16, sliding_window=window)
            ),
        ],
    )


def mamba_kv_cache_config(mamba_block_size: int, mode: str = "align") -> KVCacheConfig:
    """Attention with 32-token blocks and Mamba layers with ``mamba_block_size``."""
    return KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[KVCacheTensor(size=100 * 4096, shared_by=["attn.0", "mamba.0"])],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn.0"], FullAttentionSpec(block_size=32)),
            KVCacheGroupSpec(["mamba.0"], MambaSpec(mamba_block_size, mamba_cache_mode=mode)),
        ],
    )


# --- the happy paths ------------------------------------------------------------------


def test_llama_single_group() -> None:
    config = build_offloading_config(
        make_vllm_config(extra={"block_size": 64, "cpu_bytes_to_use": 1 << 30}, events=True),
        llama_kv_cache_config(),
    )
    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(32))
    assert config == OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=names, group_id=0),),
        # 32 tensors of 1000 * 65536 bytes over 1000 blocks
        worker_kv_bytes_per_block=32 * 65536,
        enable_kv_cache_events=True,
        extra_config={"block_size": 64, "cpu_bytes_to_use": 1 << 30},
        engine_id="engine-0",
        model=OffloadingModelConfig(
            name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", max_model_len=8192
        ),
        # 64 tokens per chunk / 16 tokens per block = 4 blocks per chunk
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            is_parallelism_agnostic=True,
        ),
    )
    assert config.tokens_per_chunk == (64,)


def test_hybrid_sliding_window() -> None:
    config = build_offloading_config(
        make_vllm_config(extra={"block_size": 64}), hybrid_kv_cache_config(window=4000)
    )
    assert config.groups == (
        OffloadingGroupConfig(tokens_per_block=16, layer_names=("l.0", "l.2"), group_id=0),
        # ceil(4000 / 64) = 63 chunks (62.5 rounds up)
        OffloadingGroupConfig(
            tokens_per_block=16,
            layer_names=("l.1", "l.3"),
            sliding_window_size_in_chunks=63,
            group_id=1,
        ),
    )
    assert config.cache == OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4)
    # 2 tensors of 500 * 65536 bytes over 500 blocks
    assert config.worker_kv_bytes_per_block == 131072
    assert config.parallel.is_parallelism_agnostic is False  # two groups

    # at max_model_len 8192 a request needs 8192 / 64 = 128 full-attention chunks and
    # min(128, 63) window chunks = 191; 10000 * 8192 // 191 = 428_900 (191 * 428_900 =
    # 81_919_900)
    info = CPUOffloadingInfo.from_config(config, num_chunks=10000, kv_bytes_per_chunk=524288)
    assert info.cpu_kv_cache_size_tokens == 428900
    assert info.cpu_kv_cache_size_bytes == 5_242_880_000


@pytest.mark.parametrize(("window", "chunks"), [(64, 1), (65, 2), (1, 1), (128, 2), (129, 3)])
def test_sliding_window_rounds_up_to_chunks(window: int, chunks: int) -> None:
    config = build_offloading_config(
        make_vllm_config(extra={"block_size": 64}), hybrid_kv_cache_config(window=window)
    )
    assert config.groups[1].sliding_window_size_in_chunks == chunks


def test_sliding_window_without_block_size_uses_one_block_chunks() -> None:
    config = build_offloading_config(make_vllm_config(), hybrid_kv_cache_config(window=4000))
    # ceil(4000 / 16) = 250
    assert config.groups[1].sliding_window_size_in_chunks == 250
    assert config.cache.blocks_per_chunk == 1


def test_mamba_hybrid_in_align_mode() -> None:
    # align mode: the Mamba block size equals the cache block size (64); the hash
    # block size is the GCD of the group block sizes, gcd(32, 64) = 32
    config = build_offloading_config(
        make_vllm_config(block_size=64, extra={"blocks_per_chunk": 2}),
        mamba_kv_cache_config(mamba_block_size=64),
    )
    assert config.groups == (
        OffloadingGroupConfig(tokens_per_block=32, layer_names=("attn.0",), group_id=0),
        OffloadingGroupConfig(
            tokens_per_block=64,
            layer_names=("mamba.0",),
            sliding_window_size_in_chunks=1,
            group_id=1,
        ),
    )
    assert config.cache == OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2)
    assert config.worker_kv_bytes_per_block == 4096
    assert config.tokens_per_chunk == (64, 128)


def test_prefix_match_unit_override() -> None:
    vllm_config = make_vllm_config(block_size=64)
    vllm_config.cache_config.prefix_match_unit = 16
    config = build_offloading_config(vllm_config, mamba_kv_cache_config(mamba_block_size=64))
    assert config.cache.tokens_per_hash == 16


def test_hash_block_size_is_not_an_input() -> None:
    # vLLM 0.33's cache_config.hash_block_size is what its engine core resolved, not
    # a request: the GCD of the groups' 32 and 64 stands
    vllm_config = make_vllm_config(block_size=64)
    vllm_config.cache_config.hash_block_size = 16
    config = build_offloading_config(vllm_config, mamba_kv_cache_config(mamba_block_size=64))
    assert config.cache.tokens_per_hash == 32


def test_mamba_in_align_mode_with_a_larger_block_hashes_at_the_gcd() -> None:
    # the Mamba block (64) differs from the cache block (32), but align mode keeps
    # the hash block at gcd(32, 64) = 32 (the seed took the LCM, 64, and refused)
    config = build_offloading_config(
        make_vllm_config(block_size=32), mamba_kv_cache_config(mamba_block_size=64)
    )
    assert config.cache.tokens_per_hash == 32
    assert [group.tokens_per_block for group in config.groups] == [32, 64]


def test_mamba_mode_falls_back_to_the_cache_config() -> None:
    @dataclass(frozen=True)
    class BareMambaSpec(KVCacheSpec):  # a Mamba spec without mamba_cache_mode
        pass

    BareMambaSpec.__name__ = "MambaSpec"
    kv_cache_config = mamba_kv_cache_config(mamba_block_size=64)
    kv_cache_config.kv_cache_groups[1].kv_cache_spec = BareMambaSpec(block_size=64)
    vllm_config = make_vllm_config(block_size=64, extra={"blocks_per_chunk": 1})
    # absent everywhere: vLLM's default "none" hashes whole scheduler blocks
    # (lcm(32, 64) = 64), which the 32-token attention block misses
    with pytest.raises(ConfigError, match=r"tokens_per_hash=64"):
        build_offloading_config(vllm_config, kv_cache_config)
    vllm_config.cache_config.mamba_cache_mode = "align"
    assert build_offloading_config(vllm_config, kv_cache_config).cache.tokens_per_hash == 32


def test_a_mamba_layer_inside_a_uniform_type_group_counts() -> None:
    kv_cache_config = mamba_kv_cache_config(mamba_block_size=64, mode="all")
    inner = {"mamba.0": kv_cache_config.kv_cache_groups[1].kv_cache_spec}
    kv_cache_config.kv_cache_groups[1].kv_cache_spec = UniformTypeKVCacheSpecs(64, inner)
    with pytest.raises(ConfigError, match=r"tokens_per_hash=64"):
        build_offloading_config(make_vllm_config(block_size=64), kv_cache_config)


def test_groups_outside_prefix_caching_do_not_set_the_hash_block() -> None:
    # vLLM hashes at the GCD of the prefix-cacheable groups only: 64, not gcd(64, 32);
    # the seed keeps every group, and a 32-token block cannot hold 64-token hashes
    kv_cache_config = KVCacheConfig(
        num_blocks=0,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=64)),
            KVCacheGroupSpec(["b"], SlidingWindowMLASpec(block_size=32, sliding_window=64)),
        ],
    )
    vllm_config = make_vllm_config(block_size=64)
    with pytest.raises(ConfigError, match=r"group 1 has tokens_per_block=32 .*tokens_per_hash=64"):
        build_offloading_config(vllm_config, kv_cache_config)
    # a prefix-cacheable window counts: gcd(64, 32) = 32
    kv_cache_config.kv_cache_groups[1].kv_cache_spec = SlidingWindowSpec(
        block_size=32, sliding_window=64
    )
    assert build_offloading_config(vllm_config, kv_cache_config).cache.tokens_per_hash == 32


def test_a_single_group_refuses_another_prefix_match_unit() -> None:
    vllm_config = make_vllm_config()
    vllm_config.cache_config.prefix_match_unit = 8
    with pytest.raises(ConfigError) as info:
        build_offloading_config(vllm_config, llama_kv_cache_config())
    message = str(info.value)
    assert "prefix_match_unit=8" in message
    assert "block of 16 tokens; unset it or set it to 16" in message
    vllm_config.cache_config.prefix_match_unit = 16
    assert build_offloading_config(vllm_config, llama_kv_cache_config()).cache.tokens_per_hash == 16


def test_context_parallel_scales_tokens_per_block() -> None:
    # block size 16 x dcp 2 x pcp 2 = 64 tokens per block, hashed at the same 64
    vllm_config = make_vllm_config(dcp=2, pcp=2, tp=4, extra={"block_size": 256})
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.groups[0].tokens_per_block == 64
    assert config.cache == OffloadingCacheConfig(tokens_per_hash=64, blocks_per_chunk=4)
    assert (config.parallel.dcp_size, config.parallel.pcp_size) == (2, 2)
    assert config.parallel.is_parallelism_agnostic is False


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (1, 2)])
def test_context_parallelism_alone_makes_the_layout_rank_specific(dcp: int, pcp: int) -> None:
    # tp 1: every rank holds all heads, so only the token sharding decides.
    config = build_offloading_config(
        make_vllm_config(dcp=dcp, pcp=pcp, tp=1), llama_kv_cache_config()
    )
    assert config.parallel.is_parallelism_agnostic is False
    baseline = build_offloading_config(make_vllm_config(tp=1), llama_kv_cache_config())
    assert baseline.parallel.is_parallelism_agnostic is True


def test_prefill_context_parallel_size_defaults_to_one() -> None:
    vllm_config = make_vllm_config(dcp=2, tp=2)
    del vllm_config.parallel_config.prefill_context_parallel_size
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.groups[0].tokens_per_block == 32
    assert config.cache.tokens_per_hash == 32
    assert config.parallel.pcp_size == 1


def test_parallel_fields_are_copied() -> None:
    vllm_config = make_vllm_config(tp=4, total_kv_heads=8)
    vllm_config.parallel_config.rank = 3
    vllm_config.parallel_config.world_size = 8
    vllm_config.parallel_config.pipeline_parallel_size = 2
    vllm_config.parallel_config.data_parallel_index = 5
    kv_cache_config = llama_kv_cache_config()
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2
    )
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert config.parallel == OffloadingParallelConfig(
        rank=3,
        world_size=8,
        tp_size=4,
        pp_size=2,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=5,
        is_parallelism_agnostic=True,  # 2 heads x TP 4 = the model's 8 heads
    )


@pytest.mark.parametrize(
    ("spec", "tp", "total_heads", "v2", "expected"),
    [
        (FullAttentionSpec(block_size=16, num_kv_heads=8), 1, 8, False, True),
        (FullAttentionSpec(block_size=16, num_kv_heads=4), 2, 8, False, True),
        # the V2 model runner's layout is not known to be agnostic
        (FullAttentionSpec(block_size=16, num_kv_heads=8), 1, 8, True, False),
        # MLA's latent cache is replicated on every rank
        (MLAAttentionSpec(block_size=16, num_kv_heads=1), 1, 1, False, False),
        # TP 8 over 4 KV heads replicates each head on two ranks
        (FullAttentionSpec(block_size=16, num_kv_heads=1), 8, 4, False, False),
        # a lone sliding-window or Mamba group is not full attention
        (SlidingWindowSpec(block_size=16, sliding_window=128), 1, 8, False, False),
        (MambaSpec(block_size=16), 1, 8, False, False),
        # uniform-type groups mix page sizes (vLLM: not a FullAttentionSpec)
        (UniformTypeKVCacheSpecs(16, {"a": FullAttentionSpec(block_size=16)}), 1, 8, False, False),
    ],
)  # fmt: skip
def test_is_parallelism_agnostic(
    spec: KVCacheSpec, tp: int, total_heads: int, v2: bool, expected: bool
) -> None:
    vllm_config = make_vllm_config(tp=tp, total_kv_heads=total_heads, use_v2_model_runner=v2)
    kv_cache_config = llama_kv_cache_config(num_layers=2)
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = spec
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert config.parallel.is_parallelism_agnostic is expected


def test_per_token_head_quantization_is_not_agnostic() -> None:
    class PerTokenHead:  # like vLLM's KVQuantMode.INT8_PER_TOKEN_HEAD
        is_per_token_head = True

    @dataclass(frozen=True, kw_only=True)
    class QuantFullAttentionSpec(FullAttentionSpec):
        kv_quant_mode: Any = field(default_factory=PerTokenHead)

    kv_cache_config = llama_kv_cache_config(num_layers=2)
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = QuantFullAttentionSpec(block_size=16)
    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert config.parallel.is_parallelism_agnostic is False


def test_uniform_type_specs_take_the_kind_of_their_layers() -> None:
    kv_cache_config = hybrid_kv_cache_config()
    inner = {"l.1": SlidingWindowSpec(block_size=16, sliding_window=256)}
    kv_cache_config.kv_cache_groups[1].kv_cache_spec = UniformTypeKVCacheSpecs(16, inner)
    config = build_offloading_config(make_vllm_config(extra={"block_size": 64}), kv_cache_config)
    assert config.groups[1].sliding_window_size_in_chunks == 4  # 256 / 64


def test_packed_tensors_count_once() -> None:
    # three views of one packed allocation: the first tensor's size is the whole
    kv_cache_config = llama_kv_cache_config(num_blocks=100, num_layers=3)
    kv_cache_config.kv_cache_tensors = [
        KVCacheTensor(size=100 * 12288, shared_by=[name], block_stride=12288)
        for name in kv_cache_config.kv_cache_groups[0].layer_names
    ]
    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert config.worker_kv_bytes_per_block == 12288


def test_scheduler_side_has_no_bytes_per_block() -> None:
    kv_cache_config = llama_kv_cache_config(num_blocks=0)
    kv_cache_config.kv_cache_tensors = []
    config = build_offloading_config(make_vllm_config(), kv_cache_config)
    assert config.worker_kv_bytes_per_block == 0


def test_attention_free_model_has_no_groups() -> None:
    config = build_offloading_config(
        make_vllm_config(), KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[])
    )
    assert config.groups == ()
    assert config.cache == OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1)
    assert config.parallel.is_parallelism_agnostic is False


@pytest.mark.parametrize(
    ("cache_dtype", "model_dtype", "expected"),
    [
        ("auto", "torch.bfloat16", "bfloat16"),
        ("auto", "float16", "float16"),
        ("fp8_e4m3", "torch.bfloat16", "fp8_e4m3"),
        ("torch.float16", "torch.bfloat16", "float16"),
    ],
)
def test_cache_dtype(cache_dtype: str, model_dtype: str, expected: str) -> None:
    vllm_config = make_vllm_config(cache_dtype=cache_dtype)
    vllm_config.model_config.dtype = model_dtype
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.model.dtype == expected


@pytest.mark.parametrize(
    ("events_config", "expected"),
    [
        (None, False),
        (SimpleNamespace(enable_kv_cache_events=False), False),
        (SimpleNamespace(enable_kv_cache_events=True), True),
    ],
)
def test_kv_cache_events(events_config: Any, expected: bool) -> None:
    vllm_config = make_vllm_config()
    vllm_config.kv_events_config = events_config
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.enable_kv_cache_events is expected


def test_optional_attributes_may_be_absent() -> None:
    vllm_config = make_vllm_config()
    del vllm_config.kv_events_config
    del vllm_config.use_v2_model_runner
    kv_cache_config = llama_kv_cache_config(num_layers=2)
    kv_cache_config.kv_cache_tensors = [
        SimpleNamespace(size=t.size, shared_by=t.shared_by)
        for t in kv_cache_config.kv_cache_tensors
    ]  # no block_stride at all: not packed
    config = build_offloading_config(vllm_config, kv_cache_config)
    assert config.enable_kv_cache_events is False
    assert config.parallel.is_parallelism_agnostic is True
    assert config.worker_kv_bytes_per_block == 2 * 65536


def test_extra_config_none_and_string_numbers() -> None:
    config = build_offloading_config(
        make_vllm_config(extra={"block_size": "128"}), llama_kv_cache_config()
    )
    assert config.cache.blocks_per_chunk == 8
    vllm_config = make_vllm_config()
    vllm_config.kv_transfer_config.kv_connector_extra_config = None
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.extra_config == {}
    assert config.cache.blocks_per_chunk == 1


def test_extra_config_is_copied() -> None:
    extra: dict[str, Any] = {"block_size": 32}
    config = build_offloading_config(make_vllm_config(extra=extra), llama_kv_cache_config())
    extra["block_size"] = 999
    assert config.extra_config == {"block_size": 32}


# --- every assertion of vLLM's becomes a ConfigError that says what to do ------------


def test_rejects_block_size_not_a_multiple_of_the_block() -> None:
    with pytest.raises(ConfigError) as info:
        build_offloading_config(
            make_vllm_config(extra={"block_size": 100}), llama_kv_cache_config()
        )
    message = str(info.value)
    assert "kv_connector_extra_config['block_size']=100" in message
    assert "GPU block size 16" in message
    assert "96 or 112" in message


def test_rejects_block_size_with_mixed_block_sizes() -> None:
    with pytest.raises(ConfigError) as info:
        build_offloading_config(
            make_vllm_config(block_size=64, extra={"block_size": 128}),
            mamba_kv_cache_config(mamba_block_size=64),
        )
    message = str(info.value)
    assert "kv_connector_extra_config['block_size']=128" in message
    assert "tokens_per_block [32, 64]" in message
    assert "blocks_per_chunk" in message


def test_rejects_block_size_without_groups() -> None:
    with pytest.raises(ConfigError, match=r"\['block_size'\]=64 needs every KV-cache group"):
        build_offloading_config(
            make_vllm_config(extra={"block_size": 64}),
            KVCacheConfig(num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[]),
        )


def test_rejects_block_size_and_blocks_per_chunk_together() -> None:
    with pytest.raises(
        ConfigError, match=r"sets both 'block_size' \(64 .*\) and 'blocks_per_chunk' \(4\)"
    ):
        build_offloading_config(
            make_vllm_config(extra={"block_size": 64, "blocks_per_chunk": 4}),
            llama_kv_cache_config(),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"blocks_per_chunk": 0}, r"\['blocks_per_chunk'\] must be >= 1, got 0"),
        ({"blocks_per_chunk": -3}, r"\['blocks_per_chunk'\] must be >= 1, got -3"),
        ({"block_size": 0}, r"\['block_size'\] must be >= 1, got 0"),
        ({"block_size": "lots"}, r"\['block_size'\] must be a positive integer, got 'lots'"),
        ({"block_size": 64.0}, r"\['block_size'\] must be an integer, got 64.0 of type float"),
        ({"block_size": True}, r"\['block_size'\] must be an integer, got True of type bool"),
    ],
)
def test_rejects_bad_chunk_settings(extra: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_offloading_config(make_vllm_config(extra=extra), llama_kv_cache_config())


def test_rejects_tokens_per_block_not_divisible_by_tokens_per_hash() -> None:
    # Mamba outside align mode: vLLM hashes whole scheduler blocks,
    # lcm(32, 1024) = 1024, which the 32-token attention block misses
    with pytest.raises(ConfigError) as info:
        build_offloading_config(
            make_vllm_config(block_size=32), mamba_kv_cache_config(1024, mode="none")
        )
    message = str(info.value)
    assert "KV-cache group 0 has tokens_per_block=32" in message
    assert "tokens_per_hash=1024" in message
    assert "--enable-prefix-caching" in message
    assert "Mamba" in message


def test_rejects_single_group_block_size_off_the_hash_block() -> None:
    # the group's spec says 16 but the cache config hashes 32-token blocks
    with pytest.raises(ConfigError, match=r"tokens_per_block=16 .* tokens_per_hash=32"):
        build_offloading_config(make_vllm_config(block_size=32), llama_kv_cache_config())


def test_rejects_prefix_match_unit_that_does_not_divide() -> None:
    vllm_config = make_vllm_config(block_size=64)
    vllm_config.cache_config.prefix_match_unit = 48
    with pytest.raises(ConfigError) as info:
        build_offloading_config(vllm_config, mamba_kv_cache_config(mamba_block_size=64))
    message = str(info.value)
    assert "prefix_match_unit=48 does not divide" in message
    assert "[32, 64]" in message
    assert "GCD 32" in message


def test_rejects_context_parallel_hybrid() -> None:
    with pytest.raises(ConfigError, match=r"2 KV-cache groups .*decode_context_parallel_size=2"):
        build_offloading_config(make_vllm_config(dcp=2, tp=2), hybrid_kv_cache_config())


def test_rejects_packed_and_unpacked_mix() -> None:
    kv_cache_config = llama_kv_cache_config(num_blocks=10, num_layers=3)
    kv_cache_config.kv_cache_tensors[1].block_stride = 65536
    with pytest.raises(ConfigError) as info:
        build_offloading_config(make_vllm_config(), kv_cache_config)
    message = str(info.value)
    assert "mixes packed tensors" in message
    assert "indices [1]" in message
    assert "indices [0, 2]" in message


def test_rejects_unsupported_spec_kind() -> None:
    kv_cache_config = hybrid_kv_cache_config()
    kv_cache_config.kv_cache_groups[1].kv_cache_spec = ChunkedLocalAttentionSpec(
        block_size=16, attention_chunk_size=8192
    )
    with pytest.raises(ConfigError) as info:
        build_offloading_config(make_vllm_config(), kv_cache_config)
    message = str(info.value)
    assert (
        "kv_cache_config.kv_cache_groups[1].kv_cache_spec is a ChunkedLocalAttentionSpec" in message
    )
    assert "FullAttentionSpec" in message


def test_rejects_missing_transfer_config() -> None:
    with pytest.raises(ConfigError, match=r"vllm_config\.kv_transfer_config is None"):
        build_offloading_config(make_vllm_config(kv_transfer_config=None), llama_kv_cache_config())


@pytest.mark.parametrize("engine_id", [None, ""])
def test_rejects_missing_engine_id(engine_id: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        build_offloading_config(make_vllm_config(engine_id=engine_id), llama_kv_cache_config())
    assert (
        f"vllm_config.kv_transfer_config.engine_id must be a non-empty string, got {engine_id!r}"
        in str(info.value)
    )


def test_rejects_bad_extra_config() -> None:
    with pytest.raises(
        ConfigError, match=r"kv_connector_extra_config must be a mapping .*got \['block_size'\]"
    ):
        build_offloading_config(make_vllm_config(extra=["block_size"]), llama_kv_cache_config())  # type: ignore[arg-type]


def _no_heads_method(v: Any, k: Any) -> None:
    v.model_config.get_total_num_kv_heads = None


def _no_spec_block_size(v: Any, k: Any) -> None:
    k.kv_cache_groups[0].kv_cache_spec = SimpleNamespace()


@pytest.mark.parametrize(
    ("remove", "path"),
    [
        (lambda v, k: delattr(v.parallel_config, "rank"), "vllm_config.parallel_config.rank"),
        (lambda v, k: delattr(v.kv_transfer_config, "engine_id"),
         "vllm_config.kv_transfer_config.engine_id"),
        (lambda v, k: delattr(v, "model_config"), "vllm_config.model_config"),
        (lambda v, k: delattr(v.model_config, "max_model_len"),
         "vllm_config.model_config.max_model_len"),
        (lambda v, k: delattr(v.cache_config, "cache_dtype"),
         "vllm_config.cache_config.cache_dtype"),
        (lambda v, k: delattr(v.cache_config, "block_size"), "vllm_config.cache_config.block_size"),
        (lambda v, k: delattr(k, "num_blocks"), "kv_cache_config.num_blocks"),
        (lambda v, k: delattr(k.kv_cache_groups[0], "layer_names"),
         "kv_cache_config.kv_cache_groups[0].layer_names"),
        (lambda v, k: delattr(k.kv_cache_tensors[1], "size"),
         "kv_cache_config.kv_cache_tensors[1].size"),
        (_no_spec_block_size, "kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size"),
        (_no_heads_method, "vllm_config.model_config.get_total_num_kv_heads must be a method"),
    ],
)  # fmt: skip
def test_missing_attribute_names_its_path(remove: Any, path: str) -> None:
    vllm_config = make_vllm_config()
    kv_cache_config = llama_kv_cache_config(num_layers=2)
    remove(vllm_config, kv_cache_config)
    with pytest.raises(ConfigError) as info:
        build_offloading_config(vllm_config, kv_cache_config)
    assert path in str(info.value)


def _zero_block_spec(v: Any, k: Any) -> None:
    k.kv_cache_groups[0].kv_cache_spec = FullAttentionSpec(block_size=0)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda v, k: setattr(k, "num_blocks", -1),
         r"kv_cache_config\.num_blocks must be >= 0, got -1"),
        (_zero_block_spec, r"kv_cache_groups\[0\]\.kv_cache_spec\.block_size must be >= 1, got 0"),
        (lambda v, k: setattr(v.parallel_config, "decode_context_parallel_size", 0),
         r"decode_context_parallel_size must be >= 1, got 0"),
        (lambda v, k: setattr(v.model_config, "max_model_len", "8k"),
         r"model_config\.max_model_len must be an integer, got '8k' of type str"),
        (lambda v, k: setattr(v.model_config, "model", None),
         r"model_config\.model must be a non-empty string, got None"),
        (lambda v, k: setattr(k, "kv_cache_groups", "full"),
         r"kv_cache_config\.kv_cache_groups must be a sequence, got 'full'"),
        (lambda v, k: setattr(k.kv_cache_groups[0], "layer_names", ["a", 7]),
         r"layer_names must hold strings, got \['a', 7\]"),
        (lambda v, k: setattr(k.kv_cache_tensors[0], "block_stride", -8),
         r"block_stride must be >= 0, got -8"),
        (lambda v, k: setattr(v.parallel_config, "rank", 1),
         r"rank must be in \[0, world_size=1\), got 1"),
    ],
)  # fmt: skip
def test_rejects_impossible_values(mutate: Any, pattern: str) -> None:
    vllm_config = make_vllm_config()
    kv_cache_config = llama_kv_cache_config(num_layers=2)
    mutate(vllm_config, kv_cache_config)
    with pytest.raises(ConfigError, match=pattern):
        build_offloading_config(vllm_config, kv_cache_config)


def test_rejects_zero_sliding_window() -> None:
    with pytest.raises(
        ConfigError,
        match=r"kv_cache_groups\[1\]\.kv_cache_spec\.sliding_window must be >= 1, got 0",
    ):
        build_offloading_config(make_vllm_config(), hybrid_kv_cache_config(window=0))  # fmt: skip


# --- is_kv_cache_tensor_packed -----------------------------------------------------------


@pytest.mark.parametrize(
    ("tensor", "expected"),
    [
        (KVCacheTensor(size=1, shared_by=[], block_stride=0), False),
        (KVCacheTensor(size=1, shared_by=[], block_stride=4096), True),
        (SimpleNamespace(size=1, block_stride=np.int64(512)), True),
        (SimpleNamespace(size=1, block_stride=None), False),
        (SimpleNamespace(size=1), False),  # vLLM before packed layouts
    ],
)
def test_is_kv_cache_tensor_packed(tensor: object, expected: bool) -> None:
    assert is_kv_cache_tensor_packed(tensor) is expected


@pytest.mark.parametrize(
    ("stride", "pattern"),
    [
        (-1, r"block_stride must be >= 0, got -1"),
        ("8", r"block_stride must be an integer, got '8'"),
    ],
)
def test_is_kv_cache_tensor_packed_rejects(stride: object, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        is_kv_cache_tensor_packed(SimpleNamespace(size=1, block_stride=stride))


@pytest.mark.parametrize("bad", [None, 16, ""])
def test_a_cache_dtype_that_is_no_dtype_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"cache_config\.cache_dtype must be a dtype name"):
        build_offloading_config(make_vllm_config(cache_dtype=bad), llama_kv_cache_config())


# --- the fields vLLM 0.33 added ------------------------------------------------------------


def test_group_ids_are_the_groups_indices() -> None:
    config = build_offloading_config(make_vllm_config(), hybrid_kv_cache_config())
    assert [group.group_id for group in config.groups] == [0, 1]
    assert config.group_ids == (0, 1)


def test_data_parallel_fields_and_the_layout_are_copied_where_present() -> None:
    vllm_config = make_vllm_config()
    absent = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert (absent.parallel.data_parallel_size, absent.parallel.data_parallel_rank_local) == (
        0,
        None,
    )
    assert absent.kv_cache_layout is None
    vllm_config.parallel_config.data_parallel_size = 4
    vllm_config.parallel_config.data_parallel_index = 3
    vllm_config.parallel_config.data_parallel_rank_local = np.int64(1)
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    config = build_offloading_config(vllm_config, llama_kv_cache_config())
    assert config.parallel.data_parallel_size == 4
    assert config.parallel.data_parallel_index == 3
    assert config.parallel.data_parallel_rank_local == 1
    assert type(config.parallel.data_parallel_rank_local) is int
    assert config.kv_cache_layout == "LBNHC"
    assert config.replicated_layout is False  # the seed never computes vLLM's rule


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda v: setattr(v.parallel_config, "data_parallel_size", -1),
         r"parallel_config\.data_parallel_size must be >= 0, got -1"),
        (lambda v: (setattr(v.parallel_config, "data_parallel_size", 2),
                    setattr(v.parallel_config, "data_parallel_index", 2)),
         r"data_parallel_index must be in \[0, data_parallel_size=2\), got 2"),
        (lambda v: setattr(v.parallel_config, "data_parallel_rank_local", -1),
         r"parallel_config\.data_parallel_rank_local must be >= 0, got -1"),
        (lambda v: setattr(v.cache_config, "kv_cache_layout", 3),
         r"kv_cache_layout must be the name of a KVCacheLayout \(e\.g\. 'LBNHC'\) or None, got 3"),
    ],
)  # fmt: skip
def test_the_new_fields_are_checked(mutate: Any, pattern: str) -> None:
    vllm_config = make_vllm_config()
    mutate(vllm_config)
    with pytest.raises(ConfigError, match=pattern):
        build_offloading_config(vllm_config, llama_kv_cache_config())


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (None, False)])
def test_canonical_layout_comes_from_the_extra_config(value: bool | None, expected: bool) -> None:
    extra = {} if value is None else {"canonical_layout": value}
    config = build_offloading_config(make_vllm_config(extra=extra), llama_kv_cache_config())
    assert config.canonical_layout is expected


@pytest.mark.parametrize("value", ["false", 1, "yes"])
def test_canonical_layout_must_be_a_bool(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        build_offloading_config(
            make_vllm_config(extra={"canonical_layout": value}), llama_kv_cache_config()
        )
    message = str(info.value)
    assert f"['canonical_layout'] must be true or false, got {value!r}" in message
    assert "the string 'false' as true" in message


# --- from_vllm_offloading_config, on stand-ins of vLLM's dataclasses ------------------------


@dataclass(frozen=True)
class VllmGroup:
    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int
    sliding_window_size_in_chunks: int | None = None


@dataclass(frozen=True)
class VllmModel:
    name: str
    dtype: str
    max_model_len: int = 0


@dataclass(frozen=True)
class VllmCache:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclass(frozen=True)
class VllmParallel:
    rank: int = 0
    world_size: int = 2
    tp_size: int = 2
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    data_parallel_index: int = 1
    data_parallel_size: int = 2
    data_parallel_rank_local: int | None = 1
    is_parallelism_agnostic: bool = True


@dataclass(frozen=True)
class VllmOffloadingConfig:
    groups: tuple[VllmGroup, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: VllmModel
    cache: VllmCache
    parallel: VllmParallel
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None


def vllm_offloading_config(**changes: Any) -> VllmOffloadingConfig:
    values: dict[str, Any] = {
        # vLLM offloads some groups only: ids 0 and 2 of three
        "groups": (
            VllmGroup(32, ("l.0", "l.2"), 0),
            VllmGroup(32, ("l.1",), 2, sliding_window_size_in_chunks=3),
        ),
        "worker_kv_bytes_per_block": 0,  # the scheduler side
        "enable_kv_cache_events": True,
        "extra_config": MappingProxyType({"cpu_bytes_to_use": 1 << 30, "blocks_per_chunk": "2"}),
        "engine_id": "engine-7",
        "model": VllmModel("org/model", "fp8_e4m3", 32768),
        "cache": VllmCache(16, 2),
        "parallel": VllmParallel(),
        "replicated_layout": True,
        "canonical_layout": True,
        "kv_cache_layout": "LBNHC",
        **changes,
    }
    return VllmOffloadingConfig(**values)


def test_from_vllm_keeps_every_field() -> None:
    config = from_vllm_offloading_config(vllm_offloading_config())
    assert config == OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=32, layer_names=("l.0", "l.2"), group_id=0),
            OffloadingGroupConfig(
                tokens_per_block=32,
                layer_names=("l.1",),
                sliding_window_size_in_chunks=3,
                group_id=2,
            ),
        ),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": 1 << 30, "blocks_per_chunk": "2"},
        engine_id="engine-7",
        model=OffloadingModelConfig(name="org/model", dtype="fp8_e4m3", max_model_len=32768),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=1,
            is_parallelism_agnostic=True,
            data_parallel_size=2,
            data_parallel_rank_local=1,
        ),
        replicated_layout=True,
        canonical_layout=True,
        kv_cache_layout="LBNHC",
    )
    assert type(config.extra_config) is dict


def test_from_vllm_takes_vllms_defaults_and_numpy_integers() -> None:
    vllm_config = SimpleNamespace(**vars(vllm_offloading_config()))
    for name in ("replicated_layout", "canonical_layout", "kv_cache_layout"):
        delattr(vllm_config, name)
    vllm_config.model = SimpleNamespace(name="m", dtype="float16")
    vllm_config.cache = VllmCache(np.int64(16), np.int32(2))  # type: ignore[arg-type]
    config = from_vllm_offloading_config(vllm_config)
    assert (config.replicated_layout, config.canonical_layout) == (False, False)
    assert config.kv_cache_layout is None
    assert config.model.max_model_len == 0
    assert config.cache == OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2)


def _drop_group_id(config: Any) -> None:
    config.groups = (SimpleNamespace(tokens_per_block=16, layer_names=("a",)),)


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda c: delattr(c, "engine_id"), r"^config\.engine_id is missing"),
        (lambda c: setattr(c, "parallel", SimpleNamespace(rank=0)),
         r"^config\.parallel\.world_size is missing"),
        (_drop_group_id, r"^config\.groups\[0\]\.group_id is missing"),
        (lambda c: setattr(c, "extra_config", None),
         r"^vLLM's config\.extra_config must be a mapping, got None"),
        # what vLLM carries but tiering refuses, named
        (lambda c: setattr(c, "extra_config", {"blocks_per_chunk": 2.7}),
         r"^vLLM's OffloadingConfig cannot be taken: OffloadingConfig\.extra_config"
         r"\['blocks_per_chunk'\] must be a positive integer .*got 2\.7 of type float"),
        (lambda c: setattr(c, "extra_config", {"max_queud_jobs": 4}),
         r"has key 'max_queud_jobs', .*did you mean 'max_queued_jobs'"),
        (lambda c: setattr(c, "model", VllmModel("m", "my_platform_fp6")),
         r"OffloadingModelConfig\.dtype='my_platform_fp6' is not a dtype torch or vLLM knows"),
        (lambda c: setattr(c, "groups", (VllmGroup(16, ("a",), 1), VllmGroup(16, ("b",), 1))),
         r"groups\[0\] and groups\[1\] both have group_id 1"),
        (lambda c: setattr(c, "groups", (VllmGroup(16, ("a",), -1),)),
         r"^vLLM's config\.groups\[0\] cannot be taken: .*group_id must be >= 0"),
        (lambda c: setattr(c, "parallel", VllmParallel(data_parallel_index=2)),
         r"data_parallel_index must be in \[0, data_parallel_size=2\), got 2"),
    ],
)  # fmt: skip
def test_from_vllm_refuses_what_tiering_cannot_take(mutate: Any, pattern: str) -> None:
    vllm_config = SimpleNamespace(**vars(vllm_offloading_config()))
    mutate(vllm_config)
    with pytest.raises(ConfigError, match=pattern):
        from_vllm_offloading_config(vllm_config)


def test_numpy_integers_in_the_extra_config_are_taken() -> None:
    # vLLM's extra config is a dict a program may fill; numpy's integers were always taken.
    config = build_offloading_config(
        make_vllm_config(extra={"block_size": np.int32(128)}), llama_kv_cache_config()
    )
    assert config.cache.blocks_per_chunk == 8


def test_a_bad_extra_config_is_shown_without_its_secrets() -> None:
    extra: dict[Any, Any] = {1: "x", "secondary_tiers": [{"url": "redis://:hunter2@h/0"}]}
    extra["secondary_tiers"][0]["password"] = "pw2"
    with pytest.raises(ConfigError) as info:
        build_offloading_config(make_vllm_config(extra=extra), llama_kv_cache_config())
    assert "must be a mapping with string keys" in str(info.value)
    assert "hunter2" not in str(info.value)
    assert "pw2" not in str(info.value)


def test_a_chunk_key_of_the_wrong_type_is_named_as_before() -> None:
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\['block_size'\] must be an"):
        build_offloading_config(
            make_vllm_config(extra={"block_size": 64.0}), llama_kv_cache_config()
        )
