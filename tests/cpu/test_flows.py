"""`tiering.cpu.flows.Flows`: write-through pins and promotion slots, reserved and settled
with no event loop, and random sequences of every call checked against its invariants."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.flows import (
    FlowCounts,
    FlowJob,
    FlowKind,
    Flows,
    Keep,
    PromotionTicket,
    WriteTicket,
    default_pin_bound,
)
from tiering.cpu.manager import CPUOffloadingManager, LookupResult
from tiering.errors import ChunkStateError, ConfigError

KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(12)]


def k(*ids: int) -> list[OffloadKey]:
    return [KEYS[i] for i in ids]


def landed(manager: CPUOffloadingManager, *ids: int) -> list[OffloadKey]:
    """Store ``ids`` in the CPU tier and land them (ready, unpinned)."""
    out = manager.prepare_store(k(*ids))
    assert out is not None
    manager.complete_store(out.keys_to_store)
    return k(*ids)


def flows_over(capacity: int = 8, labels: tuple[str, ...] = ("disk",), bound: int | None = None):
    manager = CPUOffloadingManager(capacity, "lru")
    flows = Flows(
        manager, labels, pin_bound=default_pin_bound(capacity) if bound is None else bound
    )
    flows.open_intake()
    return manager, flows


# -- write-through ------------------------------------------------------------------


def test_a_write_pins_its_chunks_until_settled_and_counts_them() -> None:
    manager, flows = flows_over()
    keys = landed(manager, 1, 2)
    ticket = flows.reserve_write(0, keys)
    assert isinstance(ticket, WriteTicket)
    assert ticket.job == FlowJob(FlowKind.WRITE, "disk", 0)
    assert ticket.keys == tuple(keys)
    assert list(ticket.chunk_ids) == manager.prepare_load(keys).chunk_ids.tolist()
    manager.complete_load(keys)
    assert manager.statistics().pinned == 2
    assert manager.statistics().loaded_total == 2  # this test's own load: a write's is not one
    assert flows.begin_write(ticket)
    assert flows.reading(0) == 2
    assert flows.settle_write(ticket, 2)
    assert flows.settle_write(ticket, 2) is False  # idempotent
    assert manager.statistics().pinned == 0
    assert flows.counts() == FlowCounts(cascade_queued=2, cascade_written=2, cascade_max_pinned=4)


def test_a_partial_write_counts_the_rest_failed() -> None:
    manager, flows = flows_over()
    ticket = flows.reserve_write(0, landed(manager, 1, 2, 3))
    assert ticket is not None
    assert flows.begin_write(ticket)
    assert not flows.settle_write(ticket, 1)
    counts = flows.counts()
    assert (counts.cascade_written, counts.cascade_failed, counts.cascade_pinned) == (1, 2, 0)


def test_a_batch_past_the_bound_is_dropped_whole() -> None:
    manager, flows = flows_over(capacity=8)  # half the tier: 4 pins
    first = flows.reserve_write(0, landed(manager, 1, 2, 3))
    assert first is not None
    # Three more would take the pins to 6: the whole batch is dropped, not its head.
    assert flows.reserve_write(0, landed(manager, 4, 5, 6)) is None
    assert flows.reserve_write(0, k(4)) is not None  # one still fits
    counts = flows.counts()
    assert (counts.cascade_queued, counts.cascade_dropped, counts.cascade_pinned) == (4, 3, 4)
    assert manager.statistics().pinned == 4


def test_closed_intake_fence_and_chunks_gone_are_dropped_and_counted() -> None:
    manager, flows = flows_over()
    keys = landed(manager, 1)
    assert flows.reserve_write(0, ()) is None  # nothing: nothing counted
    flows.close_intake()
    assert flows.reserve_write(0, keys) is None
    flows.open_intake(0)
    flows.reset(fence=True)
    assert flows.fenced
    assert flows.reserve_write(0, keys) is None
    flows.reset_flushed()
    assert flows.reserve_write(0, k(7)) is None  # not in the tier (evicted since)
    pending = manager.prepare_store(k(8))
    assert pending is not None
    assert flows.reserve_write(0, k(8)) is None  # still being written: not readable
    assert flows.counts().cascade_dropped == 4
    assert manager.statistics().pinned == 0


def test_a_write_the_shell_cannot_queue_is_unpinned_and_dropped() -> None:
    manager, flows = flows_over()
    ticket = flows.reserve_write(0, landed(manager, 1, 2))
    assert ticket is not None
    flows.refuse_write(ticket)
    flows.refuse_write(ticket)  # idempotent
    assert not flows.begin_write(ticket)
    counts = flows.counts()
    assert (counts.cascade_queued, counts.cascade_dropped, counts.cascade_pinned) == (0, 2, 0)
    assert manager.statistics().pinned == 0


def test_a_reset_voids_queued_writes_which_then_count_as_failed() -> None:
    manager, flows = flows_over()
    ticket = flows.reserve_write(0, landed(manager, 1))
    assert ticket is not None
    with pytest.raises(ChunkStateError, match="or pass force=True"):
        flows.check_reset(force=False)
    flows.check_reset(force=True)  # queued, not being read: a forced reset may go on
    flows.reset()
    manager.reset(force=True)
    assert not flows.begin_write(ticket)  # its rows hold other chunks now
    assert not flows.settle_write(ticket, 0)
    assert flows.counts().cascade_failed == 1
    assert not flows.fenced  # an unfenced reset


def test_a_write_being_read_refuses_even_a_forced_reset() -> None:
    manager, flows = flows_over()
    ticket = flows.reserve_write(0, landed(manager, 1))
    assert ticket is not None
    assert flows.begin_write(ticket)
    with pytest.raises(ChunkStateError, match=r"wait for them \(statistics\(\).secondary\)$"):
        flows.check_reset(force=True)
    flows.settle_write(ticket, 1)
    flows.check_reset(force=False)


def test_the_bound_is_split_evenly_between_the_tiers() -> None:
    manager = CPUOffloadingManager(16, "lru")
    flows = Flows(manager, ("disk", "remote"), pin_bound=8)
    assert [flows.max_pinned(i) for i in (0, 1)] == [4, 4]
    assert [c.cascade_max_pinned for c in (flows.counts(0), flows.counts(1))] == [4, 4]
    assert Flows(manager, ("a", "b", "c"), pin_bound=1).max_pinned(2) == 1  # at least one
    assert default_pin_bound(8) == 4
    assert default_pin_bound(1) == 1
    flows.open_intake(1)  # only the second tier takes writes
    keys = landed(manager, 1)
    assert flows.reserve_write(0, keys) is None
    assert flows.reserve_write(1, keys) is not None
    assert "disk: 0/4 pinned" in repr(flows)
    assert "remote: 1/4 pinned" in repr(flows)


def test_tiers_need_labels_of_their_own() -> None:
    manager = CPUOffloadingManager(4, "lru")
    with pytest.raises(ConfigError, match="its own label"):
        Flows(manager, ("disk", "disk"), pin_bound=2)
    with pytest.raises(ConfigError, match="at least one tier"):
        Flows(manager, (), pin_bound=2)


# -- promotion ----------------------------------------------------------------------


def test_a_promotion_keeps_its_leading_run_and_frees_the_rest() -> None:
    manager, flows = flows_over(capacity=8, labels=("disk", "remote"))
    ticket = flows.reserve_promotion((), k(1, 2, 3, 4), [0, 1, 1, 0])
    assert isinstance(ticket, PromotionTicket)
    assert ticket.job == FlowJob(FlowKind.PROMOTE, "disk+remote", 0)
    assert ticket.sources == (0, 1, 1, 0)
    assert [manager.lookup(key) for key in k(1, 4)] == [LookupResult.HIT_PENDING] * 2
    settled = flows.settle_promotion(ticket, set(k(1, 2, 4)))  # 3 did not load: 4 is lost too
    assert settled.kept == tuple(k(1, 2))
    assert settled.lost == tuple(k(3, 4))
    assert settled.by_tier == {"disk": 1, "remote": 1}
    assert settled.write_up == (tuple(k(2)),)  # the remote tier gave 2: the disk lacks it
    assert [manager.holds(key, ready=True) for key in k(1, 2, 3, 4)] == [True, True, False, False]
    assert manager.statistics().open_store_jobs == 0
    assert (flows.counts(0).promoted, flows.counts(0).promote_failed) == (1, 1)
    assert (flows.counts(1).promoted, flows.counts(1).promote_failed) == (1, 1)
    assert flows.settle_promotion(ticket, set(k(1))).kept == ()  # idempotent


def test_each_loaded_keeps_every_chunk_that_loaded() -> None:
    _manager, flows = flows_over()
    ticket = flows.reserve_promotion((), k(1, 2, 3), keep=Keep.EACH_LOADED)
    assert ticket is not None
    settled = flows.settle_promotion(ticket, set(k(1, 3)))
    assert settled.kept == tuple(k(1, 3))
    assert settled.lost == tuple(k(2))
    assert settled.write_up == ()  # one tier: nothing above it
    counts = flows.counts()
    assert (counts.promote_reserved, counts.promoted, counts.promote_failed) == (3, 2, 1)


def test_no_room_for_the_run_tries_shorter_runs_never_evicting_the_head() -> None:
    manager, flows = flows_over(capacity=3)
    head = landed(manager, 1)
    manager.prepare_load(head)  # the request's hit, pinned as a load would
    pending = manager.prepare_store(k(9))  # a store in flight takes a second slot
    assert pending is not None
    ticket = flows.reserve_promotion(head, k(2, 3, 4, 5))
    assert ticket is not None
    assert ticket.keys == tuple(k(2))
    assert manager.statistics().allocation_failures_total == 0
    flows.settle_promotion(ticket, set(ticket.keys))
    assert manager.holds(head[0], ready=True)
    # No room at all now (head, 2 and the store in flight): one failure, the run counted.
    manager.prepare_load(k(2))
    assert flows.reserve_promotion(head, k(3, 4)) is None
    assert manager.statistics().allocation_failures_total == 1
    assert flows.counts().promote_no_room == 2


def test_each_loaded_takes_all_or_nothing() -> None:
    manager, flows = flows_over(capacity=2)
    manager.prepare_load(landed(manager, 1))  # pinned: one slot left
    assert flows.reserve_promotion((), k(2, 3), keep=Keep.EACH_LOADED) is None
    assert manager.statistics().allocation_failures_total == 1
    assert flows.counts().promote_no_room == 2
    assert not manager.holds(KEYS[2])


def test_a_head_chunk_evicted_since_the_lookup_is_read_back_from_the_first_tier() -> None:
    _manager, flows = flows_over(capacity=4, labels=("disk", "remote"))
    ticket = flows.reserve_promotion(k(1), k(2), [1])  # 1 is no longer in the CPU tier
    assert ticket is not None
    assert ticket.keys == tuple(k(1, 2))
    assert ticket.sources == (0, 1)
    settled = flows.settle_promotion(ticket, set(k(1, 2)))
    assert settled.by_tier == {"remote": 1}  # the head is the caller's hit, not a promotion
    assert (flows.counts(0).promoted, flows.counts(1).promoted) == (1, 1)


def test_a_reset_voids_a_promotion_and_a_fence_holds_new_ones() -> None:
    manager, flows = flows_over()
    ticket = flows.reserve_promotion((), k(1, 2))
    assert ticket is not None
    flows.reset(fence=True)
    manager.reset(force=True)
    landed(manager, 1)  # another store of the same key since
    settled = flows.settle_promotion(ticket, set(k(1, 2)))
    assert settled.kept == ()
    assert settled.lost == tuple(k(1, 2))
    assert manager.holds(KEYS[1], ready=True)  # the later store is untouched
    assert flows.counts().promote_failed == 2
    assert flows.reserve_promotion((), k(3)) is None  # fenced: nothing promoted
    assert flows.counts().promote_no_room == 0
    flows.reset_flushed()
    assert flows.reserve_promotion((), k(3)) is not None
    assert flows.reserve_promotion((), k(1)) is None  # held already: nothing new
    assert flows.open_jobs == 1


# -- random sequences ----------------------------------------------------------------


class FlowsMachine(RuleBasedStateMachine):
    manager: CPUOffloadingManager
    flows: Flows
    tiers: int

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[WriteTicket] = []
        self.promotions: list[PromotionTicket] = []
        self.voided: set[FlowJob] = set()  # promotions out at a reset

    @initialize(
        capacity=st.integers(1, 8),
        tiers=st.integers(1, 3),
        bound=st.integers(1, 8),
        policy=st.sampled_from(["lru", "arc"]),
    )
    def start(self, capacity: int, tiers: int, bound: int, policy: str) -> None:
        self.manager = CPUOffloadingManager(capacity, policy)
        labels = ("disk", "remote", "other")[:tiers]
        self.tiers = tiers
        self.flows = Flows(self.manager, labels, pin_bound=min(bound, capacity))
        self.flows.open_intake()

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=4))
    def land(self, ids: list[int]) -> None:
        out = self.manager.prepare_store(k(*ids))
        if out is not None:
            self.manager.complete_store(out.keys_to_store)

    @rule(tier=st.integers(0, 2), ids=st.lists(st.integers(0, 11), min_size=1, max_size=4))
    def reserve_write(self, tier: int, ids: list[int]) -> None:
        tier %= self.tiers
        before = self.flows.counts(tier)
        ticket = self.flows.reserve_write(tier, k(*ids))
        after = self.flows.counts(tier)
        if ticket is None:
            assert after.cascade_dropped == before.cascade_dropped + len(ids)
        else:
            assert after.cascade_pinned == before.cascade_pinned + len(ids)
            self.writes.append(ticket)

    @precondition(lambda self: self.writes)
    @rule(pick=st.integers(0, 100))
    def begin_write(self, pick: int) -> None:
        ticket = self.writes[pick % len(self.writes)]
        before = self.flows.reading(ticket.tier)
        if self.flows.begin_write(ticket):
            assert self.flows.reading(ticket.tier) == before + len(ticket.keys)
            assert all(self.manager.holds(key, ready=True) for key in ticket.keys)

    @precondition(lambda self: self.writes)
    @rule(pick=st.integers(0, 100), written=st.integers(0, 4))
    def settle_write(self, pick: int, written: int) -> None:
        ticket = self.writes.pop(pick % len(self.writes))
        self.flows.settle_write(ticket, written)

    @precondition(lambda self: self.writes)
    @rule(pick=st.integers(0, 100))
    def refuse_write(self, pick: int) -> None:
        self.flows.refuse_write(self.writes.pop(pick % len(self.writes)))

    @rule(
        head=st.lists(st.integers(0, 11), max_size=2),
        wanted=st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
        data=st.data(),
        keep=st.sampled_from(Keep),
    )
    def reserve_promotion(
        self, head: list[int], wanted: list[int], data: st.DataObject, keep: Keep
    ) -> None:
        sources = data.draw(st.lists(st.integers(0, self.tiers - 1), min_size=len(wanted),
                                     max_size=len(wanted)))  # fmt: skip
        failures = self.manager.statistics().allocation_failures_total
        ticket = self.flows.reserve_promotion(k(*head), k(*wanted), sources, keep=keep)
        if ticket is not None:
            assert set(ticket.keys) <= set(k(*head, *wanted))
            assert all(self.manager.lookup(key) is LookupResult.HIT_PENDING for key in ticket.keys)
            self.promotions.append(ticket)
        assert self.manager.statistics().allocation_failures_total - failures <= 1

    @precondition(lambda self: self.promotions)
    @rule(pick=st.integers(0, 100), data=st.data())
    def settle_promotion(self, pick: int, data: st.DataObject) -> None:
        ticket = self.promotions.pop(pick % len(self.promotions))
        loaded = data.draw(st.sets(st.sampled_from(ticket.keys)))
        settled = self.flows.settle_promotion(ticket, loaded)
        assert set(settled.kept) | set(settled.lost) == set(ticket.keys)
        assert set(settled.kept) <= loaded
        for key in settled.kept:
            assert self.manager.holds(key, ready=True)
        if ticket.job in self.voided:
            assert settled.kept == ()
        else:  # the slots of what was not kept are free again
            assert not any(self.manager.holds(key) for key in settled.lost)

    @rule(fence=st.booleans())
    def reset(self, fence: bool) -> None:
        self.voided.update(ticket.job for ticket in self.promotions)
        self.flows.reset(fence=fence)
        self.manager.reset(force=True)

    @rule()
    def reset_flushed(self) -> None:
        self.flows.reset_flushed()

    @invariant()
    def pins_stay_within_their_bound_and_counts_add_up(self) -> None:
        flows = getattr(self, "flows", None)
        if flows is None:
            return
        for tier in range(self.tiers):
            c = flows.counts(tier)
            assert 0 <= c.cascade_pinned <= c.cascade_max_pinned == flows.max_pinned(tier)
            assert c.cascade_queued == c.cascade_written + c.cascade_failed + c.cascade_pinned
            assert c.promote_reserved == c.promoted + c.promote_failed + c.promoting
            assert min(c.promoting, c.promote_no_room, c.cascade_dropped) >= 0
            assert 0 <= flows.reading(tier) <= c.cascade_pinned
            # Exactly what the open tickets hold: nothing pinned or promoting once all is settled.
            assert c.cascade_pinned == sum(len(t.keys) for t in self.writes if t.tier == tier)
            assert c.promoting == sum(t.sources.count(tier) for t in self.promotions)
        assert flows.open_jobs == len(self.writes) + len(self.promotions)

    @invariant()
    def the_manager_is_consistent_and_idle_when_all_is_settled(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is None:
            return
        s = manager.statistics()
        assert s.used + s.free == s.capacity
        assert s.ready == s.used - s.writing
        assert s.evictable == s.ready - s.pinned
        assert s.pinned <= sum(len(t.keys) for t in self.writes)
        if not self.writes and not self.promotions:
            assert (s.pinned, s.writing, s.open_load_jobs, s.open_store_jobs) == (0, 0, 0, 0)


FlowsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFlowsMachine = FlowsMachine.TestCase
