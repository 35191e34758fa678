"""`TieringEngine`: the CPU tier of one engine rank, built and owned in one object.

An async server embeds one engine per rank::

    async with TieringEngine(config, kv_caches, cpu_bytes=8 << 30) as engine:
        found = engine.lookup(keys)                  # sync, cheap
        job = await engine.submit_load(keys[:found.ready], gpu_spec)
        result = await job                           # a JobResult, never an exception
        ...
        await engine.flush(block_ids)                # before reusing GPU blocks

The engine builds the KV layout from the config's groups and the caller's KV
tensors, sizes the tier from ``cpu_bytes``, and owns the manager, the host
memory, the backend and the scheduler. It works on asyncio and trio.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Self

import anyio.abc
import anyio.lowlevel
import msgspec
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tiering._types import Medium, OffloadKey
from tiering.config import DEFAULT_POLICY, OffloadingConfig
from tiering.cpu.common import CPUOffloadingInfo
from tiering.cpu.manager import (
    ChunkEvent,
    ChunksStored,
    CPUOffloadingManager,
    LookupResult,
    ManagerStatistics,
)
from tiering.errors import (
    CapacityError,
    ChunkStateError,
    ConfigError,
    ResourceClosedError,
    SpecError,
)
from tiering.events import ChunkBlocks, EventTranslator, KVEvent, KVEventBatch, KVEventsConfig
from tiering.events.bus import EventBus, EventSink, EventStatistics, EventSubscription
from tiering.policies import CachePolicy
from tiering.scheduler import (
    JobHandle,
    JobKind,
    Scheduler,
    SchedulerLimits,
    SchedulerStatistics,
    manager_job,
)
from tiering.secondary import RemoteNamespace, SecondaryStatistics, SecondaryTier, writable_row
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

logger = logging.getLogger(__name__)

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
    secondary: SecondaryTierStatistics | None = None  # None without a secondary tier


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def kv_cache_tensors(
    config: OffloadingConfig, kv_caches: Mapping[str, torch.Tensor] | Sequence[KVCacheTensor]
) -> list[KVCacheTensor]:
    """Register the per-layer tensors named by the config's groups, block-major.

    ``kv_caches`` maps each layer name of the groups to its tensor: the first
    dimension is its number of blocks and one block's elements are contiguous
    (a ``(num_blocks, ...)`` layout; a ``(2, num_blocks, ...)`` K/V layout is
    registered as two `KVCacheTensor` by the caller instead, and a sequence of
    `KVCacheTensor` is taken as it is). Every tensor has the config's dtype
    (``model.dtype``; for a vLLM quantized cache dtype such as ``fp8``, any
    dtype of the size vLLM stores it in, as attention backends view those
    bytes as they need). Anything else is a `ConfigError`.
    """
    if not isinstance(kv_caches, Mapping):
        return _given_tensors(config, kv_caches)
    named = {name for group in config.groups for name in group.layer_names}
    extra = sorted(set(kv_caches) - named)
    if extra:
        raise ConfigError(
            f"KV cache tensors {extra} belong to no group of the config; "
            f"the groups name {sorted(named)}"
        )
    tensors = []
    for g, group in enumerate(config.groups):
        for name in group.layer_names:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise ConfigError(f"no KV cache tensor for layer {name!r} of group {g}")
            where = f"KV cache tensor {name!r}"
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(
                    f"{where} is a {_type_name(tensor)}; give a torch.Tensor, block-major "
                    "(num_blocks, ...)"
                )
            if tensor.dim() < 1 or tensor.shape[0] < 1:
                raise ConfigError(
                    f"{where} must be block-major (num_blocks, ...) with at least one block, "
                    f"got shape {tuple(tensor.shape)}"
                )
            if not tensor.is_contiguous():
                raise ConfigError(
                    f"{where} is not contiguous (shape {tuple(tensor.shape)}, strides "
                    f"{tuple(tensor.stride())}): a transposed or strided view; give the "
                    "tensor the cache is stored in, block-major (num_blocks, ...) with each "
                    "block's elements contiguous"
                )
            _check_dtype(config, where, tensor)
            page_bytes = tensor[0].numel() * tensor.element_size()
            tensors.append(KVCacheTensor(tensor, int(tensor.shape[0]), page_bytes, group=g))
    return tensors


def _given_tensors(config: OffloadingConfig, kv_caches: object) -> list[KVCacheTensor]:
    """A sequence of `KVCacheTensor`, checked; anything else is refused, naming the mapping."""
    items: list[object] | None = None
    if isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        items = list(kv_caches)
    tensors = [item for item in items or () if isinstance(item, KVCacheTensor)]
    if items is None or len(tensors) != len(items):
        given = f"a {_type_name(kv_caches)}"
        if items is not None:
            given += f" of {_type_names(items)}"
        layers = [name for group in config.groups for name in group.layer_names]
        raise ConfigError(
            f"kv_caches must map each layer name to its KV cache tensor "
            f"({{layer name: torch.Tensor}} for the layers {layers}), or be a list of "
            f"KVCacheTensor; got {given}"
        )
    for index, kv in enumerate(tensors):
        _check_dtype(config, f"kv_caches[{index}].tensor", kv.tensor)
    return tensors


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"


def _type_names(values: Sequence[object]) -> str:
    kinds = sorted({_type_name(value) for value in values})
    return f"{len(values)} items ({', '.join(kinds)})" if kinds else "no items"


def _check_dtype(config: OffloadingConfig, where: str, tensor: torch.Tensor) -> None:
    """Refuse a KV tensor whose dtype is not the config's (see `kv_cache_tensors`)."""
    dtype, storage = config.model.dtype, config.model.storage_dtype
    expected = getattr(torch, storage, None)
    if not isinstance(expected, torch.dtype):
        raise ConfigError(
            f"the config's model.dtype={dtype!r} is not a dtype of torch {torch.__version__}"
        )
    if tensor.dtype == expected:
        return
    if dtype != storage and tensor.element_size() == expected.itemsize:
        return  # a vLLM quantized cache: its bytes, viewed as a backend needs
    stored = f" (stored as {storage})" if dtype != storage else ""
    raise ConfigError(
        f"{where} has dtype {str(tensor.dtype).removeprefix('torch.')} but the config's "
        f"model.dtype is {dtype!r}{stored}; give KV tensors of that dtype, or set model.dtype "
        "to theirs"
    )


def _limits(config: OffloadingConfig, limits: SchedulerLimits | None) -> SchedulerLimits:
    if limits is not None:
        return limits
    given = {k: v for k, v in config.extra_config.items() if k in _LIMIT_KEYS}
    try:
        return msgspec.convert(given, SchedulerLimits)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"extra_config: {exc}") from None


_ENGINE_IDS = itertools.count()


class _Events:
    """The event side of an engine: translator, bus and sinks, and block descriptions.

    ``described`` holds what callers said about the chunks of each store job,
    until the job's `ChunksStored` is translated (matched by job id, so a key
    stored, evicted and stored again is described by the right store); the
    descriptions of jobs that failed or were cancelled are pruned once they
    outnumber the stores in flight.
    """

    def __init__(self, config: OffloadingConfig, settings: KVEventsConfig | None) -> None:
        bpc = config.cache.blocks_per_chunk
        self.settings = settings
        self.translator = EventTranslator(
            tokens_per_chunk=[g.tokens_per_block * bpc for g in config.groups] or 1,
            hash_format=settings.hash_format if settings is not None else "int",
        )
        self.rank = config.parallel.data_parallel_index
        self.described: dict[Hashable, dict[OffloadKey, ChunkBlocks]] = {}
        self.scheduled = False
        self.endpoints: tuple[str, str | None] | None = None  # the publisher's, once bound
        self.binds: bool | None = None  # whether the publisher binds its endpoint, once open
        self.lost = 0  # events that could not be translated (a bug): logged and counted
        self._remote_translator: EventTranslator | None = None
        # Descriptions of landed chunks, until their write-through is announced
        # (only with a secondary tier; bounded: a dropped write-through leaves one).
        self.keep_landed = False
        self.landed: dict[OffloadKey, ChunkBlocks] = {}
        self._bus: EventBus | None = None

    @property
    def bus(self) -> EventBus:
        if self._bus is None:
            raise ResourceClosedError("the event bus is not open")
        return self._bus

    def open(self) -> None:
        sinks: list[EventSink] = []
        if self.settings is not None:
            from tiering.events.publisher import ZmqEventPublisher  # pyzmq only when used

            publisher = ZmqEventPublisher(self.settings)
            self.endpoints = (publisher.endpoint, publisher.replay_endpoint)
            self.binds = publisher.binds
            sinks.append(publisher)
        self._bus = EventBus(sinks)

    async def aclose(self) -> None:
        if self._bus is not None:
            await self._bus.aclose()

    @staticmethod
    def check(keys: Sequence[OffloadKey], blocks: Sequence[ChunkBlocks | None]) -> None:
        """Refuse descriptions that do not fit the store, before it is submitted."""
        if len(blocks) != len(keys):
            raise ConfigError(
                f"blocks describes {len(blocks)} chunks but the store has {len(keys)} keys; "
                "give one ChunkBlocks (or None) per key"
            )
        for info in blocks:
            if info is not None and not isinstance(info, ChunkBlocks):
                raise ConfigError(f"blocks holds {info!r}; give a ChunkBlocks or None per key")

    def describe(
        self,
        job: Hashable,
        keys: Sequence[OffloadKey],
        blocks: Sequence[ChunkBlocks | None],
        manager: CPUOffloadingManager,
    ) -> None:
        described = {k: info for k, info in zip(keys, blocks, strict=True) if info is not None}
        if described and manager.store_in_flight(job):
            self.described[job] = described
        if len(self.described) > 64 + 2 * manager.statistics().writing:
            self.described = {j: d for j, d in self.described.items() if manager.store_in_flight(j)}

    def publish(self, events: list[ChunkEvent]) -> None:
        wire: list[KVEvent] = []
        for event in events:
            blocks = None
            if isinstance(event, ChunksStored) and event.job is not None:
                blocks = self.described.pop(event.job, None)
                if blocks and self.keep_landed:  # for the write-through's own event
                    self.landed.update(blocks)
                    while len(self.landed) > _LANDED_KEPT:
                        del self.landed[next(iter(self.landed))]
            try:
                wire += self.translator.translate([event], blocks)
            except Exception:  # descriptions are checked at submission: a bug
                logger.exception("KV cache events: cannot translate %r", event)
                self.lost += 1
        if wire and self._bus is not None:
            self._bus.publish(
                KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=self.rank)
            )

    def publish_remote(self, keys: Sequence[OffloadKey], medium: Medium, locality: str) -> None:
        """Publish that ``keys`` were written to a lower tier (``locality`` on the events)."""
        if self._remote_translator is None:
            self._remote_translator = EventTranslator(
                self.translator.tokens_per_chunk,
                hash_format=self.translator.hash_format,
                locality=locality,
            )
        landed = self.landed
        blocks = {k: landed.pop(k) for k in keys if k in landed} if landed else None
        event = ChunksStored(keys=tuple(keys), medium=medium)
        wire = self._remote_translator.translate([event], blocks)
        if wire and self._bus is not None:
            self._bus.publish(
                KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=self.rank)
            )

    def statistics(self) -> EventStatistics | None:
        return self._bus.statistics() if self._bus is not None else None


class SecondaryTierStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The secondary tier as the engine uses it: its own counters, and the flows.

    ``cascade_*`` count chunks written through after their CPU store
    (``dropped``: not queued, the tier being behind; ``failed``: handed to the
    tier and not written); ``cascade_pinned`` is how many are queued or being
    written now (pinned in the CPU tier), at most ``cascade_max_pinned``;
    ``promoted`` counts chunks read into the CPU tier, ``promote_failed``
    those the tier claimed but could not give.
    """

    tier: SecondaryStatistics
    cascade_queued: int
    cascade_written: int
    cascade_dropped: int
    cascade_failed: int
    cascade_pinned: int
    cascade_max_pinned: int
    promoted: int
    promote_failed: int


class Promotion(msgspec.Struct, frozen=True):
    """What `TieringEngine.promote` did: ``ready`` leading chunks (after the
    caller's ``start``) are now ready in the CPU tier, ``promoted`` of which it
    read from the secondary tier just now."""

    ready: int
    promoted: int


#: Landed chunks' descriptions kept for their write-through's event, at most.
_LANDED_KEPT = 1 << 16

_CascadeItem = tuple[Hashable, tuple[OffloadKey, ...], list[int], int]


class _Remote:
    """The engine's side of a secondary tier: the bounded cascade and promotion.

    Cascades run in one background task: a landed store pins its chunks (so no
    eviction takes them while their rows are read) and queues them; when the
    queue is full, or its chunks would take the pins past ``max_chunks``, the
    chunks are dropped, counted and unpinned at once, so the GPU path never
    waits for the secondary tier, and a slow tier never pins so much of the
    CPU tier that stores find no room. The task lives in a task
    group entered by the engine's ``__aenter__`` and exited by its
    ``__aexit__``; `stop` (from `TieringEngine.aclose`, in any task) only
    ends it: it writes what is queued, and every pin is released whatever
    happens (a cancelled write counts as failed).
    """

    def __init__(
        self, tier: SecondaryTier, queue: int, max_chunks: int | None, capacity: int
    ) -> None:
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ConfigError(f"cascade_queue must be a positive integer, got {queue!r}")
        if max_chunks is None:
            max_chunks = max(1, capacity // 2)
        elif (
            isinstance(max_chunks, bool)
            or not isinstance(max_chunks, int)
            or not 1 <= max_chunks <= capacity
        ):
            raise ConfigError(
                f"cascade_chunks must be an integer from 1 to the CPU tier's {capacity} "
                f"chunks, got {max_chunks!r}"
            )
        self.tier = tier
        self._queue = queue
        #: Most chunks pinned by cascades at once (queued or being written).
        self.max_chunks = max_chunks
        self._send: MemoryObjectSendStream[_CascadeItem] | None = None
        self._done: anyio.Event | None = None  # made at open (needs a running loop)
        self._jobs = itertools.count()
        self.generation = 0  # bumped by a reset: queued cascades of older ones are void
        self.pending = 0  # chunks queued or being written
        self.writing = 0  # chunks whose rows a write is reading now
        self.queued = self.written = self.dropped = self.failed = 0
        self.promoted = self.promote_failed = 0

    async def open(
        self,
        task_group: anyio.abc.TaskGroup,
        manager: CPUOffloadingManager,
        row: Callable[[int], memoryview],
        on_written: Callable[[Sequence[OffloadKey]], None],
    ) -> None:
        """Start the cascade task in ``task_group``."""
        self._manager = manager
        self._row = row
        self._on_written = on_written
        send, receive = anyio.create_memory_object_stream[_CascadeItem](self._queue)
        self._send = send
        self._done = anyio.Event()
        task_group.start_soon(self._cascade_worker, receive)

    def cascade(self, keys: tuple[OffloadKey, ...], manager: CPUOffloadingManager) -> None:
        if self._send is None or self.pending + len(keys) > self.max_chunks:
            # Pins beyond the bound would leave stores no chunk to evict.
            self.dropped += len(keys)
            return
        job = ("cascade", next(self._jobs))
        try:
            spec = manager.prepare_load(keys, job=job, count=False)  # pinned while read
        except ChunkStateError:
            self.dropped += len(keys)  # evicted already (a tiny tier): nothing to write
            return
        try:
            self._send.send_nowait((job, keys, spec.chunk_ids.tolist(), self.generation))
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            manager.complete_load(job=job)
            self.dropped += len(keys)
        else:
            self.queued += len(keys)
            self.pending += len(keys)

    async def _cascade_worker(self, receive: MemoryObjectReceiveStream[_CascadeItem]) -> None:
        """Write queued cascades; never raises but a cancellation (it shares a task group
        with the engine's owner), and releases every pin however it ends."""
        current: list[_CascadeItem] = []
        try:
            async for item in receive:
                current.append(item)
                await self._write(item)
                current.clear()
        except Exception:
            logger.exception("secondary tier: the write-through task failed")
        finally:
            for item in current:  # cancelled during its write: not written
                self._settle(item, 0)
            while True:
                try:
                    self._settle(receive.receive_nowait(), 0)
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
            receive.close()
            assert self._done is not None
            self._done.set()

    async def _write(self, item: _CascadeItem) -> None:
        _, keys, chunk_ids, generation = item
        written = 0
        if generation == self.generation:  # else reset since: the rows hold other chunks
            self.writing = len(keys)
            try:
                rows = [(k, self._row(c)) for k, c in zip(keys, chunk_ids, strict=True)]
                written = await self.tier.write(rows)
            except Exception:
                logger.exception("secondary tier: a write-through failed")
            finally:
                self.writing = 0
        self._settle(item, written)
        if written == len(keys):
            try:
                self._on_written(keys)
            except Exception:
                logger.exception("secondary tier: announcing a write-through failed")

    def _settle(self, item: _CascadeItem, written: int) -> None:
        job, keys, _, _ = item
        self._manager.complete_load(job=job)  # unpin (a no-op after a reset)
        self.pending -= len(keys)
        self.written += written
        self.failed += len(keys) - written

    async def promote(self, keys: Sequence[OffloadKey], start: int) -> Promotion:
        manager = self._manager
        candidates: list[OffloadKey] = []
        for key in keys[start:]:
            if manager.holds(key):
                break  # in the CPU tier already (or being written): the run ends here
            candidates.append(key)
        run = 0
        if candidates:
            present = await self.tier.contains(candidates)
            while run < len(present) and present[run]:
                run += 1
        else:
            await anyio.lowlevel.checkpoint()  # every promotion yields, even with nothing to ask
        read = 0
        if run:
            read = await self._read(keys[:start], candidates[:run])
        ready = 0
        for key in keys[start:]:
            if not manager.holds(key, ready=True):
                break
            ready += 1
        return Promotion(ready=ready, promoted=min(read, ready))

    async def _read(self, head: Sequence[OffloadKey], wanted: Sequence[OffloadKey]) -> int:
        """Read ``wanted`` into fresh slots; the request's ``head`` is never evicted for them."""
        manager = self._manager
        job = ("promote", next(self._jobs))
        # No room for all: try a shorter run. One promotion that finds no room
        # at all is one allocation failure, however many sizes it tried.
        output = manager.prepare_store([*head, *wanted], job=job, count=False)
        while output is None and len(wanted) > 1:
            wanted = wanted[: len(wanted) // 2]
            output = manager.prepare_store([*head, *wanted], job=job, count=False)
        if output is None:
            manager.count_allocation_failure()
            return 0  # no room in the CPU tier: the request recomputes
        new = output.keys_to_store
        ids = output.store_spec.chunk_ids.tolist()
        rows = [(k, self._row(c)) for k, c in zip(new, ids, strict=True)]
        found: list[bool] = []
        try:
            found = await self.tier.read(rows)
        finally:
            good = 0
            while good < len(found) and found[good]:
                good += 1
            # Only while the job holds its keys: after a forced reset they may
            # be another store's by now.
            if manager.store_in_flight(job):
                manager.complete_store(new[good:], success=False)  # frees their slots
                manager.complete_store(job=job, success=True)  # the rest: the leading run
            self.promoted += good
            self.promote_failed += len(new) - good
        return good

    def idle(self) -> bool:
        return self.pending == 0

    async def stop(self) -> None:
        """End the cascade task after it has written what is queued (any task may call it)."""
        if self._send is not None:
            self._send.close()
            assert self._done is not None
            await self._done.wait()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.tier.aclose()

    def statistics(self) -> SecondaryTierStatistics:
        return SecondaryTierStatistics(
            tier=self.tier.statistics(),
            cascade_queued=self.queued,
            cascade_written=self.written,
            cascade_dropped=self.dropped,
            cascade_failed=self.failed,
            cascade_pinned=self.pending,
            cascade_max_pinned=self.max_chunks,
            promoted=self.promoted,
            promote_failed=self.promote_failed,
        )


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

    ``secondary`` adds a tier below this one (a `SecondaryTier`, or a function
    that builds one from the engine's `RemoteNamespace`; ``remote_namespace``
    names the deployment in it): chunks whose stores land are written to it in
    the background (at most ``cascade_queue`` stores wait, holding at most
    ``cascade_chunks`` chunks pinned, by default half the CPU tier; past that
    they are dropped and counted), and `promote` reads a request's chunks back
    from it.
    The engine closes it; with one, close the engine from the task that opened it.

    With ``config.enable_kv_cache_events``, what the tier holds is published
    as KV cache events (vLLM's wire format): one batch per turn of the event
    loop that changed the tier, to `subscribe`rs and, when ``events`` is
    given, on its ZMQ endpoint. Without it, no event is built.
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
        secondary: SecondaryTier | Callable[[RemoteNamespace], SecondaryTier] | None = None,
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
        tensors = kv_cache_tensors(config, kv_caches)
        self.layout = KVLayout(tensors, config.cache.blocks_per_chunk)
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
        self._events = _Events(config, events) if config.enable_kv_cache_events else None
        if self._events is not None and secondary is not None:
            self._events.keep_landed = True
        self.manager = CPUOffloadingManager(
            num_chunks,
            policy,
            enable_events=self._events is not None,
            on_events=self._events_pending if self._events is not None else None,
        )
        self.scheduler = Scheduler(
            self.manager,
            self._make_backend,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            block_bytes=self.layout.group_block_bytes,
            group_num_blocks=self.layout.group_num_blocks,
            limits=_limits(config, limits),
            on_stored=self._cascade if secondary is not None else None,
        )
        self._remote: _Remote | None = None
        #: What makes this engine's chunk bytes interchangeable with another's.
        self.namespace = RemoteNamespace.from_config(
            config,
            row_bytes=self.layout.row_bytes,
            page_bytes=tuple(t.page_bytes for t in self.layout.tensors),
            namespace=remote_namespace,
        )
        if secondary is not None:
            if not isinstance(secondary, SecondaryTier):
                secondary = secondary(self.namespace)
            if secondary.row_bytes != self.layout.row_bytes:
                raise ConfigError(
                    f"the secondary tier holds rows of {secondary.row_bytes} bytes but this "
                    f"engine's chunks are {self.layout.row_bytes} bytes; build its namespace "
                    "from this engine's layout (RemoteNamespace.from_config)"
                )
            self._remote = _Remote(secondary, cascade_queue, cascade_chunks, num_chunks)
        self._prefault = prefault
        self._task_group: anyio.abc.TaskGroup | None = None
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._closed: anyio.Event | None = None  # set once a close has finished
        self._pool: HostMemoryPool | None = None
        self._backend: TransferBackend | None = None
        self._state = _State.NEW

    # -- life -----------------------------------------------------------------

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

    async def __aenter__(self) -> Self:
        await anyio.lowlevel.checkpoint()  # before anything is acquired: a cancel leaves it new
        if self._state is not _State.NEW:
            raise ResourceClosedError(f"the engine is {self._state.value}; an engine opens once")
        self._pool = HostMemoryPool(
            self.layout.pool_bytes(self.manager.capacity), populate=self._prefault
        )
        try:
            if self._events is not None:
                self._events.open()
            self._token = anyio.lowlevel.current_token()
            self._closed = anyio.Event()
            if self._remote is not None:
                # The write-through task's group: entered here, exited by __aexit__
                # (at the same nesting), whichever task calls aclose.
                self._task_group = anyio.create_task_group()
                await self._task_group.__aenter__()
                await self._remote.open(
                    self._task_group, self.manager, self._row, self._events_for_remote
                )
            self.scheduler.open()
        except BaseException as exc:
            self._pool.close()
            if self._remote is not None:
                await self._remote.stop()
                if self._task_group is not None:
                    await self._task_group.__aexit__(type(exc), exc, exc.__traceback__)
                await self._remote.aclose()
            if self._events is not None:
                await self._events.aclose()
            raise
        self._state = _State.OPEN
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.aclose()
        finally:
            task_group, self._task_group = self._task_group, None
            if task_group is not None:
                await task_group.__aexit__(None, None, None)  # the task has ended already

    async def aclose(self) -> None:
        """Queued jobs end cancelled, running ones finish, host memory is freed. Idempotent."""
        if self._state in (_State.CLOSING, _State.CLOSED):
            if self._closed is not None:
                await self._closed.wait()  # a close in progress: wait until it is whole
            else:
                await anyio.lowlevel.checkpoint()
            return
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            if self._remote is not None:  # built by the engine's factory: the engine's to close
                await self._remote.aclose()
            await anyio.lowlevel.checkpoint()
            return
        self._state = _State.CLOSING
        try:
            await self.scheduler.aclose()
        finally:
            try:
                if self._remote is not None:  # before the pool: cascades read its rows
                    with anyio.CancelScope(shield=True):
                        await self._remote.stop()
                    await self._remote.aclose()
            finally:
                try:
                    if self._pool is not None:  # unmapped once no view of it is left
                        self._pool.close()
                    if self._events is not None:
                        self._publish_events()  # what the last completions changed
                        await self._events.aclose()
                finally:
                    self._state = _State.CLOSED
                    if self._closed is not None:
                        self._closed.set()

    @property
    def backend(self) -> TransferBackend:
        """The transfer backend (while the engine is open or closing)."""
        if self._backend is None or self._state not in (_State.OPEN, _State.CLOSING):
            raise ResourceClosedError(f"the engine is {self._state.value}; no backend")
        return self._backend

    # -- the scheduler side: sync and cheap -----------------------------------

    def lookup(self, keys: Sequence[OffloadKey]) -> PrefixLookup:
        """How many of a request's chunks, from the head, are ready, then pending."""
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
        """Commit a finished request's recency, keys head first."""
        self.manager.touch(keys)

    # -- jobs -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
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
        the parent hash ("self-describing" events). Ignored without events.
        """
        self._check_open()
        if blocks is not None and self._events is not None:
            self._events.check(keys, blocks)
        handle = self.scheduler.submit_nowait(JobKind.STORE, keys, gpu)
        if blocks is not None and self._events is not None:
            self._events.describe(manager_job(handle.job_id), keys, blocks, self.manager)
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
        """The secondary tier below this one, if any."""
        return self._remote.tier if self._remote is not None else None

    def _row(self, chunk_id: int) -> memoryview:
        """The host memory of chunk slot ``chunk_id``: one row of the pool."""
        if self._pool is None:
            raise ResourceClosedError("the host memory pool is not allocated")
        row = self.layout.row_bytes
        return writable_row(self._pool.tensor[chunk_id * row : (chunk_id + 1) * row].numpy(), row)

    def _cascade(self, keys: tuple[OffloadKey, ...]) -> None:
        """A store landed: queue its chunks for the secondary tier (the scheduler's hook)."""
        if self._remote is not None:
            if self._state is _State.OPEN:
                self._remote.cascade(keys, self.manager)
            else:
                self._remote.dropped += len(keys)  # landed while closing: not written through

    async def promote(self, keys: Sequence[OffloadKey], start: int = 0) -> Promotion:
        """Bring the chunks after the first ``start`` of ``keys`` in from the secondary tier.

        ``start`` is how many leading chunks the CPU tier already has (`lookup`'s
        ``ready``). The chunks that follow and are in neither tier are asked
        about in one round trip; the leading run the secondary tier holds is
        read into fresh CPU slots (being written meanwhile: lookups say
        pending, nothing evicts them), never evicting the request's first
        ``start`` chunks for them. Returns how many leading chunks after
        ``start`` are now ready (`Promotion.ready`), and how many of those it
        read just now (`Promotion.promoted`); nothing without a secondary tier.
        """
        self._check_open()
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(keys):
            raise SpecError(f"start must be an integer in [0, {len(keys)}], got {start!r}")
        if self._remote is None:
            await anyio.lowlevel.checkpoint()
            return Promotion(ready=0, promoted=0)
        return await self._remote.promote(keys, start)

    def _events_for_remote(self, keys: Sequence[OffloadKey]) -> None:
        """Publish that this engine wrote ``keys`` to the secondary tier."""
        if self._events is not None and self._remote is not None and keys:
            self._publish_events()  # the CPU tier's pending events go first, in order
            tier = self._remote.tier
            self._events.publish_remote(keys, tier.medium, str(tier.locality))

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
        return self._events.bus.subscribe(max_batches)

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
        """Drop every chunk of the tier (publishing `AllBlocksCleared` with events).

        Refuses (`ChunkStateError`) while transfers use chunks, unless ``force``.
        """
        self._check_open()
        if not force and self.scheduler.busy:
            raise ChunkStateError("cannot reset the tier while jobs are queued or running")
        remote = self._remote
        if remote is not None and (remote.writing or (not force and not remote.idle())):
            # Even forced: a write in progress reads the rows a reset would hand out.
            raise ChunkStateError(
                "cannot reset the tier while chunks are being written through to the "
                "secondary tier; wait for them (statistics().secondary)"
                + ("" if remote.writing else " or pass force=True")
            )
        self.manager.reset(force=force)
        if self._remote is not None:
            self._remote.generation += 1  # queued write-throughs name slots now void

    def _events_pending(self) -> None:
        """The manager queued a first event: publish them all at the end of this turn."""
        token = self._token
        if token is None or self._events is None or self._events.scheduled:
            return
        self._events.scheduled = True
        token.backend_class.run_sync_soon(self._publish_events, (), token.native_token)

    def _publish_events(self) -> None:
        """Publish the manager's queued events as one batch (a loop callback: never raises)."""
        events = self._events
        if events is None:
            return
        events.scheduled = False
        try:
            events.publish(self.manager.take_events())
        except Exception:
            logger.exception("engine %s: publishing KV cache events failed", self.engine_id)

    # -- seeing state ---------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            state=self._state.value,
            manager=self.manager.statistics(),
            scheduler=self.scheduler.statistics(),
            backend=self._backend.statistics() if self._backend is not None else None,
            # Cheap enough for every scrape: the pool's resident size (a scan of
            # the whole tier) is left out; `HostMemoryPool.resident_bytes` measures it.
            pool=self._pool.statistics(resident=False) if self._pool is not None else None,
            events=self._events.statistics() if self._events is not None else None,
            secondary=self._remote.statistics() if self._remote is not None else None,
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
