from __future__ import annotations

import json
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import pytest

from tiering.config import (
    SHARED_EXTRA_KEYS,
    TIERING_EXTRA_KEYS,
    TORCH_DTYPE_NAMES,
    VLLM_CACHE_DTYPES,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    load_config,
)
from tiering.errors import ConfigError

# A hybrid model: one full-attention group and one sliding-window group of
# 16-token blocks, 4 blocks per chunk (64 tokens), a 4000-token window
# (ceil(4000 / 64) = 63 chunks), on rank 1 of a TP=2 engine.
HYBRID_TOML = """\
worker_kv_bytes_per_block = 131072
enable_kv_cache_events = true
engine_id = "engine-0"

[extra_config]
block_size = 64
cache_policy = "lru"

[[groups]]
tokens_per_block = 16
layer_names = ["model.layers.0.attn", "model.layers.2.attn"]

[[groups]]
tokens_per_block = 16
layer_names = ["model.layers.1.attn", "model.layers.3.attn"]
sliding_window_size_in_chunks = 63

[model]
name = "google/gemma-3-4b-it"
dtype = "bfloat16"
max_model_len = 32768

[cache]
tokens_per_hash = 16
blocks_per_chunk = 4

[parallel]
rank = 1
world_size = 2
tp_size = 2
pp_size = 1
pcp_size = 1
dcp_size = 1
data_parallel_index = 0
is_parallelism_agnostic = false
"""

HYBRID = OffloadingConfig(
    groups=(
        OffloadingGroupConfig(
            tokens_per_block=16, layer_names=("model.layers.0.attn", "model.layers.2.attn")
        ),
        OffloadingGroupConfig(
            tokens_per_block=16,
            layer_names=("model.layers.1.attn", "model.layers.3.attn"),
            sliding_window_size_in_chunks=63,
        ),
    ),
    worker_kv_bytes_per_block=131072,
    enable_kv_cache_events=True,
    extra_config={"block_size": 64, "cache_policy": "lru"},
    engine_id="engine-0",
    model=OffloadingModelConfig(name="google/gemma-3-4b-it", dtype="bfloat16", max_model_len=32768),
    cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
    parallel=OffloadingParallelConfig(
        rank=1,
        world_size=2,
        tp_size=2,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        is_parallelism_agnostic=False,
    ),
)


def minimal_dict() -> dict[str, Any]:
    """The smallest valid config as plain data: every field without a default."""
    return {
        "groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"]}],
        "worker_kv_bytes_per_block": 65536,
        "engine_id": "e0",
        "model": {"name": "meta-llama/Llama-3.1-8B", "dtype": "float16"},
        "cache": {"tokens_per_hash": 16, "blocks_per_chunk": 1},
    }


def write_json(tmp_path: Path, data: dict[str, Any], name: str = "tier.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# --- loading --------------------------------------------------------------------------


def test_load_toml_hybrid(tmp_path: Path) -> None:
    path = tmp_path / "tier.toml"
    path.write_text(HYBRID_TOML)
    config = load_config(path)
    assert config == HYBRID
    assert config.tokens_per_chunk == (64, 64)
    assert config.groups[1].sliding_window_size_in_chunks == 63
    assert config.groups[0].sliding_window_size_in_chunks is None


def test_load_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tier.json"
    path.write_bytes(msgspec.json.encode(HYBRID))
    assert load_config(str(path)) == HYBRID


def test_load_json_defaults(tmp_path: Path) -> None:
    config = load_config(write_json(tmp_path, minimal_dict()))
    assert config.enable_kv_cache_events is False
    assert config.extra_config == {}
    assert config.model.max_model_len == 0
    assert config.groups == (OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1")),)
    assert config.parallel == OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        is_parallelism_agnostic=False,
        data_parallel_size=1,  # no parallel table: one replica
    )
    assert config.tokens_per_chunk == (16,)


def test_load_accepts_an_engine_without_groups(tmp_path: Path) -> None:
    data = minimal_dict()
    data["groups"] = []
    data["worker_kv_bytes_per_block"] = 0
    config = load_config(write_json(tmp_path, data))
    assert config.groups == ()
    assert config.tokens_per_chunk == ()


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[last] = value


def _drop(data: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node[part]
    del node[last]


@pytest.mark.parametrize(
    ("field", "value", "fragments"),
    [
        # unknown fields, at the top and nested
        ("colour", "blue", ["Object contains unknown field `colour`"]),
        ("cache.chunk_bytes", 4096, ["unknown field `chunk_bytes`", "at `$.cache`"]),
        # wrong types: msgspec names the expected and the actual type, and the path
        ("cache.blocks_per_chunk", "4", ["got `str`", "`$.cache.blocks_per_chunk`"]),
        ("cache.tokens_per_hash", 16.5, ["Expected `int`", "`$.cache.tokens_per_hash`"]),
        ("groups.0.tokens_per_block", True, ["got `bool`", "`$.groups[0].tokens_per_block`"]),
        ("groups.0.layer_names", "l0", ["Expected `array`", "`$.groups[0].layer_names`"]),
        ("enable_kv_cache_events", "yes", ["Expected `bool`", "`$.enable_kv_cache_events`"]),
        ("engine_id", None, ["Expected `str`, got `null`", "`$.engine_id`"]),
        # impossible values: the field, the value and the struct's path
        ("cache.blocks_per_chunk", 0, ["blocks_per_chunk must be >= 1", "got 0", "`$.cache`"]),
        ("cache.blocks_per_chunk", -2, ["blocks_per_chunk must be >= 1", "got -2", "`$.cache`"]),
        ("cache.tokens_per_hash", 0, ["tokens_per_hash must be >= 1", "got 0", "`$.cache`"]),
        ("groups.0.tokens_per_block", 0, ["tokens_per_block must be", "got 0 - at `$.groups[0]`"]),
        ("groups.0.tokens_per_block", -16, ["tokens_per_block must be >= 1", "got -16"]),
        ("groups.0.sliding_window_size_in_chunks", 0,
         ["sliding_window_size_in_chunks must be >= 1", "got 0", "`$.groups[0]`"]),
        ("groups.0.layer_names", ["l0", "l0"], ["names layer 'l0' twice", "`$.groups[0]`"]),
        ("worker_kv_bytes_per_block", -1, ["worker_kv_bytes_per_block must be >= 0", "got -1"]),
        ("model.max_model_len", -1, ["max_model_len must be >= 0", "got -1", "`$.model`"]),
        ("model.name", "", ["OffloadingModelConfig.name must be a non-empty string, got ''"]),
        ("engine_id", "", ["OffloadingConfig.engine_id must be a non-empty string, got ''"]),
        ("parallel", {"rank": 2, "world_size": 2, "tp_size": 2, "pp_size": 1, "pcp_size": 1,
                      "dcp_size": 1, "data_parallel_index": 0, "is_parallelism_agnostic": False},
         ["rank must be in [0, world_size=2), got 2", "`$.parallel`"]),
    ],
)  # fmt: skip
def test_load_json_rejects(tmp_path: Path, field: str, value: Any, fragments: list[str]) -> None:
    data = minimal_dict()
    _set(data, field, value)
    path = write_json(tmp_path, data, "bad.json")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "bad.json" in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("field", ["engine_id", "model", "cache", "groups", "model.dtype"])
def test_load_json_requires(tmp_path: Path, field: str) -> None:
    data = minimal_dict()
    _drop(data, field)
    with pytest.raises(ConfigError, match=rf"missing required field `{field.split('.')[-1]}`"):
        load_config(write_json(tmp_path, data))


def test_load_rejects_tokens_per_block_not_multiple_of_hash(tmp_path: Path) -> None:
    data = minimal_dict()
    data["groups"][0]["tokens_per_block"] = 24
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, data))
    assert "groups[0].tokens_per_block=24" in str(info.value)
    assert "tokens_per_hash=16" in str(info.value)


def test_load_rejects_layer_in_two_groups(tmp_path: Path) -> None:
    data = minimal_dict()
    data["groups"].append({"tokens_per_block": 32, "layer_names": ["l2", "l1"]})
    with pytest.raises(ConfigError, match=r"layer 'l1' is in groups\[0\] and groups\[1\]"):
        load_config(write_json(tmp_path, data))


def test_load_toml_rejects_with_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(HYBRID_TOML.replace("blocks_per_chunk = 4", "blocks_per_chunk = 0"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "bad.toml" in message
    assert "blocks_per_chunk must be >= 1" in message
    assert "got 0" in message
    assert "`$.cache`" in message


def test_load_toml_unknown_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(HYBRID_TOML.replace("[model]\n", "[model]\nrevision = 'main'\n"))
    with pytest.raises(ConfigError, match=r"unknown field `revision` - at `\$\.model`"):
        load_config(path)


def test_load_malformed_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"groups": [')
    with pytest.raises(ConfigError, match=r"broken\.json.*is not valid JSON"):
        load_config(path)


def test_load_malformed_toml(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("engine_id = \n")
    with pytest.raises(ConfigError, match=r"broken\.toml.*is not valid TOML"):
        load_config(path)


def test_load_toml_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('engine_id = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.toml' is not UTF-8"):
        load_config(path)


def test_load_rejects_other_suffix(tmp_path: Path) -> None:
    path = tmp_path / "tier.yaml"
    path.write_text("engine_id: e0\n")
    with pytest.raises(ConfigError, match=r"suffix '\.yaml'; use a \.json or \.toml file"):
        load_config(path)


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=r"cannot read config file .*absent\.json") as info:
        load_config(path)
    assert isinstance(info.value.__cause__, FileNotFoundError)


# --- building in Python -------------------------------------------------------------------


def test_direct_construction_normalises_sequences() -> None:
    group = OffloadingGroupConfig(tokens_per_block=32, layer_names=["a", "b"])  # type: ignore[arg-type]
    assert group.layer_names == ("a", "b")
    config = OffloadingConfig(
        groups=[group],  # type: ignore[arg-type]
        worker_kv_bytes_per_block=0,
        extra_config=MappingProxyType({"block_size": 64}),  # type: ignore[arg-type]
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
    )
    assert config.groups == (group,)
    assert config.extra_config == {"block_size": 64}
    assert type(config.extra_config) is dict
    assert config.tokens_per_chunk == (64,)


def test_records_are_frozen() -> None:
    with pytest.raises(AttributeError):
        HYBRID.engine_id = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        HYBRID.cache.blocks_per_chunk = 8  # type: ignore[misc]


def test_records_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        OffloadingCacheConfig(16, 4)  # type: ignore[call-arg]


def bad(value: object) -> Any:
    """``value``, hidden from mypy: the tests below pass wrong types on purpose."""
    return value


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=0),
         r"OffloadingCacheConfig\.blocks_per_chunk must be >= 1 .*got 0"),
        (lambda: OffloadingCacheConfig(tokens_per_hash=bad("16"), blocks_per_chunk=1),
         r"OffloadingCacheConfig\.tokens_per_hash must be an integer .*got '16' of type str"),
        (lambda: OffloadingGroupConfig(tokens_per_block=True, layer_names=("a",)),
         r"tokens_per_block must be an integer .*got True of type bool"),
        (lambda: OffloadingGroupConfig(tokens_per_block=16, layer_names=bad(("a", 3))),
         r"layer_names\[1\] must be a str, got 3"),
        (lambda: OffloadingGroupConfig(tokens_per_block=16, layer_names=("a", "")),
         r"layer_names holds an empty name"),
        (lambda: OffloadingGroupConfig(tokens_per_block=16, layer_names=bad("ab")),
         r"layer_names must be a tuple of str, got str"),
        (lambda: OffloadingModelConfig(name="m", dtype=""),
         r"OffloadingModelConfig\.dtype must be a non-empty string, got ''"),
        (lambda: OffloadingParallelConfig(rank=-1, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          is_parallelism_agnostic=False),
         r"rank must be >= 0 .*got -1"),
        (lambda: OffloadingParallelConfig(rank=0, world_size=1, tp_size=0, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          is_parallelism_agnostic=False),
         r"tp_size must be >= 1 .*got 0"),
        (lambda: OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          is_parallelism_agnostic=bad(1)),
         r"is_parallelism_agnostic must be a bool, got 1"),
        (lambda: OffloadingConfig(groups=(), worker_kv_bytes_per_block=0, engine_id="e",
                                  model=OffloadingModelConfig(name="m", dtype="half"),
                                  cache=bad({"tokens_per_hash": 1})),
         r"OffloadingConfig\.cache must be an OffloadingCacheConfig, got dict"),
        (lambda: OffloadingConfig(groups=(), worker_kv_bytes_per_block=0, engine_id="e",
                                  extra_config=bad({1: "x"}),
                                  model=OffloadingModelConfig(name="m", dtype="half"),
                                  cache=OffloadingCacheConfig(tokens_per_hash=1,
                                                              blocks_per_chunk=1)),
         r"extra_config must be a mapping with string keys, got \{1: 'x'\}"),
    ],
)  # fmt: skip
def test_direct_construction_rejects(build: Any, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build()


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError, match=re.escape("blocks_per_chunk")):
        OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=-1)


def test_a_group_may_hold_no_layer_under_pipeline_parallelism(tmp_path: Path) -> None:
    data = minimal_dict()
    _set(data, "groups.0.layer_names", [])
    assert load_config(write_json(tmp_path, data, "pp.json")).groups[0].layer_names == ()


def test_a_wrong_type_names_the_field_and_the_value(tmp_path: Path) -> None:
    data = minimal_dict()
    _set(data, "cache.blocks_per_chunk", "4")
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, data, "typed.json"))
    assert "$.cache.blocks_per_chunk" in str(info.value)
    assert "(value: '4')" in str(info.value)


# --- extra_config keys ------------------------------------------------------------------


def test_tiering_extra_keys_are_the_ones_the_code_reads() -> None:
    from tiering.scheduler import SchedulerLimits

    # The engine reads the scheduler limits, the vLLM integration blocks_per_chunk.
    assert set(SchedulerLimits.__struct_fields__) | {"blocks_per_chunk"} == TIERING_EXTRA_KEYS
    # vLLM 0.33's own kv_connector_extra_config keys on the offloading path (the list is
    # derived again from vLLM's sources in tests/vllm/test_keys.py)
    assert {
        "block_size", "cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path",
        "self_describing_kv_events", "offload_prompt_only", "spec_name", "spec_module_path",
        "canonical_layout", "secondary_tiers", "store_threshold", "max_tracker_size",
        "blocks_per_chunk", "sync_load_budget_bytes", "tier_poll_interval_s", "backpressure",
    } == SHARED_EXTRA_KEYS  # fmt: skip


def test_vllms_own_keys_pass_and_are_named_in_the_misspelling_message() -> None:
    shared = dict.fromkeys(sorted(SHARED_EXTRA_KEYS), 1)
    assert msgspec.structs.replace(HYBRID, extra_config=shared).extra_config == shared
    with pytest.raises(ConfigError) as info:
        msgspec.structs.replace(HYBRID, extra_config={**shared, "slice_chunk": 4})
    message = str(info.value)
    assert "did you mean 'slice_chunks'?" in message
    for key in ("store_threshold", "max_tracker_size", "offload_prompt_only", "spec_name"):
        assert repr(key) in message  # listed among the keys tiering reads


def test_the_misspelling_message_names_vllms_keys_as_passed_not_read() -> None:
    # vLLM's own keys (backpressure, tier_poll_interval_s...) are not read by tiering.
    with pytest.raises(ConfigError) as info:
        msgspec.structs.replace(HYBRID, extra_config={"slice_chunk": 4})
    read, passed = str(info.value).split("tiering reads ")[1].split(", and passes vLLM's own")
    assert "'slice_chunks'" in read
    assert "'backpressure'" not in read
    assert "backpressure" in passed
    assert "tier_poll_interval_s" in passed


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("max_queud_jobs", "max_queued_jobs"),
        ("max_inflight_byte", "max_inflight_bytes"),
        ("slice_chunk", "slice_chunks"),
        ("max_load_slice", "max_load_slices"),
        ("blocks_per_chunks", "blocks_per_chunk"),
    ],
)
def test_a_misspelled_tiering_key_is_refused(tmp_path: Path, key: str, meant: str) -> None:
    data = minimal_dict()
    data["extra_config"] = {key: 8}
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, data, "typo.json"))
    message = str(info.value)
    assert "typo.json" in message
    assert f"extra_config has key {key!r}, which tiering does not read" in message
    assert f"did you mean {meant!r}?" in message


def test_keys_of_others_pass_through() -> None:
    others = {
        # vLLM's own offloading keys, and some of other backends
        "spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm",
        "cpu_bytes_to_use": 8 << 30,
        "block_size": 64,
        "eviction_policy": "lru",
        "cache_policy_module_path": "x.y",
        "secondary_tiers": [],
        "num_cpu_blocks": 1024,
        "cache_policy": "lru",
        "kv_block_size": 16,
        "chunk_size": 256,
        "max_inflight_requests": 8,
        "max_queued_requests": 8,
    }
    ours = {"max_queued_jobs": 8, "max_inflight_bytes": 1 << 20, "slice_chunks": 4,
            "max_load_slices": 2, "blocks_per_chunk": 4}  # fmt: skip
    config = msgspec.structs.replace(HYBRID, extra_config={**others, **ours})
    assert config.extra_config == {**others, **ours}


def test_a_misspelled_key_is_refused_in_python_too() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'max_queued_jobs'\? tiering reads \["):
        msgspec.structs.replace(HYBRID, extra_config={"max_queue_jobs": 8})


@pytest.mark.parametrize(
    ("key", "meant"),
    [("MAX_QUEUED_JOBS", "max_queued_jobs"), ("Slice_Chunks", "slice_chunks"),
     ("BLOCKS_PER_CHUNKS", "blocks_per_chunk")],
)  # fmt: skip
def test_a_tiering_key_in_another_case_is_refused(key: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=rf"has key {key!r}, .*did you mean {meant!r}\?"):
        msgspec.structs.replace(HYBRID, extra_config={key: 8})


@pytest.mark.parametrize("key", sorted(TIERING_EXTRA_KEYS))
@pytest.mark.parametrize(
    ("bad", "shown"),
    [(-5, "-5 of type int"), (0, "0 of type int"), ("many", "'many' of type str"),
     (True, "True of type bool"), (2.0, "2.0 of type float"), (None, "None of type NoneType")],
)  # fmt: skip
def test_a_bad_value_of_a_tiering_key_is_refused_when_loading(
    tmp_path: Path, key: str, bad: Any, shown: str
) -> None:
    data = minimal_dict()
    data["extra_config"] = {key: bad}
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, data, "values.json"))
    message = str(info.value)
    assert "values.json" in message
    assert f"extra_config[{key!r}] must be a positive integer (" in message
    assert message.count(f"got {shown}") == 1


def test_a_bad_value_of_a_tiering_key_is_refused_in_python_too() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^OffloadingConfig.extra_config\['max_queued_jobs'\] must be a positive integer "
        r"\(jobs each direction queues before submissions wait\), got -5 of type int$",
    ):
        msgspec.structs.replace(HYBRID, extra_config={"max_queued_jobs": -5})


def test_blocks_per_chunk_may_be_an_integer_string_as_vllm_allows() -> None:
    config = msgspec.structs.replace(HYBRID, extra_config={"blocks_per_chunk": "4"})
    assert config.extra_config == {"blocks_per_chunk": "4"}
    with pytest.raises(ConfigError, match=r"\['blocks_per_chunk'\] must be a positive integer"):
        msgspec.structs.replace(HYBRID, extra_config={"blocks_per_chunk": "0"})
    with pytest.raises(ConfigError, match=r"\['max_queued_jobs'\] must be a positive integer"):
        msgspec.structs.replace(HYBRID, extra_config={"max_queued_jobs": "4"})  # as the engine


# --- dtypes -------------------------------------------------------------------------------


def test_the_torch_dtype_names_are_torchs() -> None:
    torch = pytest.importorskip("torch")
    known = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
    assert known - TORCH_DTYPE_NAMES == set(), "add torch's new dtypes to TORCH_DTYPE_NAMES"
    assert TORCH_DTYPE_NAMES - known == set(), "TORCH_DTYPE_NAMES names dtypes torch lacks"
    for name, storage in VLLM_CACHE_DTYPES.items():
        assert name not in TORCH_DTYPE_NAMES
        assert isinstance(getattr(torch, storage), torch.dtype), name


@pytest.mark.parametrize(
    ("dtype", "storage"),
    [("bfloat16", "bfloat16"), ("half", "half"), ("float8_e4m3fn", "float8_e4m3fn"),
     ("int64", "int64"), ("fp8", "uint8"), ("fp8_e4m3", "uint8"), ("fp8_inc", "float8_e4m3fn"),
     ("int8_per_token_head", "int8"),
     # vLLM 0.33's cache dtypes (its CacheDType), all stored as bytes
     ("nvfp4_ds_mla", "uint8"), ("octave_k3v4", "uint8"), ("octave_k3v3", "uint8"),
     ("octave_k3v3_compact", "uint8"), ("ultraquant_4bit", "uint8")],
)  # fmt: skip
def test_torch_and_vllm_dtypes_are_accepted(dtype: str, storage: str) -> None:
    model = OffloadingModelConfig(name="m", dtype=dtype)
    assert model.storage_dtype == storage


@pytest.mark.parametrize(
    ("dtype", "fragment"),
    [
        ("float77", "did you mean 'float"),
        ("bf16", "did you mean 'bfloat16'"),
        ("auto", "use a torch dtype name such as 'bfloat16' or a vLLM KV-cache dtype"),
        ("torch.bfloat16", "write 'bfloat16', without 'torch.'"),
        ("fp8_e4m2", "did you mean 'fp8_e5m2' or 'fp8_e4m3'"),
    ],
)
def test_an_unknown_dtype_is_refused(tmp_path: Path, dtype: str, fragment: str) -> None:
    data = minimal_dict()
    data["model"]["dtype"] = dtype
    with pytest.raises(ConfigError) as info:
        load_config(write_json(tmp_path, data, "dtype.json"))
    message = str(info.value)
    assert f"OffloadingModelConfig.dtype={dtype!r} is not a dtype torch or vLLM knows" in message
    assert fragment in message


# --- a byte order mark --------------------------------------------------------------------


def test_a_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + msgspec.json.encode(HYBRID))
    assert load_config(path) == HYBRID
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + HYBRID_TOML.encode())
    assert load_config(path) == HYBRID


# --- the common case ----------------------------------------------------------------------


def test_for_full_attention_builds_one_group_on_one_worker() -> None:
    config = OffloadingConfig.for_full_attention(
        ["l0", "l1"], model="m", dtype="bfloat16", tokens_per_block=16, blocks_per_chunk=4
    )
    assert config == OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1")),),
        worker_kv_bytes_per_block=0,
        engine_id="engine-0",
        model=OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
    )
    assert config.tokens_per_chunk == (64,)
    assert config.groups[0].sliding_window_size_in_chunks is None
    assert config.parallel.world_size == 1


def test_for_full_attention_passes_the_rest_through() -> None:
    config = OffloadingConfig.for_full_attention(
        ("a",), model="m", dtype="fp8", tokens_per_block=32, tokens_per_hash=16,
        worker_kv_bytes_per_block=4096, max_model_len=8192, engine_id="rank-1",
        enable_kv_cache_events=True, extra_config=MappingProxyType({"max_queued_jobs": 4}),
    )  # fmt: skip
    assert (config.cache.tokens_per_hash, config.worker_kv_bytes_per_block) == (16, 4096)
    assert (config.model.max_model_len, config.engine_id) == (8192, "rank-1")
    assert config.enable_kv_cache_events is True
    assert config.extra_config == {"max_queued_jobs": 4}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tokens_per_hash": 12}, r"tokens_per_block=16 is not a multiple of .*tokens_per_hash=12"),
        ({"dtype": "float77"}, r"dtype='float77' is not a dtype"),
        ({"blocks_per_chunk": 0}, r"blocks_per_chunk must be >= 1"),
        ({"extra_config": {"slice_chunk": 4}}, r"did you mean 'slice_chunks'"),
        ({"layer_names": "l0"}, r"got the string 'l0'; give \['l0'\] for one layer"),
    ],
)
def test_for_full_attention_checks_like_the_constructor(kwargs: Any, pattern: str) -> None:
    args: dict[str, Any] = {"layer_names": ["l0"], "model": "m", "dtype": "bfloat16",
                            "tokens_per_block": 16, **kwargs}  # fmt: skip
    with pytest.raises(ConfigError, match=pattern):
        OffloadingConfig.for_full_attention(**args)


# --- the fields vLLM 0.33 added (group_id, data parallelism, layouts) ------------------------

#: What vLLM 0.33 builds for a DP rank: every new field set.
VLLM_033_TOML = (
    HYBRID_TOML.replace(
        'engine_id = "engine-0"\n',
        'engine_id = "engine-0"\nreplicated_layout = true\ncanonical_layout = true\n'
        'kv_cache_layout = "LBNHC"\n',
    )
    .replace(
        "sliding_window_size_in_chunks = 63\n", "sliding_window_size_in_chunks = 63\ngroup_id = 3\n"
    )
    .replace(
        "data_parallel_index = 0\n",
        "data_parallel_index = 1\ndata_parallel_size = 4\ndata_parallel_rank_local = 1\n",
    )
)


def test_an_old_file_gets_the_new_fields_defaults(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(HYBRID_TOML.replace("data_parallel_index = 0", "data_parallel_index = 3"))
    config = load_config(path)
    assert [group.group_id for group in config.groups] == [None, None]
    assert config.group_ids == (0, 1)  # None: the group's position
    # a DP index without the number of replicas (unknown, 0) is still accepted
    assert config.parallel.data_parallel_index == 3
    assert config.parallel.data_parallel_size == 0
    assert config.parallel.data_parallel_rank_local is None
    assert (config.replicated_layout, config.canonical_layout) == (False, False)
    assert config.kv_cache_layout is None


def test_the_new_fields_load_and_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "new.toml"
    path.write_text(VLLM_033_TOML)
    config = load_config(path)
    assert config.group_ids == (0, 3)
    assert config.groups[1].group_id == 3
    assert (config.parallel.data_parallel_index, config.parallel.data_parallel_size) == (1, 4)
    assert config.parallel.data_parallel_rank_local == 1
    assert (config.replicated_layout, config.canonical_layout) == (True, True)
    assert config.kv_cache_layout == "LBNHC"
    again = tmp_path / "new.json"
    again.write_bytes(msgspec.json.encode(config))
    assert load_config(again) == config
    assert config != HYBRID


def _parallel(**fields: Any) -> OffloadingParallelConfig:
    values: dict[str, Any] = {"rank": 0, "world_size": 1, "tp_size": 1, "pp_size": 1,
                              "pcp_size": 1, "dcp_size": 1, "data_parallel_index": 0,
                              "is_parallelism_agnostic": False, **fields}  # fmt: skip
    return OffloadingParallelConfig(**values)


def _two_groups(first: int | None, second: int | None) -> OffloadingConfig:
    return msgspec.structs.replace(
        HYBRID,
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",), group_id=first),
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("b",), group_id=second),
        ),
    )


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",), group_id=-1),
         r"OffloadingGroupConfig\.group_id must be >= 0 .*got -1"),
        (lambda: OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",),
                                       group_id=bad(True)),
         r"group_id must be an integer .*got True of type bool"),
        (lambda: _two_groups(2, 2), r"groups\[0\] and groups\[1\] both have group_id 2"),
        # None is the position: groups[1] at position 1 collides with an explicit 1
        (lambda: _two_groups(1, None), r"groups\[0\] and groups\[1\] both have group_id 1"),
        (lambda: _parallel(data_parallel_size=-1), r"data_parallel_size must be >= 0 .*got -1"),
        (lambda: _parallel(data_parallel_index=2, data_parallel_size=2),
         r"data_parallel_index must be in \[0, data_parallel_size=2\), got 2"),
        (lambda: _parallel(data_parallel_size=2, data_parallel_rank_local=2),
         r"data_parallel_rank_local must be in \[0, data_parallel_size=2\), got 2"),
        (lambda: _parallel(data_parallel_rank_local=-1),
         r"data_parallel_rank_local must be >= 0 .*got -1"),
        (lambda: _parallel(data_parallel_rank_local=bad("0")),
         r"data_parallel_rank_local must be an integer .*got '0' of type str"),
        (lambda: msgspec.structs.replace(HYBRID, replicated_layout=bad(1)),
         r"OffloadingConfig\.replicated_layout must be a bool .*got 1"),
        (lambda: msgspec.structs.replace(HYBRID, canonical_layout=bad("true")),
         r"OffloadingConfig\.canonical_layout must be a bool .*got 'true'"),
        (lambda: msgspec.structs.replace(HYBRID, kv_cache_layout=""),
         r"OffloadingConfig\.kv_cache_layout must be a non-empty string, got ''"),
    ],
)  # fmt: skip
def test_the_new_fields_are_checked(build: Any, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build()


def test_distinct_group_ids_in_any_order_are_accepted() -> None:
    assert _two_groups(5, 0).group_ids == (5, 0)
    assert _two_groups(None, 7).group_ids == (0, 7)
    assert _parallel(data_parallel_index=3, data_parallel_size=4).data_parallel_size == 4


def test_a_bad_new_field_in_a_file_names_its_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(VLLM_033_TOML.replace("data_parallel_size = 4", "data_parallel_size = 1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "data_parallel_index must be in [0, data_parallel_size=1), got 1" in message
    assert "`$.parallel`" in message


def test_a_numpy_integer_is_refused_in_a_field_as_before() -> None:
    # A record keeps the value it is given, and msgspec cannot encode numpy's integers
    # (RemoteNamespace's digest would fail later): refused here, with the field's name.
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigError, match=r"blocks_per_chunk must be an integer .*np\.int64"):
        OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=np.int64(4))
    with pytest.raises(ConfigError, match=r"tokens_per_block must be an integer"):
        OffloadingGroupConfig(tokens_per_block=np.int64(16), layer_names=("a",), group_id=0)
