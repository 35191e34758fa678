"""`TieringSpec`: tiering as an out-of-tree offloading spec of vLLM 0.33.

Loaded by vLLM's ``OffloadingSpecFactory`` from::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm", "cpu_bytes_to_use": 8000000000}}'

vLLM builds it with its own ``OffloadingConfig`` in the scheduler process and
in every worker. The scheduler side (`get_manager`) is tiering's chunk manager
and policies (`TieringOffloadingManager`); the worker side (`get_worker`)
moves bytes with tiering's transfer backends (`TieringOffloadingWorker`).
Both sides size the CPU tier from the same ``cpu_bytes_to_use`` by vLLM's own
rule, so vLLM's native spec and this one hold the same number of chunks for
the same bytes.

``kv_connector_extra_config`` keys it reads (`EXTRA_KEYS`; every bad value is
one `ConfigError` naming the key):

==============================  ==================================================
``cpu_bytes_to_use``            host bytes of the CPU tier, over all workers (required)
``eviction_policy``             ``aslru`` (default), ``arc`` or ``lru``
``transfer_backend``            ``auto`` (default: ``cuda`` on a GPU, else ``cpu``),
                                ``cpu`` or ``cuda``
``block_size`` /
``blocks_per_chunk``            tokens / GPU blocks per chunk (vLLM reads these)
``self_describing_kv_events``   vLLM's own: BlockStored events carry token ids
``offload_prompt_only``         vLLM's own: store prompt blocks only (default true)
==============================  ==================================================
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.integrations.vllm.manager import TieringMetrics, TieringOffloadingManager
from tiering.integrations.vllm.worker import TieringOffloadingWorker
from tiering.policies import POLICY_NAMES

__all__ = ["EXTRA_KEYS", "TieringOffloadingInfo", "TieringSpec"]

#: Backends a vLLM worker may use (the mock backend moves no bytes: tests only).
_BACKENDS = ("auto", "cpu", "cuda")

#: The ``kv_connector_extra_config`` keys `TieringSpec` reads itself.
EXTRA_KEYS: tuple[str, ...] = ("cpu_bytes_to_use", "eviction_policy", "transfer_backend")


@dataclass(frozen=True)
class TieringOffloadingInfo(CPUOffloadingInfo):
    """vLLM's CPU-tier facts (``vllm:kv_offload_config_info``), plus the policy's name."""

    cpu_eviction_policy: str = DEFAULT_POLICY


def _where(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


def _cpu_bytes(extra: Mapping[str, Any]) -> int:
    value = extra.get("cpu_bytes_to_use")
    if value is None:
        raise ConfigError(
            f"{_where('cpu_bytes_to_use')} is missing; TieringSpec needs the host bytes of "
            "its CPU tier, e.g. 8000000000 for 8 GB"
        )
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = value
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ConfigError(
            f"{_where('cpu_bytes_to_use')} must be a positive number of bytes, got {value!r}"
        )
    return number


def _choice(extra: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(key, default)
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    close = difflib.get_close_matches(str(value).lower(), choices, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"{_where(key)} is {value!r}; {hint}choose one of {', '.join(choices)}")


class TieringSpec(OffloadingSpec):
    """vLLM's ``OffloadingSpec`` of tiering's CPU tier."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        definitions = {
            name: metadata
            for name, metadata in CPUOffloadingSpec.build_metric_definitions({}).items()
            if name != CPUOffloadingMetrics.STORES_SKIPPED  # no store threshold here
        }
        definitions[TieringMetrics.EVICTIONS] = OffloadingCounterMetadata(
            documentation="Chunks the CPU tier's policy evicted to make room for stores."
        )
        definitions[TieringMetrics.ALLOCATION_FAILURES] = OffloadingCounterMetadata(
            documentation=(
                "Stores the CPU tier refused for lack of room: every evictable chunk was "
                "pinned by a load or being written."
            )
        )
        definitions[TieringMetrics.STORE_FAILURES] = OffloadingCounterMetadata(
            documentation="Chunks whose store failed on a worker (their slots were freed)."
        )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        keys: tuple[str, ...] = TieringOffloadingInfo.config_info_keys()
        return keys

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra = self.extra_config
        if bool(extra.get("canonical_layout", False)) or config.canonical_layout:
            raise ConfigError(
                f"{_where('canonical_layout')} is set, but TieringSpec stores each worker's "
                "pages as they are, not vLLM's canonical (parallelism-free) layout; remove "
                "canonical_layout, or use vLLM's CPUOffloadingSpec"
            )
        if extra.get("secondary_tiers"):
            raise ConfigError(
                f"{_where('secondary_tiers')} is set, but TieringSpec has no secondary tiers "
                "inside vLLM yet; for Redis below the CPU tier use vLLM's own "
                "spec_name 'TieringOffloadingSpec' with a secondary_tiers entry of type "
                "'RedisSecondaryTier' and module_path 'tiering.integrations.vllm'"
            )
        threshold = extra.get("store_threshold")
        if threshold not in (None, 0, 1, "0", "1"):
            raise ConfigError(
                f"{_where('store_threshold')}={threshold!r}: TieringSpec stores every chunk "
                "it is offered (its policies decide what stays); remove store_threshold, or "
                "use vLLM's CPUOffloadingSpec for admission by reuse count"
            )
        # A replicated layout (every TP rank holds the same bytes) is served by keeping
        # each rank's copy: correct, as vLLM's own spec does without a shared region.
        self.replicated_layout = False
        cpu_bytes = _cpu_bytes(extra)
        self.policy = _choice(extra, "eviction_policy", DEFAULT_POLICY, POLICY_NAMES)
        self.transfer_backend = _choice(extra, "transfer_backend", "auto", _BACKENDS)
        # vLLM's sizing rule (its CPUOffloadingSpec): a chunk is every worker's pages of
        # blocks_per_chunk blocks, rounded up to the host page size.
        world_size = config.parallel.world_size
        per_chunk = config.worker_kv_bytes_per_block * world_size * self.blocks_per_chunk
        alignment = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        self.kv_bytes_per_chunk = -(-per_chunk // alignment) * alignment if per_chunk else 0
        self.num_chunks = cpu_bytes // self.kv_bytes_per_chunk if per_chunk else 0
        if per_chunk and self.num_chunks < 1:
            raise ConfigError(
                f"{_where('cpu_bytes_to_use')}={cpu_bytes} holds no chunk: one chunk is "
                f"{self.kv_bytes_per_chunk} bytes ({self.blocks_per_chunk} blocks of "
                f"{config.worker_kv_bytes_per_block} bytes on each of {world_size} workers); "
                f"give at least {self.kv_bytes_per_chunk}"
            )
        base = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self.info = TieringOffloadingInfo(
            cpu_num_chunks=base.cpu_num_chunks,
            cpu_blocks_per_chunk=base.cpu_blocks_per_chunk,
            cpu_kv_cache_size_bytes=base.cpu_kv_cache_size_bytes,
            cpu_kv_cache_size_tokens=base.cpu_kv_cache_size_tokens,
            cpu_eviction_policy=self.policy,
        )
        self._manager: TieringOffloadingManager | None = None
        self._worker: TieringOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.num_chunks < 1:
                raise ConfigError(
                    "vLLM gave TieringSpec no KV bytes per block "
                    "(OffloadingConfig.worker_kv_bytes_per_block is 0), so the CPU tier "
                    "cannot be sized"
                )
            self._manager = TieringOffloadingManager(
                self.num_chunks,
                self.policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                self_describing_events=self.kv_events_config.self_describing_kv_events,
                config_info=self.info.as_config_info(),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # Each worker holds its own pages of every chunk: its share of the tier.
            self._worker = TieringOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                backend=self.transfer_backend,
            )
        return self._worker

    def __repr__(self) -> str:
        return (
            f"<TieringSpec {self.num_chunks} chunks of {self.kv_bytes_per_chunk} bytes, "
            f"policy {self.policy}>"
        )
