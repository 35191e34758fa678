"""The dueling segmented LRU: the contract under each expert, the shadows, bounded metadata."""

from __future__ import annotations

import math
import random

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.policies import DSLRUPolicy, create_policy
from tiering.simulate import simulate_keys

NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def replay(policy: DSLRUPolicy, capacity: int, requests: list[list[OffloadKey]]) -> int:
    """What `simulate_keys` does, over ``policy`` itself (to read it afterwards): hit blocks."""
    manager = CPUOffloadingManager(capacity, policy)
    hits = 0
    for keys in requests:
        n = manager.lookup_prefix(keys)
        hits += n
        if n:
            manager.prepare_load(keys[:n])
        if n < len(keys):
            output = manager.prepare_store(keys[n:])
            if output is not None and output.keys_to_store:
                manager.complete_store(output.keys_to_store)
        if n:
            manager.complete_load(keys[:n])
        manager.touch(keys)
    return hits


def conversations(seed: int, requests: int, *, hot: int, cold: int) -> list[list[OffloadKey]]:
    """A shared head, then a hot prefix family reused often and a stream of cold tails."""
    rng = random.Random(seed)
    out: list[list[OffloadKey]] = []
    fresh = 10**6
    for _ in range(requests):
        family = rng.randrange(hot)
        head = [k(0), *(k(1000 * (family + 1) + j) for j in range(4))]
        tail = [k(fresh + j) for j in range(rng.randrange(1, cold))]
        fresh += len(tail)
        out.append(head + tail)
    return out


def test_bad_arguments_say_what_would_be_right() -> None:
    with pytest.raises(ConfigError, match="at least 1 chunk, got 0"):
        DSLRUPolicy(0)
    with pytest.raises(ConfigError, match=r"histories must be one or more finite numbers >= 0"):
        DSLRUPolicy(64, histories=())
    with pytest.raises(ConfigError, match=r"got \(2.0, -1\)"):
        DSLRUPolicy(64, histories=(2.0, -1))
    with pytest.raises(ConfigError, match=r"decay must be a finite number in \[0, 1.0\], got 2"):
        DSLRUPolicy(64, decay=2)
    with pytest.raises(ConfigError, match="margin must be a finite number"):
        DSLRUPolicy(64, margin=math.nan)


def test_starts_under_lru_and_shadows_a_small_tier_whole() -> None:
    policy = create_policy("dslru", 8)
    assert isinstance(policy, DSLRUPolicy)
    assert policy.expert == "lru"
    assert policy.statistics().detail["shadow_capacity"] == 8  # every key sampled
    big = DSLRUPolicy(5859)  # 3,000,000 tokens of 512-token chunks: one key in 64
    assert big.statistics().detail["shadow_capacity"] == 5859 >> 6


@pytest.mark.parametrize("lru", [True, False])
def test_contract_holds_with_shadows_and_under_each_expert(lru: bool) -> None:
    """Exactly n victims or None (nothing changed), never a protected key, over random calls."""
    rng = random.Random(7)
    policy = DSLRUPolicy(1024)  # shadows of 128 chunks
    tracked: set[OffloadKey] = set()
    for _ in range(3000):
        ids = [rng.randrange(4000) for _ in range(rng.randrange(1, 12))]
        request = list(dict.fromkeys(k(i) for i in ids))
        new = [key for key in request if key not in tracked]
        policy.insert(new)
        tracked.update(new)
        excess = len(tracked) - 1024
        if excess > 0:
            shield = frozenset(request)
            victims = policy.evict(excess, shield)
            assert victims is not None
            assert len(victims) == excess
            assert not shield & set(victims)
            assert set(victims) <= tracked
            tracked.difference_update(victims)
        policy.touch(request)
        assert len(policy) == len(tracked)
        policy._lru = lru
    before = len(policy)
    assert policy.evict(before + 1, NONE) is None
    assert len(policy) == before
    drained = policy.evict(before, NONE)
    assert drained is not None
    assert set(drained) == tracked


def test_lru_expert_evicts_the_least_recent_of_both_segments() -> None:
    policy = DSLRUPolicy(4096)
    assert policy.expert == "lru"
    for i in range(1, 5):
        policy.insert([k(i)])
        policy.touch([k(i)])
    policy.touch([k(1)])  # a reuse: 1 moves to protected, and is the most recent
    policy.touch([k(3)])
    assert policy.evict(2, NONE) == [k(2), k(4)]
    assert policy.evict(2, NONE) == [k(1), k(3)]


def test_a_stored_key_stays_on_probation_however_many_requests_end_before_its_own() -> None:
    """At concurrency > 1 other requests finish between a store and its request's end: the
    storing request's own touch is not a reuse, under either expert."""
    for lru in (True, False):
        policy = DSLRUPolicy(4096)
        policy._lru = lru
        policy.insert([k(1), k(2)])  # request A stores
        for i in range(10, 20):  # ten other requests store and finish
            policy.insert([k(i)])
            policy.touch([k(i)])
        policy.touch([k(1), k(2)])  # A ends
        stats = policy.statistics().detail
        assert (stats["probation"], stats["protected"]) == (12, 0)
        policy.touch([k(1), k(2)])  # a second request: now a reuse
        assert policy.statistics().detail["protected"] == 2


def test_an_untouched_stored_key_counts_as_used_when_it_was_stored() -> None:
    policy = DSLRUPolicy(4096)
    policy.insert([k(1)])
    policy.touch([k(1)])
    policy.touch([k(1)])  # protected, used at clock 2
    policy.insert([k(2)])  # stored at clock 2, its request still running
    policy.touch([k(3)])  # untracked: ignored, but the clock moves on
    assert policy.evict(1, NONE) == [k(2)]  # stored at 2 ties with 1's use at 2: probation first


def test_metadata_stays_bounded_and_clear_forgets_it() -> None:
    capacity = 2048
    policy = DSLRUPolicy(capacity)
    requests = conversations(1, 6000, hot=40, cold=30)
    replay(policy, capacity, requests)
    stats = policy.statistics()
    assert stats.tracked == capacity
    assert 0 < stats.history <= stats.history_limit
    # Ghosts: two generations of at most (4 + 2) capacities in the tier; in each shadow (a
    # 32nd of it) its keys, and two generations of (2 + 2) and (4 + 2) of its capacities.
    assert stats.history_limit == capacity * 12 + capacity // 32 * (3 + 8 + 12)
    assert stats.detail["shadow_keys"] > 0
    policy.clear()
    cleared = policy.statistics()
    assert cleared.tracked == 0
    assert cleared.history == 0
    assert policy.expert == "lru"


def test_never_below_lru_where_lru_wins_and_above_it_where_it_loses() -> None:
    """A hot family over a cold stream: a segmented expert wins, and the shadows see it."""
    requests = conversations(2, 8000, hot=60, cold=40)
    blocks = sum(len(keys) for keys in requests)
    policy = DSLRUPolicy(1024)
    mine = replay(policy, 1024, requests) / blocks
    lru = simulate_keys(requests, capacity_tokens=1024 * 512, policy="lru").hit_rate
    assert policy.expert in ("history=2", "history=4")
    assert policy.statistics().detail["expert_switches_total"] >= 1
    assert mine > lru
    # A cyclic scan LRU handles as well as any split: no expert may cost much.
    loop = [[k(0), k(i)] for _ in range(30) for i in range(1, 800)]
    looped = simulate_keys(loop, capacity_tokens=1024 * 512, policy="dslru").hit_rate
    assert looped >= simulate_keys(loop, capacity_tokens=1024 * 512, policy="lru").hit_rate


def test_results_are_deterministic() -> None:
    requests = conversations(3, 3000, hot=30, cold=20)
    one = simulate_keys(requests, capacity_tokens=1024 * 512, policy="dslru")
    two = simulate_keys(requests, capacity_tokens=1024 * 512, policy="dslru")
    assert one.hit_blocks == two.hit_blocks


def test_ghosts_remember_a_key_for_their_span_and_hold_at_most_twice_their_limit() -> None:
    from tiering.policies.dslru import _Ghosts

    ghosts = _Ghosts(span=100, limit=150)
    count = ghosts.add([k(0)], 0, probation=True)
    for i in range(1, 100):  # 99 more probation evictions: k(0) is still remembered
        count = ghosts.add([k(i)], count, probation=True)
        assert ghosts.get(k(0)) == 1
        assert len(ghosts) <= 300
    for i in range(100, 400):
        count = ghosts.add([k(i)], count, probation=True)
        assert len(ghosts) <= 300
    assert ghosts.get(k(0)) == 0  # forgotten, a generation at a time
    assert ghosts.pop(k(399)) == 400 and ghosts.get(k(399)) == 0
    # Protected evictions are negated, and crowd a generation to its limit at most.
    protected = 0
    for i in range(1000, 1400):
        protected = ghosts.add([k(i)], protected, probation=False)
        assert len(ghosts) <= 300
    assert ghosts.get(k(1399)) == -400
    ghosts.clear()
    assert len(ghosts) == 0 and ghosts.isdisjoint([k(1399)])
