"""Any of tiering's lower tiers as a secondary tier of vLLM's own ``TieringOffloadingSpec``.

vLLM's ``SecondaryTierManager`` is polled: the scheduler calls it under the
manager's lock, and every call must return at once. tiering's lower tiers
(`tiering.secondary.base.SecondaryTier`: the Redis tier, the disk tier) are
anyio-async, batched, and answer every outcome as a value. `PolledSecondaryTier`
maps the one onto the other; `RedisSecondaryTier` and `DiskSecondaryTier` add
only their entry's keys, namespace, medium and what they report.

Design note, threads: the adapter owns an event loop on a thread of its own
(an anyio blocking portal, started in the constructor, stopped by
`shutdown`). Every call from vLLM only hands work to that loop
(`tiering.integrations.vllm.handoff.Handoff`: queued, the loop woken, never
waited for) or collects what it finished from two thread-safe queues; it
never waits on the store, nor on the loop's thread (`get_finished_jobs` only
yields the GIL once, while work is out and nothing came back, so a scheduler
stepping without a model's forward does not starve that thread). The loop
thread touches only the tier, the queues and one snapshot of the statistics (a
reference swapped whole); the scheduler-side state (lookups, jobs, counters) is
touched by whichever thread holds vLLM's manager lock. Every tier call ends
within its ``timeout_s``, so `drain_jobs` and `shutdown` end too.

What vLLM's calls become:

- `lookup` is asynchronous: a key's first lookup answers ``RETRY`` and queues
  it; at the step's end (`on_schedule_end`) the queued keys go to the tier as
  one ``contains`` call (one round trip); a later lookup answers ``HIT`` or
  ``MISS``. vLLM's manager looks up past a ``RETRY``, so a whole prefix is
  asked in one step and answered by the next. Until the tier has started (the
  disk tier scans its folder) lookups stay queued and answer ``RETRY``. At
  most ``max_lookups_in_flight`` keys are queued or asked at once; past that a
  lookup answers ``RETRY`` without asking (counted, ``deferred``); the checks
  are kept by `tiering.integrations.vllm.polled_lookups.Lookups`.
- `submit_store` writes the job's rows straight from ``primary_kv_view``
  (vLLM pins them until the job is reported finished). At most
  ``max_store_jobs`` stores run at once; past that a store is failed at once
  and its chunks counted as dropped (``queue full``): the CPU tier keeps them.
  A request's retention hint (`RequestHints.given`: as `TieringSpec`'s manager
  or a tiering policy read it, else read here) goes with its chunks
  (``write_hinted``);
  `submit_hint` hands one to values the tier holds already (``hint``).
- `submit_load` reads each value straight into its row of ``primary_kv_view``;
  a value that is missing or fails a check fails that key only
  (``JobResult.successful_keys``), and the key's lookup turns to a miss so the
  scheduler recomputes it instead of promoting it again.

What the operator sees in vLLM's log (`tiering.integrations.vllm.logs` routes
the ``tiering`` loggers there): the tiers themselves log each change of their
state, once (down, back, writes backing off, writes accepted again); a tier
that cannot be used at all (its folder unusable) is one WARNING at start,
with the reason and what to check, and is then a tier of misses; and what was
lost (chunks not written, values rejected, stores dropped) is one line at most
every ``LOSS_REPORT_S``, with the counts since the last one
(`tiering.integrations.vllm.tier_report`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import logging
import queue
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

import anyio.from_thread
import anyio.lowlevel
import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiering._state import Lifecycle
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.integrations.vllm.handoff import Handoff
from tiering.integrations.vllm.logs import adopt_vllm_logging
from tiering.integrations.vllm.polled_lookups import Batch, Lookups
from tiering.integrations.vllm.request_hints import RequestHints
from tiering.integrations.vllm.tier_report import (
    ADAPTER_COUNTS,
    FAILURES,
    LOOKUPS_DEFERRED,
    LOSS_REPORT_S,
    REJECTED,
    WRITES_DROPPED,
    LossReport,
    PolledTierStatistics,
    TierReport,
    metric_definitions,
)
from tiering.secondary.base import SecondaryStatistics, SecondaryTier, TierCounters, describe
from tiering.secondary.refusals import Unwritten

__all__ = [
    "LOSS_REPORT_S",
    "LossReport",
    "PolledSecondaryTier",
    "PolledTierStatistics",
    "TierSetup",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class TierSetup(msgspec.Struct, frozen=True, kw_only=True):
    """What a subclass built from its entry: the tier (None: it cannot be used, and
    ``unusable`` says why) and the adapter's bounds."""

    tier: SecondaryTier | None
    locality: Locality
    max_lookups_in_flight: int
    max_store_jobs: int
    enable_kv_events: bool = False
    #: Start the tier in the constructor and raise its `ConfigError` (else at once on
    #: the tier's loop, a failure logged).
    start_now: bool = False
    unusable: str | None = None


class PolledSecondaryTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` over a tiering `SecondaryTier` (see the module
    docstring). Built by vLLM's ``SecondaryTierFactory`` with its keyword arguments; a
    subclass decodes its entry (`_setup`) and names what it reports."""

    medium: ClassVar[Medium] = Medium.STORAGE
    #: What the log and the metrics' help call the tier ("Redis tier", "disk tier").
    store: ClassVar[str]
    #: The prefix of its metrics' names (``vllm:kv_offload_redis_``).
    metric_prefix: ClassVar[str]
    #: Its metrics' help on refusals: what refusals look like on this store.
    refusal_examples: ClassVar[str] = "OOM, READONLY, ENOSPC..."

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        adopt_vllm_logging()
        setup = self._setup(offloading_spec, tier_type, entry)
        self.locality = setup.locality
        self._max_store_jobs = setup.max_store_jobs
        events_on = bool(offloading_spec.kv_events_config.enable_kv_cache_events)
        if setup.enable_kv_events and not events_on:
            logger.warning(
                "enable_kv_events is set on secondary tier %r but KV cache events are "
                "disabled (kv_events_config): the tier emits none",
                tier_type,
            )
        self._events: list[OffloadingEvent] | None = (
            [] if setup.enable_kv_events and events_on else None
        )
        self._tier = setup.tier
        #: Why the tier cannot be used (None: it can): lookups miss, stores are dropped.
        self.unusable = setup.unusable
        # Rows as bytes: chunk c is self._rows[c * row : (c + 1) * row].
        self._rows = primary_kv_view.cast("B")
        self._row_bytes = self.block_size_bytes
        self._lookups = Lookups(setup.max_lookups_in_flight)
        self._jobs: dict[int, concurrent.futures.Future[None]] = {}
        self._store_jobs: dict[int, list[OffloadKey]] = {}  # in flight
        self._load_jobs: dict[int, list[OffloadKey]] = {}  # in flight
        self._lookup_calls: set[concurrent.futures.Future[None]] = set()
        self._hint_calls: set[concurrent.futures.Future[None]] = set()
        #: The requests' hints, where no component above read them (`RequestHints.given`).
        self.request_hints = RequestHints(logger.warning)
        self._counts = dict.fromkeys(ADAPTER_COUNTS, 0)
        self._dropped: dict[str, int] = {}  # chunks failed at submit, by reason
        # Loop thread -> scheduler side:
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._late_drops = 0  # chunks of stores the tier took before it proved unusable
        self._unexpected = 0  # calls that raised (a bug in the tier), counted as failures
        self._last_unexpected: str | None = None
        self._latest = self._snapshot()
        self._report = TierReport(self.metric_prefix, self._latest)
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        self._handoff = Handoff()
        self._portal.start_task(self._handoff.run)
        self._life = Lifecycle(f"the secondary tier {tier_type!r}", opened=True)
        # Set once the tier has started (or proved unusable); every call waits for it.
        self._started: anyio.Event = self._portal.call(anyio.Event)
        self._start_call: concurrent.futures.Future[None] | None = None
        if self.unusable is not None:
            self._warn_unusable()
            self._portal.call(self._started.set)
        elif setup.start_now:
            try:
                self._portal.call(self._starting, True)
            except BaseException:
                self.shutdown()
                raise
        else:
            self._start_call = self._portal.start_task_soon(self._starting, False)

    # -- what a subclass gives ------------------------------------------------------

    @abc.abstractmethod
    def _setup(self, offloading_spec: Any, tier_type: str, entry: dict[str, Any]) -> TierSetup:
        """Decode ``entry`` (one `ConfigError` naming the key) and build the tier."""

    @abc.abstractmethod
    def _where(self) -> str:
        """Where the tier is, for the log (a URL without its password, a folder)."""

    def _check(self) -> str:
        """What the operator should check when the tier cannot be used."""
        return "its entry in secondary_tiers"

    async def _start_tier(self) -> None:
        """Start the tier (connect, scan); a `ConfigError` makes it unusable."""
        await anyio.lowlevel.checkpoint()

    # -- starting -------------------------------------------------------------------

    async def _starting(self, raising: bool) -> None:
        try:
            await self._start_tier()
        except ConfigError as exc:
            if raising:
                raise
            self.unusable = str(exc)
            self._warn_unusable()
        except Exception as exc:  # a bug in the tier: said once, the tier unused
            logger.exception("%s %r failed to start", self.store, self.tier_type)
            self.unusable = describe(exc)
        except anyio.get_cancelled_exc_class():  # `shutdown` during a long scan
            self.unusable = "shut down before it had started"  # waiting calls: no I/O
            raise
        finally:
            self._latest = self._snapshot()
            self._started.set()

    def _warn_unusable(self) -> None:
        logger.warning(
            "secondary tier %r (%s at %s) cannot be used: %s. Check %s. Until vLLM restarts, "
            "its lookups miss and its stores are dropped (counted in %s%s)",
            self.tier_type,
            self.store,
            self._where(),
            self.unusable,
            self._check(),
            self.metric_prefix,
            WRITES_DROPPED,
        )

    def _snapshot(self) -> SecondaryStatistics:
        if self._tier is not None:
            return self._tier.statistics()
        return TierCounters().snapshot(self.store, "down")

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: Any) -> LookupResult:
        if not self._life.is_open or self.unusable is not None:
            return LookupResult.MISS
        answer = self._lookups.lookup(key, req_context.req_id)
        if answer is None:
            self._counts["lookups_deferred"] += 1
            return LookupResult.RETRY
        return answer

    def on_schedule_end(self, context: Any) -> None:
        """Send this step's new lookups to the tier as one call (once it has started)."""
        if not self._life.is_open:
            return
        batch = self._lookups.take_batch()
        if not batch or self.unusable is not None:
            return
        self._lookups.sent(batch)
        call = self._handoff.submit(self._contains, batch)
        self._lookup_calls.add(call)
        call.add_done_callback(self._lookup_calls.discard)

    async def _contains(self, batch: Batch) -> None:
        keys = [key for key, _ in batch]
        found = await self._guarded("lookup", lambda t: t.contains(keys), [False] * len(batch))
        self._lookups.answered(batch, found)

    def on_request_finished(self, req_context: Any) -> None:
        self._lookups.finished(req_context.req_id)

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
        self._jobs[job.job_id] = self._handoff.submit(run, job.job_id, items)

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._counts["store_jobs"] += 1
        reason = None
        if not self._life.is_open:
            reason = Unwritten.CLOSED.value
        elif self.unusable is not None:
            reason = Unwritten.DOWN.value
        elif len(self._store_jobs) >= self._max_store_jobs:
            reason = Unwritten.QUEUE_FULL.value
        if reason is not None:
            self._counts["store_jobs_dropped"] += 1
            self._counts["chunks_dropped"] += len(keys)
            self._dropped[reason] = self._dropped.get(reason, 0) + len(keys)
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        context = job_metadata.req_context
        hint = self.request_hints.given(context) if context is not None else None
        self._start(self._store_jobs, job_metadata, lambda j, r: self._store(j, r, hint))

    async def _store(self, job_id: int, items: list[Any], hint: Hint | None) -> None:
        started = time.monotonic()
        write = (lambda t: t.write_hinted(items, hint)) if hint else (lambda t: t.write(items))
        written = await self._guarded("write", write, 0, len(items))
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
        if not self._life.is_open or self.unusable is not None:
            self._load_jobs[job_id] = keys
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        self._start(self._load_jobs, job_metadata, self._load)

    def submit_hint(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """Apply a request's retention ``hint`` to the values of ``keys`` the tier holds
        (a request's prefix found in the CPU tier is not written again, so its values
        here would never get its hint): one call on the tier's loop, not waited for; at
        most ``max_store_jobs`` at once, past that dropped and counted."""
        if not keys or not self._life.is_open or self.unusable is not None:
            return
        if len(self._hint_calls) >= self._max_store_jobs:
            self._counts["hints_dropped"] += 1
            return
        self._counts["hint_calls"] += 1
        call = self._handoff.submit(self._hint, list(keys), hint)
        self._hint_calls.add(call)
        call.add_done_callback(self._hint_calls.discard)

    async def _hint(self, keys: list[OffloadKey], hint: Hint) -> None:
        await self._guarded("hint", lambda t: t.hint(keys, hint), 0)

    async def _load(self, job_id: int, items: list[tuple[OffloadKey, memoryview]]) -> None:
        started = time.monotonic()
        filled = await self._guarded("read", lambda t: t.read(items), [False] * len(items))
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

    async def _guarded(
        self, what: str, call: Callable[[SecondaryTier], Awaitable[_T]], failed: _T, chunks: int = 0
    ) -> _T:
        """``await call(tier)`` once the tier has started, or ``failed`` if it is unusable
        (the ``chunks`` of a write counted as dropped) or the call raised: the tiers count
        their failures and answer them as values, so an exception is a bug (counted every
        time; logged with its traceback when it differs from the last one, so a bug hit
        at every step is one line, not one per step)."""
        await self._started.wait()
        if self.unusable is not None or self._tier is None:
            self._late_drops += chunks
            return failed
        try:
            return await call(self._tier)
        except Exception as exc:
            description = describe(exc)
            if description != self._last_unexpected:
                logger.exception(
                    "%s %s failed unexpectedly; the same error again is counted in %s%s, "
                    "not logged",
                    self.store,
                    what,
                    self.metric_prefix,
                    FAILURES,
                )
            # The loop thread's alone to change; the scheduler side only reads them.
            self._unexpected += 1
            self._last_unexpected = description
            return failed
        finally:
            self._latest = self._snapshot()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._finished.empty() and (self._jobs or self._lookups.asked):
            # Work is on the loop's thread and nothing came back: let that thread have
            # the GIL now (a scheduler stepping without a model's forward would hold it
            # for the interpreter's switch interval). Once a step, never a wait for it.
            time.sleep(0)
        self._lookups.take_answers()
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
        self._report_losses()
        return results

    def _load_failed(self, keys: list[OffloadKey], loaded: Collection[OffloadKey]) -> None:
        """A key that did not load is a miss from now on, so it is recomputed, not promoted."""
        self._counts["load_jobs_failed"] += 1
        done = set(loaded)
        for key in keys:
            if key in done:
                continue
            self._counts["keys_not_loaded"] += 1
            self._lookups.missing(key)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._lookups.in_flight or not self._finished.empty())

    def drain_jobs(self) -> None:
        """Wait until every submitted job has ended (each ends within the tier's timeout)."""
        concurrent.futures.wait(list(self._jobs.values()))

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until the tier has started and every job and lookup sent to it has ended;
        whether they all did.

        Not a vLLM call: for a caller that must know the tier's loop is quiet
        (a test, a drain before a reset that also wants the lookups answered).
        """
        calls = [*self._jobs.values(), *self._lookup_calls, *self._hint_calls]
        if self._start_call is not None:
            calls.append(self._start_call)
        _, running = concurrent.futures.wait(calls, timeout=timeout_s)
        return not running

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    # -- seeing state -----------------------------------------------------------

    @property
    def loss_report_s(self) -> float:
        """Least seconds between two lines of losses (`LOSS_REPORT_S`; a test sets it)."""
        return self._report.losses.interval_s

    @loss_report_s.setter
    def loss_report_s(self, seconds: float) -> None:
        self._report.losses.interval_s = seconds

    def _statistics(self) -> dict[str, Any]:
        """The adapter's counts, as `PolledTierStatistics`' fields."""
        return {
            "state": self._life.state.value,
            "lookups_in_flight": self._lookups.in_flight,
            "jobs_in_flight": len(self._jobs),
            "unexpected_errors": self._unexpected,
            "last_unexpected_error": self._last_unexpected,
            **self._counts,
        }

    def _dropped_by_reason(self) -> dict[str, int]:
        """Chunks the adapter failed itself, by reason (never handed to the tier)."""
        dropped = dict(self._dropped)
        if self._late_drops:
            down = Unwritten.DOWN.value
            dropped[down] = dropped.get(down, 0) + self._late_drops
        return dropped

    def _report_losses(self) -> None:
        """One line, at most every ``loss_report_s``, of what was lost since the last."""
        now = time.monotonic()
        if not self._report.losses.due(now):  # most steps: nothing to gather
            return
        lost = self._report.lost(self._latest, self._dropped_by_reason(), now)
        if lost is not None:
            logger.warning(
                "secondary tier %r (%s at %s) lost, since its last report: %s; counted in "
                "%s%s and %s%s",
                self.tier_type,
                self.store,
                self._where(),
                lost,
                self.metric_prefix,
                WRITES_DROPPED,
                self.metric_prefix,
                REJECTED,
            )

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions(cls.metric_prefix, cls.store, cls.refusal_examples)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """What changed since the last call, as vLLM's offloading stats (``None``: nothing)."""
        return self._report.stats(
            self._latest,
            self._dropped_by_reason(),
            {FAILURES: self._unexpected, LOOKUPS_DEFERRED: self._counts["lookups_deferred"]},
            up=self._latest.state == "up" and self.unusable is None,
        )

    # -- lifecycle --------------------------------------------------------------

    def shutdown(self) -> None:
        """Let every job and lookup end, close the tier, stop its thread. Idempotent."""
        if not self._life.begin_close():
            return
        if self._start_call is not None:
            self._start_call.cancel()  # a scan of a large folder: calls waiting for it miss
        try:
            concurrent.futures.wait([*self._jobs.values(), *self._lookup_calls, *self._hint_calls])
            if self._tier is not None:
                self._portal.call(self._close_tier)
        finally:
            self._portal.call(self._handoff.close)
            self._stack.close()  # stops the loop and joins its thread
            self._rows.release()
            self._life.end_close()
        self._lookups.take_answers()

    async def _close_tier(self) -> None:
        assert self._tier is not None
        await self._tier.aclose()
        self._latest = self._tier.statistics()

    def __repr__(self) -> str:
        s = self._latest
        health = "unusable" if self.unusable is not None else s.state
        return (
            f"<{type(self).__name__} [{self._life.state.value}, {self.store} {health}; "
            f"{self._where()}; {len(self._jobs)} jobs, {self._lookups.in_flight} "
            f"lookups in flight; {s.errors_total} failed calls, {s.rejected_total} rejected "
            "values]>"
        )
