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

Tiers below, at any world size on one node: every worker shares its host pool
(its pages of every chunk, ``/dev/shm``) with the scheduler, which maps all of
them; each tier below keeps a value per rank, and `ranks.RankedTier` makes the
N values one chunk (a hit only when every rank's value is there and loads, so
never a partial load; see its module).

``kv_connector_extra_config`` keys it takes (`EXTRA_KEYS`, decoded by
`TieringSpecKeys`): every bad value is one `ConfigError` naming the key, the
value and what would be right; an unknown key is refused with the key it may
misspell. vLLM's own keys are typed as vLLM reads them (an integer as an int
or a string of one, a flag as true or false); those only another of vLLM's
specs reads (``cache_policy_module_path``, ``max_tracker_size``,
``tier_poll_interval_s``, ``backpressure``) pass untouched, with one WARNING
in vLLM's log naming the spec that reads them (under this one they do nothing):

==============================  ==================================================
``cpu_bytes_to_use``            host bytes of the CPU tier, over all workers (required)
``eviction_policy``             ``dslru`` (default), ``aslru``, ``arc`` or ``lru``
``hint_share``                  the share of the CPU tier requests' retention hints
                                may protect (0 to 1; 0.2 by default)
``transfer_backend``            ``auto`` (default: ``cuda`` on a GPU, else ``cpu``),
                                ``cpu`` or ``cuda``
``block_size`` /
``blocks_per_chunk``            tokens / GPU blocks per chunk (vLLM reads these)
``self_describing_kv_events``   vLLM's own: BlockStored events carry token ids
``offload_prompt_only``         vLLM's own: store prompt blocks only (default true)
``sync_load_budget_bytes``      vLLM's own: KV bytes loaded within a step (0: off)
``canonical_layout``            vLLM's own: refused if true (pages are kept per worker)
``store_threshold``             vLLM's own: 0 or 1 only (every offered chunk is stored)
``spec_name`` /
``spec_module_path``            vLLM's own: ``TieringSpec`` / ``tiering.integrations.vllm``
``secondary_tiers``             tiering's tiers below the CPU tier, in order: a disk
                                (``DiskSecondaryTier``), a Redis (``RedisSecondaryTier``),
                                or a disk then a Redis; at any tensor-parallel size
``metrics_port``, ``metrics_host``  tiering's own CPU-tier metrics over HTTP (scheduler),
                                its URL in vLLM's log; ``metrics_host`` needs a port
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
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tiering._decode import decode
from tiering.config import DEFAULT_POLICY
from tiering.cpu.common import CPUOffloadingInfo as TieringCPUInfo
from tiering.cpu.manager import ManagerStatistics
from tiering.errors import ConfigError
from tiering.integrations.vllm.extra import TieringSpecKeys, extra_key, spec_keys
from tiering.integrations.vllm.link import CascadeMetrics, tier_label
from tiering.integrations.vllm.logs import adopt_vllm_logging
from tiering.integrations.vllm.manager import TieringMetrics, TieringOffloadingManager
from tiering.integrations.vllm.ranks import RankedTier, building_rank
from tiering.integrations.vllm.worker import TieringOffloadingWorker
from tiering.transfer import HostMemoryPool
from tiering.transfer.memory import SHM_DIR, SHM_NAME_PATTERN, sweep_stale_pools

if TYPE_CHECKING:
    from tiering.metrics import MetricsServer

__all__ = ["EXTRA_KEYS", "TieringOffloadingInfo", "TieringSpec"]

logger = logging.getLogger(__name__)

#: The ``kv_connector_extra_config`` keys `TieringSpec` takes (`TieringSpecKeys`): its
#: own and vLLM's; any other is refused.
EXTRA_KEYS: tuple[str, ...] = TieringSpecKeys.__struct_fields__


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


def _hint_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics of the requests' retention hints (`TieringMetrics`' ``HINT*``)."""
    return {
        TieringMetrics.HINTS: OffloadingCounterMetadata(
            documentation=(
                "Requests' retention hints (kv_transfer_params or kv_hints), by outcome: "
                "taken, unknown_version and other_actions (ignored), malformed (refused)."
            ),
            labelnames=(TieringMetrics.HINT_OUTCOME_LABEL,),
        ),
        TieringMetrics.HINT_RELEASED_EVICTED: OffloadingCounterMetadata(
            documentation="Chunks evicted first: their request's hint released them."
        ),
        TieringMetrics.HINT_RETENTION_OVERRIDDEN: OffloadingCounterMetadata(
            documentation=(
                "Retained chunks evicted before their hint's deadline: a store needed room "
                "only they could give."
            )
        ),
        TieringMetrics.HINT_RETAINED: OffloadingGaugeMetadata(
            documentation="Chunks of the CPU tier a retention hint protects now."
        ),
        TieringMetrics.HINT_FOLLOWING: OffloadingGaugeMetadata(
            documentation=(
                "1 while the CPU tier follows the hints (of a kind that proved right), 0 "
                "while its policy decides alone."
            )
        ),
    }


#: tiering's tiers `TieringSpec` takes below its CPU tier (``type`` of an entry).
_TIER_TYPES = ("DiskSecondaryTier", "RedisSecondaryTier")
_MODULE = "tiering.integrations.vllm"


def _secondary_entries(extra: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``secondary_tiers`` entries (tiering's tiers, in order), each checked."""
    tiers = extra.get("secondary_tiers")
    if not tiers:
        return []
    where = extra_key("secondary_tiers")
    tiers = decode(list[dict[str, Any]], tiers, where=where)
    entries: list[dict[str, Any]] = []
    for index, given in enumerate(tiers):
        entry = dict(given)
        kind, module = entry.get("type"), entry.get("module_path")
        if kind not in _TIER_TYPES or module != _MODULE:
            raise ConfigError(
                f"{where}[{index}] is type {kind!r} from {module!r}; TieringSpec takes "
                f"tiering's own tiers: type {' or '.join(map(repr, _TIER_TYPES))}, "
                f"module_path {_MODULE!r} (for vLLM's tiers, use spec_name "
                "'TieringOffloadingSpec')"
            )
        # Its rows are laid out as tiering's pools lay them (not as vLLM's CPU tier
        # does): their values live apart from TieringOffloadingSpec's in one store.
        entry["namespace"] = f"TieringSpec/{entry.get('namespace', '')}"
        tier_class = SecondaryTierFactory.get_tier_class(entry)
        tier_class.check_entry(kind, entry)  # fail at start, not later
        if kind == "DiskSecondaryTier":
            path = os.path.realpath(str(entry.get("path")))
            for before, other in enumerate(entries):
                if other["type"] == kind and os.path.realpath(str(other["path"])) == path:
                    raise ConfigError(
                        f"{where}[{index}] and [{before}] are disk tiers of one folder "
                        f"({entry['path']!r}): a folder is one tier's alone; give each its own"
                    )
        entries.append(entry)
    return entries


def _rank_entry(entry: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``entry`` for rank ``rank``'s values (its pages of each chunk), kept apart from the
    other ranks': the Redis tier's namespace and the disk tier's folder name the rank,
    and the disk's capacity is shared evenly. At world size 1, ``entry`` itself."""
    out = dict(entry)
    if world_size == 1:
        return out
    out["namespace"] = f"{out['namespace']}/rank{rank}"
    if out["type"] == "DiskSecondaryTier":  # a folder is one tier's alone (locked)
        out["path"] = os.path.join(str(out["path"]), f"rank{rank}")
        out["capacity_bytes"] = max(1, int(out["capacity_bytes"]) // world_size)
    return out


def _shm_name(config: OffloadingConfig, rank: int | None = None) -> str:
    """The tag of the shared rows of worker ``rank`` (this process's if None): its file
    is ``tiering-<pid>-<tag>-row<row bytes>`` (`shm_file_name`)."""
    engine = "".join(c if c.isalnum() or c in "-_" else "_" for c in config.engine_id)
    return f"{engine}-rank{config.parallel.rank if rank is None else rank}"


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
        definitions.update(_hint_metric_definitions())
        tiers = extra_config.get("secondary_tiers")
        if tiers and isinstance(tiers, list):
            for name, text in CascadeMetrics.DOCS.items():
                definitions[name] = OffloadingCounterMetadata(
                    documentation=text, labelnames=(TIER_LABEL,)
                )
            for entry in tiers:
                if isinstance(entry, dict) and entry.get("type") in _TIER_TYPES:
                    tier_class = SecondaryTierFactory.get_tier_class(entry)
                    definitions.update(tier_class.build_metric_definitions(entry))
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        keys: tuple[str, ...] = TieringOffloadingInfo.config_info_keys()
        return keys

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        adopt_vllm_logging()
        extra = self.extra_config
        #: The extra config's keys, checked (one `ConfigError` naming a bad one).
        self.keys = spec_keys(extra)
        if self.keys.canonical_layout or config.canonical_layout:
            raise ConfigError(
                f"{extra_key('canonical_layout')} is set, but TieringSpec stores each worker's "
                "pages as they are, not vLLM's canonical (parallelism-free) layout; remove "
                "canonical_layout, or use vLLM's CPUOffloadingSpec"
            )
        #: The tiers below the CPU tier (their entries, checked), in order.
        self.secondary_tiers = _secondary_entries(extra)
        # A replicated layout (every TP rank holds the same bytes) is served by keeping
        # each rank's copy: correct, as vLLM's own spec does without a shared region.
        self.replicated_layout = False
        cpu_bytes = self.keys.cpu_bytes
        self.policy = self.keys.policy
        self.transfer_backend = self.keys.backend
        # vLLM's sizing rule (its CPUOffloadingSpec): a chunk is every worker's pages of
        # blocks_per_chunk blocks, rounded up to the host page size.
        world_size = config.parallel.world_size
        per_chunk = config.worker_kv_bytes_per_block * world_size * self.blocks_per_chunk
        alignment = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
        self.kv_bytes_per_chunk = -(-per_chunk // alignment) * alignment if per_chunk else 0
        self.num_chunks = cpu_bytes // self.kv_bytes_per_chunk if per_chunk else 0
        if per_chunk and self.num_chunks < 1:
            raise ConfigError(
                f"{extra_key('cpu_bytes_to_use')}={cpu_bytes} holds no chunk: one chunk is "
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
        #: The CPU tier's rows in /dev/shm, shared by each worker with the scheduler's
        #: tiers below (None: no tier below).
        self.shm_name = _shm_name(config) if self.secondary_tiers else None
        self._shared_rows: list[HostMemoryPool] = []  # every rank's, mapped by the scheduler
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
            for line in self.keys.unread:  # once, from the scheduler (not once per worker)
                logger.warning("%s", line)
            self._manager = TieringOffloadingManager(
                self.num_chunks,
                self.policy,
                hint_share=self.keys.hint_share,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                self_describing_events=self.kv_events_config.self_describing_kv_events,
                config_info=self.info.as_config_info(),
                secondary=self._secondary_tiers if self.secondary_tiers else None,
                secondary_labels=[
                    tier_label(index, entry["type"])
                    for index, entry in enumerate(self.secondary_tiers)
                ],
                on_shutdown=self._close_scheduler_side,
            )
            if self.keys.metrics_address is not None:
                self._serve_metrics(self._manager, *self.keys.metrics_address)
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

    def _secondary_tiers(self) -> list[SecondaryTierManager] | None:
        """The tiers below over every worker's rows, once all the workers have shared them
        (None until then)."""
        world_size = self.config.parallel.world_size
        # The workers name their files after their pid and row size (the scheduler has no
        # layout); files of processes gone are swept first, so what is left is alive.
        sweep_stale_pools()
        names = sorted(os.listdir(SHM_DIR))
        found = [self._shared_file(names, rank) for rank in range(world_size)]
        missing = [rank for rank, pool in enumerate(found) if pool is None]
        if len(missing) == world_size:
            return None  # the workers have not registered their KV caches yet
        if missing:  # vLLM registers every worker's caches before its first step
            raise ConfigError(
                f"the host pools of rank(s) {missing} of {world_size} workers are not in "
                f"{SHM_DIR} on this host: TieringSpec's tiers below read every worker's "
                "pool, so every worker must run on the scheduler's node (tensor parallel "
                "within one node); for more nodes, use spec_name 'TieringOffloadingSpec'"
            )
        rows: list[HostMemoryPool] = []
        views: list[memoryview] = []
        tiers: list[SecondaryTierManager] = []
        try:
            for name, row_bytes in (pool for pool in found if pool is not None):
                pool = HostMemoryPool(self.num_chunks * row_bytes, shm_name=name, create=False)
                rows.append(pool)
                # Both sides keep their mappings; the name goes now, so no crash can leave
                # it behind.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
                table = pool.tensor.view(self.num_chunks, row_bytes).numpy()
                views.append(memoryview(table))  # type: ignore[arg-type]  # arrays are buffers
            for entry in self.secondary_tiers:
                tiers.append(self._tier_over(entry, views))
        except BaseException:
            for tier in tiers:
                tier.shutdown()
            for view in views:
                view.release()
            for pool in rows:
                pool.close()
            raise
        self._shared_rows = rows
        return tiers

    def _shared_file(self, names: list[str], rank: int) -> tuple[str, int] | None:
        """Worker ``rank``'s file in ``names`` (of /dev/shm) and its row bytes, if shared."""
        prefix = f"{_shm_name(self.config, rank)}-row"
        found: list[tuple[str, int]] = []
        for name in names:
            match = SHM_NAME_PATTERN.fullmatch(name)
            tag = match["tag"] if match is not None else ""
            row = tag[len(prefix) :]
            if tag.startswith(prefix) and row.isascii() and row.isdigit():
                found.append((name, int(row)))
        if len(found) > 1:
            raise ConfigError(
                f"{SHM_DIR} holds {len(found)} CPU tiers of this engine's rank {rank} "
                f"({', '.join(name for name, _ in found)}), of processes still alive: two "
                "engines run with the same engine_id (kv_transfer_config.engine_id); give "
                "each its own"
            )
        return found[0] if found else None

    def _tier_over(self, entry: dict[str, Any], views: list[memoryview]) -> SecondaryTierManager:
        """The tier of ``entry`` over the ranks' rows ``views``: one adapter per rank, made
        one tier (`RankedTier`) when there are several."""
        world_size = len(views)
        ranks: list[SecondaryTierManager] = []
        try:
            for rank, view in enumerate(views):
                with building_rank(rank):  # one line per change of state: rank 0's
                    ranks.append(
                        SecondaryTierFactory.create_secondary_tier(
                            _rank_entry(entry, rank, world_size), view, self
                        )
                    )
            if world_size == 1:
                return ranks[0]
            events = bool(entry.get("enable_kv_events")) and bool(
                self.kv_events_config.enable_kv_cache_events
            )
            return RankedTier(self, views[0], entry["type"], ranks, events=events)
        except BaseException:
            for tier in ranks:
                tier.shutdown()
            raise

    def _serve_metrics(self, manager: TieringOffloadingManager, host: str, port: int) -> None:
        """tiering's own occupancy gauges (its dashboards' names) on ``host:port``."""
        from tiering.metrics import serve_metrics

        self._metrics_view = _MetricsView(self, manager)
        self.metrics_server = serve_metrics(self._metrics_view, host, port=port)
        manager.metrics_url = self.metrics_server.url  # it ends in /metrics
        logger.info(
            "tiering's CPU-tier metrics (engine %s) are served at %s",
            self.config.engine_id,
            manager.metrics_url,
        )
        if host in ("0.0.0.0", "::", ""):
            logger.warning(
                "tiering's metrics are served on every interface (metrics_host %r): anyone "
                "who reaches port %d reads them; give metrics_host 127.0.0.1 unless a "
                "scraper on another host needs them",
                host,
                self.metrics_server.port,
            )

    def _close_scheduler_side(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        for rows in self._shared_rows:
            rows.close()  # unmapped once the tiers' views of it are gone
        self._shared_rows = []

    def __repr__(self) -> str:
        return (
            f"<TieringSpec {self.num_chunks} chunks of {self.kv_bytes_per_chunk} bytes, "
            f"policy {self.policy}>"
        )
