"""The keys of a config's ``extra_config``: vLLM's ``kv_connector_extra_config`` (layer 1).

It is shared with vLLM and other backends, so a key tiering does not read is
passed through; but a key that is not one of tiering's own
(`TIERING_EXTRA_KEYS`) nor one of vLLM's (`VLLM_EXTRA_KEYS`) and is close to
one of tiering's, whatever its case (``max_queud_jobs``, ``MAX_QUEUED_JOBS``),
is refused as a misspelling, naming the key meant, and the value of one of
tiering's own keys must be a positive integer (not a bool).
`tiering.config.OffloadingConfig` checks its ``extra_config`` with
`check_extra_config`; `tiering.integrations.vllm.extra.TieringSpecKeys` types
every key `TieringSpec` takes, vLLM's included.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tiering._checks import is_int
from tiering._decode import closest_key
from tiering.errors import ConfigError

__all__ = ["SHARED_EXTRA_KEYS", "TIERING_EXTRA_KEYS", "VLLM_EXTRA_KEYS", "check_extra_config"]

#: What each of tiering's own ``extra_config`` keys counts (for the message that
#: refuses a bad value).
_EXTRA_MEANINGS: Mapping[str, str] = MappingProxyType(
    {
        "max_queued_jobs": "jobs each direction queues before submissions wait",
        "max_inflight_bytes": "bytes each direction hands the transfer backend at once",
        "slice_chunks": "chunks in one load slice",
        "max_load_slices": "load slices at the transfer backend at once",
        "blocks_per_chunk": "GPU blocks coalesced into a chunk",
    }
)

#: The ``extra_config`` keys that are tiering's own: the scheduler limits
#: (`tiering.scheduler.SchedulerLimits`, read by the engine) and
#: ``blocks_per_chunk`` (read by `tiering.integrations.vllm`).
TIERING_EXTRA_KEYS: frozenset[str] = frozenset(_EXTRA_MEANINGS)
#: vLLM 0.33's own ``kv_connector_extra_config`` keys on the offloading path, each with
#: the file under ``vllm/`` that reads it (tests/vllm/test_keys.py derives them again
#: from vLLM's sources); never taken for a misspelling of one of tiering's keys.
VLLM_EXTRA_KEYS: tuple[str, ...] = (
    "spec_name",  # v1/kv_offload/factory.py: the spec class to load
    "spec_module_path",  # v1/kv_offload/factory.py: the module that holds it
    "block_size",  # distributed/.../offloading/config.py: tokens per chunk
    "blocks_per_chunk",  # distributed/.../offloading/config.py: GPU blocks per chunk
    "canonical_layout",  # distributed/.../offloading/config.py: parallelism-free layout
    "sync_load_budget_bytes",  # distributed/.../offloading/scheduler.py: loads in-step
    "self_describing_kv_events",  # v1/kv_offload/base.py: BlockStored with token ids
    "offload_prompt_only",  # v1/kv_offload/base.py: store prompt blocks only
    "cpu_bytes_to_use",  # v1/kv_offload/cpu/spec.py: the CPU tier's host bytes
    "eviction_policy",  # v1/kv_offload/cpu/spec.py: a vLLM cache policy's name
    "cache_policy_module_path",  # v1/kv_offload/cpu/spec.py: the module of that policy
    "store_threshold",  # v1/kv_offload/cpu/spec.py, tiering/spec.py: offers before a store
    "max_tracker_size",  # v1/kv_offload/cpu/spec.py: the store_threshold tracker's size
    "secondary_tiers",  # v1/kv_offload/tiering/spec.py: the tiers below the CPU tier
    "tier_poll_interval_s",  # v1/kv_offload/tiering/spec.py: pause between tier polls
    "backpressure",  # v1/kv_offload/tiering/spec.py: every tier's back-pressure defaults
)
#: `VLLM_EXTRA_KEYS`, as a set.
SHARED_EXTRA_KEYS: frozenset[str] = frozenset(VLLM_EXTRA_KEYS)
#: How alike (difflib's ratio) an unknown key must be to one of
#: `TIERING_EXTRA_KEYS` to be taken for its misspelling.
_MISSPELLING = 0.8


def check_extra_config(owner: str, extra: Mapping[str, Any]) -> None:
    """Refuse a misspelt key (`_check_keys`), then a bad value of one of tiering's own keys
    (`_check_values`): one `ConfigError` naming ``owner``'s ``extra_config[key]``."""
    _check_keys(owner, extra)
    _check_values(owner, extra)


def _check_values(owner: str, extra: Mapping[str, Any]) -> None:
    """Refuse a value of one of `TIERING_EXTRA_KEYS` that is not a positive integer.

    ``blocks_per_chunk`` may be an integer string, as vLLM's extra config allows
    (`tiering.integrations.vllm` reads it so).
    """
    for key, meaning in _EXTRA_MEANINGS.items():
        if key not in extra:
            continue
        value = extra[key]
        number = value
        if key == "blocks_per_chunk" and isinstance(value, str):
            with contextlib.suppress(ValueError):  # not an integer: refused below
                number = int(value.strip())
        if not is_int(number) or number < 1:
            raise ConfigError(
                f"{owner}.extra_config[{key!r}] must be a positive integer ({meaning}), "
                f"got {value!r} of type {type(value).__name__}"
            )


def _check_keys(owner: str, extra: Mapping[str, Any]) -> None:
    """Refuse a key that looks like a misspelling of one of `TIERING_EXTRA_KEYS`.

    Case does not count: ``MAX_QUEUED_JOBS`` is taken for ``max_queued_jobs``.
    """
    for key in extra:
        if key in TIERING_EXTRA_KEYS or key in SHARED_EXTRA_KEYS:
            continue
        meant = closest_key(key, sorted(TIERING_EXTRA_KEYS), cutoff=_MISSPELLING)
        if meant:
            raise ConfigError(
                f"{owner}.extra_config has key {key!r}, which tiering does not read; did you "
                f"mean {meant!r}? tiering reads {sorted(TIERING_EXTRA_KEYS)}, and passes "
                f"vLLM's own through: {sorted(SHARED_EXTRA_KEYS - TIERING_EXTRA_KEYS)}"
            )
