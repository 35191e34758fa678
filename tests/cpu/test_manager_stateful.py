"""Random sequences of every manager call, checked against a plain model after each step."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import (
    AllChunksCleared,
    ChunksRemoved,
    ChunksStored,
    CPUOffloadingManager,
    LookupResult,
)
from tiering.errors import ChunkStateError, UnknownKeyError
from tiering.policies import POLICY_NAMES

KEYS = [make_offload_key(i.to_bytes(8, "big")) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)
WRITING = "writing"
READY = "ready"


class ManagerMachine(RuleBasedStateMachine):
    manager: CPUOffloadingManager
    capacity: int

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[OffloadKey, str] = {}
        self.pins: dict[OffloadKey, int] = {}
        self.jobs: dict[int, list[OffloadKey]] = {}
        self.anonymous: list[list[OffloadKey]] = []  # loads pinned without a job id
        self.store_jobs: dict[int, list[OffloadKey]] = {}
        self.job_ids = itertools.count()
        self.public: set[OffloadKey] = set()  # what events say the tier holds
        self.evictions = 0

    @initialize(capacity=st.integers(1, 6), policy=st.sampled_from(POLICY_NAMES))
    def start(self, capacity: int, policy: str) -> None:
        self.capacity = capacity
        self.manager = CPUOffloadingManager(capacity, policy, enable_events=True)

    def evictable(self) -> set[OffloadKey]:
        return {k for k, s in self.state.items() if s == READY and not self.pins.get(k)}

    @rule(keys=key_lists, with_job=st.booleans())
    def prepare_store(self, keys: list[OffloadKey], with_job: bool) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in self.state]
        need = len(new) - (self.capacity - len(self.state))
        allowed = self.evictable() - set(keys)
        job = next(self.job_ids) if with_job else None
        out = self.manager.prepare_store(keys, job=job)
        if out is not None and job is not None and new:  # nothing to store: no job held
            self.store_jobs[job] = new
        if need > len(allowed):
            assert out is None
            return
        assert out is not None
        assert list(out.keys_to_store) == new
        assert len(out.store_spec) == len(new)
        assert len(out.evicted_keys) == max(need, 0)
        assert set(out.evicted_keys) <= allowed  # never pinned, writing or offered
        for k in out.evicted_keys:
            del self.state[k]
            self.pins.pop(k, None)
        self.evictions += len(out.evicted_keys)
        for k in new:
            self.state[k] = WRITING

    @rule(keys=key_lists, success=st.booleans())
    def complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.manager.complete_store(keys, success)
        for k in keys:
            if self.state.get(k) == WRITING:
                if success:
                    self.state[k] = READY
                else:
                    del self.state[k]

    @precondition(lambda self: bool(self.store_jobs))
    @rule(data=st.data(), success=st.booleans(), twice=st.booleans())
    def complete_store_job(self, data: st.DataObject, success: bool, twice: bool) -> None:
        job = data.draw(st.sampled_from(sorted(self.store_jobs)))
        self.manager.complete_store(job=job, success=success)
        if twice:
            self.manager.complete_store(job=job, success=not success)  # idempotent
        for k in self.store_jobs.pop(job):
            if self.state.get(k) == WRITING:
                if success:
                    self.state[k] = READY
                else:
                    del self.state[k]

    @rule(keys=key_lists, anonymous=st.booleans())
    def prepare_load(self, keys: list[OffloadKey], anonymous: bool) -> None:
        job = next(self.job_ids)
        if all(self.state.get(k) == READY for k in keys):
            if anonymous:
                self.manager.prepare_load(iter(keys))  # type: ignore[arg-type]
                self.anonymous.append(keys)
            else:
                self.manager.prepare_load(keys, job=job)
                self.jobs[job] = keys
            for k in keys:
                self.pins[k] = self.pins.get(k, 0) + 1
        else:
            before = self.manager.statistics()
            try:
                self.manager.prepare_load(keys, job=job)
            except (UnknownKeyError, ChunkStateError):
                pass
            else:
                raise AssertionError("loading a chunk that is not ready must raise")
            assert self.manager.statistics().pinned == before.pinned

    @precondition(lambda self: bool(self.jobs))
    @rule(data=st.data(), twice=st.booleans())
    def complete_load(self, data: st.DataObject, twice: bool) -> None:
        job = data.draw(st.sampled_from(sorted(self.jobs)))
        self.manager.complete_load(job=job)
        if twice:
            self.manager.complete_load(job=job)  # idempotent
        for k in self.jobs.pop(job):
            self.pins[k] -= 1

    @precondition(lambda self: bool(self.anonymous))
    @rule(data=st.data())
    def complete_anonymous_load(self, data: st.DataObject) -> None:
        keys = self.anonymous.pop(data.draw(st.integers(0, len(self.anonymous) - 1)))
        self.manager.complete_load(keys)
        for k in keys:
            self.pins[k] -= 1

    @rule(keys=key_lists)
    def over_release_is_refused(self, keys: list[OffloadKey]) -> None:
        counts: dict[OffloadKey, int] = {}
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
        if all(self.state.get(k) == READY and self.pins.get(k, 0) >= c for k, c in counts.items()):
            return  # a legal release; not what this rule is about
        before = self.manager.statistics()
        try:
            self.manager.complete_load(keys)
        except (UnknownKeyError, ChunkStateError):
            pass
        else:
            raise AssertionError("unpinning more than was pinned must raise")
        assert self.manager.statistics() == before

    @rule(keys=key_lists)
    def lookup_prefix(self, keys: list[OffloadKey]) -> None:
        expected = 0
        for k in keys:
            if self.state.get(k) != READY:
                break
            expected += 1
        assert self.manager.lookup_prefix(keys) == expected

    @rule(success=st.booleans())
    def finish_every_job(self, success: bool) -> None:
        """Completing every job leaves no job open in the manager."""
        for job in list(self.store_jobs):
            self.manager.complete_store(job=job, success=success)
            for k in self.store_jobs.pop(job):
                if self.state.get(k) == WRITING:
                    if success:
                        self.state[k] = READY
                    else:
                        del self.state[k]
        for job in list(self.jobs):
            self.manager.complete_load(job=job)
            for k in self.jobs.pop(job):
                self.pins[k] -= 1
        s = self.manager.statistics()
        assert (s.open_store_jobs, s.open_load_jobs) == (0, 0)

    @rule()
    def force_reset(self) -> None:
        self.manager.reset(force=True)
        self.state.clear()
        self.pins.clear()
        self.jobs.clear()
        self.anonymous.clear()
        self.store_jobs.clear()

    @rule(keys=key_lists)
    def lookup_and_touch(self, keys: list[OffloadKey]) -> None:
        for k in keys:
            expected = {None: LookupResult.MISS, WRITING: LookupResult.HIT_PENDING}.get(
                self.state.get(k), LookupResult.HIT
            )
            assert self.manager.lookup(k) is expected
        self.manager.touch(keys)

    @rule()
    def reset(self) -> None:
        in_flight = any(s == WRITING for s in self.state.values()) or any(self.pins.values())
        try:
            self.manager.reset()
        except ChunkStateError:
            assert in_flight
            return
        assert not in_flight
        self.state.clear()
        self.pins.clear()
        self.store_jobs.clear()

    @invariant()
    def events_tell_what_is_ready(self) -> None:
        if not hasattr(self, "manager"):
            return
        for event in self.manager.take_events():
            if isinstance(event, ChunksStored):
                assert not self.public & set(event.keys)
                self.public |= set(event.keys)
            elif isinstance(event, ChunksRemoved):
                assert set(event.keys) <= self.public  # never a removal before its store
                self.public -= set(event.keys)
            else:
                assert isinstance(event, AllChunksCleared)
                assert set(event.keys) == self.public  # a reset names what it dropped
                assert len(event.keys) == len(set(event.keys))
                self.public.clear()
        assert self.public == {k for k, s in self.state.items() if s == READY}

    @invariant()
    def slots_and_counts_add_up(self) -> None:
        if not hasattr(self, "manager"):
            return
        m = self.manager
        slots = [c.slot for c in m._chunks.values()]
        assert len(slots) == len(set(slots))  # no slot has two owners
        assert all(0 <= s < self.capacity for s in slots)
        assert not set(slots) & set(m._free)
        assert len(slots) + len(m._free) + (self.capacity - m._next_fresh) == self.capacity
        s = m.statistics()
        writing = sum(1 for v in self.state.values() if v == WRITING)
        pinned = sum(1 for v in self.pins.values() if v)
        assert (s.used, s.writing, s.pinned) == (len(self.state), writing, pinned)
        assert s.evictable == len(self.evictable())
        assert s.free == self.capacity - s.used
        assert s.ready == s.used - s.writing
        assert s.used == len(m.policy)
        assert s.evictions_total == self.evictions
        # Every job that holds state is one the model still has to complete.
        assert (s.open_store_jobs, s.open_load_jobs) == (len(self.store_jobs), len(self.jobs))
        for k, c in m._chunks.items():
            expected = -1 if self.state[k] == WRITING else self.pins.get(k, 0)
            assert c.pins == expected


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase
