"""What `TieringEngine` builds and reports, apart from the facade (layer 6).

Each function here takes what the engine was given and returns one piece,
checked, or raises `ConfigError` naming what was wrong: the KV layout and the
CPU tier's size, the transfer backend's name, the scheduler's limits, the KV
event emitter, and the chain of tiers below the CPU tier (built from their
`TierSource`s, wired to the emitter). `HostSide` holds the host memory pool and
the backend over it, and gives the chain a chunk's row. Nothing here opens
anything: the engine opens and closes what they return, in the order its module
docstring gives. The records the engine returns (`PrefixLookup`,
`EngineStatistics`) are here too; `tiering.engine` re-exports them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import torch

from tiering._checks import check_int
from tiering._types import OffloadKey
from tiering.config import OffloadingConfig
from tiering.cpu.common import CPUOffloadingInfo
from tiering.cpu.manager import CPUOffloadingManager, LookupResult, ManagerStatistics
from tiering.errors import CapacityError, ConfigError, ResourceClosedError
from tiering.events import KVEventsConfig
from tiering.events.bus import EventStatistics
from tiering.events.emitter import KVEventEmitter
from tiering.scheduler import SchedulerLimits, SchedulerStatistics
from tiering.secondary import RemoteNamespace, SecondaryTier, writable_row
from tiering.secondary.cascade import CascadeLimits, SecondaryTierStatistics
from tiering.secondary.chain import TierChain
from tiering.transfer import (
    BACKEND_NAMES,
    BackendStatistics,
    CompletionCallback,
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    PoolStatistics,
    TransferBackend,
    create_backend,
    default_backend_name,
)

__all__ = [
    "EngineStatistics",
    "HostSide",
    "PrefixLookup",
    "TierSource",
    "backend_name",
    "build_chain",
    "cpu_tier",
    "engine_name",
    "event_emitter",
    "kv_cache_tensors",
    "namespace_of",
    "prefix_lookup",
    "scheduler_limits",
    "tier_sources",
]

#: A tier below the CPU tier, or a function that builds one from the engine's namespace.
TierSource = SecondaryTier | Callable[[RemoteNamespace], SecondaryTier]

#: Keys of ``OffloadingConfig.extra_config`` read as scheduler limits.
_LIMIT_KEYS = frozenset(SchedulerLimits.__struct_fields__)


class PrefixLookup(msgspec.Struct, frozen=True):
    """A request's chunks from the head: ``ready`` to load, then ``pending`` (being
    written), then ``missing``: all the chunks after those."""

    ready: int
    pending: int
    missing: int


class EngineStatistics(msgspec.Struct, frozen=True, kw_only=True):
    state: str
    manager: ManagerStatistics
    scheduler: SchedulerStatistics
    backend: BackendStatistics | None
    pool: PoolStatistics | None
    events: EventStatistics | None = None  # None unless enable_kv_cache_events
    #: The first of ``tiers`` (None without), the field's name from before chains;
    #: read ``tiers[0]`` in new code.
    secondary: SecondaryTierStatistics | None = None
    #: Every tier below the CPU tier, in chain order.
    tiers: tuple[SecondaryTierStatistics, ...] = ()


def prefix_lookup(manager: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> PrefixLookup:
    """How many of ``keys``, from the head, ``manager`` has ready, then pending."""
    lookup = manager.lookup
    ready = pending = 0
    for key in keys:
        found = lookup(key)
        if found is LookupResult.HIT and not pending:
            ready += 1
        elif found is LookupResult.HIT_PENDING:
            pending += 1
        else:
            break
    return PrefixLookup(ready, pending, len(keys) - ready - pending)


def kv_cache_tensors(
    config: OffloadingConfig, kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor]
) -> list[KVCacheTensor]:
    """Deprecated (``tiering.engine.kv_cache_tensors``): the tensors
    ``KVLayout.from_kv_caches(config, kv_caches)`` registers."""
    return list(KVLayout.from_kv_caches(config, kv_caches).tensors)


def engine_name(engine_id: str) -> str:
    """``engine_id``, checked: a non-empty string."""
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError(f"engine_id must be a non-empty string, got {engine_id!r}")
    return engine_id


def cpu_tier(
    config: OffloadingConfig,
    kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor],
    cpu_bytes: int,
) -> tuple[KVLayout, CPUOffloadingInfo]:
    """The layout of ``kv_caches`` and the CPU tier that ``cpu_bytes`` of rows hold."""
    check_int("cpu_bytes", cpu_bytes, minimum=1)
    layout = KVLayout.from_kv_caches(config, kv_caches)
    num_chunks = layout.num_chunks(cpu_bytes)
    if num_chunks < 1:
        raise CapacityError(
            f"cpu_bytes={cpu_bytes} holds no chunk: one chunk row takes "
            f"{layout.row_bytes} bytes; give at least that"
        )
    return layout, CPUOffloadingInfo.from_config(config, num_chunks, layout.row_bytes)


def backend_name(backend: str, layout: KVLayout) -> str:
    """The transfer backend ``backend`` names (``"auto"``: the one ``layout``'s tensors need)."""
    if backend == "auto":
        return default_backend_name(layout)
    if backend not in BACKEND_NAMES:
        raise ConfigError(
            f"unknown transfer backend {backend!r}; choose auto or {', '.join(BACKEND_NAMES)}"
        )
    return backend


def scheduler_limits(config: OffloadingConfig, limits: SchedulerLimits | None) -> SchedulerLimits:
    """``limits``, or the ones ``config.extra_config`` sets (the rest at their defaults)."""
    if limits is not None:
        return limits
    given = {k: v for k, v in config.extra_config.items() if k in _LIMIT_KEYS}
    try:
        return msgspec.convert(given, SchedulerLimits)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"extra_config: {exc}") from None


def namespace_of(config: OffloadingConfig, layout: KVLayout, name: str) -> RemoteNamespace:
    """What makes the bytes of ``layout``'s chunks interchangeable with another engine's."""
    page_bytes = tuple(t.page_bytes for t in layout.tensors)
    return RemoteNamespace.from_config(
        config, row_bytes=layout.row_bytes, page_bytes=page_bytes, namespace=name
    )


def event_emitter(
    config: OffloadingConfig, events: KVEventsConfig | None, *, keep_landed: bool
) -> KVEventEmitter | None:
    """The emitter of the tier's KV events, if ``config`` turns them on (``events``
    may be given only then)."""
    if not config.enable_kv_cache_events:
        if events is not None:
            raise ConfigError(
                "events settings were given but the config has enable_kv_cache_events=False; "
                "set it to publish KV cache events"
            )
        return None
    return KVEventEmitter(config, events, keep_landed=keep_landed)


def tier_sources(secondary: TierSource | Sequence[TierSource] | None) -> list[TierSource]:
    """The engine's ``secondary=`` argument as a list of sources, in chain order."""
    if secondary is None:
        return []
    return list(secondary) if isinstance(secondary, Sequence) else [secondary]


def build_chain(
    sources: Sequence[TierSource],
    namespace: RemoteNamespace,
    manager: CPUOffloadingManager,
    row: Callable[[int], memoryview],
    *,
    row_bytes: int,
    cascade_queue: int,
    cascade_chunks: int | None,
    events: KVEventEmitter | None,
) -> TierChain | None:
    """The tiers built from ``sources`` in order, chained below the CPU tier (None
    without a source).

    ``cascade_queue`` and ``cascade_chunks`` bound its write-throughs
    (`CascadeLimits`). With ``events``, each tier announces what it wrote whole
    and what left it. If a tier or the chain cannot be built, the tiers built before are
    discarded (a disk tier's lock is freed) and the error raised.
    """
    if not sources:
        return None
    tiers: list[SecondaryTier] = []
    try:
        for source in sources:
            tiers.append(source if isinstance(source, SecondaryTier) else source(namespace))
        on_written = None
        if events is not None:
            emitter = events

            def on_written(tier: SecondaryTier) -> Callable[[Sequence[OffloadKey]], None]:
                return functools.partial(
                    emitter.publish_stored_below, medium=tier.medium, locality=str(tier.locality)
                )

            for tier in tiers:  # a tier that knows what leaves it says so
                tier.on_removed = functools.partial(
                    emitter.publish_removed_below, medium=tier.medium, locality=str(tier.locality)
                )
        limits = CascadeLimits(cascade_queue=cascade_queue, cascade_chunks=cascade_chunks)
        return TierChain(
            tiers, manager, row, row_bytes=row_bytes, limits=limits, on_written=on_written
        )
    except BaseException:
        for tier in tiers:  # built here, never to be used: free what they took
            tier.discard()
        raise


class HostSide:
    """The engine's host memory pool (mapped by `open`, ``prefault``: all at once) and
    the transfer backend over it (made by the scheduler through `make_backend`)."""

    def __init__(
        self,
        layout: KVLayout,
        num_chunks: int,
        backend: str,
        options: Mapping[str, Any] | None,
        *,
        prefault: bool,
    ) -> None:
        self.layout, self.num_chunks, self.backend_name = layout, num_chunks, backend
        self._options = dict(options or {})
        self._prefault = prefault
        self.pool: HostMemoryPool | None = None
        self.backend: TransferBackend | None = None

    def open(self) -> None:
        self.pool = HostMemoryPool(self.layout.pool_bytes(self.num_chunks), populate=self._prefault)

    def make_backend(self, on_complete: CompletionCallback) -> TransferBackend:
        self.backend = create_backend(
            self.backend_name,
            self.layout,
            self._host_pool(),
            on_complete=on_complete,
            **self._options,
        )
        return self.backend

    def row(self, chunk_id: int) -> memoryview:
        """The host memory of chunk slot ``chunk_id``: one row of the pool."""
        size = self.layout.row_bytes
        rows = self._host_pool().tensor[chunk_id * size : (chunk_id + 1) * size]
        return writable_row(rows.numpy(), size)

    def close(self) -> None:
        if self.pool is not None:  # unmapped once no view of it is left
            self.pool.close()

    def _host_pool(self) -> HostMemoryPool:
        if self.pool is None:
            raise ResourceClosedError("the host memory pool is not allocated")
        return self.pool
