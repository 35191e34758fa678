"""`SecondaryLink`: `TieringSpec`'s CPU tier over the tiers below it, on vLLM's scheduler thread.

Each tier below is a vLLM ``SecondaryTierManager`` (tiering's `DiskSecondaryTier`
or `RedisSecondaryTier`, or a `tiering.integrations.vllm.ranks.RankedTier` of
one per worker): every call returns at once, its I/O runs on its own thread,
and what finished is collected with ``get_finished_jobs``. The tiers are in
order (a disk, then a shared Redis: the engine's `tiering.secondary.chain.TierChain`).
This link is the CPU tier's side, and runs only in the calls vLLM makes to the
manager, so the tiering manager is never entered from another thread:

- **Write-through, per tier.** A store that lands in the CPU tier (`landed`)
  is handed to every tier as a store job of its own, its chunks pinned for it
  (so nothing evicts them while their rows are read); the pins go when the
  job finishes. A landed batch that would take one tier's pins past its share
  of half the CPU tier is not written to that tier (the whole batch, as in the
  engine) and is counted for it (``cascade_dropped``): the GPU path never
  waits for a tier, and a slow Redis never holds back the disk.
- **Promotion, from the first tier that has the chunk.** A chunk the CPU tier
  misses is looked up in the tiers in order (each answers ``RETRY`` until it
  knows; a lower tier is asked at the same time, so its answer is ready when
  the one above says it lacks the chunk). A chunk a tier holds, with every
  tier above it having said it lacks it, is promoted: at the end of the step
  (`on_schedule_end`) fresh CPU slots are allocated for the step's promotions
  of a request (the chunks are being written meanwhile: lookups say pending,
  nothing evicts them) and each tier reads its share in one load job. A
  chunk that found no room, or did not load, is answered ``MISS`` for the next
  step, so vLLM recomputes it. A chunk a lower tier gave is then written
  through to the tiers above it, so the next lookup finds it closer. What the
  tiers finished is collected at the step's first lookup (`poll`), before the
  CPU tier answers: a prefix asked in one step and answered in the next is
  loading in the step after (tests/vllm/test_promotion_steps.py).
- **Promote-ahead for retained requests.** vLLM looks a waiting request up
  before it runs; the link queues every chunk the tiers hold as the tiers
  answer. A step's promotions are reserved request by request, and all or
  none (their slots are fresh; a chunk still being written is not evictable),
  so when the CPU tier is short of room the requests reserved first win and
  the others are recomputed. A request whose hint retains (``hint_of``:
  `tiering.hints`) is reserved first (higher priority first), and its promoted
  chunks carry its hint, so other promotions and stores do not evict them
  (within the hints' share of the tier) before it is scheduled and loads them.
  The chunks of a request's write-throughs carry its hint to the tiers below
  (`tiering.integrations.vllm.polled`); the prefix it found in the CPU tier is
  never written again, so its values below get a retention when it ends
  (`hint_below`: a Redis TTL raised, the disk tier's values spared). Not a
  release: that prefix may be shared with other conversations (a system
  prompt), and the tiers below cannot tell (a Redis TTL lowered for all).
- **Resets.** `reset` waits for the tiers' jobs in flight (each ends within
  its timeout): their rows are about to be handed out again (so what a
  promotion it settles gave is not written up: no job may read them). Until vLLM's
  workers have reported the jobs flushed by the reset (``on_reset_flushed``), a
  late copy of theirs may still write a freed row, so nothing is promoted
  (lookups miss) and nothing is written through (counted as dropped).

Every decision of these (what is pinned or dropped, the bound split between
the tiers, the slots of a promotion and what it keeps, what a lower tier's
chunk is written up to, the fence, the counts) is `tiering.cpu.flows.Flows`'s,
the same core the engine's `TierChain` drives; the link is its shell on
vLLM's polled calls: it submits the jobs, collects them, and answers vLLM's
lookups.

vLLM's metrics get each tier's counts labelled by tier as vLLM's own
``TieringOffloadingSpec`` labels them (``tier="<index from 1>:<type>"``, the
CPU tier being ``0:primary``): the link's write-through and promotion
counters, and vLLM's own ``kv_offload_tiering_chunk_queries`` and
``_chunk_hits`` (a request's lookups of a chunk in a tier that resolved, each
counted once).

The CPU tier's rows are host memory the workers share with the scheduler
(`tiering.transfer.HostMemoryPool` in ``/dev/shm``); ``tier_factory`` builds
the tiers once that memory can be mapped (the workers register after the
scheduler is built), and returns None until then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import (
    SecondaryTierManager,
    TieringOffloadingMetrics,
    TransferJob,
)

from tiering.cpu.flows import (
    FlowCounts,
    Flows,
    Keep,
    PromotionTicket,
    WriteTicket,
    default_pin_bound,
)
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.hints import MAX_PRIORITY, Hint
from tiering.integrations.vllm.polled import LOSS_REPORT_S, LossReport, PolledSecondaryTier
from tiering.integrations.vllm.ranks import RankedTier

__all__ = ["CascadeMetrics", "SecondaryLink", "tier_label"]

logger = logging.getLogger(__name__)


def tier_label(index: int, tier_type: str) -> str:
    """vLLM's label of the tier at ``index`` below the CPU tier (0: the first), as its
    ``TieringMetricsTracker.tier_label`` writes it."""
    return f"{index + 1}:{tier_type}"


class CascadeMetrics:
    """Counters `SecondaryLink` reports to vLLM (chunks), labelled by tier."""

    WRITTEN = "vllm:kv_offload_tiering_cascade_written"
    DROPPED = "vllm:kv_offload_tiering_cascade_dropped"
    FAILED = "vllm:kv_offload_tiering_cascade_failed"
    PROMOTED = "vllm:kv_offload_tiering_promoted"
    PROMOTE_FAILED = "vllm:kv_offload_tiering_promote_failed"
    #: vLLM's own names, with vLLM's meanings (its ``TieringOffloadingMetrics``).
    QUERIES = TieringOffloadingMetrics.CHUNK_QUERIES
    HITS = TieringOffloadingMetrics.CHUNK_HITS

    DOCS: ClassVar[dict[str, str]] = {
        WRITTEN: "Chunks written through from the CPU tier to a tier below, labeled by tier.",
        DROPPED: (
            "Landed chunks not written through to a tier: its write-throughs pinned their "
            "share of half the CPU tier, labeled by tier."
        ),
        FAILED: "Chunks handed to a tier below that it did not write, labeled by tier.",
        PROMOTED: "Chunks read from a tier below into the CPU tier, labeled by tier.",
        PROMOTE_FAILED: (
            "Chunks to promote from a tier that found no CPU room or did not load, labeled by tier."
        ),
        QUERIES: "Number of chunk lookup queries sent to a tier, labeled by tier.",
        HITS: "Number of chunk lookup hits in a tier, labeled by tier.",
    }


#: The counts `SecondaryLink` reports in vLLM's log: chunks a tier did not take or give.
_LOSSES = {
    CascadeMetrics.DROPPED: "not written through (dropped: write-throughs pinned the "
    "tier's share of half the CPU tier)",
    CascadeMetrics.FAILED: "not written through (failed by the tier)",
    CascadeMetrics.PROMOTE_FAILED: "not promoted (no CPU room, or not loaded)",
}


class _Reading:
    """A promotion out: its ticket, the tiers still reading their share, what loaded."""

    __slots__ = ("loaded", "req_context", "ticket", "waiting")

    def __init__(self, ticket: PromotionTicket, req_context: ReqContext) -> None:
        self.ticket = ticket
        self.req_context = req_context
        self.waiting = set(ticket.sources)
        self.loaded: set[OffloadKey] = set()


class _Observed:
    """A request's (tier, chunk) lookups that resolved: each is counted once."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: set[tuple[int, OffloadKey]] = set()


#: Seconds of lookups without any worker's rows before the link says so and looks less.
POOL_WAIT_S = 10.0


def _no_hint(req_context: ReqContext) -> Hint | None:
    return None


class SecondaryLink:
    """The CPU tier ``cpu`` over the tiers ``tier_factory`` builds, in order (None until
    they can be built), labelled ``labels`` (`tier_label`); "tier" here is always a
    tier below the CPU tier. ``hint_of`` gives a request's retention hint."""

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        tier_factory: Callable[[], Sequence[SecondaryTierManager] | None],
        labels: Sequence[str] = ("1:secondary",),
        hint_of: Callable[[ReqContext], Hint | None] = _no_hint,
    ) -> None:
        self._cpu = cpu
        self._hint_of = hint_of
        self._factory: Callable[[], Sequence[SecondaryTierManager] | None] | None = tier_factory
        self.labels = tuple(labels)
        self.tiers: tuple[SecondaryTierManager, ...] = ()
        self.flows = Flows(cpu, self.labels, pin_bound=default_pin_bound(cpu.capacity))
        self.flows.open_intake()
        # vLLM's job id -> the write-through, per tier (a tier's job ids are its own).
        self._writes: list[dict[int, WriteTicket]] = [{} for _ in self.labels]
        self._promotions: dict[int, _Reading] = {}  # the ticket's number -> the promotion
        self._promoting: set[OffloadKey] = set()  # queued or being read
        self._queued: dict[OffloadKey, tuple[ReqContext, int]] = {}  # -> request, source
        self._miss_once: set[OffloadKey] = set()  # no room, or did not load: recompute
        self._polled = False  # whether this step's first lookup collected the tiers' jobs
        self._held: dict[str, list[OffloadKey]] = {}  # per request: CPU hits this step
        #: Whether building the tiers failed (logged; the CPU tier goes on alone).
        self.unavailable = False
        # Looking for the workers' pools (a sweep and a listing of /dev/shm): at every
        # call while vLLM starts, then at most once a second, with one warning.
        self._waiting_since: float | None = None
        self._next_look = 0.0
        self._lookups = [[0, 0] for _ in self.labels]  # per tier: queries, hits
        self._reported: dict[tuple[str, str], int] = {}
        self._losses = [LossReport(LOSS_REPORT_S) for _ in self.labels]

    @property
    def secondary(self) -> SecondaryTierManager | None:
        """The first tier below (None until built)."""
        return self.tiers[0] if self.tiers else None

    def _ready(self) -> tuple[SecondaryTierManager, ...]:
        if not self.tiers and self._factory is not None:
            now = time.monotonic()
            if now < self._next_look:
                return ()
            try:
                built = self._factory()
                if built is not None and len(built) != len(self.labels):
                    for tier in built:
                        tier.shutdown()
                    raise ConfigError(
                        f"{len(built)} tiers were built for {len(self.labels)} labels "
                        f"({', '.join(self.labels)})"
                    )
            except Exception as exc:
                # Mid-serving, in a vLLM call: the engine goes on without the tiers. The
                # operator's error (a worker's pool not on this host) is one line; any
                # other is a bug, shown with its traceback.
                logger.error(
                    "secondary tiers cannot be built: %s; the CPU tier goes on without them "
                    "until vLLM restarts",
                    exc if isinstance(exc, ConfigError) else repr(exc),
                    exc_info=not isinstance(exc, ConfigError),
                )
                self._factory = None
                self.unavailable = True
                return ()
            if built is not None:
                self.tiers = tuple(built)
                self._factory = None
            else:
                self._not_built_yet(now)
        return self.tiers

    def _not_built_yet(self, now: float) -> None:
        """No worker has shared its rows yet: after `POOL_WAIT_S`, look once a second and
        say so once (a scheduler on a node that runs none of its workers)."""
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since >= POOL_WAIT_S:
            if self._next_look == 0.0:
                logger.warning(
                    "no worker of this engine has shared its CPU-tier rows on this host "
                    "after %g s, so the tiers below (%s) are not used yet: TieringSpec's "
                    "tiers below need every worker on the scheduler's node; looking once a "
                    "second",
                    POOL_WAIT_S,
                    ", ".join(self.labels),
                )
            self._next_look = now + 1.0

    # -- vLLM's calls, forwarded --------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The answer for a chunk the CPU tier misses."""
        if self.flows.fenced or key in self._miss_once:
            return LookupResult.MISS
        if key in self._promoting:
            return LookupResult.RETRY
        undecided = False  # a tier above has not answered yet
        for index, tier in enumerate(self._ready()):
            found = tier.lookup(key, req_context)
            if found is LookupResult.RETRY:
                undecided = True
                continue
            self._observe(index, key, found, req_context)
            if found is LookupResult.HIT:
                if undecided:
                    return LookupResult.RETRY  # read it from the closest tier that has it
                self._queued[key] = (req_context, index)
                self._promoting.add(key)
                return LookupResult.RETRY
        return LookupResult.RETRY if undecided else LookupResult.MISS

    def _observe(
        self, index: int, key: OffloadKey, found: LookupResult, req_context: ReqContext
    ) -> None:
        """Count a resolved lookup once per request, tier and chunk (as vLLM counts them)."""
        observed = req_context.get_state(_Observed)
        if observed is None:
            observed = _Observed()
            req_context.set_state(observed)
        if (index, key) in observed.seen:
            return
        observed.seen.add((index, key))
        counts = self._lookups[index]
        counts[0] += 1
        counts[1] += found is LookupResult.HIT

    def landed(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` became ready in the CPU tier: write them through to every tier (or
        count them dropped for a tier: fenced by a reset, or past its share of the pins)."""
        if not keys:
            return
        for index in range(len(self._ready())):
            self._write(index, keys, req_context)

    def _write(self, index: int, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        ticket = self.flows.reserve_write(index, keys)
        if ticket is None:
            return
        self._writes[index][ticket.job.number] = ticket
        self.flows.begin_write(ticket)  # the tier reads the rows until the job ends
        self.tiers[index].submit_store(
            TransferJob(
                job_id=ticket.job.number,
                keys=list(ticket.keys),
                chunk_ids=np.asarray(ticket.chunk_ids, dtype=np.int64),
                is_promotion=False,
                req_context=req_context,
            )
        )

    def poll(self) -> None:
        """Collect what the tiers finished, once a step, before the CPU tier answers the
        step's first lookup: a promotion read while the model ran is a hit in the next
        step, not one step later (as vLLM's own manager polls its tiers)."""
        if not self._polled:
            self._polled = True
            self.collect()

    def held(self, key: OffloadKey, req_context: ReqContext) -> None:
        """The CPU tier holds ``key``, a chunk of the request ``req_context`` looked up this
        step: the request's promotions must not evict it (they would evict its own hits,
        to be promoted again a round later)."""
        self._held.setdefault(req_context.req_id, []).append(key)

    def on_schedule_end(self, context: Any) -> None:
        self._polled = False
        held, self._held = self._held, {}
        if not self.tiers:
            return
        self._miss_once.clear()  # answered MISS for one step: vLLM has recomputed them
        self.collect()
        by_request: dict[int, tuple[ReqContext, list[OffloadKey], list[int]]] = {}
        for key, (req_context, source) in self._queued.items():
            _, keys, sources = by_request.setdefault(id(req_context), (req_context, [], []))
            keys.append(key)
            sources.append(source)
        self._queued.clear()
        for req_context, keys, sources in sorted(by_request.values(), key=self._rank):
            self._promote(keys, sources, req_context, held.get(req_context.req_id, ()))
        for tier in self.tiers:
            tier.on_schedule_end(context)

    def hint_below(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """A request's retention ``hint`` for the values of ``keys`` (the chunks it loaded
        from the CPU tier) that the tiers below hold: one call each, not waited for."""
        if not keys or hint.empty:
            return
        for tier in self.tiers:
            if isinstance(tier, PolledSecondaryTier | RankedTier):
                tier.submit_hint(keys, hint)

    def _rank(self, promotion: tuple[ReqContext, list[OffloadKey], list[int]]) -> int:
        """The order of a request's promotion in a step (a stable sort: lookup order
        otherwise): retained requests first, the higher priority first, while the CPU
        tier follows retentions (not once it measured them wrong)."""
        hint = self._hint_of(promotion[0])
        if hint is None or not hint.retains or not self._cpu.hints.following_retentions:
            return 0
        return -(MAX_PRIORITY + 1 + hint.priority)  # from -1 (lowest) to -201

    def _promote(
        self,
        keys: list[OffloadKey],
        sources: list[int],
        req_context: ReqContext,
        held: Sequence[OffloadKey],
    ) -> None:
        wanted = [
            (key, s) for key, s in zip(keys, sources, strict=True) if not self._cpu.holds(key)
        ]
        self._promoting.difference_update(set(keys) - {key for key, _ in wanted})
        if not wanted:
            return
        head = [key for key in held if self._cpu.holds(key)]  # the request's hits: kept
        ticket = self.flows.reserve_promotion(
            head, [key for key, _ in wanted], [s for _, s in wanted], keep=Keep.EACH_LOADED
        )
        if ticket is None:  # no room (counted): answered MISS next step, so vLLM recomputes
            self._miss_once.update(key for key, _ in wanted)
            self._promoting.difference_update(key for key, _ in wanted)
            return
        self._promotions[ticket.job.number] = _Reading(ticket, req_context)
        hint = self._hint_of(req_context)
        if hint is not None and hint.retains:  # kept until the request loads them
            self._cpu.hint(ticket.keys, hint)
        for index in sorted(set(ticket.sources)):
            mine = [i for i, source in enumerate(ticket.sources) if source == index]
            self.tiers[index].submit_load(
                TransferJob(
                    job_id=ticket.job.number,
                    keys=[ticket.keys[i] for i in mine],
                    chunk_ids=np.asarray([ticket.chunk_ids[i] for i in mine], dtype=np.int64),
                    is_promotion=True,
                    req_context=req_context,
                )
            )

    def collect(self, *, write_up: bool = True) -> None:
        """Settle the jobs the tiers finished (``write_up``: and write what a lower tier
        gave up to the tiers above; not in a reset, which frees the rows)."""
        for index, tier in enumerate(self.tiers):
            for result in tier.get_finished_jobs():
                write = self._writes[index].pop(result.job_id, None)
                if write is not None:
                    self.flows.settle_write(write, len(write.keys) if result.success else 0)
                    continue
                reading = self._promotions.get(result.job_id)
                if reading is None or index not in reading.waiting:
                    continue
                ticket = reading.ticket
                mine = {k for k, s in zip(ticket.keys, ticket.sources, strict=True) if s == index}
                loaded = mine if result.success else set(result.successful_keys or ()) & mine
                reading.loaded.update(loaded)
                reading.waiting.discard(index)
                if not reading.waiting:
                    del self._promotions[result.job_id]
                    self._settle(reading, write_up=write_up)

    def _settle(self, reading: _Reading, *, write_up: bool = True) -> None:
        ticket = reading.ticket
        self._promoting.difference_update(ticket.keys)
        settled = self.flows.settle_promotion(ticket, reading.loaded)
        self._miss_once.update(settled.lost)
        for index, keys in enumerate(settled.write_up if write_up else ()):
            if keys:  # a lower tier gave them: written through to this one, which lacked them
                self._write(index, keys, reading.req_context)

    def has_pending_work(self) -> bool:
        return bool(any(self._writes) or self._promotions or self._queued) or any(
            tier.has_pending_work() for tier in self.tiers
        )

    def reset(self) -> None:
        """Before the CPU tier is emptied: no job of a tier may still use its rows."""
        for tier in self.tiers:
            tier.drain_jobs()
        # No new job now: a write-up would read rows the reset hands out again.
        self.collect(write_up=False)
        # Jobs the drain did not end are void: their rows are handed out again.
        for writes in self._writes:
            for write in writes.values():
                self.flows.settle_write(write, 0)
            writes.clear()
        for reading in self._promotions.values():
            reading.loaded.clear()
            self._settle(reading)
        self.flows.reset(fence=True)
        self._promotions.clear()
        self._promoting.clear()
        self._queued.clear()
        self._miss_once.clear()
        self._held.clear()

    def on_reset_flushed(self) -> None:
        """vLLM's workers reported every job in flight at the reset: rows are ours again."""
        self.flows.reset_flushed()

    def on_new_request(self, req_context: ReqContext) -> None:
        for tier in self.tiers:
            tier.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        for tier in self.tiers:
            tier.on_request_finished(req_context)

    def take_events(self) -> Iterator[OffloadingEvent]:
        for tier in self.tiers:
            yield from tier.take_events()

    # -- what vLLM reads ----------------------------------------------------------

    def _counts(self) -> dict[tuple[str, str], int]:
        """vLLM's counters by (name, tier label), read from the flows' counts."""
        counts: dict[tuple[str, str], int] = {}
        for index, label in enumerate(self.labels):
            for name, count in _metrics_of(self.flows.counts(index)).items():
                counts[name, label] = count
            queries, hits = self._lookups[index]
            counts[CascadeMetrics.QUERIES, label] = queries
            counts[CascadeMetrics.HITS, label] = hits
        return counts

    def add_stats(self, stats: OffloadingConnectorStats) -> OffloadingConnectorStats:
        counts = self._counts()
        self._warn_of_losses(counts)
        for (name, label), count in counts.items():
            delta = count - self._reported.get((name, label), 0)
            if delta:
                stats.increase_counter(name, delta, (label,))
        self._reported = counts
        for tier in self.tiers:
            theirs = tier.get_stats()
            if theirs is not None:
                stats = stats.aggregate(theirs)
        return stats

    def _warn_of_losses(self, counts: dict[tuple[str, str], int]) -> None:
        """Say in vLLM's log, at most once a minute per tier, what it did not take or give
        since the last line (`LossReport`, the tiers' own reporter)."""
        now = time.monotonic()
        for label, report in zip(self.labels, self._losses, strict=True):
            if not report.due(now):
                continue
            grown = report.take({name: counts[name, label] for name in _LOSSES}, now)
            if grown is None:
                continue
            logger.warning(
                "secondary tier %s lost, since its last report: %s; counted in %s",
                label,
                ", ".join(f"{n:,} chunks {_LOSSES[name]}" for name, n in grown.items()),
                " and ".join(f'{name}{{tier="{label}"}}' for name in grown),
            )

    def statistics(self, tier: int | None = None) -> dict[str, int]:
        """The link's counts (chunks) of ``tier`` (an index; None: every tier's, added up),
        and what write-throughs pin now."""
        picked = range(len(self.labels)) if tier is None else (tier,)
        total: dict[str, int] = {}
        for index in picked:
            counts = self.flows.counts(index)
            named = {_stat_name(name): n for name, n in _metrics_of(counts).items()}
            named["cascade_pinned"] = counts.cascade_pinned
            for name, count in named.items():
                total[name] = total.get(name, 0) + count
        return total

    def shutdown(self) -> None:
        self._factory = None
        for tier in self.tiers:
            tier.shutdown()

    def __repr__(self) -> str:
        state = "not built" if not self.tiers else f"{len(self._promotions)} promotions out"
        return f"<SecondaryLink [{', '.join(self.labels)}; {state}] {self.flows!r}>"


def _metrics_of(counts: FlowCounts) -> dict[str, int]:
    """`CascadeMetrics`' counters from a tier's `FlowCounts` (a chunk to promote that found
    no room counts as failed, as one that did not load)."""
    return {
        CascadeMetrics.WRITTEN: counts.cascade_written,
        CascadeMetrics.DROPPED: counts.cascade_dropped,
        CascadeMetrics.FAILED: counts.cascade_failed,
        CascadeMetrics.PROMOTED: counts.promoted,
        CascadeMetrics.PROMOTE_FAILED: counts.promote_failed + counts.promote_no_room,
    }


def _stat_name(metric: str) -> str:
    """`SecondaryLink.statistics`' name of a `CascadeMetrics` counter."""
    return metric.removeprefix("vllm:kv_offload_tiering_")
