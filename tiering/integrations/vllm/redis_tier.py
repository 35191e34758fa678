"""tiering's Redis tier as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

A ``secondary_tiers`` entry loads it; its keys are decoded by
`tiering.integrations.vllm.extra.RedisEntry`, whose module shows one (vLLM logs
``--kv-transfer-config`` at startup: give the URL by ``url_env``, or the password
by ``password_file``; a ``url`` with a password is warned of).

What it adds to vLLM: a shared store whose values check themselves
(`tiering.secondary.codec`: header, namespace digest, key and checksum, all
verified before a value is accepted), whose keys are namespaced by what makes
chunk bytes interchangeable (model, KV dtype, row size, blocks per chunk,
tokens per block, the parallel layout, an operator's ``namespace``), and that
goes down and comes back without costing the engine anything (health gating
with backoff: while Redis is away, calls are answered at once, without I/O).
All of that is `tiering.secondary.redis.RedisTier`; this module only maps
vLLM's calls onto it.

Design note, threads: vLLM calls a secondary tier on the scheduler thread,
under the manager's lock, and every call must return at once. `RedisTier` is
anyio-async, so the tier owns an event loop on a thread of its own (an anyio
blocking portal, started in the constructor, stopped by `shutdown`). Every
call from vLLM only hands work to that loop (``start_task_soon``) or collects
what it finished from two thread-safe queues; it never waits on Redis. The
loop thread touches only the `RedisTier`, the queues and one snapshot of the
statistics (a reference swapped whole); the scheduler-side state (lookups,
jobs, counters) is touched by the scheduler thread only. Every `RedisTier`
call ends within its ``timeout_s``, so `drain_jobs` and `shutdown` end too.

What vLLM's calls become:

- `lookup` is asynchronous: a key's first lookup answers ``RETRY`` and queues
  it; at the step's end (`on_schedule_end`) the queued keys go to Redis as one
  ``contains`` call (one round trip); a later lookup answers ``HIT`` or
  ``MISS``. At most ``max_lookups_in_flight`` keys are queued or asked at once;
  past that a lookup answers ``RETRY`` without asking (counted, ``deferred``).
- `submit_store` writes the job's rows straight from ``primary_kv_view``
  (vLLM pins them until the job is reported finished). At most
  ``max_store_jobs`` stores run at once; past that a store is failed at once
  and its chunks counted as dropped (``queue full``): the CPU tier keeps them.
- `submit_load` reads each value straight into its row of ``primary_kv_view``;
  a value that is missing or fails a check fails that key only
  (``JobResult.successful_keys``), and the key's lookup turns to a miss so the
  scheduler recomputes it instead of promoting it again. Loads are bounded by
  the CPU tier's free rows, which vLLM allocates before it submits one.

Medium and locality: vLLM knows two media, ``CPU`` (the engine's own host
memory) and ``STORAGE`` (everything else); Redis is another process's memory,
often another host's, so it is ``STORAGE``, and ``REMOTE`` by default (other
engines on the same store see its chunks; ``"locality": "LOCAL"`` for a
server of this engine alone). Its hits are reported as
``CacheHitSource.EXTERNAL_UNSPECIFIED`` (vLLM's name for a remote store), not
``DISK``, which ``STORAGE`` would imply.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import anyio.from_thread
import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadKey,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering._state import Lifecycle
from tiering.errors import ConfigError
from tiering.integrations.vllm.extra import VLLM_ENTRY_KEYS, redis_options, remote_namespace
from tiering.secondary.base import SecondaryStatistics, describe
from tiering.secondary.redis import RedisTier
from tiering.secondary.refusals import Unwritten

__all__ = ["RedisSecondaryTier", "RedisSecondaryTierStatistics", "remote_namespace"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Why chunks handed to `submit_store` were not written, beside `RedisTier`'s reasons.
DROPPED_QUEUE_FULL = Unwritten.QUEUE_FULL.value
DROPPED_CLOSED = Unwritten.CLOSED.value

_PREFIX = "vllm:kv_offload_redis_"
METRIC_FAILURES = _PREFIX + "failures"
METRIC_TIMEOUTS = _PREFIX + "timeouts"
METRIC_UNAVAILABLE = _PREFIX + "unavailable"
METRIC_REFUSALS = _PREFIX + "refusals"
METRIC_REJECTED = _PREFIX + "rejected_values"
METRIC_READ_MISSES = _PREFIX + "read_misses"
METRIC_WRITES_DROPPED = _PREFIX + "writes_dropped"
METRIC_LOOKUPS_DEFERRED = _PREFIX + "lookups_deferred"
METRIC_UP = _PREFIX + "up"

_INFO_KEYS = ("redis_url", "redis_namespace", "redis_checksum")


class RedisSecondaryTierStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the tier: its `RedisTier`'s counters and the adapter's own.

    ``redis`` is the snapshot the loop thread took after its last call.
    ``store_jobs_dropped`` (and ``chunks_dropped``) were failed at submit
    (``max_store_jobs`` reached, or the tier closed); ``lookups_deferred`` were
    answered ``RETRY`` without asking (``max_lookups_in_flight`` reached).
    """

    state: str
    redis: SecondaryStatistics
    store_jobs: int
    store_jobs_failed: int
    store_jobs_dropped: int
    chunks_dropped: int
    load_jobs: int
    load_jobs_failed: int
    keys_not_loaded: int
    lookups_deferred: int
    unexpected_errors: int
    last_unexpected_error: str | None
    lookups_in_flight: int
    jobs_in_flight: int


class _Lookup:
    """One key's existence check; ``found`` is ``None`` until Redis answered."""

    __slots__ = ("found", "requests", "sent")

    def __init__(self) -> None:
        self.found: bool | None = None
        self.sent = False
        self.requests: set[str] = set()


class RedisSecondaryTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over tiering's `RedisTier` (see the module docstring).

    Its entry's keys, and what each means: `tiering.integrations.vllm.extra.RedisEntry`.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        options = redis_options(tier_type, entry)
        self.locality = Locality(options.locality.value)
        self.namespace = remote_namespace(
            offloading_spec.config, self.block_size_bytes, options.keys.namespace
        )
        self._max_lookups = options.keys.max_lookups_in_flight
        self._max_store_jobs = options.keys.max_store_jobs
        events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if options.keys.enable_kv_events and not events_on:
            logger.warning(
                "enable_kv_events is set on secondary tier %r but KV cache events are "
                "disabled (kv_events_config): the tier emits none",
                tier_type,
            )
        self._events: list[OffloadingEvent] | None = (
            [] if options.keys.enable_kv_events and events_on else None
        )
        if options.password_in_entry:
            logger.warning(
                "secondary tier %r: its 'url' holds a password, and vLLM logs "
                "--kv-transfer-config at startup: give 'url_env' (an environment variable "
                "holding the URL) or 'password_file' instead",
                tier_type,
            )
        try:
            self._tier = RedisTier(options.url, self.namespace, **options.redis)
        except ConfigError as exc:
            raise ConfigError(f"secondary tier {tier_type!r}: {exc}") from exc
        self.url = self._tier.url  # no password
        # Rows as bytes: chunk c is self._rows[c * row : (c + 1) * row].
        self._rows = primary_kv_view.cast("B")
        self._row_bytes = self.block_size_bytes
        # Scheduler thread only:
        self._lookups: dict[OffloadKey, _Lookup] = {}
        self._queued: list[tuple[OffloadKey, _Lookup]] = []
        self._asked = 0  # keys sent to Redis and not answered yet
        self._request_keys: dict[str, set[OffloadKey]] = {}
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}
        self._store_jobs: dict[int, list[OffloadKey]] = {}  # in flight
        self._load_jobs: dict[int, list[OffloadKey]] = {}  # in flight
        self._lookup_calls: set[concurrent.futures.Future[None]] = set()
        self._counts = dict.fromkeys(
            (
                "store_jobs",
                "store_jobs_failed",
                "store_jobs_dropped",
                "chunks_dropped",
                "load_jobs",
                "load_jobs_failed",
                "keys_not_loaded",
                "lookups_deferred",
            ),
            0,
        )
        self._dropped: dict[str, int] = {}  # chunks failed at submit, by reason
        # Loop thread -> scheduler thread:
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[list[tuple[OffloadKey, _Lookup]], list[bool]]] = (
            queue.SimpleQueue()
        )
        self._unexpected = 0  # calls that raised (a bug in the tier), counted as failures
        self._last_unexpected: str | None = None
        self._reported_unexpected = 0
        self._latest: SecondaryStatistics = self._tier.statistics()
        self._reported: SecondaryStatistics = self._latest
        self._reported_dropped: dict[str, int] = {}
        self._reported_deferred = 0
        self._reported_up: int | None = None
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        self._life = Lifecycle("the Redis secondary tier", opened=True)
        if options.keys.connect_on_start:
            try:
                self._portal.call(self._tier.connect)
            except BaseException:
                self.shutdown()
                raise
        logger.info(
            "Redis secondary tier %r at %s, namespace %s (%s)",
            tier_type,
            self.url,
            self.namespace.digest().hex()[:16],
            self.namespace.namespace or "no operator namespace",
        )

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: Any) -> LookupResult:
        if not self._life.is_open:
            return LookupResult.MISS
        self._take_answers()
        state = self._lookups.get(key)
        if state is None:
            if len(self._queued) + self._asked >= self._max_lookups:
                self._counts["lookups_deferred"] += 1
                return LookupResult.RETRY
            state = self._lookups[key] = _Lookup()
            self._queued.append((key, state))
        req_id = req_context.req_id
        state.requests.add(req_id)
        self._request_keys.setdefault(req_id, set()).add(key)
        if state.found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if state.found else LookupResult.MISS

    def on_schedule_end(self, context: Any) -> None:
        """Send this step's new lookups to Redis as one call."""
        self._take_answers()
        if not self._queued or not self._life.is_open:
            return
        batch = [(k, s) for k, s in self._queued if self._lookups.get(k) is s]
        self._queued = []
        if not batch:
            return
        for _, state in batch:
            state.sent = True
        self._asked += len(batch)
        call = self._portal.start_task_soon(self._contains, batch)
        self._lookup_calls.add(call)
        call.add_done_callback(self._lookup_calls.discard)

    async def _contains(self, batch: list[tuple[OffloadKey, _Lookup]]) -> None:
        keys = [key for key, _ in batch]
        found = await self._guarded("lookup", self._tier.contains(keys), [False] * len(batch))
        self._answers.put((batch, found))

    def _take_answers(self) -> None:
        while True:
            try:
                batch, found = self._answers.get_nowait()
            except queue.Empty:
                return
            self._asked -= len(batch)
            for (key, state), hit in zip(batch, found, strict=True):
                if self._lookups.get(key) is not state:
                    continue  # forgotten meanwhile
                if not state.requests:
                    del self._lookups[key]
                else:
                    state.found = hit

    def on_request_finished(self, req_context: Any) -> None:
        for key in self._request_keys.pop(req_context.req_id, ()):
            state = self._lookups.get(key)
            if state is None:
                continue
            state.requests.discard(req_context.req_id)
            if not state.requests and (state.found is not None or not state.sent):
                del self._lookups[key]  # an asked one goes when its answer comes

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    # -- jobs -------------------------------------------------------------------

    def _start(
        self,
        in_flight: dict[int, list[OffloadKey]],
        job: TransferJob,
        run: Callable[[int, list[tuple[OffloadKey, memoryview]]], Awaitable[None]],
    ) -> None:
        """Hand ``job`` to the loop: ``run`` gets each key with its chunk's row."""
        row = self._row_bytes
        items = [
            (key, self._rows[int(chunk) * row : (int(chunk) + 1) * row])
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True)
        ]
        in_flight[job.job_id] = [key for key, _ in items]
        self._jobs[job.job_id] = self._portal.start_task_soon(run, job.job_id, items)

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._counts["store_jobs"] += 1
        if not self._life.is_open or len(self._store_jobs) >= self._max_store_jobs:
            reason = DROPPED_QUEUE_FULL if self._life.is_open else DROPPED_CLOSED
            self._counts["store_jobs_dropped"] += 1
            self._counts["chunks_dropped"] += len(keys)
            self._dropped[reason] = self._dropped.get(reason, 0) + len(keys)
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        self._start(self._store_jobs, job_metadata, self._store)

    async def _store(self, job_id: int, items: list[tuple[OffloadKey, memoryview]]) -> None:
        started = time.monotonic()
        written = await self._guarded("write", self._tier.write(items), 0)
        self._finished.put(
            JobResult(
                job_id=job_id,
                success=written == len(items),
                transfer_time=time.monotonic() - started,
                transfer_bytes=written * self._row_bytes,
            )
        )

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._counts["load_jobs"] += 1
        if not self._life.is_open:
            self._load_jobs[job_id] = keys
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        self._start(self._load_jobs, job_metadata, self._load)

    async def _load(self, job_id: int, items: list[tuple[OffloadKey, memoryview]]) -> None:
        started = time.monotonic()
        filled = await self._guarded("read", self._tier.read(items), [False] * len(items))
        loaded = [key for (key, _), ok in zip(items, filled, strict=True) if ok]
        complete = len(loaded) == len(items)
        self._finished.put(
            JobResult(
                job_id=job_id,
                success=complete,
                successful_keys=None if complete or not loaded else tuple(loaded),
                transfer_time=time.monotonic() - started,
                transfer_bytes=len(loaded) * self._row_bytes,
            )
        )

    async def _guarded(self, what: str, call: Awaitable[_T], failed: _T) -> _T:
        """``await call``, or ``failed`` if it raised: `RedisTier` counts its failures and
        answers them as values, so an exception is a bug (logged, counted)."""
        try:
            return await call
        except Exception as exc:
            logger.exception("Redis tier %s failed unexpectedly", what)
            # The loop thread's alone to change; the scheduler thread only reads it.
            self._unexpected += 1
            self._last_unexpected = describe(exc)
            return failed
        finally:
            self._latest = self._tier.statistics()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._take_answers()
        results: list[JobResult] = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            self._jobs.pop(result.job_id, None)
            results.append(result)
            stored = self._store_jobs.pop(result.job_id, None)
            if stored is not None:
                if not result.success:
                    self._counts["store_jobs_failed"] += 1
                elif self._events is not None:
                    self._events.append(
                        OffloadingEvent(
                            keys=stored, medium=self.medium, removed=False, locality=self.locality
                        )
                    )
            loaded = self._load_jobs.pop(result.job_id, None)
            if loaded is not None and not result.success:
                self._load_failed(loaded, result.successful_keys or ())
        return results

    def _load_failed(self, keys: list[OffloadKey], loaded: Collection[OffloadKey]) -> None:
        """A key that did not load is a miss from now on, so it is recomputed, not promoted."""
        self._counts["load_jobs_failed"] += 1
        done = set(loaded)
        for key in keys:
            if key in done:
                continue
            self._counts["keys_not_loaded"] += 1
            state = self._lookups.get(key)
            if state is not None and state.found is not None:
                state.found = False

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._queued or self._asked or not self._finished.empty())

    def drain_jobs(self) -> None:
        """Wait until every submitted job has ended (each ends within the tier's timeout)."""
        concurrent.futures.wait(list(self._jobs.values()))

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every job and every lookup sent to Redis has ended; whether they all did.

        Not a vLLM call: for a caller that must know the tier's loop is quiet
        (a test, a drain before a reset that also wants the lookups answered).
        """
        calls = [*self._jobs.values(), *self._lookup_calls]
        _, running = concurrent.futures.wait(calls, timeout=timeout_s)
        return not running

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    # -- seeing state -----------------------------------------------------------

    def statistics(self) -> RedisSecondaryTierStatistics:
        return RedisSecondaryTierStatistics(
            state=self._life.state.value,
            redis=self._latest,
            lookups_in_flight=len(self._queued) + self._asked,
            jobs_in_flight=len(self._jobs),
            unexpected_errors=self._unexpected,
            last_unexpected_error=self._last_unexpected,
            **self._counts,
        )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        def counter(text: str, *labels: str) -> Any:
            return OffloadingCounterMetadata(documentation=text, labelnames=labels)

        return {
            METRIC_FAILURES: counter(
                "Failed calls to the Redis tier (server unreachable, timeout, protocol error)."
            ),
            METRIC_TIMEOUTS: counter("Calls to the Redis tier that ran out of time."),
            METRIC_UNAVAILABLE: counter(
                "Calls answered without I/O because the Redis tier was down or backing off."
            ),
            METRIC_REFUSALS: counter(
                "Commands the Redis server refused, by its error code (OOM, READONLY...).",
                "reason",
            ),
            METRIC_REJECTED: counter(
                "Values read from Redis that failed a check and were not loaded, by reason.",
                "reason",
            ),
            METRIC_READ_MISSES: counter("Chunks a load asked for that Redis no longer held."),
            METRIC_WRITES_DROPPED: counter(
                "Chunks handed to the Redis tier that were not written, by reason.", "reason"
            ),
            METRIC_LOOKUPS_DEFERRED: counter(
                "Lookups answered retry without asking: too many keys already in flight."
            ),
            METRIC_UP: OffloadingGaugeMetadata(
                documentation="Whether the Redis tier is up (1) or down and backing off (0)."
            ),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What changed since the last call, as vLLM's offloading stats (``None``: nothing)."""
        now, before = self._latest, self._reported
        stats = OffloadingConnectorStats()
        for name, field in (
            (METRIC_FAILURES, "errors_total"),
            (METRIC_TIMEOUTS, "timeouts_total"),
            (METRIC_UNAVAILABLE, "unavailable_total"),
            (METRIC_READ_MISSES, "read_misses_total"),
        ):
            delta = getattr(now, field) - getattr(before, field)
            if delta:
                stats.increase_counter(name, delta)
        for name, new, old in (
            (METRIC_REFUSALS, now.refused_by_reason, before.refused_by_reason),
            (METRIC_REJECTED, now.rejected_by_reason, before.rejected_by_reason),
            (METRIC_WRITES_DROPPED, now.write_errors_by_reason, before.write_errors_by_reason),
            (METRIC_WRITES_DROPPED, self._dropped, self._reported_dropped),
        ):
            for reason, count in new.items():
                if count - old.get(reason, 0):
                    stats.increase_counter(name, count - old.get(reason, 0), (reason,))
        unexpected = self._unexpected
        if unexpected - self._reported_unexpected:
            stats.increase_counter(METRIC_FAILURES, unexpected - self._reported_unexpected)
        self._reported_unexpected = unexpected
        deferred = self._counts["lookups_deferred"]
        if deferred - self._reported_deferred:
            stats.increase_counter(METRIC_LOOKUPS_DEFERRED, deferred - self._reported_deferred)
        up = 1 if now.state == "up" else 0
        if up != self._reported_up:  # a gauge keeps its value: sent when it changes
            stats.set_gauge(METRIC_UP, up)
            self._reported_up = up
        self._reported = now
        self._reported_dropped = dict(self._dropped)
        self._reported_deferred = deferred
        return None if stats.is_empty() else stats

    @classmethod
    def check_entry(cls, tier_type: str, entry: Mapping[str, Any]) -> None:
        """Refuse a bad ``secondary_tiers`` entry before anything is built (one `ConfigError`
        naming the key); vLLM's own keys of an entry are not the tier's to check."""
        redis_options(tier_type, {k: v for k, v in entry.items() if k not in VLLM_ENTRY_KEYS})

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        return dict(
            zip(
                _INFO_KEYS,
                (self.url, self.namespace.digest().hex()[:16], self._tier.codec.checksum.name),
                strict=True,
            )
        )

    # -- lifecycle --------------------------------------------------------------

    def shutdown(self) -> None:
        """Let every job and lookup end, close the tier, stop its thread. Idempotent."""
        if not self._life.begin_close():
            return
        try:
            concurrent.futures.wait([*self._jobs.values(), *self._lookup_calls])
            self._portal.call(self._close_tier)
        finally:
            self._stack.close()  # stops the loop and joins its thread
            self._rows.release()
            self._life.end_close()
        self._take_answers()

    async def _close_tier(self) -> None:
        await self._tier.aclose()
        self._latest = self._tier.statistics()

    def __repr__(self) -> str:
        s = self._latest
        return (
            f"<RedisSecondaryTier [{self._life.state.value}, redis {s.state}; {self.url}; "
            f"{len(self._jobs)} jobs, {len(self._queued) + self._asked} lookups in flight; "
            f"{s.errors_total} failed calls, {s.rejected_total} rejected values]>"
        )
