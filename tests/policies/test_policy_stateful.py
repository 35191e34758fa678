"""Random sequences of every policy call, against a plain model of the contract, per policy."""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tiering._types import OffloadKey, make_offload_key
from tiering.policies import POLICY_NAMES, CachePolicy, create_policy

KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(10)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
CAPACITY = 4  # sizes ghost lists and targets; the contract itself has no capacity


def drain(policy: CachePolicy) -> list[OffloadKey]:
    """Every key of a copy of ``policy``, in its eviction order (the original is kept)."""
    twin = copy.deepcopy(policy)
    order = twin.evict(len(twin), frozenset())
    assert order is not None
    return order


class PolicyMachine(RuleBasedStateMachine):
    """The contract of `CachePolicy`: exactly ``n`` victims or nothing at all."""

    name: str

    def __init__(self) -> None:
        super().__init__()
        self.policy = create_policy(self.name, CAPACITY)
        self.tracked: set[OffloadKey] = set()

    @rule(keys=key_lists)
    def insert(self, keys: list[OffloadKey]) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in self.tracked]
        self.policy.insert(new)
        self.tracked.update(new)

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.policy.touch(keys)  # untracked keys are ignored, repeats allowed

    @rule(n=st.integers(-1, 8), protected=st.frozensets(st.sampled_from(KEYS), max_size=5))
    def evict(self, n: int, protected: frozenset[OffloadKey]) -> None:
        candidates = self.tracked - protected
        before = drain(self.policy) if n > len(candidates) else None
        stats = self.policy.statistics()
        victims = self.policy.evict(n, protected)
        if n <= 0:
            assert victims == []
        elif n > len(candidates):
            assert victims is None
            assert drain(self.policy) == before  # all or nothing: not even the order moved
            assert self.policy.statistics() == stats
        else:
            assert victims is not None
            assert len(victims) == n
            assert len(set(victims)) == n
            assert set(victims) <= candidates
            self.tracked.difference_update(victims)

    @rule(keys=key_lists)
    def remove(self, keys: list[OffloadKey]) -> None:
        self.policy.remove(keys)
        self.tracked.difference_update(keys)

    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.tracked.clear()
        assert self.policy.statistics().history == 0

    @invariant()
    def counts_match(self) -> None:
        assert len(self.policy) == len(self.tracked)
        stats = self.policy.statistics()
        assert stats.name == self.name
        assert stats.tracked == len(self.tracked)
        assert 0 <= stats.history <= stats.history_limit
        assert stats.metadata_bytes >= 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_contract(name: str) -> None:
    machine = type(f"{name.upper()}Machine", (PolicyMachine,), {"name": name})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=50, stateful_step_count=25, deadline=None)
    )


def test_every_policy_drains_completely() -> None:
    for name in POLICY_NAMES:
        policy = create_policy(name, CAPACITY)
        policy.insert(KEYS[:6])
        policy.touch(KEYS[:6])
        policy.touch(KEYS[2:4])
        assert sorted(drain(policy)) == sorted(KEYS[:6])
        assert len(policy) == 6
