"""`SecondaryLink`: `TieringSpec`'s CPU tier over a secondary tier, on vLLM's scheduler thread.

The secondary tier is a vLLM ``SecondaryTierManager`` (tiering's
`RedisSecondaryTier`): every call returns at once, its I/O runs on its own
thread, and what finished is collected with ``get_finished_jobs``. This link
is the CPU tier's side, and runs only in the calls vLLM makes to the manager,
so the tiering manager is never entered from another thread:

- **Write-through.** A store that lands in the CPU tier (`landed`) pins its
  chunks (so nothing evicts them while their rows are read) and is handed to
  the tier as a store job; the pins go when it finishes. While write-throughs
  already pin half the CPU tier, what does not fit is not written and is
  counted (``cascade_dropped``): the GPU path never waits for the tier.
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

The CPU tier's rows are host memory the worker shares with the scheduler
(`tiering.transfer.HostMemoryPool` in ``/dev/shm``); ``tier_factory`` builds
the tier once that memory can be mapped (the worker registers after the
scheduler is built), and returns None until then.
"""

from __future__ import annotations

import itertools
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
    """The CPU tier ``tier`` of ``capacity`` chunks over the secondary tier ``tier_factory``
    builds (None until it can be built)."""

    def __init__(
        self,
        tier: CPUOffloadingManager,
        tier_factory: Callable[[], SecondaryTierManager | None],
    ) -> None:
        self._tier = tier
        self._factory: Callable[[], SecondaryTierManager | None] | None = tier_factory
        self.secondary: SecondaryTierManager | None = None
        self._max_pinned = max(1, tier.capacity // 2)
        self._ids = itertools.count()
        self._writes: dict[int, int] = {}  # job id -> chunks pinned by it
        self._pinned = 0
        self._promotions: dict[int, tuple[OffloadKey, ...]] = {}  # job id -> keys
        self._promoting: set[OffloadKey] = set()  # queued or being read
        self._queued: dict[OffloadKey, ReqContext] = {}  # to promote at the step's end
        self._miss_once: set[OffloadKey] = set()  # no room, or did not load: recompute
        # From a reset until vLLM says its flushed jobs ended (`on_reset_flushed`), a
        # worker may still write freed slots: nothing is promoted or written through.
        self._fenced = False
        #: Whether building the tier failed (logged; the CPU tier goes on alone).
        self.unavailable = False
        self._counts = dict.fromkeys(CascadeMetrics.DOCS, 0)
        self._reported = dict(self._counts)
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
        if self._fenced or key in self._miss_once:
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
        """``keys`` became ready in the CPU tier: write them through."""
        secondary = self._ready()
        if secondary is None or not keys:
            return
        if self._fenced:  # a late copy of a flushed job may still overwrite these rows
            self._counts[CascadeMetrics.DROPPED] += len(keys)
            return
        room = self._max_pinned - self._pinned
        if room < len(keys):  # the head of the prefix first: it is the most shared
            self._counts[CascadeMetrics.DROPPED] += len(keys) - max(room, 0)
            keys = keys[: max(room, 0)]
            if not keys:
                return
        job_id = next(self._ids)
        spec = self._tier.prepare_load(keys, job=("cascade", job_id), count=False)
        self._writes[job_id] = len(keys)
        self._pinned += len(keys)
        secondary.submit_store(
            TransferJob(
                job_id=job_id,
                keys=keys,
                chunk_ids=spec.block_ids.astype(np.int64),
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
        tier = self._tier
        wanted = [key for key in keys if not tier.holds(key)]
        self._promoting.difference_update(set(keys) - set(wanted))
        job_id = next(self._ids)
        out = tier.prepare_store(wanted, job=("promote", job_id), count=False) if wanted else None
        if out is None:
            if wanted:
                tier.count_allocation_failure()
                self._counts[CascadeMetrics.PROMOTE_FAILED] += len(wanted)
                self._miss_once.update(wanted)
                self._promoting.difference_update(wanted)
            return
        new = tuple(out.keys_to_store)
        self._promotions[job_id] = new
        secondary.submit_load(
            TransferJob(
                job_id=job_id,
                keys=new,
                chunk_ids=out.store_spec.block_ids.astype(np.int64),
                is_promotion=True,
                req_context=req_context,
            )
        )

    def collect(self) -> None:
        """Settle the jobs the secondary tier finished."""
        secondary = self.secondary
        if secondary is None:
            return
        tier = self._tier
        for result in secondary.get_finished_jobs():
            job_id = result.job_id
            pinned = self._writes.pop(job_id, None)
            if pinned is not None:
                tier.complete_load(job=("cascade", job_id))  # a no-op after a reset
                self._pinned -= pinned
                written = CascadeMetrics.WRITTEN if result.success else CascadeMetrics.FAILED
                self._counts[written] += pinned
                continue
            keys = self._promotions.pop(job_id, None)
            if keys is None:
                continue
            self._promoting.difference_update(keys)
            if not tier.store_in_flight(("promote", job_id)):
                continue  # reset since: the slots are another store's
            loaded = set(keys) if result.success else set(result.successful_keys or ())
            failed = [key for key in keys if key not in loaded]
            tier.complete_store(failed, success=False)  # frees their slots
            tier.complete_store(job=("promote", job_id), success=True)  # the rest
            self._miss_once.update(failed)
            self._counts[CascadeMetrics.PROMOTED] += len(keys) - len(failed)
            self._counts[CascadeMetrics.PROMOTE_FAILED] += len(failed)

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
        self._writes.clear()
        self._pinned = 0
        self._promotions.clear()
        self._promoting.clear()
        self._queued.clear()
        self._miss_once.clear()
        self._fenced = True

    def on_reset_flushed(self) -> None:
        """vLLM's workers reported every job in flight at the reset: rows are ours again."""
        self._fenced = False

    def on_new_request(self, req_context: ReqContext) -> None:
        if self.secondary is not None:
            self.secondary.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.secondary is not None:
            self.secondary.on_request_finished(req_context)

    def take_events(self) -> Iterator[OffloadingEvent]:
        if self.secondary is not None:
            yield from self.secondary.take_events()

    def add_stats(self, stats: OffloadingConnectorStats) -> OffloadingConnectorStats:
        self._warn_of_losses()
        for name, count in self._counts.items():
            if count - self._reported[name]:
                stats.increase_counter(name, count - self._reported[name])
        self._reported = dict(self._counts)
        if self.secondary is not None:
            theirs = self.secondary.get_stats()
            if theirs is not None:
                merged: OffloadingConnectorStats = stats.aggregate(theirs)
                return merged
        return stats

    def _warn_of_losses(self) -> None:
        """Say in vLLM's log, at most once a minute, what was not written or not promoted."""
        lost = tuple(self._counts[name] for name in _LOSSES)
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
        return {
            "cascade_written": self._counts[CascadeMetrics.WRITTEN],
            "cascade_dropped": self._counts[CascadeMetrics.DROPPED],
            "cascade_failed": self._counts[CascadeMetrics.FAILED],
            "promoted": self._counts[CascadeMetrics.PROMOTED],
            "promote_failed": self._counts[CascadeMetrics.PROMOTE_FAILED],
            "cascade_pinned": self._pinned,
        }

    def shutdown(self) -> None:
        self._factory = None
        if self.secondary is not None:
            self.secondary.shutdown()
