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
        self.unknown: set[OffloadKey] = set()  # answered RETRY: the tier does not know yet
        self.events: list[Any] = []
        self.locality = None
        self.stores: list[TransferJob] = []
        self.loads: list[TransferJob] = []
        self.finished: list[JobResult] = []
        self.drained = 0

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self.unknown:
            return LookupResult.RETRY
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

    def get_stats(self) -> None:
        return None

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events


def linked(capacity: int = 8) -> tuple[CPUOffloadingManager, ScriptedTier, SecondaryLink]:
    manager = CPUOffloadingManager(capacity, "lru")
    tier = ScriptedTier()
    return manager, tier, SecondaryLink(manager, lambda: [tier])  # type: ignore[list-item]


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


def chained(capacity: int = 16) -> tuple[CPUOffloadingManager, list[ScriptedTier], SecondaryLink]:
    """A CPU tier over two tiers (a disk, then a Redis, say)."""
    manager = CPUOffloadingManager(capacity, "lru")
    tiers = [ScriptedTier(), ScriptedTier()]
    labels = ("1:DiskSecondaryTier", "2:RedisSecondaryTier")
    return manager, tiers, SecondaryLink(manager, lambda: tiers, labels)  # type: ignore[arg-type,return-value]


def test_a_landed_batch_is_written_to_every_tier_each_within_its_share() -> None:
    manager, (disk, redis), link = chained(capacity=16)  # each tier may pin 4 (16 / 2 / 2)
    link.landed(land(manager, 0, 1, 2), CONTEXT)
    assert [list(j.keys) for j in disk.stores] == [list(j.keys) for j in redis.stores] == [KEYS[:3]]
    disk.finish(disk.stores[0])
    link.collect()
    link.landed(land(manager, 3, 4), CONTEXT)  # Redis still pins 3: 5 is past its 4
    assert (len(disk.stores), len(redis.stores)) == (2, 1)
    assert link.statistics(0)["cascade_dropped"] == 0
    assert link.statistics(1)["cascade_dropped"] == 2
    assert link.statistics()["cascade_pinned"] == 2 + 3


def test_a_chunk_comes_from_the_first_tier_that_holds_it_and_is_written_up() -> None:
    manager, (disk, redis), link = chained()
    disk.held.add(KEYS[0])
    redis.held.update(KEYS[:3])
    disk.unknown.add(KEYS[2])  # the disk has not answered yet for the third
    answers = [link.lookup(key, CONTEXT) for key in KEYS[:4]]
    assert answers == [LookupResult.RETRY] * 3 + [LookupResult.MISS]
    link.on_schedule_end(None)
    ((from_disk,), (from_redis,)) = disk.loads, redis.loads
    assert list(from_disk.keys) == [KEYS[0]]
    assert list(from_redis.keys) == [KEYS[1]]  # the third waits for the disk's answer
    assert from_disk.job_id == from_redis.job_id  # one promotion, read by two tiers
    disk.finish(from_disk)
    link.collect()
    assert not manager.holds(KEYS[0], ready=True)  # settled once every tier has read
    redis.finish(from_redis)
    link.collect()
    assert manager.holds(KEYS[0], ready=True)
    assert manager.holds(KEYS[1], ready=True)
    (write_up,) = disk.stores  # Redis gave the second: written up to the disk, which lacked it
    assert list(write_up.keys) == [KEYS[1]]
    assert (link.statistics(0)["promoted"], link.statistics(1)["promoted"]) == (1, 1)
    disk.unknown.clear()
    assert link.lookup(KEYS[2], CONTEXT) is LookupResult.RETRY  # now the disk says miss...
    link.on_schedule_end(None)
    assert [list(job.keys) for job in redis.loads[1:]] == [[KEYS[2]]]  # ...and Redis gives it


def test_a_promotion_a_reset_settles_writes_nothing_up_from_rows_being_freed() -> None:
    """A chunk Redis gave, settled by the reset's drain, is not written up to the disk: the
    reset frees its slot, and a store job would read the row while vLLM reuses it (a value
    of another chunk's bytes, checksummed, under this chunk's key)."""
    manager, (disk, redis), link = chained()
    redis.held.add(KEYS[0])
    assert link.lookup(KEYS[0], CONTEXT) is LookupResult.RETRY
    link.on_schedule_end(None)
    (load,) = redis.loads
    redis.finish(load)  # read while vLLM resets: the drain ends it
    link.reset()
    manager.reset(force=True)
    assert disk.stores == []  # nothing submitted that reads a row after the reset
    assert not link.has_pending_work()
    assert manager.statistics().pinned == 0


def test_vllms_metrics_get_each_tiers_counts_under_its_label() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from tiering.integrations.vllm.link import CascadeMetrics

    manager, (disk, redis), link = chained()
    redis.held.add(KEYS[5])
    mine, other = ReqContext(req_id="mine"), ReqContext(req_id="other")
    for context in (mine, mine, other):  # a request's lookups of a chunk count once
        link.lookup(KEYS[5], context)
        link.lookup(KEYS[6], context)
    link.landed(land(manager, 0), CONTEXT)
    stats = link.add_stats(OffloadingConnectorStats())
    values = stats.data["data"]  # vLLM's payload: {name: {label values: count}}
    # KEYS[5] was being promoted when "other" asked: answered at once, no tier asked.
    assert values[CascadeMetrics.QUERIES] == {
        ("1:DiskSecondaryTier",): 3,
        ("2:RedisSecondaryTier",): 3,
    }
    assert values[CascadeMetrics.HITS] == {("2:RedisSecondaryTier",): 1}
    assert CascadeMetrics.WRITTEN not in values  # nothing written yet: no zero increments
    disk.finish(disk.stores[0])
    link.collect()
    again = link.add_stats(OffloadingConnectorStats()).data["data"]
    assert again[CascadeMetrics.WRITTEN] == {("1:DiskSecondaryTier",): 1}


def test_each_tiers_losses_are_one_line_a_minute_with_the_counts(caplog) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    manager, (_disk, _redis), link = chained(capacity=8)  # each tier may pin 2
    link.landed(land(manager, 0, 1, 2), CONTEXT)  # past both shares: dropped for both
    with caplog.at_level("WARNING", logger="tiering.integrations.vllm.link"):
        link.add_stats(OffloadingConnectorStats())
        link.landed(land(manager, 3, 4, 5), CONTEXT)
        link.add_stats(OffloadingConnectorStats())  # within the minute: not said again
    lines = [r.getMessage() for r in caplog.records if r.name == "tiering.integrations.vllm.link"]
    assert [line.split(" lost")[0] for line in lines] == [
        "secondary tier 1:DiskSecondaryTier",
        "secondary tier 2:RedisSecondaryTier",
    ]
    assert "3 chunks not written through (dropped" in lines[0]


@pytest.mark.parametrize("name", ["CascadeMetrics", "SecondaryLink"])
def test_the_old_module_path_warns_and_gives_the_links_names(name: str) -> None:
    import tiering.integrations.vllm.cascade as old
    import tiering.integrations.vllm.link as link

    with pytest.warns(
        DeprecationWarning,
        match=f"vllm.cascade.{name} is deprecated; use tiering.integrations.vllm.link.{name}",
    ):
        assert getattr(old, name) is getattr(link, name)


def test_without_any_workers_rows_the_link_says_so_once_and_looks_once_a_second(
    caplog, monkeypatch
) -> None:
    """A scheduler on a node that runs none of its workers: one warning, not a /dev/shm
    sweep at every lookup for ever."""
    import tiering.integrations.vllm.link as link_module

    clock = [100.0]
    monkeypatch.setattr(link_module.time, "monotonic", lambda: clock[0])
    looks: list[float] = []

    def factory() -> None:
        looks.append(clock[0])

    link = SecondaryLink(CPUOffloadingManager(8, "lru"), factory)
    with caplog.at_level("WARNING", logger="tiering.integrations.vllm.link"):
        for _ in range(3):  # while vLLM starts: every call looks
            assert link._ready() == ()
        clock[0] += link_module.POOL_WAIT_S
        for _ in range(5):  # past the wait: one look, then none within the second
            assert link._ready() == ()
        clock[0] += 1.0
        assert link._ready() == ()
    assert len(looks) == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "no worker of this engine has shared its CPU-tier rows" in warnings[0]
