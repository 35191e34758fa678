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
``eviction_policy``             ``dslru`` (default), ``aslru``, ``arc`` or ``lru``
``transfer_backend``            ``auto`` (default: ``cuda`` on a GPU, else ``cpu``),
                                ``cpu`` or ``cuda``
``block_size`` /
``blocks_per_chunk``            tokens / GPU blocks per chunk (vLLM reads these)
``self_describing_kv_events``   vLLM's own: BlockStored events carry token ids
``offload_prompt_only``         vLLM's own: store prompt blocks only (default true)
``secondary_tiers``             one entry: tiering's Redis tier below the CPU tier
``metrics_port``, ``metrics_host``  tiering's own CPU-tier metrics over HTTP (scheduler)
==============================  ==================================================
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

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
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tiering._checks import is_int
from tiering._decode import closest_key, decode
from tiering.config import DEFAULT_POLICY
from tiering.cpu.common import CPUOffloadingInfo as TieringCPUInfo
from tiering.cpu.manager import ManagerStatistics
from tiering.errors import ConfigError
from tiering.integrations.vllm.extra import metrics_extra
from tiering.integrations.vllm.link import CascadeMetrics
from tiering.integrations.vllm.manager import TieringMetrics, TieringOffloadingManager
from tiering.integrations.vllm.redis_tier import RedisSecondaryTier
from tiering.integrations.vllm.worker import TieringOffloadingWorker
from tiering.policies import POLICY_NAMES
from tiering.transfer import HostMemoryPool
from tiering.transfer.memory import SHM_DIR, SHM_NAME_PATTERN, sweep_stale_pools

if TYPE_CHECKING:
    from tiering.metrics import MetricsServer

__all__ = ["EXTRA_KEYS", "TieringOffloadingInfo", "TieringSpec"]

logger = logging.getLogger(__name__)

#: Backends a vLLM worker may use (the mock backend moves no bytes: tests only).
_BACKENDS = ("auto", "cpu", "cuda")

#: The ``kv_connector_extra_config`` keys `TieringSpec` reads itself.
EXTRA_KEYS: tuple[str, ...] = ("cpu_bytes_to_use", "eviction_policy", "transfer_backend")


@dataclass(frozen=True)
class TieringOffloadingInfo(CPUOffloadingInfo):
    """vLLM's CPU-tier facts (``vllm:kv_offload_config_info``), plus the policy's name."""

    cpu_eviction_policy: str = DEFAULT_POLICY


class _ManagerView(NamedTuple):
    manager: ManagerStatistics
    scheduler: None = None  # vLLM's workers move the bytes, in other processes


class _MetricsView:
    """What `tiering.metrics` reads of an engine, for the spec's CPU tier: its manager's
    statistics (no transfer figures: vLLM's workers move the bytes, in other processes)."""

    def __init__(self, spec: TieringSpec, manager: TieringOffloadingManager) -> None:
        self.engine_id = spec.config.engine_id
        self.info = TieringCPUInfo(
            cpu_num_chunks=spec.info.cpu_num_chunks,
            cpu_blocks_per_chunk=spec.info.cpu_blocks_per_chunk,
            cpu_kv_cache_size_bytes=spec.info.cpu_kv_cache_size_bytes,
            cpu_kv_cache_size_tokens=spec.info.cpu_kv_cache_size_tokens,
        )
        self.backend_name = spec.transfer_backend
        self.manager = manager.tier

    def statistics(self) -> _ManagerView:
        return _ManagerView(manager=self.manager.statistics())


def _secondary_entry(extra: Mapping[str, Any], world_size: int) -> dict[str, Any] | None:
    """The one ``secondary_tiers`` entry (tiering's Redis tier), checked; None without one."""
    tiers = extra.get("secondary_tiers")
    if not tiers:
        return None
    where = _where("secondary_tiers")
    tiers = decode(list[dict[str, Any]], tiers, where=where)
    if len(tiers) != 1:
        raise ConfigError(
            f"{where} lists {len(tiers)} tiers; TieringSpec takes one below its CPU tier"
        )
    entry = dict(tiers[0])
    kind, module = entry.get("type"), entry.get("module_path")
    if (kind, module) != ("RedisSecondaryTier", "tiering.integrations.vllm"):
        raise ConfigError(
            f"{where}[0] is type {kind!r} from {module!r}; TieringSpec takes tiering's own "
            "tier: type 'RedisSecondaryTier', module_path 'tiering.integrations.vllm' (for "
            "vLLM's tiers, use spec_name 'TieringOffloadingSpec')"
        )
    if world_size != 1:
        raise ConfigError(
            f"{where} is set with {world_size} workers; TieringSpec's secondary tier reads "
            "the rows of one worker (world size 1); for more, use spec_name "
            "'TieringOffloadingSpec' with this entry"
        )
    # Its rows are laid out as tiering's pool lays them (not as vLLM's CPU tier does):
    # their values live apart from TieringOffloadingSpec's in the same store.
    entry["namespace"] = f"TieringSpec/{entry.get('namespace', '')}"
    RedisSecondaryTier.check_entry("RedisSecondaryTier", entry)  # fail at start, not later
    return entry


def _shm_name(config: OffloadingConfig) -> str:
    """The tag of this engine's shared rows: the worker's file is
    ``tiering-<pid>-<tag>-row<row bytes>`` (`shm_file_name`)."""
    engine = "".join(c if c.isalnum() or c in "-_" else "_" for c in config.engine_id)
    return f"{engine}-rank{config.parallel.rank}"


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
    if not is_int(number) or number < 1:
        raise ConfigError(
            f"{_where('cpu_bytes_to_use')} must be a positive number of bytes, got {value!r}"
        )
    return int(number)


def _choice(extra: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(key, default)
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    close = closest_key(str(value), choices, cutoff=0.6)
    hint = f"did you mean {close!r}? " if close else ""
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
            documentation=(
                "Chunks whose store failed: a worker's copy, or a promotion's read from the "
                "secondary tier (their slots were freed)."
            )
        )
        if extra_config.get("secondary_tiers"):
            for name, text in CascadeMetrics.DOCS.items():
                definitions[name] = OffloadingCounterMetadata(documentation=text)
            definitions.update(RedisSecondaryTier.build_metric_definitions(extra_config))
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
        self.secondary_tier = _secondary_entry(extra, config.parallel.world_size)
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
        #: The CPU tier's rows in /dev/shm, shared by the worker with the scheduler's
        #: secondary tier (None: no secondary tier).
        self.shm_name = _shm_name(config) if self.secondary_tier is not None else None
        self._shared_rows: HostMemoryPool | None = None
        #: tiering's metrics of the CPU tier, where ``metrics_port`` asks for them.
        self.metrics_server: MetricsServer | None = None
        self._metrics_view: _MetricsView | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.num_chunks < 1:
                raise ConfigError(
                    "vLLM gave TieringSpec no KV bytes per block "
                    "(OffloadingConfig.worker_kv_bytes_per_block is 0), so the CPU tier "
                    "cannot be sized"
                )
            metrics = self._metrics_port()  # refused before anything is built
            self._manager = TieringOffloadingManager(
                self.num_chunks,
                self.policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                self_describing_events=self.kv_events_config.self_describing_kv_events,
                config_info=self.info.as_config_info(),
                secondary=self._secondary_tier if self.secondary_tier is not None else None,
                on_shutdown=self._close_scheduler_side,
            )
            if metrics is not None:
                self._serve_metrics(self._manager, *metrics)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # Each worker holds its own pages of every chunk: its share of the tier.
            self._worker = TieringOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                backend=self.transfer_backend,
                shm_name=self.shm_name,
            )
        return self._worker

    def _secondary_tier(self) -> SecondaryTierManager | None:
        """The secondary tier over the worker's rows, once the worker has shared them."""
        if self.secondary_tier is None or self.shm_name is None:
            return None
        # The worker names the file after its pid and its row size (the scheduler has no
        # layout); files of processes gone are swept first, so what is left is alive.
        sweep_stale_pools()
        prefix = f"{self.shm_name}-row"
        found: list[tuple[str, int]] = []
        for name in sorted(os.listdir(SHM_DIR)):
            match = SHM_NAME_PATTERN.fullmatch(name)
            tag = match["tag"] if match is not None else ""
            row = tag[len(prefix) :]
            if tag.startswith(prefix) and row.isascii() and row.isdigit():
                found.append((name, int(row)))
        if not found:
            return None  # the worker has not registered its KV caches yet
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ConfigError(
                f"{SHM_DIR} holds {len(found)} CPU tiers of this engine ({names}), of "
                "processes still alive: two engines run with the same engine_id "
                "(kv_transfer_config.engine_id); give each its own"
            )
        name, row_bytes = found[0]
        size = self.num_chunks * row_bytes
        rows = HostMemoryPool(size, shm_name=name, create=False)
        # Both sides keep their mappings; the name goes now, so no crash can leave it behind.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
        table = rows.tensor.view(self.num_chunks, row_bytes).numpy()
        view = memoryview(table)  # type: ignore[arg-type]  # numpy arrays are buffers
        try:
            tier: SecondaryTierManager = SecondaryTierFactory.create_secondary_tier(
                dict(self.secondary_tier), view, self
            )
        except BaseException:
            view.release()
            rows.close()
            raise
        self._shared_rows = rows
        return tier

    def _metrics_port(self) -> tuple[str, int] | None:
        """``metrics_port`` (and ``metrics_host``, loopback by default), checked."""
        keys = metrics_extra(self.extra_config)
        return None if keys.metrics_port is None else (keys.metrics_host, keys.metrics_port)

    def _serve_metrics(self, manager: TieringOffloadingManager, host: str, port: int) -> None:
        """tiering's own occupancy gauges (its dashboards' names) on ``host:port``."""
        from tiering.metrics import serve_metrics

        self._metrics_view = _MetricsView(self, manager)
        self.metrics_server = serve_metrics(self._metrics_view, host, port=port)
        manager.metrics_url = f"{self.metrics_server.url}/metrics"
        logger.info("tiering's CPU-tier metrics at %s", manager.metrics_url)

    def _close_scheduler_side(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self._shared_rows is not None:
            self._shared_rows.close()  # unmapped once the tier's view of it is gone
            self._shared_rows = None

    def __repr__(self) -> str:
        return (
            f"<TieringSpec {self.num_chunks} chunks of {self.kv_bytes_per_chunk} bytes, "
            f"policy {self.policy}>"
        )
