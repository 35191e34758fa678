"""Retention hints on top of every policy: the contract with and without hints, the share,
released first, retained kept, and hints followed only while they carry information."""

from __future__ import annotations

import copy
import random
from collections.abc import Container, Sequence

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.policies import POLICY_NAMES, CachePolicy, create_policy
from tiering.policies.hints import HintBook

KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), max_size=6)
hints = st.one_of(
    st.none(),
    st.builds(Hint, release=st.just(True), priority=st.integers(-2, 2)),
    st.builds(Hint, retain_s=st.floats(0.5, 20.0), priority=st.integers(-2, 2)),
)
CAPACITY = 5
NONE: frozenset[OffloadKey] = frozenset()


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Hinted(CachePolicy):
    """A policy and a hint book as the manager drives them, as one `CachePolicy`, so the
    contract's machine runs over it; ``next_hint`` goes with the next touch."""

    def __init__(self, policy: CachePolicy, book: HintBook) -> None:
        self.name = policy.name
        self.policy = policy
        self.book = book
        self.tracked: set[OffloadKey] = set()
        self.next_hint: Hint | None = None

    def insert(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.insert(keys)
        self.tracked.update(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.touch(keys)
        self.book.note(keys, self.next_hint, self.tracked)
        self.next_hint = None

    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        victims = self.book.evict(self.policy, n, protected)
        if victims:
            self.tracked.difference_update(victims)
        return victims

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        self.policy.remove(keys)
        self.book.forget(keys)
        self.tracked.difference_update(keys)

    def clear(self) -> None:
        self.policy.clear()
        self.book.clear()
        self.tracked.clear()

    def __len__(self) -> int:
        return len(self.policy)


class HintedMachine(RuleBasedStateMachine):
    """The `CachePolicy` contract over a policy with hints (exactly ``n`` victims or none,
    never a protected key), and the hints' own bounds, against a twin without hints that
    must decide victim for victim alike while no hint was given."""

    name: str

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.hinted = Hinted(
            create_policy(self.name, CAPACITY),
            HintBook(CAPACITY, share=0.4, clock=self.clock, evidence=2, memory=16),
        )
        self.plain = create_policy(self.name, CAPACITY)
        self.tracked: set[OffloadKey] = set()
        self.hints_given = False

    @rule(keys=key_lists)
    def insert(self, keys: list[OffloadKey]) -> None:
        new = [key for key in dict.fromkeys(keys) if key not in self.tracked]
        self.hinted.insert(new)
        self.plain.insert(new)
        self.tracked.update(new)

    @rule(keys=key_lists, hint=hints)
    def touch(self, keys: list[OffloadKey], hint: Hint | None) -> None:
        self.hints_given |= hint is not None
        self.hinted.next_hint = hint
        self.hinted.touch(keys)
        self.plain.touch(keys)

    @rule(seconds=st.floats(0.0, 10.0))
    def wait(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(n=st.integers(-1, 8), protected=st.frozensets(st.sampled_from(KEYS), max_size=5))
    def evict(self, n: int, protected: frozenset[OffloadKey]) -> None:
        candidates = self.tracked - protected
        before = copy.deepcopy(self.hinted.book.statistics())
        victims = self.hinted.evict(n, protected)
        if self.hints_given:
            plain = self.plain.evict(n, protected)
            if plain != victims and plain is not None and victims is not None:
                # The twins part ways: the plain one follows the hinted one's victims.
                self.plain.remove(victims)
                self.plain.insert([key for key in plain if key not in victims])
        else:
            assert self.plain.evict(n, protected) == victims  # no hint: today's decision
        if n <= 0:
            assert victims == []
        elif n > len(candidates):
            assert victims is None  # retention never makes room that is not there
            assert self.hinted.book.statistics() == before
        else:
            assert victims is not None  # retention never refuses room that is there
            assert len(victims) == len(set(victims)) == n
            assert set(victims) <= candidates
            self.tracked.difference_update(victims)

    @rule(keys=key_lists)
    def remove(self, keys: list[OffloadKey]) -> None:
        self.hinted.remove(keys)
        self.plain.remove(keys)
        self.tracked.difference_update(keys)

    @invariant()
    def bounded(self) -> None:
        assert len(self.hinted) == len(self.tracked)
        stats = self.hinted.book.statistics()
        assert stats.retained <= stats.retained_limit == int(0.4 * CAPACITY)
        assert stats.released <= len(self.tracked)  # only keys of the tier


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_contract_with_and_without_hints(name: str) -> None:
    machine = type(f"Hinted{name.upper()}Machine", (HintedMachine,), {"name": name})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=60, stateful_step_count=30, deadline=None)
    )


def run_requests(
    manager: CPUOffloadingManager, requests: Sequence[Sequence[OffloadKey]], hint_of: object
) -> tuple[int, list[OffloadKey]]:
    """Each request as a server runs it: hits, store, touch with its hint (``hint_of(i)``);
    the hit keys and every victim, in order."""
    hits = 0
    victims: list[OffloadKey] = []
    for i, keys in enumerate(requests):
        found = manager.lookup_prefix(keys)
        hits += found
        if found < len(keys):
            out = manager.prepare_store(keys[found:])
            assert out is not None
            victims += out.evicted_keys
            manager.complete_store(out.keys_to_store)
        manager.touch(keys, hint_of(i))  # type: ignore[operator]
    return hits, victims


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_manager_without_hints_evicts_victim_for_victim_as_its_policy_alone(name: str) -> None:
    rng = random.Random(7)
    requests = [[k(rng.randrange(60)) for _ in range(rng.randrange(1, 6))] for _ in range(400)]
    requests = [list(dict.fromkeys(r)) for r in requests]
    manager = CPUOffloadingManager(16, create_policy(name, 16))
    _, with_book = run_requests(manager, requests, lambda i: None)
    # The same requests with the policy alone, evicting as the manager did before hints.
    policy = create_policy(name, 16)
    held: list[OffloadKey] = []
    alone: list[OffloadKey] = []
    for keys in requests:
        run = 0
        for key in keys:
            if key not in held:
                break
            run += 1
        new = [key for key in keys[run:] if key not in held]
        policy.insert(new)
        need = len(held) + len(new) - 16
        if need > 0:
            out = policy.evict(need, set(new) | {key for key in keys[run:] if key in held})
            assert out is not None
            alone += out
            held = [key for key in held if key not in out]
        held += new
        policy.touch(keys)
    assert with_book == alone
    assert manager.hints.statistics().hinted_keys_total == 0
    assert manager.statistics().hints is None  # no hint given: nothing to report


def test_released_keys_go_first_and_a_use_takes_the_release_back() -> None:
    manager = CPUOffloadingManager(4, "lru")
    for i in range(4):
        out = manager.prepare_store([k(i)])
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.touch([k(i)], Hint(release=True) if i in (2, 3) else None)
    manager.touch([k(3)])  # used again: no longer released
    out = manager.prepare_store([k(10)])
    assert out is not None
    assert out.evicted_keys == (k(2),)
    manager.complete_store(out.keys_to_store)
    out = manager.prepare_store([k(11)])
    assert out is not None
    assert out.evicted_keys == (k(0),)
    stats = manager.statistics().hints
    assert stats is not None
    assert stats.released_evicted_total == 1
    assert stats.released == 0


def test_a_release_spares_the_head_other_conversations_share() -> None:
    manager = CPUOffloadingManager(64, "lru")
    system = [k(0), k(1)]  # a system prompt every conversation begins with

    def request(keys: list[OffloadKey], hint: Hint | None) -> None:
        found = manager.lookup_prefix(keys)
        out = manager.prepare_store(keys[found:])
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.touch(keys, hint)

    for c in range(10, 16):  # six conversations of two turns each
        request([*system, k(c * 10)], Hint(retain_s=60))
        request([*system, k(c * 10), k(c * 10 + 1)], Hint(retain_s=60))
    request([*system, k(100), k(101), k(102)], Hint(release=True))  # one of them ends
    stats = manager.statistics().hints
    assert stats is not None
    assert stats.released == 3  # its own three blocks, not the shared two


def test_released_keys_of_the_lowest_priority_go_first() -> None:
    manager = CPUOffloadingManager(3, "lru")
    for i, priority in enumerate((5, -3, 0)):
        out = manager.prepare_store([k(i)])
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.touch([k(i)], Hint(release=True, priority=priority))
    out = manager.prepare_store([k(7), k(8)])
    assert out is not None
    assert out.evicted_keys == (k(1), k(2))


def test_retained_keys_are_kept_until_their_deadline_within_the_share() -> None:
    clock = Clock()
    manager = CPUOffloadingManager(10, "lru", hint_share=0.2, clock=clock)

    def store(*ids: int, hint: Hint | None = None) -> tuple[OffloadKey, ...]:
        keys = [k(i) for i in ids]
        out = manager.prepare_store(keys)
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.touch(keys, hint)
        return out.evicted_keys

    store(0, 1, hint=Hint(retain_s=60))  # the oldest two: LRU's first victims
    for i in range(2, 10):
        store(i)
    assert set(store(20, 21)) == {k(2), k(3)}  # spared: 0 and 1
    clock.now = 30.0
    # A third retention, of a higher priority: past the share, 0 and 1 lose theirs.
    assert set(store(30, 31, hint=Hint(retain_s=60, priority=1))) == {k(4), k(5)}
    stats = manager.hints.statistics()
    assert stats.retained == stats.retained_limit == 2
    assert stats.retention_overflow_total == 2
    assert set(store(40, 41)) == {k(0), k(1)}
    assert set(store(42, 43)) == {k(6), k(7)}  # 30 and 31 still kept
    clock.now = 100.0  # their deadline passed: LRU's order again
    assert manager.hints.statistics().retained == 0  # none protected now
    assert store(50, 51, 52, 53, 54, 55) == tuple(k(i) for i in (8, 9, 21, 20, 31, 30))


def test_retention_never_refuses_room() -> None:
    manager = CPUOffloadingManager(4, "lru", hint_share=1.0)
    keys = [k(i) for i in range(4)]
    out = manager.prepare_store(keys)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.touch(keys, Hint(retain_s=600))
    out = manager.prepare_store([k(9)])
    assert out is not None
    assert out.evicted_keys == (k(3),)
    assert manager.hints.statistics().retention_overridden_total == 1


def conversation_requests(turns: int, seed: int) -> tuple[list[list[OffloadKey]], list[bool]]:
    """Conversations of a few turns each (each turn the last's keys and new ones),
    interleaved; and whether each request has a next turn."""
    rng = random.Random(seed)
    requests: list[list[OffloadKey]] = []
    continues: list[bool] = []
    open_: list[tuple[list[OffloadKey], int]] = []
    fresh = iter(range(10**6))
    for _ in range(turns):
        if open_ and rng.random() < 0.6:
            i = rng.randrange(len(open_))
            keys, left = open_.pop(i)
            keys = keys + [k(next(fresh)) for _ in range(3)]
        else:
            keys, left = [k(next(fresh)) for _ in range(6)], rng.choice((0, 0, 1, 3))
        requests.append(keys)
        continues.append(left > 0)
        if left > 0:
            open_.append((keys, left - 1))
    return requests, continues


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_right_hints_win_and_random_ones_stop_being_followed(name: str) -> None:
    requests, continues = conversation_requests(3000, seed=3)
    retain, release = Hint(retain_s=600), Hint(release=True)

    def hits(hint_of: object) -> tuple[int, CPUOffloadingManager]:
        manager = CPUOffloadingManager(40, create_policy(name, 40))
        return run_requests(manager, requests, hint_of)[0], manager

    none, _ = hits(lambda i: None)
    right, followed = hits(lambda i: retain if continues[i] else release)
    noise = random.Random(5)
    coins = [noise.random() < 0.5 for _ in requests]
    wrong, dropped = hits(lambda i: retain if coins[i] else release)
    assert right > 1.15 * none  # 1.21x with every policy
    assert followed.hints.statistics().following_releases
    stats = dropped.hints.statistics()
    assert not stats.following_releases
    assert not stats.following_retentions
    assert wrong >= 0.97 * none  # 0.99x


def test_the_book_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError, match=r"hint_share must be a fraction from 0 to 1, got 1\.5"):
        HintBook(8, share=1.5)
    with pytest.raises(ConfigError, match="hint_share"):
        CPUOffloadingManager(8, hint_share=-0.1)


def test_a_reset_forgets_hints() -> None:
    manager = CPUOffloadingManager(4, "lru")
    out = manager.prepare_store([k(1)])
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.touch([k(1)], Hint(release=True))
    assert manager.hints.statistics().released == 1
    manager.reset()
    assert manager.hints.statistics().released == 0
    assert manager.hints.active is False
