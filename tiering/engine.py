"""`TieringEngine`: the CPU tier of one engine rank, built and owned in one object.

An async server embeds one engine per rank::

    async with TieringEngine(config, kv_caches, cpu_bytes=8 << 30) as engine:
        found = engine.lookup(keys)                  # sync, cheap
        job = await engine.submit_load(keys[:found.ready], gpu_spec)
        result = await job                           # a JobResult, never an exception
        ...
        await engine.flush(block_ids)                # before reusing GPU blocks

The engine builds the pieces (with `tiering.assembly`) and owns their life;
each piece does its own work: the KV layout (`KVLayout.from_kv_caches`), the
chunk manager, the host memory pool, the scheduler (which builds the transfer
backend), the KV event emitter (`KVEventEmitter`) and the chain of tiers below
it (`TierChain`).

Design note: the close order. The engine's life is one `AsyncLifecycle` and
one exit stack. `__aenter__` registers every closer before it opens anything,
and `aclose` unwinds the stack in the reverse order: the chain first stops
taking landed stores, then the scheduler lets running jobs finish (landing
their last stores), then the chain writes what is queued and closes its tiers
(write-throughs read pool rows, so the pool outlives them), then the pool is
unmapped, then the emitter publishes what the last completions changed and
closes the bus. An open that fails unwinds the same stack, each piece closed
only if it was opened (a closer of a piece not opened does nothing). The
write-through task's group is not on the stack: `__aexit__` leaves it after
`aclose`, in the task that entered it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from tiering._checks import check_int
from tiering._closing import AsyncLifecycle
from tiering._state import ResourceState
from tiering._types import OffloadKey, TransferDirection
from tiering.assembly import (
    EngineStatistics,
    HostSide,
    PrefixLookup,
    TierSource,
    backend_name,
    build_chain,
    cpu_tier,
    engine_name,
    event_emitter,
    namespace_of,
    prefix_lookup,
    scheduler_limits,
    tier_sources,
)
from tiering.config import DEFAULT_POLICY, OffloadingConfig
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ChunkStateError, ConfigError, ResourceClosedError, SpecError
from tiering.events import ChunkBlocks, KVEventsConfig
from tiering.events.bus import EventSubscription
from tiering.hints import Hint, check_hint
from tiering.policies import CachePolicy
from tiering.scheduler import JobHandle, Scheduler, SchedulerLimits, manager_job
from tiering.secondary import SecondaryTier
from tiering.secondary.cascade import Promotion, SecondaryTierStatistics
from tiering.specs import GPULoadStoreSpec, IntArray
from tiering.transfer import KVCacheTensor, TransferBackend

__all__ = [
    "EngineStatistics",
    "PrefixLookup",
    "Promotion",
    "SecondaryTierStatistics",
    "TieringEngine",
]

STORE, LOAD = TransferDirection.STORE, TransferDirection.LOAD
NEW, OPEN, CLOSING = ResourceState.NEW, ResourceState.OPEN, ResourceState.CLOSING


def __getattr__(name: str) -> Any:
    if name == "kv_cache_tensors":  # deprecated: unused, and `KVLayout` says the same
        replacement = "KVLayout.from_kv_caches(config, kv_caches).tensors"
        message = f"tiering.engine.kv_cache_tensors is deprecated; use {replacement}"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        from tiering.assembly import kv_cache_tensors

        return kv_cache_tensors
    raise AttributeError(f"module 'tiering.engine' has no attribute {name!r}")


class TieringEngine:
    """The CPU tier of one engine rank: manager, host memory, backend and scheduler.

    ``kv_caches`` maps layer names (as in ``config.groups``) to block-major
    tensors, or lists `KVCacheTensor` directly. ``backend`` is ``"auto"``
    (``cuda`` when the KV tensors are on a CUDA device, else ``cpu``),
    ``"cpu"``, ``"cuda"`` or ``"mock"``; ``backend_options`` go to its
    constructor. Scheduler limits come from ``limits`` or from the config's
    ``extra_config`` (``max_queued_jobs``, ``max_inflight_bytes``, ``slice_chunks``,
    ``max_load_slices``). ``engine_id`` names the engine in metrics (by default
    ``config.engine_id``).
    ``prefault`` maps the whole CPU tier at open (the memory is committed
    then, and no store pays a page fault later); ``False`` maps it lazily.

    ``secondary`` adds a tier below this one, or a chain of them in order (each
    a `SecondaryTier`, or a function that builds one from the engine's
    `RemoteNamespace`; ``remote_namespace`` names the deployment in it): chunks
    whose stores land are written to each in the background (per tier, at most
    ``cascade_queue`` stores wait; the chain holds at most ``cascade_chunks``
    chunks pinned, by default half the CPU tier, split between its tiers; past
    that they are dropped and counted), and `promote` reads a request's chunks
    back from the first tier that has them (`TierChain`). The engine closes them;
    `tiers` lists them.

    `aclose` may be called from any task. With a tier below, the
    write-through task runs in a task group of the task that enters the
    engine, which the end of its ``async with`` block leaves.

    With ``config.enable_kv_cache_events``, what the tier holds is published
    as KV cache events (vLLM's wire format): one batch per turn of the event
    loop that changed the tier, to `subscribe`rs and, when ``events`` is
    given, on its ZMQ endpoint (moved by ``config.parallel.data_parallel_index``,
    as vLLM moves each data-parallel rank's). Without it, no event is built.

    Retention hints (`tiering.hints`: what a client or a router knows of a
    request's prefix) come with a request's `touch` and `submit_store`: the
    CPU tier honours them at once, and a store's travels with its write-through
    to the tiers below (the disk tier evicts released values first and spares
    retained ones; a Redis tier sets their TTL); `hint` applies one later, to
    every tier (a conversation closed after its last turn). A bad hint is a
    `HintError` before anything changes::

        keep = Hint(retain_s=600)                    # the conversation goes on
        job = await engine.submit_store(keys[hits:], gpu_spec, hint=keep)
        engine.touch(keys, keep)
        ...
        await engine.hint(keys, Hint(release=True))  # it is over: its chunks go first
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
        cpu_bytes = check_int("cpu_bytes", cpu_bytes, minimum=1)  # first, before anything is built
        self.config = config
        #: Names this engine in metrics (the ``engine`` label) and logs: ``engine_id``,
        #: or the config's (``config.engine_id``; vLLM's ``kv_transfer_config.engine_id``).
        self.engine_id = engine_name(config.engine_id if engine_id is None else engine_id)
        self.layout, self.info = cpu_tier(config, kv_caches, cpu_bytes)
        self.backend_name = backend_name(backend, self.layout)
        num_chunks = self.info.cpu_num_chunks
        self._host = HostSide(
            self.layout, num_chunks, self.backend_name, backend_options, prefault=prefault
        )
        sources = tier_sources(secondary)
        self._events = event_emitter(config, events, keep_landed=bool(sources))
        self.manager = CPUOffloadingManager(
            num_chunks,
            policy,
            enable_events=self._events is not None,
            on_events=self._events.publish_soon if self._events is not None else None,
        )
        limits = scheduler_limits(config, limits)
        #: What makes this engine's chunk bytes interchangeable with another's.
        self.namespace = namespace_of(config, self.layout, remote_namespace)
        #: The tiers below the CPU tier and their write-throughs and promotions.
        self._chain = build_chain(
            sources,
            self.namespace,
            self.manager,
            self._host.row,
            row_bytes=self.layout.row_bytes,
            cascade_queue=cascade_queue,
            cascade_chunks=cascade_chunks,
            events=self._events,
        )
        self.scheduler = Scheduler(
            self.manager,
            self._host.make_backend,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            block_bytes=self.layout.group_block_bytes,
            group_num_blocks=self.layout.group_num_blocks,
            limits=limits,
            on_stored=self._chain.stored if self._chain is not None else None,
        )
        self._life = AsyncLifecycle("the engine")
        self._closers = contextlib.AsyncExitStack()  # what aclose unwinds
        self._task_group: anyio.abc.TaskGroup | None = None  # the write-through task's

    # -- life -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await anyio.lowlevel.checkpoint()  # before anything is acquired: a cancel leaves it new
        self._life.open()
        events, chain, closers = self._events, self._chain, self._closers
        # Closed in the reverse order (see the module's note).
        if events is not None:
            closers.push_async_callback(events.aclose)
        closers.callback(self._host.close)
        if chain is not None:
            closers.push_async_callback(chain.aclose)
        closers.push_async_callback(self.scheduler.aclose)
        if chain is not None:
            closers.callback(chain.stop_intake)
        try:
            if chain is not None:  # left by __aexit__, after aclose
                self._task_group = anyio.create_task_group()
                await self._task_group.__aenter__()
            if events is not None:
                events.open(self.manager)
            self._host.open()
            if chain is not None and self._task_group is not None:
                chain.start(self._task_group)
            self.scheduler.open()
        except BaseException:
            # Whatever it took is released; its parts open once: so does the engine.
            try:
                await self.aclose()
            finally:
                await self._leave_task_group()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            await self.aclose()
        finally:
            await self._leave_task_group()
        return False

    async def _leave_task_group(self) -> None:
        # Without the caller's exception: the task has ended (aclose ran); anyio would wrap it.
        task_group, self._task_group = self._task_group, None
        if task_group is not None:
            await task_group.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Queued jobs end cancelled, running ones finish, host memory is freed. Idempotent;
        any task may call it."""
        never_opened = self._life.state is NEW
        if not await self._life.begin_aclose():
            return
        try:
            if never_opened and self._chain is not None:  # built here: the engine's to close
                await self._chain.aclose()
            await self._closers.aclose()
        finally:
            self._life.end_close()

    @property
    def backend(self) -> TransferBackend:
        """The transfer backend (while the engine is open or closing)."""
        backend = self._host.backend
        if backend is None or self._life.state not in (OPEN, CLOSING):
            raise ResourceClosedError(f"the engine is {self._life.state.value}; no backend")
        return backend

    # -- the scheduler side: sync and cheap -----------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> PrefixLookup:
        """How many of a request's chunks, from the head, are ready, then pending.
        `ResourceClosedError` unless open: a closed engine's pool is released."""
        self._check_open()
        return prefix_lookup(self.manager, keys)

    def touch(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> None:
        """Commit a finished request's recency, keys head first (the engine must be open),
        and its retention ``hint`` (`tiering.hints.Hint`), once per request.

        The hint reaches the CPU tier only (a touch does no I/O); `hint` applies one
        to every tier, and a store's ``hint`` travels with its write-through. A bad
        hint is refused (`HintError`) before anything changes.
        """
        hint = check_hint(hint)
        self._check_open()
        self.manager.touch(keys, hint)

    # -- jobs -----------------------------------------------------------------

    def _check_open(self) -> None:
        self._life.check_open("open it with async with")

    def submit_store_nowait(
        self,
        keys: Sequence[OffloadKey],
        gpu: GPULoadStoreSpec,
        *,
        blocks: Sequence[ChunkBlocks | None] | None = None,
        hint: Hint | None = None,
    ) -> JobHandle:
        """Queue a store of ``keys`` (one per chunk of ``gpu``); `anyio.WouldBlock` if full.

        ``blocks`` (one per key, or None) describes each chunk's blocks for its
        `BlockStored` event: their hashes, and optionally their token ids and
        the parent hash ("self-describing" events). Ignored unless events are on
        and ``config.extra_config["self_describing_kv_events"]`` asks for them.

        ``hint`` (`tiering.hints.Hint`) is the request's retention hint: it applies
        to ``keys`` in the CPU tier (those already there, and those stored, unless
        the store fails), and travels with the write-through of those this store
        writes to the tiers below (the disk tier evicts released values first and
        spares retained ones, a Redis tier sets their TTL; values written there
        before get it from `hint`). A bad hint is refused (`HintError`) before
        anything is queued.
        """
        return self._submit_store(keys, gpu, blocks, check_hint(hint))

    def _submit_store(
        self,
        keys: Sequence[OffloadKey],
        gpu: GPULoadStoreSpec,
        blocks: Sequence[ChunkBlocks | None] | None,
        hint: Hint | None,
    ) -> JobHandle:
        """`submit_store_nowait` with ``hint`` checked (`check_hint`)."""
        self._check_open()
        if hint is not None and hint.empty:
            hint = None
        events = self._events
        if blocks is not None and events is not None:
            events.check(keys, blocks)
        handle = self.scheduler.submit_nowait(STORE, keys, gpu, hint=hint)
        if blocks is not None and events is not None:
            events.describe(manager_job(handle.job_id), keys, blocks)
        if hint is not None:
            self.manager.hint(keys, hint)
        return handle

    def submit_load_nowait(self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec) -> JobHandle:
        """Queue a load of ready ``keys`` into ``gpu``; `anyio.WouldBlock` if full."""
        self._check_open()
        return self.scheduler.submit_nowait(LOAD, keys, gpu)

    async def submit_store(
        self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec, *,
        blocks: Sequence[ChunkBlocks | None] | None = None, hint: Hint | None = None,
    ) -> JobHandle:  # fmt: skip
        """Queue a store, waiting for room in the queue; returns its handle at once after.

        Always a checkpoint (also for a store that ends at submission: keys
        all present, or no room), so a loop of them lets the loop run. ``hint``
        as for `submit_store_nowait` (a bad one refused before the checkpoint).
        """
        checked = check_hint(hint)
        return await self.scheduler.submit_waiting(
            STORE, lambda: self._submit_store(keys, gpu, blocks, checked)
        )

    async def submit_load(self, keys: Sequence[OffloadKey], gpu: GPULoadStoreSpec) -> JobHandle:
        """Queue a load, waiting for room in the queue; returns its handle at once after."""
        return await self.scheduler.submit_waiting(LOAD, lambda: self.submit_load_nowait(keys, gpu))

    async def flush(self, gpu_block_ids: Sequence[int] | IntArray) -> None:
        """Return once no store submitted before still reads ``gpu_block_ids``."""
        await self.scheduler.flush(gpu_block_ids)

    # -- the tiers below --------------------------------------------------------

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        """Every tier below this one, in order (empty without)."""
        return self._chain.tiers if self._chain is not None else ()

    @property
    def secondary(self) -> SecondaryTier | None:
        """Deprecated: ``tiers[0]`` (the first tier below this one), if any."""
        message = "TieringEngine.secondary is deprecated; use engine.tiers[0]"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return self.tiers[0] if self.tiers else None

    async def wait_written_through(self) -> None:
        """Return once every write-through queued so far has been written to the
        tiers below or counted as not written (nothing stays pinned for it): before a
        `reset`, or to read the tiers' statistics after a burst of stores. A
        checkpoint; returns at once without a tier below."""
        if self._chain is None:
            await anyio.lowlevel.checkpoint()
            return
        await self._chain.wait_idle()

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """Apply a request's retention ``hint`` (`tiering.hints.Hint`) to ``keys`` wherever
        they live now: the CPU tier (those it holds, without a use), then each tier
        below that honours hints (one round trip each; the others count it ignored).

        For a hint that comes after the request's touch and store (a conversation
        closed later: ``Hint(release=True)``); a value whose write-through is still
        on its way lands with its store's hint (`wait_written_through` first where
        that matters). A bad hint is refused (`HintError`) before anything changes.
        Always a checkpoint.
        """
        checked = check_hint(hint)
        self._check_open()
        if checked is None or checked.empty:
            await anyio.lowlevel.checkpoint()
            return
        self.manager.hint(keys, checked)
        if self._chain is None:
            await anyio.lowlevel.checkpoint()
            return
        await self._chain.hint(keys, checked)

    async def promote(self, keys: Sequence[OffloadKey], start: int = 0) -> Promotion:
        """Bring the chunks after the first ``start`` of ``keys`` in from the tiers below.

        ``start`` is how many leading chunks the CPU tier already has (`lookup`'s
        ``ready``); see `TierChain.promote`. Returns how many leading chunks
        after ``start`` are now ready, and how many of those it read just now;
        nothing without a tier below.
        """
        self._check_open()
        start = check_int("start", start, minimum=0, maximum=len(keys), error=SpecError)
        if self._chain is None:
            await anyio.lowlevel.checkpoint()
            return Promotion(ready=0, promoted=0)
        return await self._chain.promote(keys, start)

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
        if self._chain is not None:
            self._chain.check_reset(force=force)
        self.manager.reset(force=force)
        if self._chain is not None:
            self._chain.tier_reset()

    # -- seeing state ---------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        tiers = self._chain.statistics() if self._chain is not None else ()
        host = self._host
        return EngineStatistics(
            state=self._life.state.value,
            manager=self.manager.statistics(),
            scheduler=self.scheduler.statistics(),
            backend=host.backend.statistics() if host.backend is not None else None,
            # Cheap enough for every scrape: the pool's resident size (a scan of
            # the whole tier) is left out; `HostMemoryPool.resident_bytes` measures it.
            pool=host.pool.statistics(resident=False) if host.pool is not None else None,
            events=self._events.statistics() if self._events is not None else None,
            secondary=tiers[0] if tiers else None,
            tiers=tiers,
        )

    def __repr__(self) -> str:
        m = self.manager.statistics()
        s = self.scheduler.statistics()
        return (
            f"<TieringEngine {self.engine_id} [{self._life.state.value}; {self.backend_name}; "
            f"chunks: {m.used}/{m.capacity} used, {m.writing} writing, {m.pinned} pinned; loads: "
            f"{s.loads.queued} queued, {s.loads.in_flight} running; stores: "
            f"{s.stores.queued} queued, {s.stores.in_flight} running]>"
        )
