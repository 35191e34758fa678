from __future__ import annotations

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import (
    AllChunksCleared,
    ChunksRemoved,
    ChunksStored,
    CPUOffloadingManager,
    LookupResult,
)
from tiering.errors import ChunkStateError, ConfigError, InvalidKeyError, UnknownKeyError
from tiering.policies import POLICY_NAMES


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


@pytest.fixture(params=POLICY_NAMES)
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def stored(m: CPUOffloadingManager, *ids: int) -> list[int]:
    out = m.prepare_store(keys(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out.store_spec.chunk_ids.tolist()


def test_slots_are_deterministic_fresh_first_then_freed(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    assert stored(m, 1, 2, 3) == [0, 1, 2]
    slot_of = dict(zip(keys(1, 2, 3), [0, 1, 2], strict=True))
    out = m.prepare_store(keys(4, 5, 6))  # one fresh slot, then two evictions
    assert out is not None
    first, second = out.evicted_keys
    # The fresh slot first, then freed slots, most recently freed first.
    assert out.store_spec.chunk_ids.tolist() == [3, slot_of[second], slot_of[first]]


def test_lru_slot_reuse_is_exact() -> None:
    m = CPUOffloadingManager(3, "lru")
    assert stored(m, 1) == [0]
    assert stored(m, 2) == [1]
    assert stored(m, 3) == [2]
    m.touch(keys(1))
    out = m.prepare_store(keys(4, 5))  # evicts 2 then 3 (least recent first)
    assert out is not None
    assert out.evicted_keys == tuple(keys(2, 3))
    # Freed slots are reused most recently freed first.
    assert out.store_spec.chunk_ids.tolist() == [2, 1]


def test_prepare_store_skips_present_and_repeated_keys(policy: str) -> None:
    m = CPUOffloadingManager(8, policy)
    stored(m, 1)
    pending = m.prepare_store(keys(2))
    assert pending is not None
    out = m.prepare_store(keys(1, 2, 3, 3, 4))
    assert out is not None
    assert out.keys_to_store == tuple(keys(3, 4))
    assert len(out.store_spec) == 2


def test_eviction_is_all_or_nothing(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, 1, 2, 3, 4)
    m.prepare_load(keys(1, 2))  # pinned: only 3 and 4 are evictable
    before = m.statistics()
    assert m.prepare_store(keys(5, 6, 7)) is None
    after = m.statistics()
    assert after.allocation_failures_total == before.allocation_failures_total + 1
    assert (after.used, after.evictable, after.evictions_total) == (4, 2, 0)
    for kk in keys(1, 2, 3, 4):
        assert m.lookup(kk) is LookupResult.HIT
    out = m.prepare_store(keys(5, 6))
    assert out is not None
    assert set(out.evicted_keys) == set(keys(3, 4))


def test_pinned_writing_and_same_call_keys_are_never_evicted(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, 1, 2)
    writing = m.prepare_store(keys(3))
    assert writing is not None
    m.prepare_load(keys(1))
    # Room for one: 2 is the only evictable chunk, but it is offered again.
    assert m.prepare_store(keys(2, 5, 6)) is None
    out = m.prepare_store(keys(5, 6))
    assert out is not None
    assert out.evicted_keys == tuple(keys(2))
    assert m.lookup(k(1)) is LookupResult.HIT
    assert m.lookup(k(3)) is LookupResult.HIT_PENDING
    assert m.prepare_store(keys(7)) is None  # 1 pinned, 3 writing, 5 and 6 writing


def test_failed_store_frees_slots_without_public_event(policy: str) -> None:
    m = CPUOffloadingManager(2, policy, enable_events=True)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    m.complete_store(keys(1, 2), success=False)
    assert m.take_events() == []
    s = m.statistics()
    assert (s.used, s.free, s.writing, s.store_failed_total) == (0, 2, 0, 2)
    assert m.lookup(k(1)) is LookupResult.MISS
    assert stored(m, 3, 4) == [1, 0]  # the freed slots, most recently freed first


def test_complete_store_is_idempotent(policy: str) -> None:
    m = CPUOffloadingManager(4, policy, enable_events=True)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    m.complete_store(out.keys_to_store)
    m.complete_store(out.keys_to_store)
    m.complete_store(out.keys_to_store, success=False)  # already landed: ignored
    m.complete_store(keys(9))  # never prepared: ignored
    s = m.statistics()
    assert (s.ready, s.stored_total, s.store_failed_total) == (2, 2, 0)
    assert m.take_events() == [ChunksStored(keys=tuple(keys(1, 2)))]


def test_complete_load_with_job_is_idempotent_and_keeps_other_pins(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, 1, 2)
    m.prepare_load(keys(1, 2), job="a")
    m.prepare_load(keys(1), job="b")
    m.complete_load(job="a")
    m.complete_load(job="a")  # no-op: does not steal b's pin on 1
    s = m.statistics()
    assert (s.pinned, s.evictable) == (1, 1)
    m.complete_load(job="b")
    assert m.statistics().pinned == 0
    m.prepare_load(keys(1), job="c")
    with pytest.raises(ChunkStateError, match="already holds pins"):
        m.prepare_load(keys(1), job="c")


def test_pins_are_counted_and_overrelease_raises(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, 1, 2)
    m.prepare_load(keys(1))
    m.prepare_load(keys(1))
    m.complete_load(keys(1))
    assert m.statistics().pinned == 1
    m.complete_load(keys(1))
    assert m.statistics().pinned == 0
    m.prepare_load(keys(2))
    with pytest.raises(ChunkStateError, match=f"{k(1).hex()} 1x: it is not pinned"):
        m.complete_load(keys(2, 1))
    s = m.statistics()
    assert (s.pinned, s.evictable) == (1, 1)  # nothing changed: 2 is still pinned
    with pytest.raises(ChunkStateError, match="2x: it is pinned 1x"):
        m.complete_load(keys(2, 2))


def test_misuse_names_key_and_state(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    with pytest.raises(UnknownKeyError, match=f"{k(7).hex()}.*not in the tier"):
        m.prepare_load(keys(7))
    m.prepare_store(keys(1))
    stored(m, 2)
    with pytest.raises(ChunkStateError, match=f"{k(1).hex()}.*being written"):
        m.prepare_load(keys(2, 1))
    assert m.statistics().pinned == 0  # atomic: 2 was not pinned either
    with pytest.raises(ChunkStateError, match="being written"):
        m.complete_load(keys(1))
    with pytest.raises(UnknownKeyError):
        m.complete_load(keys(7))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_capacity_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="num_chunks"):
        CPUOffloadingManager(bad)  # type: ignore[arg-type]


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown cache policy 'mru'; choose one of lru, arc"):
        CPUOffloadingManager(4, "mru")


def test_events_after_landing_and_on_eviction(policy: str) -> None:
    m = CPUOffloadingManager(2, policy, enable_events=True)
    out = m.prepare_store(keys(1, 2))
    assert out is not None
    assert m.take_events() == []  # nothing readable yet
    m.complete_store(keys(1, 2))
    assert m.take_events() == [ChunksStored(keys=tuple(keys(1, 2)))]
    out = m.prepare_store(keys(3))
    assert out is not None
    assert m.take_events() == [ChunksRemoved(keys=out.evicted_keys)]
    assert len(out.evicted_keys) == 1
    m.complete_store(keys(3))
    m.reset()
    (kept,) = [k for k in keys(1, 2) if k not in out.evicted_keys]
    assert m.take_events() == [
        ChunksStored(keys=tuple(keys(3))),
        AllChunksCleared(keys=(kept, *keys(3))),  # what it held, for the removals
    ]


def test_a_reset_names_the_ready_chunks_only(policy: str) -> None:
    """A chunk still being written was never announced: a forced reset leaves it unnamed."""
    m = CPUOffloadingManager(4, policy, enable_events=True)
    assert m.prepare_store(keys(1, 2)) is not None
    m.complete_store(keys(1, 2))
    assert m.prepare_store(keys(3)) is not None  # writing
    m.reset(force=True)
    assert m.take_events()[-1] == AllChunksCleared(keys=tuple(keys(1, 2)))
    m.reset()
    assert m.take_events() == [AllChunksCleared()]  # an empty tier held nothing


def test_no_events_are_built_when_disabled(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, 1, 2)
    stored(m, 3)
    m.reset()
    assert m.take_events() == []
    assert m.statistics().events_pending == 0


def test_event_queue_is_bounded_and_drops_are_counted() -> None:
    m = CPUOffloadingManager(8, enable_events=True, max_pending_events=2)
    for i in range(5):
        stored(m, i)
    events = m.take_events()
    assert events == [ChunksStored(keys=(k(3),)), ChunksStored(keys=(k(4),))]
    assert m.statistics().events_dropped_total == 3


def test_reset_empties_everything_and_refuses_in_flight(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    stored(m, 1, 2)
    m.prepare_load(keys(1))
    with pytest.raises(ChunkStateError, match="1 are pinned"):
        m.reset()
    m.complete_load(keys(1))
    m.prepare_store(keys(3))
    with pytest.raises(ChunkStateError, match="1 chunks are being written"):
        m.reset()
    m.reset(force=True)
    s = m.statistics()
    assert (s.used, s.free, s.writing, s.pinned, s.evictable) == (0, 4, 0, 0, 0)
    assert len(m.policy) == 0
    assert m.lookup(k(1)) is LookupResult.MISS
    assert stored(m, 5, 6, 7, 8) == [0, 1, 2, 3]


def test_lookup_and_lookup_prefix_count_results(policy: str) -> None:
    m = CPUOffloadingManager(8, policy)
    stored(m, 1, 2)
    m.prepare_store(keys(3))
    assert m.lookup_prefix(keys(1, 2, 3, 4)) == 2
    assert m.lookup_prefix(keys(1, 5, 2)) == 1
    assert m.lookup(k(3)) is LookupResult.HIT_PENDING
    s = m.statistics()
    assert (s.lookups_hit_total, s.lookups_pending_total, s.lookups_miss_total) == (3, 2, 1)


def test_statistics_and_repr_show_live_counts(policy: str) -> None:
    m = CPUOffloadingManager(5, policy)
    stored(m, 1, 2, 3)
    m.prepare_store(keys(4))
    m.prepare_load(keys(1))
    s = m.statistics()
    assert (s.capacity, s.used, s.free, s.writing, s.ready, s.pinned, s.evictable) == (
        5,
        4,
        1,
        1,
        3,
        1,
        2,
    )
    assert s.used_ratio == pytest.approx(0.8)
    assert repr(m) == (
        f"<CPUOffloadingManager [4/5 chunks: 1 writing, 1 pinned, 2 evictable; policy {policy}]>"
    )


def test_lru_evicts_tail_of_prefix_before_head() -> None:
    m = CPUOffloadingManager(4, "lru")
    request = keys(1, 2, 3)
    out = m.prepare_store(request)
    assert out is not None
    m.complete_store(out.keys_to_store)
    m.touch(request)
    out = m.prepare_store(keys(10, 11))
    assert out is not None
    assert out.evicted_keys == (k(3),)  # the tail goes first
    # Recency is committed per request: a later request that extends the prefix
    # makes the whole prefix more recent, head most recent of all.
    m.complete_store(out.keys_to_store)
    m.touch(keys(10, 11))
    m.touch(keys(1, 2))
    out = m.prepare_store(keys(20, 21))
    assert out is not None
    assert out.evicted_keys == tuple(keys(11, 10))


def test_mixing_job_and_key_unpins_raises_instead_of_corrupting(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, 1)
    m.prepare_load(keys(1), job="a")
    m.complete_load(keys(1))  # takes the job's pin
    with pytest.raises(ChunkStateError, match="not pinned"):
        m.complete_load(job="a")
    s = m.statistics()
    assert (s.pinned, s.evictable, s.writing) == (0, 1, 0)
    assert m.lookup(k(1)) is LookupResult.HIT
    stored(m, 2, 3)  # evicts one, counts still agree with the policy
    assert m.statistics().used == len(m.policy) == 2


def test_iterators_are_taken_whole(policy: str) -> None:
    m = CPUOffloadingManager(2, policy)
    stored(m, 1)
    spec = m.prepare_load(iter(keys(1)), job="j")  # type: ignore[arg-type]
    assert spec.chunk_ids.tolist() == [0]
    assert m.statistics().pinned == 1
    assert m.prepare_store(keys(2, 3)) is None  # 1 is pinned: no room for two
    m.complete_load(iter(keys(1)))  # type: ignore[arg-type]
    assert m.statistics().pinned == 0


def test_store_jobs_complete_once_even_after_the_key_is_stored_again(policy: str) -> None:
    m = CPUOffloadingManager(4, policy, enable_events=True)
    assert m.prepare_store(keys(1), job="first") is not None
    m.complete_store(job="first", success=False)
    again = m.prepare_store(keys(1), job="second")
    assert again is not None
    m.complete_store(job="first", success=True)  # late duplicate: ignored
    assert m.lookup(k(1)) is LookupResult.HIT_PENDING
    assert m.take_events() == []
    m.complete_store(job="second")
    assert m.lookup(k(1)) is LookupResult.HIT
    m.prepare_store(keys(2), job="third")
    with pytest.raises(ChunkStateError, match="already in flight"):
        m.prepare_store(keys(3), job="third")


def test_a_policy_instance_must_be_fresh() -> None:
    from tiering.policies import LRUPolicy

    used = LRUPolicy()
    used.insert(keys(1))
    with pytest.raises(ConfigError, match="already tracks 1 keys"):
        CPUOffloadingManager(4, used)
    with pytest.raises(ConfigError, match="CachePolicy or a policy name"):
        CPUOffloadingManager(4, object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_pending_events"):
        CPUOffloadingManager(4, max_pending_events="5")  # type: ignore[arg-type]


def test_recency_is_right_when_a_store_lands_after_the_touch() -> None:
    # An async server finishes a request before its stores land.
    m = CPUOffloadingManager(3, "lru")
    stored(m, 1)
    m.prepare_load(keys(1), job="load")
    pending = m.prepare_store(keys(2))
    assert pending is not None
    m.complete_load(job="load")
    m.touch(keys(1, 2))  # head 1, tail 2 (still being written)
    m.complete_store(keys(2))
    stored(m, 3)
    out = m.prepare_store(keys(4))
    assert out is not None
    assert out.evicted_keys == (k(2),)  # the tail goes first; the head 1 stays


@pytest.mark.parametrize("keys", [["abc"], [1, 2], [[1]], [k(0), "late"], [None]])
def test_a_key_that_is_not_bytes_is_refused_before_anything_changes(keys: list[object]) -> None:
    manager = CPUOffloadingManager(4, "lru")
    before = manager.statistics()
    with pytest.raises(InvalidKeyError, match="offload keys must be bytes"):
        manager.prepare_store(keys)  # type: ignore[arg-type]
    assert manager.statistics() == before


@pytest.mark.parametrize("first", [["x"], {"a": 1}])
def test_an_iterator_holding_an_unhashable_key_is_refused_whole(first: object) -> None:
    manager = CPUOffloadingManager(4, "lru")
    for order in ([first, k(1)], [k(1), first]):
        with pytest.raises(InvalidKeyError, match="offload keys must be bytes"):
            manager.prepare_store(iter(order))  # type: ignore[arg-type]
        assert manager.statistics().used == 0


@pytest.mark.parametrize("key", ["abc", 1, None])
def test_loads_and_unpins_of_a_key_that_is_not_bytes_are_refused(key: object) -> None:
    manager = CPUOffloadingManager(4, "lru")
    with pytest.raises(InvalidKeyError, match="offload keys must be bytes"):
        manager.prepare_load([key])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError, match="offload keys must be bytes"):
        manager.complete_load([key])  # type: ignore[list-item]
