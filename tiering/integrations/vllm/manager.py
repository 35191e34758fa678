"""`TieringOffloadingManager`: tiering's CPU tier as vLLM 0.33's scheduler-side manager.

vLLM's offloading connector calls an ``OffloadingManager`` once per block key
(``lookup``) and once per batch of keys (``prepare_load``, ``prepare_store``,
their ``complete_*``), always with the request's ``ReqContext``. This class
answers those calls with tiering's `tiering.cpu.manager.CPUOffloadingManager`
(its slots, chunk states and policy) and translates the types both ways.

Recency. vLLM never calls ``touch``: a request's accesses reach the manager
through the keys it loads and stores, and are committed when the request ends
(``on_request_finished``), head of the prefix first, as tiering's own engine
commits them. The keys are ordered by the position vLLM records for each
(``req_context.get_offload_key_position``), so stores that arrive out of order
(sliding-window backfills) still commit in prefix order. A request's keys live
in its context's scratch space (``set_state``), so nothing is kept for a
request that vLLM forgets.

Hints. A request's retention hint (`tiering.hints`: ``{"tiering": {"version": 1,
"retain_s": 600}}`` in its ``kv_transfer_params``, or a ``"tiering.retention"``
action of its ``kv_hints``) is read once, when vLLM announces the request
(``on_new_request``) by the manager's `RequestHints`, and kept in the
request's context (``set_state``). The tier gets it with the request's use
(``touch`` at the end, as above) and with each of its stores as they land
(`CPUOffloadingManager.hint`: the chunks a request stores are retained, or
released, from the moment they are held, not only once it ends); the tiers
below get it with the request's write-throughs (``write_hinted``), and a
retained request's promotions go first (`SecondaryLink`). A malformed
or unknown hint is counted, said once per kind in vLLM's log, and the request
goes on without it; never an error in a scheduler step. The counts reach
vLLM's metrics (`TieringMetrics`: ``hints{outcome=...}``, the released chunks
evicted first, the retentions the tier had to override, the chunks retained
now and whether the tier follows the hints).

Events. With KV events on, the tier's chunk events leave through vLLM's own
path (``take_events``, drained by the connector into vLLM's publisher) as
``OffloadingEvent`` records of medium CPU: a landed store is stored, an
eviction is removed, and a reset removes every chunk the tier held (never a
medium-less "all cleared", which a router would apply to its GPU state too),
except with self-describing events, where vLLM drops what it would describe the
removals with at the reset: there, as vLLM's native manager, nothing.

Resets. vLLM discards every job in flight at a reset and never completes
them (its stale-job threshold), so the tier is emptied at once
(``reset(force=True)``); vLLM has its workers finish the flushed jobs before any
new store is submitted, so a reused slot is never written twice at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import LookupResult as VllmLookupResult
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.cpu.manager import (
    AllChunksCleared,
    ChunksRemoved,
    ChunksStored,
    CPUOffloadingManager,
    LookupResult,
)
from tiering.hints import Hint, HintCounts
from tiering.integrations.vllm.link import SecondaryLink
from tiering.integrations.vllm.request_hints import RequestHints
from tiering.policies import CachePolicy
from tiering.policies.hints import DEFAULT_HINT_SHARE, HintStatistics

__all__ = ["TieringMetrics", "TieringOffloadingManager"]

logger = logging.getLogger(__name__)

_LOOKUP = {
    LookupResult.HIT: VllmLookupResult.HIT,
    LookupResult.MISS: VllmLookupResult.MISS,
    LookupResult.HIT_PENDING: VllmLookupResult.HIT_PENDING,
}


class TieringMetrics:
    """Names of the metrics `TieringOffloadingManager` reports besides vLLM's CPU-tier ones."""

    EVICTIONS = "vllm:kv_offload_tiering_cpu_evictions"
    ALLOCATION_FAILURES = "vllm:kv_offload_tiering_cpu_allocation_failures"
    STORE_FAILURES = "vllm:kv_offload_tiering_cpu_store_failures"  # a worker's or a promotion's
    #: Requests' hints by ``outcome``: `HINT_OUTCOMES` (`tiering.hints.HintCounts`' fields).
    HINTS = "vllm:kv_offload_tiering_hints"
    HINT_OUTCOME_LABEL = "outcome"
    HINT_OUTCOMES = tuple(HintCounts.__struct_fields__)
    #: Chunks evicted first because their request said its conversation was over.
    HINT_RELEASED_EVICTED = "vllm:kv_offload_tiering_hint_released_evicted"
    #: Retained chunks evicted before their deadline: a store needed room only they had.
    HINT_RETENTION_OVERRIDDEN = "vllm:kv_offload_tiering_hint_retention_overridden"
    #: Gauges: chunks retained (protected) now; 1 while the tier follows the hints.
    HINT_RETAINED = "vllm:kv_offload_tiering_hint_retained_chunks"
    HINT_FOLLOWING = "vllm:kv_offload_tiering_hint_following"


@dataclass(slots=True)
class _RequestKeys:
    """The keys one request loaded or stored, in the order first seen."""

    owner: object
    generation: int
    keys: dict[OffloadKey, None] = field(default_factory=dict)
    #: Of ``keys``: those it loaded from the CPU tier (its hint goes to their values below).
    loaded: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class TieringOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over a tiering `CPUOffloadingManager` of ``num_chunks``.

    ``policy`` is a tiering `CachePolicy` or a policy name
    (`tiering.policies.POLICY_NAMES`); ``hint_share`` the share of the tier requests'
    retention hints may protect. ``config_info`` is the one series of
    vLLM's ``kv_offload_config_info`` this tier reports.
    """

    def __init__(
        self,
        num_chunks: int,
        policy: CachePolicy | str,
        *,
        hint_share: float = DEFAULT_HINT_SHARE,
        enable_events: bool = False,
        self_describing_events: bool = False,
        config_info: ConfigInfoMapping | None = None,
        secondary: Callable[[], Sequence[SecondaryTierManager] | None] | None = None,
        secondary_labels: Sequence[str] = ("1:secondary",),
        on_shutdown: Callable[[], object] | None = None,
    ) -> None:
        self.medium = Medium.CPU
        self._tier = CPUOffloadingManager(
            num_chunks, policy, enable_events=enable_events, hint_share=hint_share
        )
        self._enable_events = enable_events
        # vLLM forgets the self-describing payloads of every chunk at a reset (before it
        # takes this reset's events), so it could only announce a removal of one hash
        # per chunk where the store named them all: then a reset announces nothing, as
        # vLLM's native manager does. Otherwise stores and removals name the same hash.
        self._reset_events = not self_describing_events
        self._config_info: ConfigInfoMapping = dict(config_info or {})
        self._generation = 0
        # Counts since the last get_stats(), for vLLM's counters (which add deltas).
        self._reported: dict[tuple[str, str], int] = {}
        #: Reads each request's hint once; counts what it ignored or refused.
        self.request_hints = RequestHints(logger.warning)
        self._allocation_sizes: list[int] = []
        #: The tiers below, when configured (built once the rows can be mapped), labelled
        #: ``secondary_labels`` in vLLM's metrics.
        self.link = (
            SecondaryLink(self._tier, secondary, secondary_labels, hint_of=self.hint_of)
            if secondary is not None
            else None
        )
        self._on_shutdown = on_shutdown
        #: Where tiering's own metrics of this tier are served (``metrics_port``), if asked.
        self.metrics_url: str | None = None

    @property
    def tier(self) -> CPUOffloadingManager:
        """The tiering manager behind this one (for its `statistics`)."""
        return self._tier

    # -- requests ---------------------------------------------------------------

    def _request(self, req_context: ReqContext) -> _RequestKeys:
        state: _RequestKeys | None = req_context.get_state(_RequestKeys)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestKeys(owner=self, generation=self._generation)
            req_context.set_state(state)
        return state

    def hint_of(self, req_context: ReqContext) -> Hint | None:
        """The request's hint, read from its channels the first time it is asked."""
        return self.request_hints.of(req_context)

    @property
    def hint_counts(self) -> HintCounts:
        """What the requests' channels carried (a copy): hints taken, ignored, refused."""
        return self.request_hints.counts

    def hint_statistics(self) -> HintStatistics:
        """What the tier's hints hold and did (`tiering.policies.hints.HintBook`)."""
        return self._tier.hints.statistics()

    def _observe(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        state = self._request(req_context)
        if not state.finished:
            state.keys.update(dict.fromkeys(keys))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        self.hint_of(req_context)
        if self.link is not None:
            self.link.on_new_request(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.link is not None:  # whatever this manager's own state says of the request
            self.link.on_request_finished(req_context)
        state = req_context.get_state(_RequestKeys)
        if (
            state is None
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        keys = list(state.keys)
        if not keys:
            return
        positions = [req_context.get_offload_key_position(key) for key in keys]
        if None not in positions:
            order = sorted(range(len(keys)), key=positions.__getitem__)  # stable: group order
            keys = [keys[i] for i in order]
        # Only what the tier still holds: the policy reads the last key as the request's tail.
        held = [key for key in keys if self._tier.holds(key)]
        hint = self.hint_of(req_context)
        self._tier.touch(held, hint)
        if hint is not None and hint.retains and self.link is not None:  # not written again
            self.link.hint_below([key for key in keys if key in state.loaded], hint)

    # -- the tier ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> VllmLookupResult:
        link = self.link
        if link is None:
            return _LOOKUP[self._tier.lookup(key)]
        link.poll()  # promotions read since the last step are hits now
        found = self._tier.lookup(key)
        if found is LookupResult.MISS:
            return link.lookup(key, req_context)
        link.held(key, req_context)  # the request's promotions must not evict it
        return _LOOKUP[found]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = tuple(keys)
        spec = self._tier.prepare_load(keys)
        self._observe(keys, req_context)
        if self.link is not None:
            self._request(req_context).loaded.update(keys)
        return VllmCPULoadStoreSpec(spec.block_ids.tolist())

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tier.complete_load(tuple(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = tuple(keys)
        state = self._request(req_context)
        # The request's own prefix (the chunks it loaded or stored before) is in use:
        # a store of it evicts other chunks first, as vLLM's native manager ranks a
        # request's accesses as it goes. Pinned for this try only (not counted as a
        # load); when nothing else can make room, the store may evict them after all.
        tier = self._tier
        self._observe(keys, req_context)
        offered = set(keys)
        own = [key for key in state.keys if key not in offered and tier.holds(key, ready=True)]
        out = None
        if own:
            tier.prepare_load(own, count=False)
            try:
                out = tier.prepare_store(keys, count=False)
            finally:
                tier.complete_load(own)
        if out is None:
            out = tier.prepare_store(keys)
        if out is None:
            return None
        if out.keys_to_store:
            self._allocation_sizes.append(len(out.keys_to_store))
        return PrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=VllmCPULoadStoreSpec(out.store_spec.block_ids.tolist()),
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        keys = tuple(keys)
        tier = self._tier
        if self.link is None or not success:
            tier.complete_store(keys, success)
        else:
            landing = [key for key in keys if tier.holds(key) and not tier.holds(key, ready=True)]
            tier.complete_store(keys, success)
            self.link.landed(landing, req_context)
        hint = self.hint_of(req_context)
        if success and hint is not None:  # the request's stores carry its hint as they land
            tier.hint(keys, hint)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self.link is not None:
            self.link.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.link is not None and self.link.has_pending_work()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._tier.touch([key for key in keys if self._tier.holds(key)])

    def reset_cache(self) -> None:
        if self.link is not None:
            self.link.reset()  # no job of the secondary tier uses the rows any more
        self._tier.reset(force=True)
        self._generation += 1

    def on_reset_flushed(self) -> None:
        if self.link is not None:
            self.link.on_reset_flushed()

    # -- what vLLM reads --------------------------------------------------------

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.link is not None:
            yield from self.link.take_events()  # the secondary tier's own (it owns them)
        if not self._enable_events:
            return
        for event in self._tier.take_events():
            if isinstance(event, ChunksStored):
                yield OffloadingEvent(keys=list(event.keys), medium=self.medium, removed=False)
            elif isinstance(event, ChunksRemoved) or (
                isinstance(event, AllChunksCleared) and event.keys and self._reset_events
            ):
                yield OffloadingEvent(keys=list(event.keys), medium=self.medium, removed=True)

    def get_stats(self) -> OffloadingConnectorStats:
        stats = self._tier.statistics()
        out = OffloadingConnectorStats()
        capacity = stats.capacity
        # vLLM's CPU-tier gauges, with its meanings: the share of slots in use by
        # transfers (pinned by a load, or being written), and of each kind.
        busy = (stats.used - stats.evictable) / capacity
        writing = stats.writing / capacity
        out.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, busy)
        out.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing)
        out.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(busy - writing, 0.0))
        for size in self._allocation_sizes:
            out.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        now: dict[tuple[str, str], int] = {
            (TieringMetrics.EVICTIONS, ""): stats.evictions_total,
            (TieringMetrics.ALLOCATION_FAILURES, ""): stats.allocation_failures_total,
            (TieringMetrics.STORE_FAILURES, ""): stats.store_failed_total,
        }
        hints = stats.hints  # None until the tier saw a hint: no sample that says otherwise
        if hints is None and (TieringMetrics.HINT_RELEASED_EVICTED, "") in self._reported:
            hints = self._tier.hints.statistics()  # reset since: what it holds now is news
        if hints is not None:
            out.set_gauge(TieringMetrics.HINT_RETAINED, hints.retained)
            out.set_gauge(TieringMetrics.HINT_FOLLOWING, int(self._tier.hints.following))
            now[TieringMetrics.HINT_RELEASED_EVICTED, ""] = hints.released_evicted_total
            now[TieringMetrics.HINT_RETENTION_OVERRIDDEN, ""] = hints.retention_overridden_total
        for outcome, count in self.request_hints.as_dict().items():
            now[TieringMetrics.HINTS, outcome] = count
        for (name, label), total in now.items():  # vLLM's counters add deltas
            delta = total - self._reported.get((name, label), 0)
            out.increase_counter(name, delta, (label,) if label else ())
        self._reported.update(now)
        return out if self.link is None else self.link.add_stats(out)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown()  # e.g. the spec unmaps the rows it shared with the tier
            self._on_shutdown = None

    def __repr__(self) -> str:
        return f"<TieringOffloadingManager {self._tier!r}>"
