"""A prefix only a lower tier holds is back in the CPU tier and loading within 2 steps of
the tier's answer, under `TieringSpec` and under vLLM's own ``TieringOffloadingSpec``.

vLLM 0.33's ``_maximal_prefix_lookup`` looks up past a ``RETRY`` until a ``MISS``,
so a whole prefix is asked of the tier in one step. The first scheduler stores a
40-chunk prefix (written through to a real redis-server, or a real folder); a
second scheduler, over the same store and with an empty CPU tier, then gets a
request of that prefix. Each step is followed by the model's time, here the
wait for the tiers to finish what they were handed (a model's step is longer
than a round trip to Redis or a read of the disk). Counted: the step in which
the tier answered every chunk of the prefix (a hit), and the step in which
vLLM scheduled the request's load from the CPU tier.

Bytes: under `TieringSpec` (at tensor-parallel sizes 1 and 2), vLLM's own
worker connectors move them (the harness's `FakeModel`, one per rank) and every
page the request starts from is checked. vLLM's spec has no worker on a
machine without a GPU, so there the rows the tier filled are compared with the
rows the first scheduler's tier stored.

And a request's promotions never evict its own hits (`TieringSpec`): where the
CPU tier holds part of a prefix and is full, the rest is promoted without a
second round.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, make_offload_key

import tiering.integrations.vllm as integration

from ..secondary import conftest as secondary
from .harness import (
    Engine,
    attention_spec,
    build_engine,
    disk_entry,
    redis_entry,
    tiering_extra,
    write_model,
)

redis_server = secondary.redis_server

CHUNK = attention_spec().page_size_bytes * 2  # one 16-token block, both layers
PREFIX_CHUNKS = 40
PROMPT = [1 + (7 * i) % 31000 for i in range(PREFIX_CHUNKS * 16 + 8)]  # 40 blocks, a tail
CPU_CHUNKS = 128  # write-throughs may pin half: the 40 chunks land in one batch
TIERS = ("RedisSecondaryTier", "DiskSecondaryTier")
#: The most steps from the tier's answer to the load (issue #28).
MOST_STEPS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def tier_entry(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The ``secondary_tiers`` entry of the test's tier: one namespace, or one folder."""
    kind = request.param
    if kind == "RedisSecondaryTier":
        server = request.getfixturevalue("redis_server")
        return redis_entry(server.url, namespace=f"steps-{uuid.uuid4().hex}")
    if not hasattr(integration, kind):
        pytest.fail(f"tiering.integrations.vllm has no {kind}")
    return disk_entry(tmp_path / "tier", 4 * PREFIX_CHUNKS * CHUNK)


def make_engine(model: Path, spec: str, entry: dict[str, Any], tp: int = 1) -> Engine:
    cpu_bytes = CPU_CHUNKS * CHUNK  # the same chunks at any tensor-parallel size
    if spec == "TieringSpec":
        extra = tiering_extra(cpu_bytes, secondary_tiers=[dict(entry)])
        engine = build_engine(model, extra, tp=tp)
        engine.attach_model()  # vLLM's worker connectors move real bytes, one per rank
        return engine
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [dict(entry)],
    }
    return build_engine(model, extra)


def shut(engine: Engine) -> None:
    engine.scheduler.shutdown()
    for model in engine.models:
        model.connector.shutdown()


@dataclass
class Watch:
    """Every call of the tiers' ``lookup``, ``submit_store`` and ``submit_load`` (whatever
    engine made the tier), and the rows they read and filled (vLLM's spec only)."""

    lookups: list[tuple[object, bytes, LookupResult]] = field(default_factory=list)
    tiers: dict[int, Any] = field(default_factory=dict)
    stored: dict[bytes, bytes] = field(default_factory=dict)  # key -> the row written
    loaded: dict[bytes, tuple[Any, int]] = field(default_factory=dict)  # key -> tier, chunk

    def idle(self) -> None:
        """The model's time: every tier finishes what it was handed."""
        for tier in self.tiers.values():
            assert tier.wait_idle(10), f"{tier!r} did not finish in 10 s"


def _rows(tier: Any) -> np.ndarray:
    return np.frombuffer(tier._primary_kv_view.cast("B"), dtype=np.uint8).reshape(-1, CHUNK)


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Watch:
    seen = Watch()
    for name in TIERS:
        cls = getattr(integration, name, None)
        if cls is None:
            continue
        lookup, store, load = cls.lookup, cls.submit_store, cls.submit_load

        def spied_lookup(self: Any, key: bytes, context: Any, _lookup: Any = lookup) -> Any:
            seen.tiers[id(self)] = self
            result = _lookup(self, key, context)
            seen.lookups.append((self, key, result))
            return result

        def spied_store(self: Any, job: Any, _store: Any = store) -> None:
            seen.tiers[id(self)] = self
            rows = _rows(self)
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
                seen.stored[key] = rows[int(chunk)].tobytes()
            _store(self, job)

        def spied_load(self: Any, job: Any, _load: Any = load) -> None:
            seen.tiers[id(self)] = self
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
                seen.loaded[key] = (self, int(chunk))
            _load(self, job)

        monkeypatch.setattr(cls, "lookup", spied_lookup)
        monkeypatch.setattr(cls, "submit_store", spied_store)
        monkeypatch.setattr(cls, "submit_load", spied_load)
    return seen  # monkeypatch puts the classes back


def prefix_keys(request: Any) -> list[bytes]:
    return [make_offload_key(bytes(h), 0) for h in request.block_hashes[:PREFIX_CHUNKS]]


def store_prefix(model: Path, spec: str, entry: dict[str, Any], watch: Watch, tp: int = 1) -> None:
    """The first scheduler: the prefix is computed, offloaded and written to the tier."""
    engine = make_engine(model, spec, entry, tp)
    try:
        if spec == "TieringOffloadingSpec":  # bytes of the test's own in every CPU row
            view = engine.manager.primary_tier.get_kv_memoryview()
            flat = view.cast("B")
            rows = np.frombuffer(flat, dtype=np.uint8).reshape(-1, CHUNK)
            rows[:] = np.random.default_rng(28).integers(0, 256, rows.shape, np.uint8)
            del rows
            flat.release()
        request = engine.add(PROMPT)
        engine.run()
        watch.idle()
        engine.run()  # the write-throughs settle
        keys = prefix_keys(request)
        assert set(keys) <= set(watch.stored), "the prefix was not written to the tier"
        if spec == "TieringSpec":
            assert engine.manager.link.statistics()["cascade_written"] >= PREFIX_CHUNKS
    finally:
        shut(engine)
        watch.tiers.clear()


@dataclass
class Steps:
    asked: int  # the step of the request's first lookup in the tier
    answered: int  # the step in which the tier answered a hit for every chunk
    loading: int  # the step in which vLLM scheduled the request's load
    hit_tokens: int


def steps_to_load(
    engine: Engine, watch: Watch, from_tier: slice = slice(None), max_steps: int = 20
) -> tuple[Steps, Any]:
    """Send a request of `PROMPT`; step (the model's time after each) until its load is
    scheduled. The tier is to answer a hit for the prefix's chunks ``from_tier``."""
    watch.lookups.clear()
    before = engine.hit_tokens
    request = engine.add(PROMPT)
    keys = set(prefix_keys(request)[from_tier])
    asked = answered = loading = None
    for step in range(max_steps):
        output = engine.step()
        here = [(key, result) for _, key, result in watch.lookups]
        watch.lookups.clear()
        assert {k for k, _ in here} <= keys, "a chunk the CPU tier held was asked of the tier"
        if asked is None and here:
            asked = step
        if answered is None and {k for k, r in here if r is LookupResult.HIT} == keys:
            answered = step
        metadata = output.kv_connector_metadata
        jobs = metadata.load_jobs.values() if metadata is not None else ()
        if any(job.req_id == request.request_id for job in jobs):
            loading = step
            break
        watch.idle()
    where = f"asked at step {asked}, answered at {answered}, loading at {loading}"
    assert asked is not None, where
    assert answered is not None, f"the tier did not answer a hit for every chunk: {where}"
    assert loading is not None, f"not loaded from the tier in {max_steps} steps: {where}"
    engine.run()
    return Steps(asked, answered, loading, engine.hit_tokens - before), request


@pytest.mark.parametrize("tier_entry", TIERS, indirect=True)
@pytest.mark.parametrize(
    ("spec", "tp"), [("TieringSpec", 1), ("TieringSpec", 2), ("TieringOffloadingSpec", 1)]
)
def test_a_prefix_only_a_lower_tier_holds_is_loading_within_two_steps_of_its_answer(
    model: Path, spec: str, tp: int, tier_entry: dict[str, Any], watch: Watch
) -> None:
    store_prefix(model, spec, tier_entry, watch, tp)
    stored = dict(watch.stored)
    watch.loaded.clear()
    engine = make_engine(model, spec, tier_entry, tp)  # a second scheduler: empty CPU tier
    try:
        verified = engine.model.verified_blocks if engine.model is not None else 0
        steps, request = steps_to_load(engine, watch)
        assert steps.answered - steps.asked == 1  # asked in one step, answered by the next
        assert steps.loading - steps.answered <= MOST_STEPS, steps
        assert steps.hit_tokens == PREFIX_CHUNKS * 16  # the whole prefix, from the tier
        keys = prefix_keys(request)
        assert set(keys) <= set(watch.loaded)  # promoted, none recomputed
        if engine.model is not None:  # loaded to the "GPU" pages by vLLM's worker, checked
            assert engine.model.verified_blocks - verified >= PREFIX_CHUNKS * 2
        else:  # the CPU rows the tier filled hold what the first scheduler's tier stored
            for key in keys:
                tier, chunk = watch.loaded[key]
                assert _rows(tier)[chunk].tobytes() == stored[key]
    finally:
        shut(engine)


def test_the_first_lookup_of_a_step_settles_promotions_before_the_cpu_tier_answers(
    model: Path, redis_server: Any, watch: Watch
) -> None:
    """Before: `TieringSpec`'s link collected finished promotions only at the step's end,
    so a promotion read while the model ran was still pending in the next step's lookups
    and the load went out a step later than under vLLM's own manager."""
    entry = redis_entry(redis_server.url, namespace=f"steps-{os.getpid()}-{uuid.uuid4().hex}")
    store_prefix(model, "TieringSpec", entry, watch)
    engine = make_engine(model, "TieringSpec", entry)
    try:
        steps, _ = steps_to_load(engine, watch)
        assert steps.loading - steps.answered == 1
    finally:
        shut(engine)


@pytest.mark.parametrize("tier_entry", TIERS, indirect=True)
def test_a_requests_promotions_never_evict_its_own_hits(
    model: Path, tier_entry: dict[str, Any], watch: Watch
) -> None:
    """The CPU tier is full and holds the prefix's first 24 chunks (a later request shared
    10 of them), the tier alone its last 16. Before: their promotion evicted the least
    recent chunks, the request's own 14 hits, which were then asked of the tier and
    promoted a round (2 steps) later; vLLM's own manager does the same. Now a request's
    hits are kept, and its load goes out the step after the tier's answer."""
    engine = build_engine(
        model,
        tiering_extra(
            CPU_CHUNKS * CHUNK, eviction_policy="lru", secondary_tiers=[dict(tier_entry)]
        ),
    )
    engine.attach_model()
    head = PROMPT[: 10 * 16]
    shared = [*head, *(20_000 + i for i in range(20 * 16))]  # the head, then 20 chunks
    other = [10_000 + i for i in range(84 * 16)]  # 84 chunks: the CPU tier is full
    try:
        for prompt in (PROMPT, shared + [3] * 8, other + [3] * 8):
            assert engine.scheduler.reset_prefix_cache()
            engine.add(prompt)
            engine.run()
            watch.idle()
            engine.run()
        keys = prefix_keys(_request(engine, PROMPT))
        tier_only = slice(24, PREFIX_CHUNKS)  # a request's tail is evicted first
        cpu = engine.manager.tier
        assert [cpu.holds(key) for key in keys] == [True] * 24 + [False] * 16
        assert cpu.statistics().used == CPU_CHUNKS
        assert engine.scheduler.reset_prefix_cache()
        for worker in engine.models:
            worker.wipe()  # the GPU lost every page: the loads must bring them back
        verified = engine.model.verified_blocks
        steps, _ = steps_to_load(engine, watch, from_tier=tier_only)
        assert steps.loading - steps.answered == 1, steps
        assert steps.hit_tokens == PREFIX_CHUNKS * 16
        assert engine.model.verified_blocks - verified >= PREFIX_CHUNKS * 2
        assert engine.manager.link.statistics()["promoted"] == 16
    finally:
        shut(engine)


def _request(engine: Engine, prompt: list[int]) -> Any:
    """A request of ``prompt`` with vLLM's block hashes, never scheduled."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="probe",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=engine.block_hasher,
    )
