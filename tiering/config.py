"""The configuration of a tier: what the engine needs to know about the model.

The records came with the seed (the original code this project started from,
described in ``../shared/DESIGN.md``) and keep the names and meanings of the
configuration that servers built on vLLM hand to their offloading backends
(vLLM's ``vllm/v1/kv_offload/config.py``), so a server can pass its own values
through unchanged; `tiering.integrations.vllm` builds one from a live vLLM config.

Every record is a frozen, keyword-only msgspec Struct that refuses unknown
fields. Values are checked in ``__post_init__``, which runs both when a record
is built in Python and when it is decoded, so an `OffloadingConfig` that exists
is a possible one. `load_config` reads one from a JSON or TOML file through
`tiering._decode`: every problem is one `ConfigError` naming the file, msgspec's
path (``$.cache.blocks_per_chunk``; ``$.cache`` after a check's own message) and
the value.

``model.dtype`` is a dtype torch knows (`TORCH_DTYPE_NAMES`) or one of vLLM's
KV-cache dtypes (`VLLM_CACHE_DTYPES`). ``extra_config`` is vLLM's
``kv_connector_extra_config``, shared with vLLM and other backends, so a key
tiering does not read is passed through; but a key that is not one of
tiering's own (`TIERING_EXTRA_KEYS`) and is close to one, whatever its case
(``max_queud_jobs``, ``MAX_QUEUED_JOBS``), is refused as a misspelling, naming
the key meant, and the value of one of tiering's own keys must be a positive
integer (not a bool) when the config is built, not only when an engine is.
"""

from __future__ import annotations

import codecs
import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec

from tiering._checks import is_int
from tiering._decode import decode, shown
from tiering.errors import ConfigError
from tiering.extra_config import (
    SHARED_EXTRA_KEYS,
    TIERING_EXTRA_KEYS,
    VLLM_EXTRA_KEYS,
    check_extra_config,
)

__all__ = [
    "DEFAULT_POLICY",
    "SHARED_EXTRA_KEYS",
    "TIERING_EXTRA_KEYS",
    "TORCH_DTYPE_NAMES",
    "VLLM_CACHE_DTYPES",
    "VLLM_EXTRA_KEYS",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "load_config",
]

#: The cache policy a tier uses when none is named (one of
#: `tiering.policies.POLICY_NAMES`): the dueling segmented LRU, which follows LRU
#: or a segmented LRU, whichever sampled shadows say hits more (by how much: the
#: README's policy table, which `bench/policy.py` prints and checks).
DEFAULT_POLICY = "dslru"

#: The names of the dtypes torch knows (``torch.<name>`` is a ``torch.dtype``),
#: as of torch 2.13. This module does not import torch; tests/test_config.py
#: checks the list against the installed torch.
TORCH_DTYPE_NAMES: frozenset[str] = frozenset((
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble",
    "cfloat", "chalf", "complex128", "complex32", "complex64", "double", "float", "float16",
    "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1", "int16", "int2", "int3", "int32",
    "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8", "quint2x4",
    "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4",
    "uint5", "uint6", "uint64", "uint7", "uint8",
))  # fmt: skip

#: vLLM's KV-cache dtypes (``--kv-cache-dtype``) that are not torch names, and
#: the torch dtype vLLM allocates each as (its ``STR_DTYPE_TO_TORCH_DTYPE``): a
#: quantized cache is bytes that attention backends view as they need.
VLLM_CACHE_DTYPES: Mapping[str, str] = MappingProxyType(
    {
        "fp8": "uint8",
        "fp8_e4m3": "uint8",
        "fp8_e5m2": "uint8",
        "fp8_inc": "float8_e4m3fn",
        "fp8_ds_mla": "uint8",
        "fp8_per_token_head": "uint8",
        "int8_per_token_head": "int8",
        "int4_per_token_head": "uint8",
        "nvfp4_ds_mla": "uint8",
        "nvfp4": "uint8",
        "nvfp4_4over6": "uint8",
        "octave_k3v4": "uint8",
        "octave_k3v3": "uint8",
        "octave_k3v3_compact": "uint8",
        "ultraquant_4bit": "uint8",
        "turboquant_k8v4": "uint8",
        "turboquant_4bit_nc": "uint8",
        "turboquant_k3v4_nc": "uint8",
        "turboquant_3bit_nc": "uint8",
    }
)


def _check_int(
    owner: str, name: str, value: object, minimum: int, meaning: str, *, none: str = ""
) -> None:
    """Raise a `ConfigError` unless ``value`` is an integer (not a bool) ``>= minimum``, or
    None where ``none`` says what None means."""
    if none:
        if value is None:
            return
        meaning = f"{meaning}; None = {none}"
    if not (is_int(value) and isinstance(value, int)):  # a field keeps it: numpy's won't encode
        raise ConfigError(
            f"{owner}.{name} must be an integer ({meaning}), got {value!r} "
            f"of type {type(value).__name__}"
        )
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum} ({meaning}), got {value}")


def _check_bool(owner: str, name: str, value: object, meaning: str = "") -> None:
    if not isinstance(value, bool):
        meant = f" ({meaning})" if meaning else ""
        raise ConfigError(f"{owner}.{name} must be a bool{meant}, got {value!r}")


def _check_text(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}.{name} must be a non-empty string, got {value!r}")


def _check_dtype(owner: str, dtype: str) -> None:
    if dtype in TORCH_DTYPE_NAMES or dtype in VLLM_CACHE_DTYPES:
        return
    bare = dtype.removeprefix("torch.")
    if bare != dtype and bare in TORCH_DTYPE_NAMES:
        hint = f"write {bare!r}, without 'torch.'"
    else:
        close = difflib.get_close_matches(dtype, [*TORCH_DTYPE_NAMES, *VLLM_CACHE_DTYPES], n=3)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        hint += "use a torch dtype name such as 'bfloat16' or a vLLM KV-cache dtype such as 'fp8'"
    raise ConfigError(f"{owner}.dtype={dtype!r} is not a dtype torch or vLLM knows; {hint}")


def _as_tuple(struct: msgspec.Struct, owner: str, name: str, item_type: type) -> tuple[Any, ...]:
    """The field ``name`` as a tuple of ``item_type``; lists are normalised in place."""
    value = getattr(struct, name)
    if isinstance(value, list):
        value = tuple(value)
        msgspec.structs.force_setattr(struct, name, value)
    if not isinstance(value, tuple):
        raise ConfigError(
            f"{owner}.{name} must be a tuple of {item_type.__name__}, got {type(value).__name__}"
        )
    for index, item in enumerate(value):
        if not isinstance(item, item_type):
            raise ConfigError(
                f"{owner}.{name}[{index}] must be a {item_type.__name__}, "
                f"got {item!r} of type {type(item).__name__}"
            )
    return value


class OffloadingGroupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One KV-cache group: layers that share a block table.

    ``tokens_per_block`` is the token span of one GPU block across all workers
    (the group's block size times the context-parallel sizes).
    ``sliding_window_size_in_chunks`` is the number of trailing chunks a request
    needs in this group (a sliding-window or Mamba group), or None for full
    attention, which needs every chunk. ``group_id`` is the group's index in
    vLLM's ``KVCacheConfig.kv_cache_groups`` (vLLM may offload only some of its
    groups), or None for the group's position in `OffloadingConfig.groups`.
    """

    tokens_per_block: int
    layer_names: tuple[str, ...]
    sliding_window_size_in_chunks: int | None = None
    group_id: int | None = None

    def __post_init__(self) -> None:
        owner = "OffloadingGroupConfig"
        _check_int(owner, "tokens_per_block", self.tokens_per_block, 1, "tokens in one GPU block")
        # May be empty: under pipeline parallelism a stage can hold no layer of a
        # group (vLLM keeps every group on every worker).
        names = _as_tuple(self, owner, "layer_names", str)
        seen: set[str] = set()
        for name in names:
            if not name:
                raise ConfigError(f"{owner}.layer_names holds an empty name: {list(names)!r}")
            if name in seen:
                raise ConfigError(
                    f"{owner}.layer_names names layer {name!r} twice; each layer appears once"
                )
            seen.add(name)
        window, meaning = self.sliding_window_size_in_chunks, "trailing chunks a request needs"
        _check_int(
            owner, "sliding_window_size_in_chunks", window, 1, meaning, none="full attention"
        )
        meaning = "index in vLLM's kv_cache_groups"
        _check_int(owner, "group_id", self.group_id, 0, meaning, none="the group's position")


class OffloadingModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model: its name, its KV-cache dtype and its longest request (0 when unknown)."""

    name: str
    dtype: str
    max_model_len: int = 0

    def __post_init__(self) -> None:
        owner = "OffloadingModelConfig"
        _check_text(owner, "name", self.name)
        _check_text(owner, "dtype", self.dtype)
        _check_dtype(owner, self.dtype)
        _check_int(
            owner,
            "max_model_len",
            self.max_model_len,
            0,
            "tokens in the longest request; 0 = unknown",
        )

    @property
    def storage_dtype(self) -> str:
        """The torch dtype name KV tensors of this dtype have: ``dtype`` itself, or for
        a vLLM KV-cache dtype the one vLLM allocates (``"fp8_e4m3"`` -> ``"uint8"``)."""
        return VLLM_CACHE_DTYPES.get(self.dtype, self.dtype)


class OffloadingCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prefix-hash granularity and chunk size (``blocks_per_chunk`` GPU blocks per chunk)."""

    tokens_per_hash: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        owner = "OffloadingCacheConfig"
        _check_int(owner, "tokens_per_hash", self.tokens_per_hash, 1, "tokens per prefix hash")
        _check_int(
            owner, "blocks_per_chunk", self.blocks_per_chunk, 1, "GPU blocks coalesced into a chunk"
        )


class OffloadingParallelConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """Where this worker sits in the parallel layout.

    ``is_parallelism_agnostic`` is true when concatenating a block's bytes over
    all workers gives the same result whatever the parallel layout, so chunks
    can be shared between engines laid out differently.
    ``data_parallel_size`` is the number of data-parallel replicas (0 when
    unknown: a config written before the field existed); when known,
    ``data_parallel_index`` and ``data_parallel_rank_local`` are below it.
    ``data_parallel_rank_local`` is set only in vLLM's SPMD mode, else None.
    """

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    is_parallelism_agnostic: bool
    data_parallel_size: int = 0
    data_parallel_rank_local: int | None = None

    def __post_init__(self) -> None:
        owner = "OffloadingParallelConfig"
        _check_int(owner, "world_size", self.world_size, 1, "number of workers")
        _check_int(owner, "rank", self.rank, 0, "worker index, 0 on the scheduler side")
        if self.rank >= self.world_size:
            raise ConfigError(
                f"{owner}.rank must be in [0, world_size={self.world_size}), got {self.rank}"
            )
        for name, meaning in (
            ("tp_size", "tensor-parallel size"),
            ("pp_size", "pipeline-parallel size"),
            ("pcp_size", "prefill context-parallel size"),
            ("dcp_size", "decode context-parallel size"),
        ):
            _check_int(owner, name, getattr(self, name), 1, meaning)
        _check_int(
            owner, "data_parallel_index", self.data_parallel_index, 0, "data-parallel replica index"
        )
        _check_bool(owner, "is_parallelism_agnostic", self.is_parallelism_agnostic)
        size = self.data_parallel_size
        _check_int(owner, "data_parallel_size", size, 0, "data-parallel replicas; 0 = unknown")
        local, meaning = self.data_parallel_rank_local, "local data-parallel rank in SPMD mode"
        _check_int(owner, "data_parallel_rank_local", local, 0, meaning, none="not in SPMD mode")
        for name in ("data_parallel_index", "data_parallel_rank_local"):
            value = getattr(self, name)
            if size and value is not None and value >= size:
                raise ConfigError(
                    f"{owner}.{name} must be in [0, data_parallel_size={size}), got {value}"
                )


def _single_rank() -> OffloadingParallelConfig:
    return OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        is_parallelism_agnostic=False,
        data_parallel_size=1,
    )


class OffloadingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a tier needs to know about the engine it serves.

    Guarantees, checked on construction and on decoding: every size is
    positive (``worker_kv_bytes_per_block`` may be 0, meaning "not known on the
    scheduler side"), every group's ``tokens_per_block`` is a multiple of
    ``cache.tokens_per_hash``, no layer belongs to two groups and no two groups
    have one `group_ids` entry. An engine without KV-cache groups (an
    attention-free model) has ``groups == ()``.

    The last three fields are vLLM's layout decisions, carried as vLLM made
    them: ``replicated_layout`` (every worker's bytes per block are identical,
    so one host copy serves all), ``canonical_layout`` (the topology-free
    per-layer host layout was asked for) and ``kv_cache_layout`` (the name of
    the worker KV cache's resolved ``KVCacheLayout``, e.g. ``"LBNHC"``; None
    when not resolved).
    """

    groups: tuple[OffloadingGroupConfig, ...]
    #: KV bytes one worker stores per GPU block, over all its KV tensors.
    worker_kv_bytes_per_block: int
    #: Emit KV cache events (vLLM's wire format) for what the tier holds.
    enable_kv_cache_events: bool = False
    #: Backend-specific settings (vLLM's ``kv_connector_extra_config``), passed through.
    extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Identifies this engine; distinct per data-parallel rank.
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig = msgspec.field(default_factory=_single_rank)
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None

    def __post_init__(self) -> None:
        owner = "OffloadingConfig"
        groups = _as_tuple(self, owner, "groups", OffloadingGroupConfig)
        _check_int(
            owner,
            "worker_kv_bytes_per_block",
            self.worker_kv_bytes_per_block,
            0,
            "KV bytes per block on one worker; 0 = unknown",
        )
        _check_bool(owner, "enable_kv_cache_events", self.enable_kv_cache_events)
        extra = self.extra_config
        if isinstance(extra, Mapping) and not isinstance(extra, dict):
            extra = dict(extra)
            msgspec.structs.force_setattr(self, "extra_config", extra)
        if not isinstance(extra, dict) or not all(isinstance(key, str) for key in extra):
            raise ConfigError(
                f"{owner}.extra_config must be a mapping with string keys, got {shown(extra)}"
            )
        check_extra_config(owner, extra)
        _check_text(owner, "engine_id", self.engine_id)
        _check_bool(
            owner, "replicated_layout", self.replicated_layout, "one host copy for all workers"
        )
        _check_bool(
            owner, "canonical_layout", self.canonical_layout, "the topology-free host layout"
        )
        if self.kv_cache_layout is not None:
            _check_text(owner, "kv_cache_layout", self.kv_cache_layout)
        for name, kind in (
            ("model", OffloadingModelConfig),
            ("cache", OffloadingCacheConfig),
            ("parallel", OffloadingParallelConfig),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{owner}.{name} must be an {kind.__name__}, got {type(value).__name__}"
                )
        tokens_per_hash = self.cache.tokens_per_hash
        owners: dict[str, int] = {}
        for index, group in enumerate(groups):
            if group.tokens_per_block % tokens_per_hash:
                raise ConfigError(
                    f"{owner}.groups[{index}].tokens_per_block={group.tokens_per_block} is not "
                    f"a multiple of cache.tokens_per_hash={tokens_per_hash}; every group's "
                    "block must hold a whole number of prefix-hash blocks"
                )
            for layer in group.layer_names:
                if layer in owners:
                    raise ConfigError(
                        f"{owner}: layer {layer!r} is in groups[{owners[layer]}] and "
                        f"groups[{index}]; a layer belongs to exactly one group"
                    )
                owners[layer] = index
        seen: dict[int, int] = {}
        for index, group_id in enumerate(self.group_ids):
            if group_id in seen:
                raise ConfigError(
                    f"{owner}: groups[{seen[group_id]}] and groups[{index}] both have group_id "
                    f"{group_id} (None stands for the group's position); each group has its own"
                )
            seen[group_id] = index

    @property
    def group_ids(self) -> tuple[int, ...]:
        """Each group's ``group_id``, its position in ``groups`` where that is None."""
        return tuple(
            index if group.group_id is None else group.group_id
            for index, group in enumerate(self.groups)
        )

    @property
    def tokens_per_chunk(self) -> tuple[int, ...]:
        """Tokens one chunk spans, per group: ``tokens_per_block * cache.blocks_per_chunk``."""
        factor = self.cache.blocks_per_chunk
        return tuple(group.tokens_per_block * factor for group in self.groups)

    @classmethod
    def for_full_attention(
        cls,
        layer_names: Sequence[str],
        *,
        model: str,
        dtype: str,
        tokens_per_block: int,
        blocks_per_chunk: int = 1,
        tokens_per_hash: int | None = None,
        worker_kv_bytes_per_block: int = 0,
        max_model_len: int = 0,
        engine_id: str = "engine-0",
        enable_kv_cache_events: bool = False,
        extra_config: Mapping[str, Any] | None = None,
    ) -> OffloadingConfig:
        """The config of the common case: one full-attention group on one worker.

        ``layer_names`` are the layers whose KV tensors the engine is given
        (one block-major tensor each); ``tokens_per_block`` is the GPU block
        size in tokens, ``blocks_per_chunk`` how many blocks make one chunk.
        The prefix hash is taken per GPU block unless ``tokens_per_hash`` (a
        divisor of ``tokens_per_block``) says otherwise. ``worker_kv_bytes_per_block``
        may stay 0 (unknown): the engine measures the tensors it is given.
        Every value is checked as in the constructor (a `ConfigError`).
        """
        if isinstance(layer_names, str):
            raise ConfigError(
                f"layer_names must be a sequence of layer names, got the string {layer_names!r}; "
                f"give [{layer_names!r}] for one layer"
            )
        return cls(
            groups=(
                OffloadingGroupConfig(
                    tokens_per_block=tokens_per_block, layer_names=tuple(layer_names)
                ),
            ),
            worker_kv_bytes_per_block=worker_kv_bytes_per_block,
            enable_kv_cache_events=enable_kv_cache_events,
            extra_config=dict(extra_config or {}),
            engine_id=engine_id,
            model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=max_model_len),
            cache=OffloadingCacheConfig(
                tokens_per_hash=tokens_per_block if tokens_per_hash is None else tokens_per_hash,
                blocks_per_chunk=blocks_per_chunk,
            ),
        )


def load_config(path: str | os.PathLike[str]) -> OffloadingConfig:
    """Read an `OffloadingConfig` from a ``.json`` or ``.toml`` file: its fields by name,
    its records as tables (``examples/tiering.toml`` has every key, its meaning, default).

    Guarantees a fully checked config or a `ConfigError` whose message names
    the file, the offending field with msgspec's path (``$.cache.blocks_per_chunk``,
    or ``$.cache`` after the field's name) and the value: unknown fields, wrong types,
    missing required fields, impossible values, malformed files and unreadable
    files are all reported that way. A file may start with a UTF-8 byte order
    mark. TOML has no null: leave a field out for None (where None is its default).
    """
    source = Path(path)
    suffix = source.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(
            f"config file {str(source)!r} has suffix {suffix!r}; use a .json or .toml file"
        )
    try:
        raw = source.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(source)!r}: {exc}") from exc
    raw = raw.removeprefix(codecs.BOM_UTF8)  # as editors on Windows save UTF-8
    try:
        data = msgspec.json.decode(raw) if suffix == ".json" else _parse_toml(raw, source)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not valid JSON: {exc}") from exc
    context = f"invalid config file {str(source)!r}: "
    return decode(OffloadingConfig, data, context=context, json_paths=True)


def _parse_toml(raw: bytes, source: Path) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not UTF-8: {exc}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not valid TOML: {exc}") from exc
