"""tiering's Redis tier as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

A ``secondary_tiers`` entry loads it::

    {"type": "RedisSecondaryTier", "module_path": "tiering.integrations.vllm",
     "url_env": "TIERING_REMOTE_URL", "namespace": "prod", "timeout_s": 2.0}

``url_env`` names the environment variable holding the URL (password included),
or ``url`` gives a URL without a password and ``password_file`` the file whose
first line is the password: vLLM logs ``--kv-transfer-config`` at startup, so
the entry itself should hold no secret (a ``url`` with a password is warned of).

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
from collections.abc import Collection, Iterable, Mapping
from typing import Any, ClassVar

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

from tiering._state import ResourceState
from tiering.errors import ConfigError
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import Locality as TierLocality
from tiering.secondary.base import SecondaryStatistics, describe
from tiering.secondary.codec import RemoteNamespace
from tiering.secondary.redis import RedisTier, redact_url
from tiering.secondary.redis.address import resolve_url

__all__ = ["RedisSecondaryTier", "RedisSecondaryTierStatistics", "remote_namespace"]

logger = logging.getLogger(__name__)

#: Why chunks handed to `submit_store` were not written, beside `RedisTier`'s reasons.
DROPPED_QUEUE_FULL = "queue full"
DROPPED_CLOSED = "closed"

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
#: The keys of a ``secondary_tiers`` entry that vLLM's factory reads, not the tier.
_VLLM_ENTRY_KEYS = frozenset({"type", "module_path", "backpressure"})


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

    Entry keys (beside vLLM's ``type``, ``module_path`` and ``backpressure``):
    ``url_env`` (the name of an environment variable holding the URL) or ``url``
    (``redis://`` or ``rediss://``, as `RedisTier` takes it), ``password_file``
    (the password, read from a file's first line, for a URL that holds none),
    ``namespace`` (an operator's split of one store), ``ttl_s``, ``timeout_s``,
    ``connect_timeout_s``, ``cluster``, ``max_batch``, ``max_concurrency``,
    ``backoff_s`` (``[first, longest]``), ``checksum`` (``xxh3`` or ``ml64``),
    ``auth_key_file`` (a file holding the secret shared by every engine of the
    store: values are written with a MAC under it and only values with a valid
    one are loaded; without it, the variable ``TIERING_AUTH_KEY`` if set),
    ``locality`` (``REMOTE`` or ``LOCAL``), ``max_lookups_in_flight``,
    ``max_store_jobs``, ``enable_kv_events`` (``BlockStored`` events for
    chunks written; Redis evicts and expires values on its own, so no removal
    is ever announced) and ``connect_on_start`` (connect in the constructor and
    raise `ConfigError` for a wrong URL, credentials or server; by default
    the first call connects, and a server that is away is only counted).
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
        options = _Options(tier_type, entry)
        self.locality = Locality(options.locality.value)
        self.namespace = remote_namespace(
            offloading_spec.config, self.block_size_bytes, options.namespace
        )
        self._max_lookups = options.max_lookups_in_flight
        self._max_store_jobs = options.max_store_jobs
        events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if options.enable_kv_events and not events_on:
            logger.warning(
                "enable_kv_events is set on secondary tier %r but KV cache events are "
                "disabled (kv_events_config): the tier emits none",
                tier_type,
            )
        self._events: list[OffloadingEvent] | None = (
            [] if options.enable_kv_events and events_on else None
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
        self._state = ResourceState.OPEN
        if options.connect_on_start:
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
        if self._state is not ResourceState.OPEN:
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
        if not self._queued or self._state is not ResourceState.OPEN:
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
        try:
            found = await self._tier.contains([key for key, _ in batch])
        except Exception as exc:  # RedisTier answers failures as misses; this is a bug
            logger.exception("Redis tier lookup failed unexpectedly")
            self._tier_bug(exc)
            found = [False] * len(batch)
        self._latest = self._tier.statistics()
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

    def _row(self, chunk_id: Any) -> memoryview:
        start = int(chunk_id) * self._row_bytes
        return self._rows[start : start + self._row_bytes]

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._counts["store_jobs"] += 1
        if self._state is not ResourceState.OPEN or len(self._store_jobs) >= self._max_store_jobs:
            reason = DROPPED_QUEUE_FULL if self._state is ResourceState.OPEN else DROPPED_CLOSED
            self._counts["store_jobs_dropped"] += 1
            self._counts["chunks_dropped"] += len(keys)
            self._dropped[reason] = self._dropped.get(reason, 0) + len(keys)
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        items = [(k, self._row(c)) for k, c in zip(keys, job_metadata.chunk_ids, strict=True)]
        self._store_jobs[job_id] = keys
        self._jobs[job_id] = self._portal.start_task_soon(self._store, job_id, items)

    async def _store(self, job_id: int, items: list[tuple[OffloadKey, memoryview]]) -> None:
        started = time.monotonic()
        try:
            written = await self._tier.write(items)
        except Exception as exc:  # RedisTier counts failures itself; this is a bug
            logger.exception("Redis tier write failed unexpectedly")
            self._tier_bug(exc)
            written = 0
        self._latest = self._tier.statistics()
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
        if self._state is not ResourceState.OPEN:
            self._load_jobs[job_id] = keys
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        items = [(k, self._row(c)) for k, c in zip(keys, job_metadata.chunk_ids, strict=True)]
        self._load_jobs[job_id] = keys
        self._jobs[job_id] = self._portal.start_task_soon(self._load, job_id, items)

    async def _load(self, job_id: int, items: list[tuple[OffloadKey, memoryview]]) -> None:
        started = time.monotonic()
        try:
            filled = await self._tier.read(items)
        except Exception as exc:  # RedisTier answers failures as misses; this is a bug
            logger.exception("Redis tier read failed unexpectedly")
            self._tier_bug(exc)
            filled = [False] * len(items)
        self._latest = self._tier.statistics()
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

    def _tier_bug(self, exc: Exception) -> None:
        # The loop thread's alone to change; the scheduler thread only reads it.
        self._unexpected += 1
        self._last_unexpected = describe(exc)

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
            state=self._state.value,
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
        _Options(tier_type, {k: v for k, v in entry.items() if k not in _VLLM_ENTRY_KEYS})

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
        if self._state is not ResourceState.OPEN:
            return
        self._state = ResourceState.CLOSING
        try:
            concurrent.futures.wait([*self._jobs.values(), *self._lookup_calls])
            self._portal.call(self._close_tier)
        finally:
            self._stack.close()  # stops the loop and joins its thread
            self._rows.release()
            self._state = ResourceState.CLOSED
        self._take_answers()

    async def _close_tier(self) -> None:
        await self._tier.aclose()
        self._latest = self._tier.statistics()

    def __repr__(self) -> str:
        s = self._latest
        return (
            f"<RedisSecondaryTier [{self._state.value}, redis {s.state}; {self.url}; "
            f"{len(self._jobs)} jobs, {len(self._queued) + self._asked} lookups in flight; "
            f"{s.errors_total} failed calls, {s.rejected_total} rejected values]>"
        )


def remote_namespace(config: Any, row_bytes: int, namespace: str = "") -> RemoteNamespace:
    """The namespace of the rows vLLM's scheduler-side CPU tier holds for ``config``.

    ``config`` is vLLM's ``OffloadingConfig``. A row of that tier holds a
    chunk's bytes of every worker, so the shard is the whole parallel layout
    (sizes and the host layout), not one rank's place in it.
    """
    p = config.parallel
    shard = (
        f"all{p.world_size}.tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}"
        f".{config.kv_cache_layout or 'default'}"
        f"{'.canonical' if config.canonical_layout else ''}"
        f"{'.replicated' if config.replicated_layout else ''}"
    )
    return RemoteNamespace(
        model=config.model.name,
        dtype=config.model.dtype,
        row_bytes=row_bytes,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        page_bytes=(config.worker_kv_bytes_per_block,),
        tokens_per_block=tuple(g.tokens_per_block for g in config.groups),
        shard=shard,
        namespace=namespace,
    )


class _Options:
    """A ``secondary_tiers`` entry, checked: one `ConfigError` naming the key per bad value."""

    _NUMBERS = ("ttl_s", "timeout_s", "connect_timeout_s")
    _INTEGERS = ("max_batch", "max_concurrency")
    _KNOWN = (
        "url",
        "url_env",
        "password_file",
        "namespace",
        *_NUMBERS,
        *_INTEGERS,
        "cluster",
        "backoff_s",
        "checksum",
        "auth_key_file",
        "locality",
        "max_lookups_in_flight",
        "max_store_jobs",
        "enable_kv_events",
        "connect_on_start",
    )

    def __init__(self, tier_type: str, entry: Mapping[str, Any]) -> None:
        self._where = f"secondary tier {tier_type!r} (RedisSecondaryTier)"
        unknown = sorted(set(entry) - set(self._KNOWN))
        if unknown:
            raise ConfigError(
                f"{self._where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"it takes {', '.join(self._KNOWN)}"
            )
        url, url_env, password_file = (entry.get(k) for k in ("url", "url_env", "password_file"))
        for key, value in (("url_env", url_env), ("password_file", password_file)):
            if value is not None and not isinstance(value, str):
                self._bad(key, value, "a string")
        #: Whether the entry itself holds a password: vLLM logs the entry at startup.
        self.password_in_entry = False
        if url_env is None:
            if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
                shown = "no url" if url is None else f"{type(url).__name__} {_shown(url)}"
                if isinstance(url, str):  # never a password
                    shown = repr(redact_url(url))
                raise ConfigError(
                    f"{self._where}: 'url' must be a Redis URL, redis://[user@]host"
                    f"[:port][/db] or rediss://... for TLS (with 'password_file' for the "
                    f"password), or 'url_env' the name of an environment variable holding "
                    f"it; got {shown}"
                )
            self.password_in_entry = ":" in url.partition("://")[2].rpartition("@")[0]
        try:
            self.url = resolve_url(url, url_env=url_env, password_file=password_file)
        except ConfigError as exc:
            raise ConfigError(f"{self._where}: {exc}") from None
        if not self.url.startswith(("redis://", "rediss://")):
            raise ConfigError(
                f"{self._where}: the environment variable {url_env} must hold a Redis URL, "
                f"redis://[user[:password]@]host[:port][/db] or rediss://..., got "
                f"{redact_url(self.url)!r}"
            )
        namespace = entry.get("namespace", "")
        if not isinstance(namespace, str):
            self._bad("namespace", namespace, "a string (an operator's split of one store)")
        self.namespace = namespace
        self.redis: dict[str, Any] = {}
        for key in self._NUMBERS:
            value = entry.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                self._bad(key, value, "a number of seconds")
            if value is not None:
                self.redis[key] = float(value)
        for key in self._INTEGERS:
            if key in entry:
                self.redis[key] = self._integer(entry, key, 1)
        if "cluster" in entry:
            cluster = entry["cluster"]
            if cluster is not None and not isinstance(cluster, bool):
                self._bad("cluster", cluster, "true, false or null (detect it)")
            self.redis["cluster"] = cluster
        if "backoff_s" in entry:
            backoff = entry["backoff_s"]
            if (
                not isinstance(backoff, list | tuple)
                or len(backoff) != 2
                or any(isinstance(v, bool) or not isinstance(v, int | float) for v in backoff)
                or not 0 < backoff[0] <= backoff[1]
            ):
                self._bad("backoff_s", backoff, "[first, longest] seconds, 0 < first <= longest")
            self.redis["backoff_s"] = (float(backoff[0]), float(backoff[1]))
        if "checksum" in entry:
            checksum = entry["checksum"]
            if not isinstance(checksum, str) or checksum.lower() not in ("xxh3", "ml64"):
                self._bad("checksum", checksum, "'xxh3' or 'ml64'")
            self.redis["checksum"] = checksum
        key_file = entry.get("auth_key_file")
        if key_file is not None and not isinstance(key_file, str):
            self._bad("auth_key_file", key_file, "the path of a file holding the key")
        try:  # else $TIERING_AUTH_KEY, if set: no secret in the entry, which vLLM logs
            self.redis["auth_key"] = AuthKey.load(key_file)
        except ConfigError as exc:
            source = "'auth_key_file'" if key_file is not None else "$TIERING_AUTH_KEY"
            raise ConfigError(f"{self._where}: {source}: {exc}") from None
        locality = entry.get("locality") or "REMOTE"
        if not isinstance(locality, str) or locality.upper() not in ("LOCAL", "REMOTE"):
            self._bad("locality", locality, "'REMOTE' (shared with other engines) or 'LOCAL'")
        self.locality = TierLocality(locality.upper())
        self.redis["locality"] = self.locality
        self.max_lookups_in_flight = self._integer(entry, "max_lookups_in_flight", 1, 4096)
        self.max_store_jobs = self._integer(entry, "max_store_jobs", 1, 64)
        self.enable_kv_events = self._flag(entry, "enable_kv_events")
        self.connect_on_start = self._flag(entry, "connect_on_start")

    def _bad(self, key: str, value: object, right: str) -> None:
        raise ConfigError(f"{self._where}: {key!r} must be {right}, got {_shown(value)}")

    def _integer(self, entry: Mapping[str, Any], key: str, least: int, default: int = 0) -> int:
        value = entry.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            self._bad(key, value, f"an integer of at least {least}")
        return int(value)

    def _flag(self, entry: Mapping[str, Any], key: str) -> bool:
        value = entry.get(key, False)
        if not isinstance(value, bool):
            self._bad(key, value, "true or false")
        return bool(value)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
