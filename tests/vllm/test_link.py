"""`SecondaryLink` over a scripted secondary tier: vLLM's polled calls, the flows' one drop
rule, promotions kept chunk by chunk, and resets (no Redis, no scheduler)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.integrations.vllm.link import SecondaryLink

KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(16)]
CONTEXT = ReqContext(req_id="r")


class ScriptedTier:
    """What the link calls of a vLLM ``SecondaryTierManager``; the test says what holds
    and what finishes."""

    def __init__(self) -> None:
        self.held: set[OffloadKey] = set()
        self.stores: list[TransferJob] = []
        self.loads: list[TransferJob] = []
        self.finished: list[JobResult] = []
        self.drained = 0

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> None:
        self.stores.append(job)

    def submit_load(self, job: TransferJob) -> None:
        self.loads.append(job)

    def finish(self, job: TransferJob, success: bool = True, keys: Any = None) -> None:
        self.finished.append(JobResult(job_id=job.job_id, success=success, successful_keys=keys))

    def get_finished_jobs(self) -> list[JobResult]:
        done, self.finished = self.finished, []
        return done

    def has_pending_work(self) -> bool:
        return False

    def drain_jobs(self) -> None:
        self.drained += 1

    def on_schedule_end(self, context: Any) -> None:
        pass


def linked(capacity: int = 8) -> tuple[CPUOffloadingManager, ScriptedTier, SecondaryLink]:
    manager = CPUOffloadingManager(capacity, "lru")
    tier = ScriptedTier()
    return manager, tier, SecondaryLink(manager, lambda: tier)  # type: ignore[arg-type]


def land(manager: CPUOffloadingManager, *ids: int) -> list[OffloadKey]:
    keys = [KEYS[i] for i in ids]
    out = manager.prepare_store(keys)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    return keys


def test_a_landed_batch_past_half_the_tier_is_dropped_whole() -> None:
    manager, tier, link = linked(capacity=8)  # write-throughs pin at most 4
    link.landed(land(manager, 0, 1, 2), CONTEXT)
    link.landed(land(manager, 3, 4), CONTEXT)  # 5 pins would be past 4: none written
    assert [list(job.keys) for job in tier.stores] == [KEYS[:3]]
    assert manager.statistics().pinned == 3
    tier.finish(tier.stores[0])
    link.collect()
    stats = link.statistics()
    written = stats["cascade_written"], stats["cascade_dropped"], stats["cascade_pinned"]
    assert written == (3, 2, 0)
    assert manager.statistics().pinned == 0


def test_a_promotion_keeps_each_chunk_that_loaded_and_misses_the_rest_once() -> None:
    manager, tier, link = linked()
    tier.held.update(KEYS[:3])
    answers = [link.lookup(key, CONTEXT) for key in KEYS[:4]]
    assert answers == [LookupResult.RETRY] * 3 + [LookupResult.MISS]  # the tier lacks the 4th
    link.on_schedule_end(None)
    (job,) = tier.loads
    assert job.is_promotion
    assert list(job.keys) == KEYS[:3]
    assert link.lookup(KEYS[0], CONTEXT) is LookupResult.RETRY  # being read
    tier.finish(job, success=False, keys=[KEYS[0], KEYS[2]])
    link.collect()
    assert [manager.holds(key, ready=True) for key in KEYS[:3]] == [True, False, True]
    assert link.lookup(KEYS[1], CONTEXT) is LookupResult.MISS  # recomputed this step
    link.on_schedule_end(None)
    assert link.lookup(KEYS[1], CONTEXT) is LookupResult.RETRY  # asked again next step
    stats = link.statistics()
    assert (stats["promoted"], stats["promote_failed"]) == (2, 1)


def test_a_promotion_with_no_room_is_counted_failed_and_recomputed() -> None:
    manager, tier, link = linked(capacity=2)
    manager.prepare_load(land(manager, 0, 1))  # every slot pinned
    tier.held.add(KEYS[5])
    assert link.lookup(KEYS[5], CONTEXT) is LookupResult.RETRY
    link.on_schedule_end(None)
    assert tier.loads == []
    assert link.statistics()["promote_failed"] == 1
    assert manager.statistics().allocation_failures_total == 1
    assert link.lookup(KEYS[5], CONTEXT) is LookupResult.MISS


def test_a_reset_settles_what_is_out_and_fences_until_flushed() -> None:
    manager, tier, link = linked()
    link.landed(land(manager, 0, 1), CONTEXT)  # never finished: the drain left it
    link.reset()
    manager.reset(force=True)
    assert tier.drained == 1
    stats = link.statistics()
    assert (stats["cascade_failed"], stats["cascade_pinned"]) == (2, 0)
    assert not link.has_pending_work()
    tier.held.add(KEYS[3])
    assert link.lookup(KEYS[3], CONTEXT) is LookupResult.MISS  # fenced
    link.landed(land(manager, 2), CONTEXT)
    assert link.statistics()["cascade_dropped"] == 1
    link.on_reset_flushed()
    assert link.lookup(KEYS[3], CONTEXT) is LookupResult.RETRY
    link.landed(land(manager, 4), CONTEXT)
    assert len(tier.stores) == 2


@pytest.mark.parametrize("name", ["CascadeMetrics", "SecondaryLink"])
def test_the_old_module_path_warns_and_gives_the_links_names(name: str) -> None:
    import tiering.integrations.vllm.cascade as old
    import tiering.integrations.vllm.link as link

    with pytest.warns(
        DeprecationWarning,
        match=f"vllm.cascade.{name} is deprecated; use tiering.integrations.vllm.link.{name}",
    ):
        assert getattr(old, name) is getattr(link, name)
