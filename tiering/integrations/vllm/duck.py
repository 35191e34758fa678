"""Reading vLLM's duck-typed configuration objects, and vLLM's own config converted.

vLLM's ``VllmConfig``, ``KVCacheConfig`` and ``OffloadingConfig`` are read by
attribute, never imported: any objects with the attributes work. A missing
required attribute is a `ConfigError` naming its path
(``vllm_config.parallel_config.rank``); an integer is an ``int`` or one of
numpy's, never a bool or a float (`tiering._checks.is_int`).
`from_vllm_offloading_config` turns vLLM's ``OffloadingConfig`` into tiering's,
losslessly.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any

from tiering._checks import is_int
from tiering._decode import shown
from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from tiering.errors import ConfigError

__all__ = ["as_int", "as_iterable", "attr", "attr_int", "from_vllm_offloading_config"]

_ABSENT: Any = object()


def attr(obj: object, path: str, name: str, default: Any = _ABSENT) -> Any:
    """``obj.name``; a `ConfigError` naming ``path.name`` when it is missing and required."""
    value = getattr(obj, name, default)
    if value is _ABSENT:
        raise ConfigError(
            f"{path}.{name} is missing; tiering reads it (the object is a {type(obj).__name__})"
        )
    return value


def as_int(value: object, where: str, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` (ints and numpy integers; not bools or floats)."""
    if not is_int(value):
        raise ConfigError(
            f"{where} must be an integer, got {value!r} of type {type(value).__name__}"
        )
    number = operator.index(value)  # type: ignore[arg-type]
    if number < minimum:
        raise ConfigError(f"{where} must be >= {minimum}, got {number}")
    return number


def attr_int(obj: object, path: str, name: str, minimum: int, default: Any = _ABSENT) -> int:
    """``obj.name`` as an int ``>= minimum`` (`attr`, then `as_int`)."""
    return as_int(attr(obj, path, name, default), f"{path}.{name}", minimum)


def as_iterable(value: object, path: str, name: str) -> Iterable[Any]:
    """``value`` if it is a sequence of items (not a string); else a `ConfigError`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{path}.{name} must be a sequence, got {value!r}")
    return value


def _vllm_int(obj: object, path: str, name: str, default: Any = _ABSENT) -> Any:
    """``obj.name`` as an int where it is one (numpy integers too); else as it came.

    The records check the value; this only names a missing field by its path.
    """
    value = attr(obj, path, name, default)
    if isinstance(value, bool) or value is None:
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def from_vllm_offloading_config(config: object) -> OffloadingConfig:
    """tiering's `OffloadingConfig` for vLLM's own (``vllm.v1.kv_offload.config``), duck-typed.

    Lossless: every field of vLLM 0.33's dataclasses has a field of the same
    name and value here (groups in order with ``group_id``,
    ``tokens_per_block``, ``layer_names``, ``sliding_window_size_in_chunks``;
    ``worker_kv_bytes_per_block``, 0 on the scheduler side;
    ``enable_kv_cache_events``; ``extra_config``, copied into a dict;
    ``engine_id``; ``model``, ``cache`` and every ``parallel`` field;
    ``replicated_layout``, ``canonical_layout``, ``kv_cache_layout``). The
    fields vLLM gives defaults (``sliding_window_size_in_chunks``,
    ``max_model_len`` and the three layout fields) may be absent, with vLLM's
    defaults; any other missing one is a `ConfigError` naming its path
    (``config.parallel.data_parallel_size``).

    tiering checks what vLLM only carries. A value tiering refuses is a
    `ConfigError` that names the field and says it came from vLLM: notably an
    ``extra_config`` value of one of tiering's own keys that is not a positive
    integer (vLLM truncates ``blocks_per_chunk`` 2.7 to 2; tiering asks for 2),
    a key that looks like a misspelling of one of them, or a cache dtype that
    neither torch nor vLLM 0.33 names (a platform's own registered dtype).
    """
    path = "config"
    groups: list[OffloadingGroupConfig] = []
    for index, group in enumerate(as_iterable(attr(config, path, "groups"), path, "groups")):
        where = f"{path}.groups[{index}]"
        fields = {
            "tokens_per_block": _vllm_int(group, where, "tokens_per_block"),
            "layer_names": tuple(
                as_iterable(attr(group, where, "layer_names"), where, "layer_names")
            ),
            "sliding_window_size_in_chunks": _vllm_int(
                group, where, "sliding_window_size_in_chunks", None
            ),
            "group_id": _vllm_int(group, where, "group_id"),
        }
        try:
            groups.append(OffloadingGroupConfig(**fields))
        except ConfigError as exc:
            raise ConfigError(f"vLLM's {where} cannot be taken: {exc}") from exc
    extra = attr(config, path, "extra_config")
    if not isinstance(extra, Mapping):
        raise ConfigError(f"vLLM's {path}.extra_config must be a mapping, got {shown(extra)}")
    model, model_path = attr(config, path, "model"), f"{path}.model"
    cache, cache_path = attr(config, path, "cache"), f"{path}.cache"
    parallel, parallel_path = attr(config, path, "parallel"), f"{path}.parallel"
    model_fields = {
        "name": attr(model, model_path, "name"),
        "dtype": attr(model, model_path, "dtype"),
        "max_model_len": _vllm_int(model, model_path, "max_model_len", 0),
    }
    cache_fields = {
        "tokens_per_hash": _vllm_int(cache, cache_path, "tokens_per_hash"),
        "blocks_per_chunk": _vllm_int(cache, cache_path, "blocks_per_chunk"),
    }
    parallel_fields = {
        name: _vllm_int(parallel, parallel_path, name) for name in _VLLM_PARALLEL_FIELDS
    }
    top = {
        "worker_kv_bytes_per_block": _vllm_int(config, path, "worker_kv_bytes_per_block"),
        "enable_kv_cache_events": attr(config, path, "enable_kv_cache_events"),
        "engine_id": attr(config, path, "engine_id"),
        "replicated_layout": attr(config, path, "replicated_layout", False),
        "canonical_layout": attr(config, path, "canonical_layout", False),
        "kv_cache_layout": attr(config, path, "kv_cache_layout", None),
    }
    try:
        return OffloadingConfig(
            groups=tuple(groups),
            extra_config=dict(extra),
            model=OffloadingModelConfig(**model_fields),
            cache=OffloadingCacheConfig(**cache_fields),
            parallel=OffloadingParallelConfig(**parallel_fields),
            **top,
        )
    except ConfigError as exc:
        raise ConfigError(f"vLLM's OffloadingConfig cannot be taken: {exc}") from exc


#: The fields of vLLM 0.33's ``OffloadingParallelConfig``, every one required.
_VLLM_PARALLEL_FIELDS = (
    "rank",
    "world_size",
    "tp_size",
    "pp_size",
    "pcp_size",
    "dcp_size",
    "data_parallel_index",
    "data_parallel_size",
    "data_parallel_rank_local",
    "is_parallelism_agnostic",
)
