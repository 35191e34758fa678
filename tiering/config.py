"""The seed configuration of a tier: what the engine needs to know about the model.

The records use the names and meanings of the configuration that servers built
on vLLM hand to their offloading backends (vLLM's ``vllm/v1/kv_offload/config.py``),
so a server can pass its own values through unchanged; `tiering.integrations.vllm`
builds one from a live vLLM configuration.

Every record is a frozen, keyword-only msgspec Struct that refuses unknown
fields. Values are checked in ``__post_init__``, which runs both when a record
is built in Python and when it is decoded, so an `OffloadingConfig` that exists
is a possible one. `load_config` reads one from a JSON or TOML file and turns
every problem into a `ConfigError` that names the file, the field and the value:
a wrong type carries msgspec's path to the field (``$.cache.blocks_per_chunk``),
an impossible value the path to its record (``$.cache``) after a message that
names the field and the value.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from tiering.errors import ConfigError

__all__ = [
    "DEFAULT_POLICY",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "load_config",
]

#: The cache policy a tier uses when none is named (one of
#: `tiering.policies.POLICY_NAMES`): the adaptive segmented LRU, ahead of LRU
#: on the conversation trace from 0.5 to 10 million tokens and on both built-in
#: workloads (figures in the README; `bench/policy.py` checks them).
DEFAULT_POLICY = "aslru"


def _check_int(owner: str, name: str, value: object, minimum: int, meaning: str) -> None:
    """Raise a `ConfigError` unless ``value`` is an int (not a bool) ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{owner}.{name} must be an integer ({meaning}), got {value!r} "
            f"of type {type(value).__name__}"
        )
    if value < minimum:
        raise ConfigError(f"{owner}.{name} must be >= {minimum} ({meaning}), got {value}")


def _check_text(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}.{name} must be a non-empty string, got {value!r}")


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
    attention, which needs every chunk.
    """

    tokens_per_block: int
    layer_names: tuple[str, ...]
    sliding_window_size_in_chunks: int | None = None

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
        if self.sliding_window_size_in_chunks is not None:
            _check_int(
                owner,
                "sliding_window_size_in_chunks",
                self.sliding_window_size_in_chunks,
                1,
                "trailing chunks a request needs; None for full attention",
            )


class OffloadingModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The model: its name, its KV-cache dtype and its longest request (0 when unknown)."""

    name: str
    dtype: str
    max_model_len: int = 0

    def __post_init__(self) -> None:
        owner = "OffloadingModelConfig"
        _check_text(owner, "name", self.name)
        _check_text(owner, "dtype", self.dtype)
        _check_int(
            owner,
            "max_model_len",
            self.max_model_len,
            0,
            "tokens in the longest request; 0 = unknown",
        )


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
    """

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    is_parallelism_agnostic: bool

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
        if not isinstance(self.is_parallelism_agnostic, bool):
            raise ConfigError(
                f"{owner}.is_parallelism_agnostic must be a bool, "
                f"got {self.is_parallelism_agnostic!r}"
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
    )


class OffloadingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a tier needs to know about the engine it serves.

    Guarantees, checked on construction and on decoding: every size is
    positive (``worker_kv_bytes_per_block`` may be 0, meaning "not known on the
    scheduler side"), every group's ``tokens_per_block`` is a multiple of
    ``cache.tokens_per_hash``, and no layer belongs to two groups. An engine
    without KV-cache groups (an attention-free model) has ``groups == ()``.
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
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                f"{owner}.enable_kv_cache_events must be a bool, "
                f"got {self.enable_kv_cache_events!r}"
            )
        extra = self.extra_config
        if isinstance(extra, Mapping) and not isinstance(extra, dict):
            extra = dict(extra)
            msgspec.structs.force_setattr(self, "extra_config", extra)
        if not isinstance(extra, dict) or not all(isinstance(key, str) for key in extra):
            raise ConfigError(
                f"{owner}.extra_config must be a mapping with string keys, got {extra!r}"
            )
        _check_text(owner, "engine_id", self.engine_id)
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

    @property
    def tokens_per_chunk(self) -> tuple[int, ...]:
        """Tokens one chunk spans, per group: ``tokens_per_block * cache.blocks_per_chunk``."""
        factor = self.cache.blocks_per_chunk
        return tuple(group.tokens_per_block * factor for group in self.groups)


def load_config(path: str | os.PathLike[str]) -> OffloadingConfig:
    """Read an `OffloadingConfig` from a ``.json`` or ``.toml`` file.

    Guarantees a fully checked config or a `ConfigError` whose message names
    the file, the offending field with msgspec's path (``$.cache.blocks_per_chunk``,
    or ``$.cache`` after the field's name) and the value: unknown fields, wrong types,
    missing required fields, impossible values, malformed files and unreadable
    files are all reported that way. TOML has no null: leave
    ``sliding_window_size_in_chunks`` out for a full-attention group.
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
    try:
        data = msgspec.json.decode(raw) if suffix == ".json" else _parse_toml(raw, source)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not valid JSON: {exc}") from exc
    try:
        return msgspec.convert(data, OffloadingConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"invalid config file {str(source)!r}: {exc}{_value_at(data, str(exc))}"
        ) from exc


_PATH = re.compile(r"- at `\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])+)`$")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _value_at(data: object, message: str) -> str:
    """`` (value: ...)`` for the field a msgspec error message points at, if it is there."""
    match = _PATH.search(message)
    if match is None:
        return ""
    value = data
    for name, index in _STEP.findall(match.group(1)):
        if name and isinstance(value, dict) and name in value:
            value = value[name]
        elif index and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        else:
            return ""
    text = repr(value)
    return f" (value: {text if len(text) <= 80 else text[:77] + '...'})"


def _parse_toml(raw: bytes, source: Path) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not UTF-8: {exc}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(source)!r} is not valid TOML: {exc}") from exc
