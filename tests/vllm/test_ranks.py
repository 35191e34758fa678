"""`RankedTier`: N per-rank tiers as one chunk's tier (no Redis, no scheduler; the whole
path at TP 2 and 4 is tests/vllm/test_tp.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingEvent, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from tiering.errors import ConfigError
from tiering.integrations.vllm.ranks import RankedTier

from .test_link import KEYS, ScriptedTier

CONTEXT = ReqContext(req_id="r")


def ranked(n: int = 2, events: bool = False) -> tuple[RankedTier, list[ScriptedTier]]:
    ranks = [ScriptedTier() for _ in range(n)]
    view = memoryview(np.zeros((4, 8), dtype=np.uint8))
    tier = RankedTier(None, view, "RedisSecondaryTier", ranks, events=events)  # type: ignore[arg-type]
    return tier, ranks


def job(*ids: int, promotion: bool = False) -> TransferJob:
    return TransferJob(
        job_id=7,
        keys=[KEYS[i] for i in ids],
        chunk_ids=np.arange(len(ids), dtype=np.int64),
        is_promotion=promotion,
        req_context=CONTEXT,
    )


def test_a_chunk_is_a_hit_only_when_every_rank_holds_it_and_a_miss_when_one_lacks_it():
    tier, (zero, one) = ranked()
    zero.held.update(KEYS[:3])
    one.held.update(KEYS[:2])
    one.unknown.add(KEYS[1])
    answers = [tier.lookup(key, CONTEXT) for key in KEYS[:3]]
    assert answers == [LookupResult.HIT, LookupResult.RETRY, LookupResult.MISS]


def test_a_store_is_reported_once_every_rank_has_and_succeeds_only_if_all_wrote():
    tier, ranks = ranked(4)
    tier.submit_store(job(0, 1))
    assert [len(rank.stores) for rank in ranks] == [1] * 4  # every rank, the same job
    for rank in ranks[:3]:
        rank.finish(rank.stores[0])
    assert list(tier.get_finished_jobs()) == []
    assert tier.has_pending_work()
    ranks[3].finish(ranks[3].stores[0], success=False)
    (result,) = tier.get_finished_jobs()
    assert (result.job_id, result.success) == (7, False)
    assert not tier.has_pending_work()


def test_a_chunk_loads_only_if_every_rank_loaded_it():
    tier, (zero, one) = ranked()
    tier.submit_load(job(0, 1, 2, promotion=True))
    zero.finish(zero.loads[0], success=False, keys=[KEYS[0], KEYS[1]])
    one.finish(one.loads[0], success=False, keys=[KEYS[1], KEYS[2]])
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert list(result.successful_keys) == [KEYS[1]]  # rank 0 lacked the third, rank 1 the first


def test_a_load_every_rank_completed_is_a_success_and_none_loaded_names_no_key():
    tier, (zero, one) = ranked()
    tier.submit_load(job(0, 1, promotion=True))
    zero.finish(zero.loads[0])
    one.finish(one.loads[0])
    (result,) = tier.get_finished_jobs()
    assert result.success
    assert result.successful_keys is None
    tier.submit_load(job(2, promotion=True))
    zero.finish(zero.loads[1], success=False)
    one.finish(one.loads[1])
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert result.successful_keys is None


def test_a_chunk_is_announced_stored_only_once_every_rank_wrote_it_and_removed_when_one_lost_it():
    """A rank that failed its store leaves the chunk a miss: no event may say it is there."""
    tier, (zero, one) = ranked(events=True)
    tier.submit_store(job(0, 1))
    for rank in (zero, one):  # what each rank's adapter says of its own value
        rank.medium = Medium.STORAGE
        rank.events.append(
            OffloadingEvent(keys=[KEYS[0], KEYS[1]], medium=rank.medium, removed=False)
        )
    zero.finish(zero.stores[0])
    one.finish(one.stores[0], success=False)
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert list(tier.take_events()) == []  # rank 1 wrote neither: neither is there
    tier.submit_store(job(2, 3))
    zero.finish(zero.stores[1])
    assert list(tier.get_finished_jobs()) == []  # rank 1 still writing: not yet
    assert list(tier.take_events()) == []
    one.finish(one.stores[1])
    assert len(list(tier.get_finished_jobs())) == 1
    (stored,) = tier.take_events()
    assert (stored.keys, stored.removed, stored.medium) == (
        [KEYS[2], KEYS[3]],
        False,
        Medium.STORAGE,
    )
    # Rank 1's folder evicted the third chunk, then both ranks' evicted it: said once.
    one.events.append(OffloadingEvent(keys=[KEYS[2]], medium=Medium.STORAGE, removed=True))
    zero.events.append(OffloadingEvent(keys=[KEYS[2]], medium=Medium.STORAGE, removed=True))
    (removed,) = tier.take_events()
    assert (removed.keys, removed.removed) == ([KEYS[2]], True)


def test_without_events_nothing_is_kept_for_them_and_one_rank_is_refused():
    tier, (zero, one) = ranked()
    for _ in range(3):
        tier.submit_store(job(0))
        zero.finish(zero.stores[-1])
        one.finish(one.stores[-1])
        assert len(list(tier.get_finished_jobs())) == 1
    assert list(tier.take_events()) == []
    assert tier._whole is None
    with pytest.raises(ConfigError, match="two ranks or more"):
        RankedTier(None, memoryview(np.zeros((4, 8), dtype=np.uint8)), "t", [zero])  # type: ignore[arg-type]
