"""`TieringEngine`: the CPU tier of one engine rank, built and owned in one object.

An async server embeds one engine per rank::

    async with TieringEngine(config, kv_caches, cpu_bytes=8 << 30) as engine:
        found = engine.lookup(keys)                  # sync, cheap
        job = await engine.submit_load(keys[:found.ready], gpu_spec)
        result = await job                           # a JobResult, never an exception
        ...
        await engine.flush(block_ids)                # before reusing GPU blocks

The engine builds the pieces and owns their life; each piece does its own work:
the KV layout (`KVLayout.from_kv_caches`), the chunk manager, the host memory
pool, the scheduler (which builds the transfer backend), the KV event emitter
(`KVEventEmitter`) and the chain of tiers below it (`TierChain`).

Design note: the close order. `aclose` ends the pieces in the reverse of the
order `__aenter__` registers them on an exit stack: the cascade first stops
taking landed stores, then the scheduler lets running jobs finish (landing
their last stores), then the cascade writes what is queued and closes the tier
(write-throughs read pool rows, so the pool outlives them), then the pool is
unmapped, then the emitter publishes what the last completions changed and
closes the bus. An open that fails unwinds the same stack, each piece closed
only if it was opened.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import torch

from tiering._state import ResourceState
from tiering._types import OffloadKey
from tiering.config import DEFAULT_POLICY, OffloadingConfig
from tiering.cpu.common import CPUOffloadingInfo
from tiering.cpu.manager import CPUOffloadingManager, LookupResult, ManagerStatistics
from tiering.errors import (
    CapacityError,
    ChunkStateError,
    ConfigError,
    ResourceClosedError,
    SpecError,
)
from tiering.events import ChunkBlocks, KVEventsConfig
from tiering.events.bus import EventStatistics, EventSubscription
from tiering.events.emitter import KVEventEmitter
from tiering.policies import CachePolicy
from tiering.scheduler import (
    JobHandle,
    JobKind,
    Scheduler,
    SchedulerLimits,
    SchedulerStatistics,
    manager_job,
)
from tiering.secondary import RemoteNamespace, SecondaryTier, writable_row
from tiering.secondary.cascade import CascadeLimits, Promotion, SecondaryTierStatistics
from tiering.secondary.chain import TierChain
from tiering.specs import GPULoadStoreSpec, IntArray
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
    "PrefixLookup",
    "Promotion",
    "SecondaryTierStatistics",
    "TieringEngine",
    "kv_cache_tensors",
]

#: A tier below the CPU tier, or a function that builds one from the engine's namespace.
TierSource = SecondaryTier | Callable[[RemoteNamespace], SecondaryTier]

#: Keys of ``OffloadingConfig.extra_config`` read as scheduler limits.
_LIMIT_KEYS = frozenset(SchedulerLimits.__struct_fields__)

_ENGINE_IDS = itertools.count()


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
    secondary: SecondaryTierStatistics | None = None  # the first tier below; None without
    #: Every tier below the CPU tier, in chain order (``secondary`` is the first).
    tiers: tuple[SecondaryTierStatistics, ...] = ()


def kv_cache_tensors(
    config: OffloadingConfig, kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor]
) -> list[KVCacheTensor]:
    """The tensors `KVLayout.from_kv_caches` registers for ``kv_caches``, checked as it does."""
    return list(KVLayout.from_kv_caches(config, kv_caches).tensors)


def _limits(config: OffloadingConfig, limits: SchedulerLimits | None) -> SchedulerLimits:
    if limits is not None:
        return limits
    given = {k: v for k, v in config.extra_config.items() if k in _LIMIT_KEYS}
    try:
        return msgspec.convert(given, SchedulerLimits)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"extra_config: {exc}") from None


@contextlib.asynccontextmanager
async def _task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for the engine's own task, left without the caller's exception:
    the task has ended by then (`aclose` runs first), and anyio would wrap the
    exception in an `ExceptionGroup`."""
    task_group = anyio.create_task_group()
    await task_group.__aenter__()
    try:
        yield task_group
    finally:
        await task_group.__aexit__(None, None, None)


class TieringEngine:
    """The CPU tier of one engine rank: manager, host memory, backend and scheduler.

    ``kv_caches`` maps layer names (as in ``config.groups``) to block-major
    tensors, or lists `KVCacheTensor` directly. ``backend`` is ``"auto"``
    (``cuda`` when the KV tensors are on a CUDA device, else ``cpu``),
    ``"cpu"``, ``"cuda"`` or ``"mock"``; ``backend_options`` go to its
    constructor. Scheduler limits come from ``limits`` or from the config's
    ``extra_config`` (``max_queued_jobs``, ``max_inflight_bytes``, ``slice_chunks``,
    ``max_load_slices``). ``engine_id`` names the engine in metrics.
    ``prefault`` maps the whole CPU tier at open (the memory is committed
    then, and no store pays a page fault later); ``False`` maps it lazily.

    ``secondary`` adds a tier below this one, or a chain of them in order (each
    a `SecondaryTier`, or a function that builds one from the engine's
    `RemoteNamespace`; ``remote_namespace`` names the deployment in it): chunks
    whose stores land are written to each in the background (per tier, at most
    ``cascade_queue`` stores wait; the chain holds at most ``cascade_chunks``
    chunks pinned, by default half the CPU tier, split between its tiers; past
    that they are dropped and counted), and `promote` reads a request's chunks
    back from the first tier that has them (`TierChain`). The engine closes them.

    `aclose` may be called from any task. With a secondary tier, the
    write-through task runs in a task group of the task that enters the
    engine, which the end of its ``async with`` block leaves.

    With ``config.enable_kv_cache_events``, what the tier holds is published
    as KV cache events (vLLM's wire format): one batch per turn of the event
    loop that changed the tier, to `subscribe`rs and, when ``events`` is
    given, on its ZMQ endpoint (moved by ``config.parallel.data_parallel_index``,
    as vLLM moves each data-parallel rank's). Without it, no event is built.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor],
        *,
        cpu_bytes: int,
        policy: str | CachePolicy = DEFAULT_POLICY,
        backend: str = "auto",
        backend_options: Mapping[str, Any] | None = None,
        limits: SchedulerLimits | None = None,
        engine_id: str | None = None,
        prefault: bool = True,
        events: KVEventsConfig | None = None,
        secondary: TierSource | Sequence[TierSource] | None = None,
        remote_namespace: str = "",
        cascade_queue: int = 64,
        cascade_chunks: int | None = None,
    ) -> None:
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes < 1:
            raise ConfigError(f"cpu_bytes must be a positive integer, got {cpu_bytes!r}")
        self.config = config
        #: Names this engine in metrics and logs: ``engine_id``, or ``"0"``,
        #: ``"1"``, ... in the order engines are built in this process.
        self.engine_id = str(next(_ENGINE_IDS)) if engine_id is None else engine_id
        if not self.engine_id:
            raise ConfigError("engine_id must be a non-empty string, got ''")
        self.layout = KVLayout.from_kv_caches(config, kv_caches)
        num_chunks = self.layout.num_chunks(cpu_bytes)
        if num_chunks < 1:
            raise CapacityError(
                f"cpu_bytes={cpu_bytes} holds no chunk: one chunk row takes "
                f"{self.layout.row_bytes} bytes; give at least that"
            )
        self.info = CPUOffloadingInfo.from_config(config, num_chunks, self.layout.row_bytes)
        if backend == "auto":
            backend = default_backend_name(self.layout)
        if backend not in BACKEND_NAMES:
            raise ConfigError(
                f"unknown transfer backend {backend!r}; choose auto or {', '.join(BACKEND_NAMES)}"
            )
        self.backend_name = backend
        self._backend_options = dict(backend_options or {})
        if events is not None and not config.enable_kv_cache_events:
            raise ConfigError(
                "events settings were given but the config has enable_kv_cache_events=False; "
                "set it to publish KV cache events"
            )
        sources: list[TierSource] = []
        if secondary is not None:
            sources = list(secondary) if isinstance(secondary, Sequence) else [secondary]
        self._events: KVEventEmitter | None = None
        if config.enable_kv_cache_events:
            self._events = KVEventEmitter(config, events, keep_landed=bool(sources))
        self.manager = CPUOffloadingManager(
            num_chunks,
            policy,
            enable_events=self._events is not None,
            on_events=self._events.publish_soon if self._events is not None else None,
        )
        scheduler_limits = _limits(config, limits)
        #: What makes this engine's chunk bytes interchangeable with another's.
        self.namespace = RemoteNamespace.from_config(
            config,
            row_bytes=self.layout.row_bytes,
            page_bytes=tuple(t.page_bytes for t in self.layout.tensors),
            namespace=remote_namespace,
        )
        self._secondary: TierChain | None = None
        if sources:
            tiers = self._build_tiers(sources)
            on_written = None
            if self._events is not None:
                emitter = self._events

                def on_written(tier: SecondaryTier) -> Callable[[Sequence[OffloadKey]], None]:
                    return functools.partial(
                        emitter.publish_stored_below,
                        medium=tier.medium,
                        locality=str(tier.locality),
                    )

            if self._events is not None:
                for tier in tiers:  # a tier that knows what leaves it says so
                    tier.on_removed = functools.partial(
                        self._events.publish_removed_below,
                        medium=tier.medium,
                        locality=str(tier.locality),
                    )
            try:
                self._secondary = TierChain(
                    tiers,
                    self.manager,
                    self._row,
                    row_bytes=self.layout.row_bytes,
                    limits=CascadeLimits(
                        cascade_queue=cascade_queue, cascade_chunks=cascade_chunks
                    ),
                    on_written=on_written,
                )
            except BaseException:
                for tier in tiers:  # built here, never to be used: free what they took
                    tier.discard()
                raise
        self.scheduler = Scheduler(
            self.manager,
            self._make_backend,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            block_bytes=self.layout.group_block_bytes,
            group_num_blocks=self.layout.group_num_blocks,
            limits=scheduler_limits,
            on_stored=self._secondary.stored if self._secondary is not None else None,
        )
        self._prefault = prefault
        self._stack: contextlib.AsyncExitStack | None = None  # what __aexit__ unwinds
        self._closers = contextlib.AsyncExitStack()  # what aclose unwinds
        self._closed: anyio.Event | None = None  # set once a close has finished
        self._pool: HostMemoryPool | None = None
        self._backend: TransferBackend | None = None
        self._state = ResourceState.NEW

    # -- life -----------------------------------------------------------------

    def _build_tiers(self, sources: Sequence[TierSource]) -> list[SecondaryTier]:
        """The tiers below, built from ``sources`` in order; if one cannot be built, those
        built before it are discarded (a disk tier's lock is freed) and the error raised."""
        tiers: list[SecondaryTier] = []
        try:
            for source in sources:
                tiers.append(
                    source if isinstance(source, SecondaryTier) else source(self.namespace)
                )
        except BaseException:
            for tier in tiers:
                tier.discard()
            raise
        return tiers

    def _make_backend(self, on_complete: CompletionCallback) -> TransferBackend:
        if self._pool is None:  # pragma: no cover - open() allocates it first
            raise ResourceClosedError("the host memory pool is not allocated")
        self._backend = create_backend(
            self.backend_name,
            self.layout,
            self._pool,
            on_complete=on_complete,
            **self._backend_options,
        )
        return self._backend

    def _close_pool(self) -> None:
        if self._pool is not None:  # unmapped once no view of it is left
            self._pool.close()

    async def __aenter__(self) -> Self:
        await anyio.lowlevel.checkpoint()  # before anything is acquired: a cancel leaves it new
        if self._state is not ResourceState.NEW:
            raise ResourceClosedError(f"the engine is {self._state.value}; an engine opens once")
        self._closed = anyio.Event()
        events, secondary = self._events, self._secondary
        try:
            async with contextlib.AsyncExitStack() as stack:
                if secondary is not None:  # the write-through task's group, left by __aexit__
                    task_group = await stack.enter_async_context(_task_group())
                closers = await stack.enter_async_context(self._closers)
                # Closed in the reverse order (see the module's note); a closer of a
                # piece not opened yet does nothing.
                if events is not None:
                    closers.push_async_callback(events.aclose)
                closers.callback(self._close_pool)
                if secondary is not None:
                    closers.push_async_callback(secondary.aclose)
                closers.push_async_callback(self.scheduler.aclose)
                if secondary is not None:
                    closers.callback(secondary.stop_intake)
                if events is not None:
                    events.open(self.manager)
                self._pool = HostMemoryPool(
                    self.layout.pool_bytes(self.manager.capacity), populate=self._prefault
                )
                if secondary is not None:
                    secondary.start(task_group)
                self.scheduler.open()
                # On exit: close first, then leave the task group.
                stack.push_async_callback(self.aclose)
                self._stack = stack.pop_all()
        except BaseException:
            # Whatever it took is released; its parts open once: so does the engine.
            self._state = ResourceState.CLOSED
            self._closed.set()
            raise
        self._state = ResourceState.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        stack, self._stack = self._stack, None
        if stack is None:  # never entered
            await self.aclose()
            return False
        return bool(await stack.__aexit__(exc_type, exc, traceback))

    async def aclose(self) -> None:
        """Queued jobs end cancelled, running ones finish, host memory is freed. Idempotent;
        any task may call it."""
        if self._state is ResourceState.NEW:
            self._state = ResourceState.CLOSED
            if self._secondary is not None:  # built by the engine's factory: the engine's to close
                await self._secondary.aclose()
            await anyio.lowlevel.checkpoint()
            return
        if self._state is not ResourceState.OPEN:
            if self._closed is not None:
                await self._closed.wait()  # a close in progress: wait until it is whole
            else:
                await anyio.lowlevel.checkpoint()
            return
        self._state = ResourceState.CLOSING
        try:
            await self._closers.aclose()
        finally:
            self._state = ResourceState.CLOSED
            if self._closed is not None:
                self._closed.set()

    @property
    def backend(self) -> TransferBackend:
        """The transfer backend (while the engine is open or closing)."""
        if self._backend is None or self._state not in (ResourceState.OPEN, ResourceState.CLOSING):
            raise ResourceClosedError(f"the engine is {self._state.value}; no backend")
        return self._backend

    # -- the scheduler side: sync and cheap -----------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> PrefixLookup:
        """How many of a request's chunks, from the head, are ready, then pending.

        `ResourceClosedError` unless the engine is open: a closed engine's pool
        is released, so nothing it once held is ready.
        """
        self._check_open()
        lookup = self.manager.lookup
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

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Commit a finished request's recency, keys head first (`ResourceClosedError`
        unless the engine is open)."""
        self._check_open()
        self.manager.touch(keys)

    # -- jobs -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not ResourceState.OPEN:
            raise ResourceClosedError(f"the engine is {self._state.value}; open it with async with")

    def submit_store_nowait(
        self,
        keys: Sequence[OffloadKey],
        gpu: GPULoadStoreSpec,
        *,
        blocks: Sequence[ChunkBlocks | None] | None = None,
    ) -> JobHandle:
        """Queue a store of ``keys`` (one per chunk of ``gpu``); `anyio.WouldBlock` if full.

        ``blocks`` (one per key, or None) describes each chunk's blocks for its
        `BlockStored` event: their hashes, and optionally their token ids and
        the parent hash ("self-describing" events). Ignored unless events are on
        and ``config.extra_config["self_describing_kv_events"]`` asks for them.
        """
        self._check_open()
        events = self._events
        if blocks is None or events is None:
            return self.scheduler.submit_nowait(JobKind.STORE, keys, gpu)
        events.check(keys, blocks)
        handle = self.scheduler.submit_nowait(JobKind.STORE, keys, gpu)
        events.describe(manager_job(handle.job_id), keys, blocks)
        return handle

    def submit_load_nowait(self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec) -> JobHandle:
        """Queue a load of ready ``keys`` into ``gpu``; `anyio.WouldBlock` if full."""
        self._check_open()
        return self.scheduler.submit_nowait(JobKind.LOAD, keys, gpu)

    async def submit_store(
        self,
        keys: Sequence[OffloadKey],
        gpu: GPULoadStoreSpec,
        *,
        blocks: Sequence[ChunkBlocks | None] | None = None,
    ) -> JobHandle:
        """Queue a store, waiting for room in the queue; returns its handle at once after.

        Always a checkpoint (also for a store that ends at submission: keys
        all present, or no room), so a loop of them lets the loop run.
        """
        return await self.scheduler.submit_waiting(
            JobKind.STORE, lambda: self.submit_store_nowait(keys, gpu, blocks=blocks)
        )

    async def submit_load(self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec) -> JobHandle:
        """Queue a load, waiting for room in the queue; returns its handle at once after."""
        return await self.scheduler.submit_waiting(
            JobKind.LOAD, lambda: self.submit_load_nowait(keys, gpu)
        )

    async def flush(self, gpu_block_ids: Sequence[int] | IntArray) -> None:
        """Return once no store submitted before still reads ``gpu_block_ids``."""
        await self.scheduler.flush(gpu_block_ids)

    # -- the secondary tier -----------------------------------------------------

    @property
    def secondary(self) -> SecondaryTier | None:
        """The first tier below this one, if any."""
        return self._secondary.tiers[0] if self._secondary is not None else None

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """Every tier below this one, in order (empty without)."""
        return self._secondary.tiers if self._secondary is not None else ()

    def _row(self, chunk_id: int) -> memoryview:
        """The host memory of chunk slot ``chunk_id``: one row of the pool."""
        if self._pool is None:
            raise ResourceClosedError("the host memory pool is not allocated")
        row = self.layout.row_bytes
        return writable_row(self._pool.tensor[chunk_id * row : (chunk_id + 1) * row].numpy(), row)

    async def wait_written_through(self) -> None:
        """Return once every write-through queued so far has been written to the
        secondary tier or counted as not written (nothing stays pinned for it): before
        a `reset`, or to read the secondary tier's statistics after a burst of stores.
        A checkpoint; returns at once without a secondary tier."""
        if self._secondary is None:
            await anyio.lowlevel.checkpoint()
            return
        await self._secondary.wait_idle()

    async def promote(self, keys: Sequence[OffloadKey], start: int = 0) -> Promotion:
        """Bring the chunks after the first ``start`` of ``keys`` in from the secondary tier.

        ``start`` is how many leading chunks the CPU tier already has (`lookup`'s
        ``ready``); see `TierChain.promote`. Returns how many leading chunks
        after ``start`` are now ready, and how many of those it read just now;
        nothing without a secondary tier.
        """
        self._check_open()
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(keys):
            raise SpecError(f"start must be an integer in [0, {len(keys)}], got {start!r}")
        if self._secondary is None:
            await anyio.lowlevel.checkpoint()
            return Promotion(ready=0, promoted=0)
        return await self._secondary.promote(keys, start)

    # -- events ---------------------------------------------------------------

    def subscribe(self, max_batches: int = 1024) -> EventSubscription:
        """An async iterator of the event batches published from now on.

        It yields `SequencedBatch` items, and a `Gap` where it lost its oldest
        batches for being slow (at most ``max_batches`` wait); a slow
        subscriber never slows the engine. It ends when the engine closes;
        ``aclose`` it to stop sooner (one dropped without closing stops
        receiving once it is garbage-collected).
        """
        self._check_open()
        if self._events is None:
            raise ConfigError(
                "KV cache events are off; set enable_kv_cache_events in the config to subscribe"
            )
        return self._events.subscribe(max_batches)

    @property
    def event_endpoints(self) -> tuple[str, str | None] | None:
        """The ZMQ publisher's bound ``(endpoint, replay_endpoint)``, once open; else None."""
        return self._events.endpoints if self._events is not None else None

    @property
    def event_publisher_binds(self) -> bool | None:
        """Whether the ZMQ publisher binds its endpoint (True: subscribers connect to it) or
        connects to it (False: a subscriber must bind there), once open; else None."""
        return self._events.binds if self._events is not None else None

    def reset(self, *, force: bool = False) -> None:
        """Drop every chunk of the tier (with events, a `BlockRemoved` of what it held).

        Refuses (`ChunkStateError`) while transfers use chunks, unless ``force``;
        even forced, while a write-through reads the tier's rows.
        """
        self._check_open()
        if not force and self.scheduler.busy:
            raise ChunkStateError("cannot reset the tier while jobs are queued or running")
        if self._secondary is not None:
            self._secondary.check_reset(force=force)
        self.manager.reset(force=force)
        if self._secondary is not None:
            self._secondary.tier_reset()

    # -- seeing state ---------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        tiers = self._secondary.statistics() if self._secondary is not None else ()
        return EngineStatistics(
            state=self._state.value,
            manager=self.manager.statistics(),
            scheduler=self.scheduler.statistics(),
            backend=self._backend.statistics() if self._backend is not None else None,
            # Cheap enough for every scrape: the pool's resident size (a scan of
            # the whole tier) is left out; `HostMemoryPool.resident_bytes` measures it.
            pool=self._pool.statistics(resident=False) if self._pool is not None else None,
            events=self._events.statistics() if self._events is not None else None,
            secondary=tiers[0] if tiers else None,
            tiers=tiers,
        )

    def __repr__(self) -> str:
        m = self.manager.statistics()
        s = self.scheduler.statistics()
        return (
            f"<TieringEngine {self.engine_id} [{self._state.value}; {self.backend_name}; "
            f"chunks: {m.used}/{m.capacity} used, {m.writing} writing, {m.pinned} pinned; loads: "
            f"{s.loads.queued} queued, {s.loads.in_flight} running; stores: "
            f"{s.stores.queued} queued, {s.stores.in_flight} running]>"
        )
