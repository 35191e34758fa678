"""The contract every cache policy keeps, and what ARC adds to LRU."""

from __future__ import annotations

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.errors import ConfigError
from tiering.policies import POLICY_NAMES, ARCPolicy, CachePolicy, LRUPolicy, create_policy

NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


@pytest.fixture(params=POLICY_NAMES)
def policy(request: pytest.FixtureRequest) -> CachePolicy:
    return create_policy(str(request.param), capacity=8)


def test_create_policy_by_name() -> None:
    assert isinstance(create_policy("lru", 4), LRUPolicy)
    assert isinstance(create_policy("arc", 4), ARCPolicy)
    with pytest.raises(ConfigError, match="'fifo'"):
        create_policy("fifo", 4)
    with pytest.raises(ConfigError, match="at least 1 chunk, got 0"):
        ARCPolicy(0)


def test_tail_of_a_request_is_evicted_before_its_head(policy: CachePolicy) -> None:
    policy.insert(keys(1, 2, 3))
    policy.touch(keys(1, 2, 3))
    assert policy.evict(1, NONE) == [k(3)]
    assert policy.evict(1, NONE) == [k(2)]
    assert len(policy) == 1


def test_eviction_is_all_or_nothing_and_skips_protected(policy: CachePolicy) -> None:
    policy.insert(keys(1, 2, 3))
    assert policy.evict(3, frozenset(keys(2))) is None
    assert len(policy) == 3
    victims = policy.evict(2, frozenset(keys(2)))
    assert victims is not None
    assert sorted(victims) == sorted(keys(1, 3))
    assert policy.evict(0, NONE) == []
    assert len(policy) == 1


def test_remove_clear_and_untracked_touch(policy: CachePolicy) -> None:
    policy.insert(keys(1, 2, 3))
    policy.touch(keys(9, 8))  # untracked: ignored
    policy.remove(keys(2, 9))
    assert len(policy) == 2
    victims = policy.evict(2, NONE)
    assert victims is not None
    assert sorted(victims) == sorted(keys(1, 3))
    policy.insert(keys(4))
    policy.clear()
    assert len(policy) == 0
    assert policy.evict(1, NONE) is None


def test_lru_is_plain_recency() -> None:
    lru = LRUPolicy()
    for i in range(1, 5):
        lru.insert(keys(i))
    lru.touch(keys(1))
    assert lru.evict(2, NONE) == keys(2, 3)


def test_arc_keeps_frequent_keys_through_a_scan() -> None:
    arc = ARCPolicy(4)
    lru = LRUPolicy()
    for p in (arc, lru):
        p.insert(keys(1, 2))
        p.touch(keys(1, 2))  # the storing request itself: still one reference
        p.touch(keys(1, 2))  # a second request: frequent
    for i in range(10, 30):  # a scan of one-off keys through a tier of 4
        for p in (arc, lru):
            victims = p.evict(len(p) - 3, NONE) if len(p) >= 4 else []
            assert victims is not None
            p.insert(keys(i))
            p.touch(keys(i))
    arc_left = arc.evict(len(arc), NONE)
    lru_left = lru.evict(len(lru), NONE)
    assert arc_left is not None
    assert lru_left is not None
    assert set(keys(1, 2)) <= set(arc_left)  # ARC kept them
    assert not set(keys(1, 2)) & set(lru_left)  # LRU lost them to the scan


def test_arc_first_touch_after_insert_is_not_a_second_reference() -> None:
    arc = ARCPolicy(4)
    arc.insert(keys(1))
    arc.touch(keys(1))
    assert "T1: 1, T2: 0" in repr(arc)
    arc.touch(keys(1))
    assert "T1: 0, T2: 1" in repr(arc)


def test_arc_ghost_hits_adapt_the_target() -> None:
    arc = ARCPolicy(2)
    arc.insert(keys(1))
    arc.insert(keys(2))
    assert arc.evict(1, NONE) == [k(1)]  # 1 -> B1
    assert arc.target_t1 == 0
    arc.insert(keys(1))  # a hit in B1: recency was evicted too early
    assert arc.target_t1 == 1
    assert "T2: 1" in repr(arc)
    # Now T1 = {2}, T2 = {1}; with p = 1, T1 is not above target: T2 gives.
    assert arc.evict(1, NONE) == [k(1)]  # 1 -> B2
    arc.insert(keys(1))  # a hit in B2: frequency was evicted too early
    assert arc.target_t1 == 0


def test_arc_ghost_lists_are_bounded() -> None:
    arc = ARCPolicy(3)
    for i in range(100):
        if len(arc) == 3:
            assert arc.evict(1, NONE) is not None
        arc.insert(keys(i))
    t1, t2, b1, b2 = (len(x) for x in (arc._t1, arc._t2, arc._b1, arc._b2))
    assert t1 + b1 <= 3
    assert t1 + t2 + b1 + b2 <= 6


def test_insert_alone_puts_the_tail_first(policy: CachePolicy) -> None:
    policy.insert(keys(1, 2, 3))
    assert policy.evict(2, NONE) == keys(3, 2)


def test_arc_adapts_by_the_ratio_of_ghost_list_sizes() -> None:
    arc = ARCPolicy(8)
    arc.insert(keys(1, 2, 3, 4, 5, 6))
    arc.touch(keys(1, 2, 3, 4, 5, 6))  # the storing request
    arc.touch(keys(1, 2, 3, 4, 5, 6))  # a second one: all six frequent, in T2
    arc.insert(keys(7, 8))
    # The keys just admitted do not count towards |T1|: with p = 0, T2 gives.
    assert arc.evict(5, NONE) == keys(6, 5, 4, 3, 2)
    assert arc.evict(1, NONE) == keys(8)
    assert "T1: 1, T2: 1, B1: 1, B2: 5" in repr(arc)
    arc.insert(keys(8))  # a B1 hit: p grows by |B2| / |B1| = 5
    assert arc.target_t1 == 5
    arc.insert(keys(6))  # a B2 hit: p falls by max(|B1| / |B2|, 1) = 1
    assert arc.target_t1 == 4
    assert "T2: 3" in repr(arc)  # ghost hits are re-references: both went to T2


def test_arc_target_is_capped_at_capacity() -> None:
    arc = ARCPolicy(2)
    for _ in range(5):
        arc.insert(keys(1, 2))
        assert arc.evict(2, NONE) is not None
        arc.insert(keys(1, 2))  # B1 hits
        assert arc.evict(2, NONE) is not None
    assert arc.target_t1 <= 2


def test_arc_lists_stay_bounded_with_frequency_and_ghosts() -> None:
    import random

    rng = random.Random(7)
    arc = ARCPolicy(5)
    for _ in range(2000):
        key = keys(rng.randrange(30))
        if len(arc) == 5 and key[0] not in arc._t1 and key[0] not in arc._t2:
            assert arc.evict(1, NONE) is not None
        if key[0] in arc._t1 or key[0] in arc._t2:
            arc.touch(key)
        else:
            arc.insert(key)
            arc.touch(key)
        t1, t2, b1, b2 = (len(x) for x in (arc._t1, arc._t2, arc._b1, arc._b2))
        assert t1 + t2 <= 5
        assert t1 + b1 <= 5
        assert t1 + t2 + b1 + b2 <= 10
        assert 0 <= arc.target_t1 <= 5
    assert len(arc._t2) > 0
    assert len(arc._b2) > 0
