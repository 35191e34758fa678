"""The adaptive segmented LRU: probation, protection, ghost admission, the adaptive split."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.policies import POLICY_NAMES, ASLRUPolicy, CachePolicy, LRUPolicy, create_policy
from tiering.sim import requests_to_keys, simulate_keys
from tiering.workload import Request, chat_workload, documents_workload

NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


def tracked(policy: CachePolicy) -> set[OffloadKey]:
    """The keys ``policy`` tracks (drained from a copy)."""
    twin = copy.deepcopy(policy)
    return set(twin.evict(len(twin), NONE) or [])


def request(policy: CachePolicy, *ids: int) -> None:
    """What the manager does for one request: store what is new, then commit recency."""
    policy.insert([key for key in keys(*ids) if key not in tracked(policy)])
    policy.touch(keys(*ids))


def detail(policy: ASLRUPolicy) -> dict[str, float]:
    return policy.statistics().detail


def test_registered_and_default() -> None:
    assert "aslru" in POLICY_NAMES
    assert DEFAULT_POLICY in POLICY_NAMES
    assert isinstance(create_policy("aslru", 8), ASLRUPolicy)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "at least 1 chunk, got 0"),
        ({"capacity": 4, "history": -1.0}, "history"),
        ({"capacity": 4, "window": float("nan")}, "window"),
        ({"capacity": 4, "step": float("inf")}, "step"),
        ({"capacity": 4, "initial_probation": 1.5}, "at most 1, got 1.5"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ASLRUPolicy(**kwargs)  # type: ignore[arg-type]


def test_once_used_chunks_go_before_reused_ones() -> None:
    policy = ASLRUPolicy(8)
    request(policy, 1, 2)
    request(policy, 1, 2)  # a second request: 1 and 2 proved reuse
    request(policy, 3, 4)  # newer, but used once
    assert detail(policy)["protected"] == 2
    assert policy.evict(2, NONE) == keys(4, 3)  # probation first, tail first
    assert policy.evict(1, NONE) == keys(2)  # then protected, tail first


def test_a_scan_of_one_off_chunks_does_not_flush_reused_ones() -> None:
    aslru, lru = ASLRUPolicy(4), LRUPolicy()
    for policy in (aslru, lru):
        request(policy, 1, 2)
        request(policy, 1, 2)
        for i in range(10, 30):  # one-off chunks through a tier of 4
            if len(policy) >= 4:
                assert policy.evict(len(policy) - 3, NONE) is not None
            request(policy, i)
    assert set(keys(1, 2)) <= tracked(aslru)
    assert not set(keys(1, 2)) & tracked(lru)


def test_the_new_last_chunk_of_a_request_goes_first() -> None:
    policy = ASLRUPolicy(8)
    request(policy, 1, 2, 3)
    request(policy, 7)
    assert policy.evict(1, NONE) == keys(7)  # the newest request's (partial) last block
    assert policy.evict(1, NONE) == keys(3)
    request(policy, 1, 2, 5)  # 1 and 2 reused: protected; 5 is the new last block
    assert policy.evict(1, NONE) == keys(5)
    assert detail(policy)["protected"] == 2


def test_a_key_stored_again_while_remembered_is_protected() -> None:
    policy = ASLRUPolicy(8, step=0.0)  # a frozen split: admission alone
    request(policy, 1, 2)
    assert policy.evict(2, NONE) == keys(2, 1)
    assert policy.statistics().history == 2  # remembered in the probation ghost
    request(policy, 1, 2)  # stored again: admitted to protected at once
    assert detail(policy)["protected"] == 2
    assert detail(policy)["admitted_total"] == 2
    assert policy.statistics().history == 0
    request(policy, 9)
    assert policy.evict(1, NONE) == keys(9)


def test_marginal_ghost_hits_move_the_target_both_ways() -> None:
    policy = ASLRUPolicy(20, window=0.5, step=0.1)  # window 10 evictions, step 2 chunks
    assert policy.target_probation == 0
    request(policy, 1)
    assert policy.evict(1, NONE) == keys(1)
    request(policy, 1)  # a probation ghost hit 0 evictions back: probation too small
    assert policy.target_probation == 2
    assert detail(policy)["marginal_probation_hits_total"] == 1
    assert policy.evict(1, NONE) == keys(1)  # probation is under target: protected gives
    request(policy, 1)  # a protected ghost hit: protected too small
    assert policy.target_probation == 0
    assert detail(policy)["marginal_protected_hits_total"] == 1
    request(policy, 1)
    policy.remove(keys(1))
    assert policy.target_probation == 0  # never below 0


def test_far_ghost_hits_admit_but_do_not_move_the_target() -> None:
    policy = ASLRUPolicy(20, window=0.1, step=0.1)  # window 2 evictions
    request(policy, 1)
    assert policy.evict(1, NONE) == keys(1)
    for i in range(100, 105):  # five more probation evictions: 1 is now far back
        request(policy, i)
        assert policy.evict(1, NONE) == keys(i)
    request(policy, 1)
    assert policy.target_probation == 0
    assert detail(policy)["admitted_total"] == 1
    assert detail(policy)["protected"] == 1


def test_marginal_hits_count_only_the_leading_run_of_a_store() -> None:
    policy = ASLRUPolicy(20, window=0.5, step=0.1)
    request(policy, 1, 2)
    assert policy.evict(1, NONE) == keys(2)
    policy.insert(keys(5, 2))  # 5 would miss anyway: 2 behind it is no marginal hit
    assert policy.target_probation == 0
    assert detail(policy)["admitted_total"] == 1


def test_ghost_lists_stay_bounded() -> None:
    rng = random.Random(11)
    policy = ASLRUPolicy(5, history=2.0)
    present: set[OffloadKey] = set()
    for _ in range(3000):
        ids = sorted(rng.sample(range(40), rng.randint(1, 3)))
        new = [key for key in keys(*ids) if key not in present]
        room = len(present) + len(new) - 5
        if room > 0:
            victims = policy.evict(room, frozenset(keys(*ids)))
            if victims is None:
                continue
            present.difference_update(victims)
        policy.insert(new)
        present.update(new)
        policy.touch(keys(*ids))
        stats = policy.statistics()
        assert stats.history <= stats.history_limit == 2 * 5 + 5
        assert len(policy) == len(present) <= 5
        assert 0 <= policy.target_probation <= 5
    assert detail(policy)["admitted_total"] > 0
    assert detail(policy)["protected"] > 0


def test_clear_forgets_history_and_the_learned_split() -> None:
    policy = ASLRUPolicy(20, window=0.5, step=0.1, initial_probation=0.25)
    request(policy, 1)
    assert policy.evict(1, NONE) == keys(1)
    request(policy, 1)
    assert policy.target_probation == 7
    policy.clear()
    assert len(policy) == 0
    assert policy.target_probation == 5
    stats = policy.statistics()
    assert (stats.tracked, stats.history, stats.detail["admitted_total"]) == (0, 0, 0)
    assert "probation: 0" in repr(policy)


@pytest.mark.parametrize(
    ("workload", "capacity_chunks"),
    [(chat_workload, 60), (documents_workload, 100)],
    ids=["chat", "documents"],
)
def test_the_default_beats_lru_on_small_synthetic_workloads(
    workload: Callable[[int], list[Request]], capacity_chunks: int
) -> None:
    request_keys = requests_to_keys(workload(1500))
    rate = {
        name: simulate_keys(request_keys, capacity_tokens=capacity_chunks * 512, policy=name)
        for name in ("lru", DEFAULT_POLICY, "optimal")
    }
    assert rate[DEFAULT_POLICY].hit_rate >= 1.15 * rate["lru"].hit_rate
    assert rate[DEFAULT_POLICY].hit_rate <= rate["optimal"].hit_rate
