"""The dueling segmented LRU: the contract under each expert, the shadows, bounded metadata."""

from __future__ import annotations

import math
import random

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.policies import DSLRUPolicy, create_policy
from tiering.sim import simulate_keys

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


def test_a_stored_key_awaiting_its_touch_counts_as_newer_than_every_use() -> None:
    policy = DSLRUPolicy(4096)
    policy.insert([k(1)])
    policy.touch([k(1)])
    policy.touch([k(1)])  # protected, used last of all
    policy.insert([k(2)])  # stored; its request still runs
    policy.touch([k(3)])  # untracked: ignored
    assert policy.evict(1, NONE) == [k(1)]  # as LRU: the store is the newest


class _LRUOnly(DSLRUPolicy):
    def _score(self) -> None:  # the shadows never get a say
        self._sampled = 0


def test_the_lru_expert_is_lru_victim_for_victim() -> None:
    """Keys present past a request's first miss, repeats, shared heads: the same victims."""
    rng = random.Random(11)
    ours, theirs = _LRUOnly(200), create_policy("lru", 200)
    managers = [CPUOffloadingManager(200, ours), CPUOffloadingManager(200, theirs)]
    for _ in range(4000):
        request = list(dict.fromkeys(k(rng.randrange(600)) for _ in range(rng.randrange(1, 20))))
        seen = []
        for manager in managers:
            n = manager.lookup_prefix(request)
            if n:
                manager.prepare_load(request[:n])
            output = manager.prepare_store(request[n:]) if n < len(request) else None
            if output is not None and output.keys_to_store:
                manager.complete_store(output.keys_to_store)
            if n:
                manager.complete_load(request[:n])
            manager.touch(request)
            seen.append((n, frozenset(output.evicted_keys) if output else frozenset()))
        assert seen[0] == seen[1]
    assert ours.expert == "lru"


def test_metadata_stays_bounded_and_clear_forgets_it() -> None:
    capacity = 2048
    policy = DSLRUPolicy(capacity)
    requests = conversations(1, 6000, hot=40, cold=30)
    replay(policy, capacity, requests)
    stats = policy.statistics()
    assert stats.tracked == capacity
    assert 0 < stats.history <= stats.history_limit
    # Ghosts: two generations of at most (4 + 2) capacities in the tier; in each shadow (a
    # 32nd of it) its keys, and in each segmented one two generations of (4 + 2) of its own.
    assert stats.history_limit == capacity * 12 + capacity // 32 * (1 + 2 * 13)
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
    from tiering.policies._segments import Ghosts as _Ghosts

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
    assert ghosts.pop(k(399)) == 400
    assert ghosts.get(k(399)) == 0
    # Protected evictions are negated, and crowd a generation to its limit at most.
    protected = 0
    for i in range(1000, 1400):
        protected = ghosts.add([k(i)], protected, probation=False)
        assert len(ghosts) <= 300
    assert ghosts.get(k(1399)) == -400
    ghosts.clear()
    assert len(ghosts) == 0
    assert ghosts.isdisjoint([k(1399)])


def test_the_lru_expert_is_lru_when_requests_end_out_of_order() -> None:
    """A stored key's first touch moves it: the LRU expert stays LRU at concurrency > 1."""
    ours, theirs = _LRUOnly(4096), create_policy("lru", 4096)
    for policy in (ours, theirs):
        policy.insert([k(1)])  # request A stores a
        policy.insert([k(2)])  # request B stores b...
        policy.touch([k(2)])  # ...and ends
        policy.insert([k(3)])
        policy.touch([k(3)])
        policy.touch([k(3)])  # q, used twice
        policy.touch([k(1)])  # A ends: a is the most recent
    assert ours.evict(2, NONE) == theirs.evict(2, NONE) == [k(2), k(3)]


def test_history_never_exceeds_its_limit_even_for_one_large_eviction() -> None:
    policy = DSLRUPolicy(1)
    keys = [k(i) for i in range(100)]
    policy.insert(keys)
    policy.touch(keys)
    assert policy.evict(100, NONE) is not None
    stats = policy.statistics()
    assert stats.history <= stats.history_limit


def test_a_shadow_refusing_a_store_changes_nothing() -> None:
    from tiering.policies._shadows import SegmentedShadow as _SegmentedShadow

    shadow = _SegmentedShadow(2, admit=8, span=8, window=1, step=1.0)
    shadow.access([k(1)], True)
    shadow.access([k(2)], True)
    shadow.access([k(3)], True)  # evicts one of them into the ghosts
    (gone,) = {k(1), k(2)} - set(shadow.probation) - set(shadow.protected)
    (kept,) = {k(1), k(2)} - {gone}
    assert shadow.memory.get(gone) > 0
    before = (dict(shadow.probation), dict(shadow.protected), shadow.target, len(shadow.memory))
    shadow.access([kept, k(3), gone], True)  # both held keys in the request: no room
    after = (dict(shadow.probation), dict(shadow.protected), shadow.target, len(shadow.memory))
    assert after[2:] == before[2:]
    assert shadow.memory.get(gone) > 0  # still remembered
    assert set(after[0]) | set(after[1]) == {kept, k(3)}


def short_think_conversations(requests: int, seed: int) -> list[list[OffloadKey]]:
    """Fifty conversations at a time, each turn its prompt so far plus a few new blocks:
    LRU and the splits take turns ahead, and none leads for long."""
    rng = random.Random(seed)
    out: list[list[OffloadKey]] = []
    live: list[list[OffloadKey]] = []
    fresh = 10**9
    for _ in range(requests):
        if live and rng.random() < 0.7:
            conversation = live[rng.randrange(len(live))]
        else:
            conversation = [k(0)]
            live.append(conversation)
        new = [k(fresh + j) for j in range(rng.randrange(1, 6))]
        fresh += len(new)
        conversation.extend(new)
        out.append(list(conversation))
        if rng.random() > 0.9:
            live.remove(conversation)
        if len(live) > 50:
            live.pop(0)
    return out


def test_leaving_lru_takes_the_long_run_too_where_experts_take_turns() -> None:
    requests = short_think_conversations(6000, 3)
    lru = replay(_LRUOnly(100), 100, requests)
    assert replay(DSLRUPolicy(100), 100, requests) >= lru
    # Judged on the short run alone (the long run decayed as fast), it follows each
    # lead and loses to LRU.
    assert replay(DSLRUPolicy(100, long_decay=0.97), 100, requests) < lru
