"""`DiskIndex`, the disk tier's index alone: plans and settles, with no event loop and no I/O."""

from __future__ import annotations

import errno
from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiering._types import OffloadKey, make_offload_key
from tiering.policies import POLICY_NAMES, create_policy
from tiering.secondary.disk.index import DiskIndex, WritePlan
from tiering.secondary.disk.layout import WriteOutcome

VALUE = 100  # bytes of every value file here
KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(12)]
NOTHING = memoryview(b"")


def rows(keys: Sequence[OffloadKey]) -> list[tuple[OffloadKey, memoryview]]:
    return [(key, NOTHING) for key in keys]


def outcome(
    renamed: Sequence[int] = (), gone: Sequence[int] = (), errors: dict[int, int] | None = None
) -> WriteOutcome:
    out = WriteOutcome()
    out.renamed = list(renamed)
    out.gone = list(gone)
    out.errors = {i: OSError(code, errno.errorcode[code]) for i, code in (errors or {}).items()}
    return out


class Index:
    """A `DiskIndex` of ``values`` values, recording what it announces."""

    def __init__(self, values: int, policy: str = "lru") -> None:
        self.announced: list[OffloadKey] = []
        self.index = DiskIndex(
            create_policy(policy, values), values * VALUE, lambda key: VALUE, self.announced.extend
        )

    def write(self, keys: Sequence[OffloadKey]) -> WritePlan:
        """A write of ``keys`` planned and settled, every item renamed, every victim gone."""
        plan = self.index.plan_write(rows(keys), measure=False)
        self.index.settle(plan, outcome(range(len(plan.items)), range(len(plan.victims))))
        return plan


def test_a_write_into_room_evicts_nothing() -> None:
    t = Index(4)
    plan = t.write(KEYS[:3])
    assert [k for k, _ in plan.items] == KEYS[:3]
    assert plan.new == KEYS[:3]
    assert plan.victims == []
    assert (t.index.used, len(t.index), t.index.reserved) == (3 * VALUE, 3, 0)


def test_a_full_index_evicts_by_its_policy_and_announces_it() -> None:
    t = Index(3)
    t.write(KEYS[:3])
    plan = t.write(KEYS[3:5])
    assert len(plan.victims) == 2
    assert set(plan.victims) < set(KEYS[:3])
    assert t.announced == plan.victims
    assert t.index.evictions == 2
    assert not any(victim in t.index for victim in plan.victims)
    assert (t.index.used, len(t.index)) == (3 * VALUE, 3)


def test_values_being_read_are_never_evicted() -> None:
    t = Index(2)
    t.write(KEYS[:2])
    t.index.begin_read([KEYS[0]])
    plan = t.write([KEYS[2]])
    assert plan.victims == [KEYS[1]]
    assert t.index.end_read([KEYS[0]]) == set()
    assert t.index.reading == {}


def test_a_key_in_flight_is_left_to_its_call_and_no_room_cuts_the_batch() -> None:
    t = Index(2)
    first = t.index.plan_write(rows(KEYS[:2]), measure=False)
    assert first.reserved == 2 * VALUE
    second = t.index.plan_write(rows([KEYS[0], KEYS[2]]), measure=False)
    # KEYS[0] is being written by the first call; for KEYS[2] nothing can be evicted.
    assert (second.busy, second.no_room, second.items) == (1, 1, [])
    t.index.settle(second, outcome())
    t.index.settle(first, outcome([0, 1]))
    assert (t.index.used, t.index.reserved, t.index.writing) == (2 * VALUE, 0, {})


def test_victims_whose_files_stay_go_with_the_next_write() -> None:
    t = Index(2)
    t.write(KEYS[:2])
    plan = t.index.plan_write(rows([KEYS[2]]), measure=False)
    [victim] = plan.victims
    [kept] = [k for k in KEYS[:2] if k != victim]
    t.index.settle(plan, outcome([0], gone=[]))  # the victim's file is still there
    assert t.index.trash == [victim]
    nxt = t.index.plan_write(rows([kept]), measure=False)  # held already: no room needed
    assert nxt.victims == [victim]
    assert t.index.trash == []
    t.index.settle(nxt, outcome([0], gone=[0]))
    assert t.index.trash == []


def test_a_value_written_anew_while_read_is_fresh() -> None:
    t = Index(3)
    t.write([KEYS[0]])
    t.index.begin_read([KEYS[0]])
    t.write([KEYS[0]])
    assert t.index.end_read([KEYS[0]]) == {KEYS[0]}
    assert t.index.rewritten == set()


def test_a_smaller_file_system_lowers_the_capacity_and_evicts() -> None:
    t = Index(10)
    t.write(KEYS[:6])
    # 250 bytes free of 10,000: the tier's 600 + 250 - a reserve of 100 -> 750.
    assert t.index.refit((250, 10_000)) is False  # lowered, nothing evicted: no room made
    assert t.index.effective_capacity_bytes == 750
    assert t.index.used == 6 * VALUE  # still fits
    assert t.index.refit((0, 10_000)) is True  # 600 - 100: one value goes
    assert (t.index.effective_capacity_bytes, t.index.used) == (500, 5 * VALUE)
    assert len(t.index.trash) == 1
    t.index.refit((1 << 30, 1 << 31))  # space freed: back to the configured capacity
    assert t.index.effective_capacity_bytes == 10 * VALUE


def test_a_refit_never_evicts_a_value_being_read_or_written() -> None:
    t = Index(4)
    t.write(KEYS[:4])
    t.index.begin_read([KEYS[0]])
    plan = t.index.plan_write(rows([KEYS[1]]), measure=True)  # held already: written anew
    # Room for 2 values (400 bytes held, none free, a reserve of 200): 2 of them go, and
    # only the 2 that no call reads or writes may.
    assert t.index.refit((0, 200 * VALUE)) is True
    assert t.index.effective_capacity_bytes == 2 * VALUE
    assert sorted(t.index.trash) == sorted(KEYS[2:4])
    assert all(key in t.index for key in KEYS[:2])
    t.index.end_read([KEYS[0]])
    t.index.settle(plan, outcome([0]))
    assert (t.index.used, t.index.reserved, t.index.writing) == (2 * VALUE, 0, {})


def test_a_quota_holds_what_the_files_take() -> None:
    t = Index(10)
    t.write(KEYS[:3])
    plan = t.index.plan_write(rows([KEYS[3]]), measure=True)
    plan.space = (1 << 30, 1 << 31)  # fstatvfs sees room; the quota refused the value
    settled = t.index.settle(plan, outcome(errors={0: errno.EDQUOT}))
    assert settled.written == 0
    assert settled.room is True  # values it may evict: their files take the next ones
    assert t.index.effective_capacity_bytes == 3 * VALUE


def test_adopt_indexes_a_scan_and_trims_to_capacity() -> None:
    t = Index(2)
    victims = t.index.adopt([(k, VALUE, i) for i, k in enumerate(KEYS[:3])], None)
    assert len(victims) == 1
    assert victims[0] in KEYS[:3]
    assert (len(t.index), t.index.used) == (2, 2 * VALUE)


class IndexMachine(RuleBasedStateMachine):
    """Random interleavings of writes (planned, then settled in any order), reads, losses
    and file system measures."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[WritePlan] = []
        self.reads: list[list[OffloadKey]] = []
        self.evicted = 0

    @initialize(values=st.integers(1, 6), policy=st.sampled_from(POLICY_NAMES))
    def start(self, values: int, policy: str) -> None:
        self.t = Index(values, policy)
        self.index = self.t.index

    def in_flight(self) -> set[OffloadKey]:
        return set(self.index.reading) | set(self.index.writing)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), measure=st.booleans())
    def plan_write(self, keys: list[OffloadKey], measure: bool) -> None:
        busy = set(self.index.writing) | self.index.unlinking
        protected = self.in_flight() | set(keys)
        held = set(self.index.sizes)
        plan = self.index.plan_write(rows(keys), measure=measure)
        chosen = [k for k, _ in plan.items]
        assert not set(chosen) & busy  # a key in flight is left to its call
        assert chosen == [k for k in keys if k not in busy][: len(chosen)]  # a head
        assert plan.busy + plan.no_room + len(chosen) == len(keys)
        # A value evicted now may also be named by the trash (evicted before, its file
        # left, then written anew): one eviction, named twice (its second delete is a no-op).
        evicted = {v for v in plan.victims if v in held}
        assert not evicted & protected  # never one read, written, or of the batch
        self.evicted += len(evicted)
        self.plans.append(plan)

    @precondition(lambda self: self.plans)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        plan = self.plans.pop(data.draw(st.integers(0, len(self.plans) - 1)))
        positions = range(len(plan.items))
        renamed = data.draw(
            st.lists(st.sampled_from(positions), unique=True) if positions else st.just([])
        )
        victims = range(len(plan.victims))
        gone = data.draw(
            st.lists(st.sampled_from(victims), unique=True) if victims else st.just([])
        )
        failed = [p for p in positions if p not in renamed]
        codes = st.sampled_from([errno.ENOSPC, errno.EDQUOT, errno.EIO])
        errors = {p: data.draw(codes) for p in failed if data.draw(st.booleans())}
        if plan.measure and not self.plans and not self.reads:  # all evictable: the fit holds
            plan.space = (data.draw(st.integers(0, 8 * VALUE)), 100 * VALUE)
        before = self.index.evictions
        settled = self.index.settle(plan, outcome(sorted(renamed), sorted(gone), errors))
        assert settled.written == len(renamed)
        self.evicted += self.index.evictions - before

    @precondition(lambda self: self.index.sizes)
    @rule(data=st.data())
    def begin_read(self, data: st.DataObject) -> None:
        keys = data.draw(
            st.lists(st.sampled_from(sorted(self.index.sizes)), min_size=1, unique=True)
        )
        self.index.begin_read(keys)
        self.reads.append(keys)

    @precondition(lambda self: self.reads)
    @rule(data=st.data(), lose=st.booleans())
    def end_read(self, data: st.DataObject, lose: bool) -> None:
        keys = self.reads.pop(data.draw(st.integers(0, len(self.reads) - 1)))
        fresh = self.index.end_read(keys)
        # Its file was gone: the tier forgets it. (Not while a write of it is in flight:
        # that write, planned when the value was held, reserved nothing, and indexes it
        # again when it lands; until the next write evicts, the index then holds one value
        # over its capacity, as the tier did before #27.)
        if lose and keys[0] not in fresh and keys[0] not in self.index.writing:
            self.index.lose(keys[0])

    @invariant()
    def counts_add_up(self) -> None:
        index = self.index
        assert index.used == sum(index.sizes.values()) == VALUE * len(index.sizes)
        assert len(index.policy) == len(index.sizes)
        assert index.evictions == self.evicted
        assert index.reserved == VALUE * sum(len(p.new) for p in self.plans)

    @invariant()
    def never_over_capacity(self) -> None:
        index = self.index
        assert index.used + index.reserved <= index.effective_capacity_bytes
        assert VALUE <= index.effective_capacity_bytes <= index.capacity_bytes

    @invariant()
    def nothing_in_flight_when_all_settled(self) -> None:
        index = self.index
        if not self.plans:
            assert (index.reserved, index.writing, index.unlinking) == (0, {}, set())
        if not self.reads:
            assert index.reading == {}
            assert index.rewritten == set()


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
