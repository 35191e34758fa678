"""`SecondaryLink`: `TieringSpec`'s CPU tier over a secondary tier, on vLLM's scheduler thread.

The secondary tier is a vLLM ``SecondaryTierManager`` (tiering's
`RedisSecondaryTier`): every call returns at once, its I/O runs on its own
thread, and what finished is collected with ``get_finished_jobs``. This link
is the CPU tier's side, and runs only in the calls vLLM makes to the manager,
so the tiering manager is never entered from another thread:

- **Write-through.** A store that lands in the CPU tier (`landed`) pins its
  chunks (so nothing evicts them while their rows are read) and is handed to
  the tier as a store job; the pins go when it finishes. A landed batch that
  would take the write-throughs' pins past half the CPU tier is not written
  (the whole batch, as in the engine) and is counted (``cascade_dropped``): the
  GPU path never waits for the tier.
- **Promotion.** A chunk the CPU tier misses is looked up in the tier (which
  answers ``RETRY`` until it knows); one it holds is promoted: at the end of
  the step (`on_schedule_end`) fresh CPU slots are allocated for the step's
  promotions (the chunks are being written meanwhile: lookups say pending,
  nothing evicts them) and read by a load job. A chunk that found no room, or
  did not load, is answered ``MISS`` for the next step, so vLLM recomputes it.
- **Resets.** `reset` waits for the tier's jobs in flight (each ends within
  its timeout): their rows are about to be handed out again. Until vLLM's
  workers have reported the jobs flushed by the reset (``on_reset_flushed``), a
  late copy of theirs may still write a freed row, so nothing is promoted
  (lookups miss) and nothing is written through (counted as dropped).

Every decision of these (what is pinned or dropped, the slots of a promotion
and what it keeps, the fence, the counts) is `tiering.cpu.flows.Flows`'s, the
same core the engine's `tiering.secondary.chain.TierChain` drives; the link is
its shell on vLLM's polled calls: it submits the jobs, collects them, and
answers vLLM's lookups.

The CPU tier's rows are host memory the worker shares with the scheduler
(`tiering.transfer.HostMemoryPool` in ``/dev/shm``); ``tier_factory`` builds
the tier once that memory can be mapped (the worker registers after the
scheduler is built), and returns None until then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob

from tiering.cpu.flows import (
    FlowCounts,
    Flows,
    Keep,
    PromotionTicket,
    WriteTicket,
    default_pin_bound,
)
from tiering.cpu.manager import CPUOffloadingManager

__all__ = ["CascadeMetrics", "SecondaryLink"]

logger = logging.getLogger(__name__)

#: Least seconds between two warnings of chunks lost to the secondary tier.
WARN_EVERY_S = 60.0


class CascadeMetrics:
    """Counters `SecondaryLink` reports to vLLM (chunks)."""

    WRITTEN = "vllm:kv_offload_tiering_cascade_written"
    DROPPED = "vllm:kv_offload_tiering_cascade_dropped"
    FAILED = "vllm:kv_offload_tiering_cascade_failed"
    PROMOTED = "vllm:kv_offload_tiering_promoted"
    PROMOTE_FAILED = "vllm:kv_offload_tiering_promote_failed"

    DOCS: ClassVar[dict[str, str]] = {
        WRITTEN: "Chunks written through from the CPU tier to the secondary tier.",
        DROPPED: "Landed chunks not written through: write-throughs pinned half the tier.",
        FAILED: "Chunks handed to the secondary tier that it did not write.",
        PROMOTED: "Chunks read from the secondary tier into the CPU tier.",
        PROMOTE_FAILED: "Chunks to promote that found no CPU room or did not load.",
    }


#: The counts `SecondaryLink` warns of: chunks the tiers did not move.
_LOSSES = (CascadeMetrics.DROPPED, CascadeMetrics.FAILED, CascadeMetrics.PROMOTE_FAILED)


class SecondaryLink:
    """The CPU tier ``cpu`` over the secondary tier ``tier_factory`` builds (None until it
    can be built): "tier" here is always the secondary tier."""

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        tier_factory: Callable[[], SecondaryTierManager | None],
    ) -> None:
        self._cpu = cpu
        self._factory: Callable[[], SecondaryTierManager | None] | None = tier_factory
        self.secondary: SecondaryTierManager | None = None
        self.flows = Flows(cpu, ("secondary",), pin_bound=default_pin_bound(cpu.capacity))
        self.flows.open_intake()
        self._writes: dict[int, WriteTicket] = {}  # vLLM's job id -> the write-through
        self._promotions: dict[int, PromotionTicket] = {}  # vLLM's job id -> the promotion
        self._promoting: set[OffloadKey] = set()  # queued or being read
        self._queued: dict[OffloadKey, ReqContext] = {}  # to promote at the step's end
        self._miss_once: set[OffloadKey] = set()  # no room, or did not load: recompute
        #: Whether building the tier failed (logged; the CPU tier goes on alone).
        self.unavailable = False
        self._reported = dict.fromkeys(CascadeMetrics.DOCS, 0)
        self._warned: tuple[int, ...] = (0, 0, 0)  # the losses last logged
        self._warned_at = -WARN_EVERY_S

    def _ready(self) -> SecondaryTierManager | None:
        if self.secondary is None and self._factory is not None:
            try:
                self.secondary = self._factory()
            except Exception:
                # Mid-serving, in a vLLM call: the engine goes on without the tier.
                logger.exception("secondary tier: cannot be built; going on without it")
                self._factory = None
                self.unavailable = True
                return None
            if self.secondary is not None:
                self._factory = None
        return self.secondary

    # -- vLLM's calls, forwarded --------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The answer for a chunk the CPU tier misses."""
        if self.flows.fenced or key in self._miss_once:
            return LookupResult.MISS
        if key in self._promoting:
            return LookupResult.RETRY
        secondary = self._ready()
        if secondary is None:
            return LookupResult.MISS
        found = secondary.lookup(key, req_context)
        if found is not LookupResult.HIT:
            return LookupResult.MISS if found is LookupResult.MISS else LookupResult.RETRY
        self._queued[key] = req_context
        self._promoting.add(key)
        return LookupResult.RETRY

    def landed(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` became ready in the CPU tier: write them through (or count them dropped:
        fenced by a reset, or past the pins write-throughs may hold)."""
        secondary = self._ready()
        if secondary is None or not keys:
            return
        ticket = self.flows.reserve_write(0, keys)
        if ticket is None:
            return
        self._writes[ticket.job.number] = ticket
        self.flows.begin_write(ticket)  # the tier reads the rows until the job ends
        secondary.submit_store(
            TransferJob(
                job_id=ticket.job.number,
                keys=list(ticket.keys),
                chunk_ids=np.asarray(ticket.chunk_ids, dtype=np.int64),
                is_promotion=False,
                req_context=req_context,
            )
        )

    def on_schedule_end(self, context: Any) -> None:
        secondary = self.secondary
        if secondary is None:
            return
        self._miss_once.clear()  # answered MISS for one step: vLLM has recomputed them
        self.collect()
        by_request: dict[int, tuple[ReqContext, list[OffloadKey]]] = {}
        for key, req_context in self._queued.items():
            by_request.setdefault(id(req_context), (req_context, []))[1].append(key)
        self._queued.clear()
        for req_context, keys in by_request.values():
            self._promote(secondary, keys, req_context)
        secondary.on_schedule_end(context)

    def _promote(
        self, secondary: SecondaryTierManager, keys: list[OffloadKey], req_context: ReqContext
    ) -> None:
        wanted = [key for key in keys if not self._cpu.holds(key)]
        self._promoting.difference_update(set(keys) - set(wanted))
        if not wanted:
            return
        ticket = self.flows.reserve_promotion((), wanted, keep=Keep.EACH_LOADED)
        if ticket is None:  # no room (counted): answered MISS next step, so vLLM recomputes
            self._miss_once.update(wanted)
            self._promoting.difference_update(wanted)
            return
        self._promotions[ticket.job.number] = ticket
        secondary.submit_load(
            TransferJob(
                job_id=ticket.job.number,
                keys=ticket.keys,
                chunk_ids=np.asarray(ticket.chunk_ids, dtype=np.int64),
                is_promotion=True,
                req_context=req_context,
            )
        )

    def collect(self) -> None:
        """Settle the jobs the secondary tier finished."""
        secondary = self.secondary
        if secondary is None:
            return
        for result in secondary.get_finished_jobs():
            write = self._writes.pop(result.job_id, None)
            if write is not None:
                self.flows.settle_write(write, len(write.keys) if result.success else 0)
                continue
            promotion = self._promotions.pop(result.job_id, None)
            if promotion is not None:
                loaded = promotion.keys if result.success else (result.successful_keys or ())
                self._settle(promotion, set(loaded))

    def _settle(self, promotion: PromotionTicket, loaded: set[OffloadKey]) -> None:
        self._promoting.difference_update(promotion.keys)
        self._miss_once.update(self.flows.settle_promotion(promotion, loaded).lost)

    def has_pending_work(self) -> bool:
        secondary = self.secondary
        return bool(self._writes or self._promotions or self._queued) or (
            secondary is not None and secondary.has_pending_work()
        )

    def reset(self) -> None:
        """Before the CPU tier is emptied: no job of the tier may still use its rows."""
        secondary = self.secondary
        if secondary is not None:
            secondary.drain_jobs()
            self.collect()
        # Jobs the drain did not end are void: their rows are handed out again.
        for write in self._writes.values():
            self.flows.settle_write(write, 0)
        for promotion in self._promotions.values():
            self._settle(promotion, set())
        self.flows.reset(fence=True)
        self._writes.clear()
        self._promotions.clear()
        self._promoting.clear()
        self._queued.clear()
        self._miss_once.clear()

    def on_reset_flushed(self) -> None:
        """vLLM's workers reported every job in flight at the reset: rows are ours again."""
        self.flows.reset_flushed()

    def on_new_request(self, req_context: ReqContext) -> None:
        if self.secondary is not None:
            self.secondary.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.secondary is not None:
            self.secondary.on_request_finished(req_context)

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.secondary is not None:
            yield from self.secondary.take_events()

    def _counts(self) -> dict[str, int]:
        """vLLM's counters, read from the flows' counts."""
        return _metrics_of(self.flows.counts())

    def add_stats(self, stats: OffloadingConnectorStats) -> OffloadingConnectorStats:
        counts = self._counts()
        self._warn_of_losses(counts)
        for name, count in counts.items():
            if count - self._reported[name]:
                stats.increase_counter(name, count - self._reported[name])
        self._reported = counts
        if self.secondary is not None:
            theirs = self.secondary.get_stats()
            if theirs is not None:
                merged: OffloadingConnectorStats = stats.aggregate(theirs)
                return merged
        return stats

    def _warn_of_losses(self, counts: dict[str, int]) -> None:
        """Say in vLLM's log, at most once a minute, what was not written or not promoted."""
        lost = tuple(counts[name] for name in _LOSSES)
        now = time.monotonic()
        if lost == self._warned or now < self._warned_at + WARN_EVERY_S:
            return
        self._warned, self._warned_at = lost, now
        logger.warning(
            "secondary tier: %d chunks not written through (%d dropped: write-throughs pinned "
            "half the CPU tier; %d failed) and %d not promoted (no CPU room or not loaded), "
            "so far; vllm:kv_offload_tiering_cascade_* counts them",
            lost[0] + lost[1],
            lost[0],
            lost[1],
            lost[2],
        )

    def statistics(self) -> dict[str, int]:
        """The link's counts (chunks), and what write-throughs pin now."""
        counts = self.flows.counts()
        return {
            "cascade_written": counts.cascade_written,
            "cascade_dropped": counts.cascade_dropped,
            "cascade_failed": counts.cascade_failed,
            "promoted": counts.promoted,
            "promote_failed": counts.promote_failed + counts.promote_no_room,
            "cascade_pinned": counts.cascade_pinned,
        }

    def shutdown(self) -> None:
        self._factory = None
        if self.secondary is not None:
            self.secondary.shutdown()


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
