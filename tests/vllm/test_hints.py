"""Retention hints through vLLM 0.33's own per-request channels, honoured under vLLM.

Requests reach vLLM's real scheduler (the harness) carrying a hint in their
``kv_transfer_params`` (``{"tiering": {"version": 1, ...}}``, what any
OpenAI-compatible client can send) or in their ``kv_hints`` (a
``KvHintsEnvelope`` action ``"tiering.retention"``, an orchestrator's). Under
`TieringSpec` and under vLLM's own CPU manager with a tiering policy
(``cache_policy_module_path``), each scenario runs twice, with the hint and
without, and the two runs are compared: a retained prefix survives a flood that
evicts it without the hint; a released one is evicted first while older
unhinted ones stay. Malformed hints are counted, said once per kind in vLLM's
log, and the steps go on; the counts reach vLLM's Prometheus metrics, and a
tier that never saw a hint reports no hint figures. With a disk tier below, a
hinted request's write-throughs carry its hint, and a retained waiting
request's promotion is reserved ahead of the others' so its chunks are in the
CPU tier when it is scheduled; without the hint, the same request is recomputed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import make_offload_key

from tiering.hints import HintCounts
from tiering.integrations.vllm.manager import TieringMetrics
from tiering.integrations.vllm.policies import TieringCachePolicy

from .harness import (
    Engine,
    attention_spec,
    build_engine,
    disk_entry,
    native_extra,
    prometheus_text,
    tiering_extra,
    write_model,
)
from .vllm_log import vllm_logging

CHUNK = attention_spec().page_size_bytes * 2  # one 16-token block, both layers
CPU_CHUNKS = 64  # retained chunks may hold a fifth: 12
PREFIX = 8  # chunks of a hinted request's prompt (its retention fits the share)
RETAIN = {"tiering": {"version": 1, "retain_s": 600}}
RELEASE = {"tiering": {"version": 1, "release": True}}
SPECS = ("TieringSpec", "CPUOffloadingSpec")
OUTCOMES = TieringMetrics.HINT_OUTCOMES


def envelope(*actions: tuple[str, str, dict[str, Any]]) -> KvHintsEnvelope:
    """An orchestrator's envelope of ``(action_type, action_version, payload)`` actions."""
    return KvHintsEnvelope(
        protocol_version="1",
        message_id="m-1",
        actions=[
            KvHintAction(
                action_id=f"a-{i}", action_type=kind, action_version=version, payload=payload
            )
            for i, (kind, version, payload) in enumerate(actions)
        ],
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("hints") / "model")


def make_engine(model: Path, spec: str, chunks: int = CPU_CHUNKS, **extra: Any) -> Engine:
    """`TieringSpec`, or vLLM's own CPU manager with tiering's default policy."""
    if spec == "TieringSpec":
        return build_engine(model, tiering_extra(chunks * CHUNK, **extra))
    return build_engine(
        model,
        native_extra(
            chunks * CHUNK,
            eviction_policy="DSLRUCachePolicy",
            cache_policy_module_path="tiering.integrations.vllm",
        ),
    )


def prompt(seed: int, chunks: int = PREFIX) -> list[int]:
    """``chunks`` full blocks of a prefix of its own (its first token), then a tail."""
    return [1 + seed, *(100 + i for i in range(chunks * 16 - 1)), 3, 3, 3, 3, 3, 3, 3, 3]


def keys_of(request: Any, chunks: int = PREFIX) -> list[bytes]:
    return [make_offload_key(bytes(h), 0) for h in request.block_hashes[:chunks]]


def send(engine: Engine, seed: int, chunks: int = PREFIX, **channels: Any) -> Any:
    """One request, alone, to its end (the GPU prefix cache dropped first)."""
    assert engine.scheduler.reset_prefix_cache()
    request = engine.add(prompt(seed, chunks), **channels)
    engine.run()
    assert request.request_id in engine.finished
    return request


def holds(engine: Engine, key: bytes) -> bool:
    manager = engine.manager
    if hasattr(manager, "tier"):
        return bool(manager.tier.holds(key))
    return manager._policy.get(key) is not None


def hints_of(engine: Engine) -> Any:
    """The tier's `HintBook`: the tiering manager's, or the tiering policy's."""
    manager = engine.manager
    if hasattr(manager, "tier"):
        return manager.tier.hints
    policy = manager._policy
    assert isinstance(policy, TieringCachePolicy)
    return policy.hints


def counts_of(engine: Engine) -> HintCounts:
    manager = engine.manager
    return manager.hint_counts if hasattr(manager, "tier") else manager._policy.hint_counts


CHANNELS = {
    "kv_transfer_params": {"kv_transfer_params": RETAIN},
    "kv_hints": {"kv_hints": envelope(("tiering.retention", "1", {"retain_s": 600}))},
}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_a_hint_reaches_the_policy_through_each_channel(
    model: Path, spec: str, channel: str
) -> None:
    engine = make_engine(model, spec)
    try:
        request = send(engine, 1, **CHANNELS[channel])
        send(engine, 2)  # unhinted
        stats = hints_of(engine).statistics()
        assert stats.retained == PREFIX  # the request's stored chunks, all retained
        assert stats.hinted_keys_total >= PREFIX
        assert all(holds(engine, key) for key in keys_of(request))
        assert counts_of(engine) == HintCounts(taken=1)
    finally:
        engine.scheduler.shutdown()


def flood(engine: Engine, first: int, chunks: int) -> None:
    """Unhinted requests of new prefixes, ``chunks`` in all."""
    for seed in range(first, first + chunks // PREFIX):
        send(engine, seed)


@pytest.mark.parametrize("spec", SPECS)
def test_a_retained_prefix_survives_a_flood_that_evicts_it_without_the_hint(
    model: Path, spec: str
) -> None:
    kept: dict[bool, list[bool]] = {}
    hits: dict[bool, int] = {}
    for hinted in (False, True):
        engine = make_engine(model, spec)
        try:
            channels = {"kv_transfer_params": RETAIN} if hinted else {}
            request = send(engine, 1, **channels)
            flood(engine, 10, 2 * CPU_CHUNKS)  # twice the tier, each prefix used once
            kept[hinted] = [holds(engine, key) for key in keys_of(request)]
            before = engine.hit_tokens
            send(engine, 1)  # the conversation's next turn
            hits[hinted] = engine.hit_tokens - before
        finally:
            engine.scheduler.shutdown()
    assert kept == {False: [False] * PREFIX, True: [True] * PREFIX}
    assert hits == {False: 0, True: PREFIX * 16}


@pytest.mark.parametrize("spec", SPECS)
def test_a_released_prefix_goes_first_while_older_unhinted_ones_stay(
    model: Path, spec: str
) -> None:
    """The tier holds 7 prefixes of 8 chunks (the oldest first); an 8th fills it and a
    9th needs room for 8. Without the hint the oldest goes; with the 7th released, it
    goes and the oldest stays."""
    for hinted in (False, True):
        engine = make_engine(model, spec)
        try:
            oldest = send(engine, 1)
            for seed in range(2, 7):
                send(engine, seed)
            channels = {"kv_transfer_params": RELEASE} if hinted else {}
            released = send(engine, 7, **channels)
            send(engine, 8)  # the tier is full
            assert all(holds(engine, key) for key in keys_of(oldest))
            send(engine, 9)  # room for 8 more
            old, rel = keys_of(oldest), keys_of(released)
            if hinted:
                assert all(holds(engine, key) for key in old)
                assert not any(holds(engine, key) for key in rel)
                assert hints_of(engine).statistics().released_evicted_total == PREFIX
            else:
                assert not any(holds(engine, key) for key in old)
                assert all(holds(engine, key) for key in rel)
        finally:
            engine.scheduler.shutdown()


@pytest.mark.parametrize("spec", SPECS)
def test_what_the_book_keeps_per_chunk_is_bounded_by_the_tier_after_its_hints_are_gone(
    model: Path, spec: str
) -> None:
    """Once a hint was seen the book counts every request's uses of the chunks the tier
    holds; they go with the chunks, also when no hint is left to honour (the released
    prefix evicted, then a flood of three tiers' worth of unhinted requests)."""
    engine = make_engine(model, spec)
    try:
        send(engine, 1, kv_transfer_params=RELEASE)
        flood(engine, 10, 3 * CPU_CHUNKS)
        book = hints_of(engine)
        assert book.statistics().released_evicted_total == PREFIX
        assert not book.active
        assert len(book._uses) <= CPU_CHUNKS  # the book's only per-chunk record left
    finally:
        engine.scheduler.shutdown()


#: Malformed and ignored hints, by how the reader counts them.
FAULTS: list[tuple[str, dict[str, Any]]] = [
    ("malformed", {"kv_transfer_params": {"tiering": {"version": 1, "retain_s": "600"}}}),
    ("malformed", {"kv_transfer_params": {"tiering": {"version": 1, "keep": True}}}),
    (
        "malformed",
        {"kv_transfer_params": {"tiering": {"version": 1, "retain_s": 60, "release": True}}},
    ),
    ("malformed", {"kv_transfer_params": {"tiering": "retain"}}),
    ("malformed", {"kv_hints": envelope(("tiering.retention", "1", {"retain_s": -1}))}),
    ("unknown_version", {"kv_transfer_params": {"tiering": {"version": 2, "retain_s": 60}}}),
    ("unknown_version", {"kv_hints": envelope(("tiering.retention", "9", {"retain_s": 60}))}),
    ("other_actions", {"kv_hints": envelope(("router.session", "1", {"sticky": True}))}),
]


@pytest.mark.parametrize("spec", SPECS)
def test_malformed_hints_are_counted_said_once_per_kind_and_the_steps_go_on(
    model: Path, spec: str
) -> None:
    with vllm_logging() as log:
        engine = make_engine(model, spec)
        try:
            for seed, (_, channels) in enumerate(FAULTS * 2, start=1):
                send(engine, seed, **channels)  # each request runs to its end
            send(engine, 100, kv_transfer_params=RETAIN)  # a good one still counts
            counts = counts_of(engine)
        finally:
            engine.scheduler.shutdown()
    want = {kind: 2 * sum(1 for k, _ in FAULTS if k == kind) for kind, _ in FAULTS}
    assert counts == HintCounts(taken=1, **want)
    lines = log.lines("WARNING", "tiering: ")
    assert len(lines) == 2, log.text  # one per kind of fault, never one per request
    assert "malformed hint was refused" in lines[0].message
    assert "retain_s" in lines[0].message
    assert "version 2" in lines[1].message
    assert "speaks version 1" in lines[1].message


def test_vllms_prometheus_metrics_show_the_hint_counts(model: Path) -> None:
    """Through vLLM's own `OffloadPromMetrics` over the definitions `TieringSpec` declares
    (what ``vllm serve``'s /metrics renders)."""
    engine = make_engine(model, "TieringSpec")
    try:
        send(engine, 1, kv_transfer_params=RETAIN)
        send(engine, 2, kv_transfer_params=RELEASE)
        send(engine, 3, **FAULTS[0][1])
        flood(engine, 10, CPU_CHUNKS)
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)  # the tier emptied
        send(engine, 4, kv_transfer_params=RELEASE)
        flood(engine, 30, CPU_CHUNKS)  # the released prefix goes first again
        following = engine.manager.tier.hints.following
    finally:
        engine.scheduler.shutdown()
    assert engine.labelled[TieringMetrics.HINTS, ("taken",)] == 3
    assert engine.labelled[TieringMetrics.HINTS, ("malformed",)] == 1
    text = prometheus_text(engine)
    assert 'vllm:kv_offload_tiering_hints_total{engine="0",outcome="taken"} 3.0' in text
    assert 'vllm:kv_offload_tiering_hints_total{engine="0",outcome="malformed"} 1.0' in text
    assert 'vllm:kv_offload_tiering_hints_total{engine="0",outcome="unknown_version"} 0.0' in text
    # Counted once across the reset (the book's totals stand); what it holds is now's.
    released = 'vllm:kv_offload_tiering_hint_released_evicted_total{engine="0"}'
    assert f"{released} {2 * PREFIX}.0" in text
    assert 'vllm:kv_offload_tiering_hint_retained_chunks{engine="0"} 0.0' in text
    assert f'vllm:kv_offload_tiering_hint_following{{engine="0"}} {float(following)}' in text


def test_a_tier_that_never_saw_a_hint_reports_no_hint_figures(model: Path) -> None:
    """Where nobody gives hints, the hint book's figures have no sample (a 1 for "following"
    or a 0 for "retained" would say what is not so); the channels' counts are zeros."""
    engine = make_engine(model, "TieringSpec")
    try:
        flood(engine, 10, CPU_CHUNKS + PREFIX)
    finally:
        engine.scheduler.shutdown()
    names = {name for payload in engine.payloads for name in payload.get("data", {})}
    assert TieringMetrics.HINTS in names
    assert not names & {
        TieringMetrics.HINT_RETAINED,
        TieringMetrics.HINT_FOLLOWING,
        TieringMetrics.HINT_RELEASED_EVICTED,
        TieringMetrics.HINT_RETENTION_OVERRIDDEN,
    }
    assert sum(engine.labelled.get((TieringMetrics.HINTS, (o,)), 0) for o in OUTCOMES) == 0


def idle(engine: Engine) -> None:
    """The model's time: every tier below finishes what it was handed."""
    for tier in engine.manager.link.tiers:
        assert tier.wait_idle(10), f"{tier!r} did not finish in 10 s"


def settle(engine: Engine) -> None:
    engine.run()
    idle(engine)
    engine.run()  # the write-throughs settle


@pytest.mark.parametrize(("hinted", "distrusted"), [(False, False), (True, False), (True, True)])
def test_a_retained_waiting_requests_chunks_are_promoted_ahead_of_the_others(
    model: Path, tmp_path: Path, hinted: bool, distrusted: bool
) -> None:
    """Three requests wait together, their prefixes (24, 24 and 20 chunks) only in the
    disk tier below a full CPU tier of 64: a step's promotions take fresh slots, all or
    none per request, so only two fit. Without a hint the first two looked up are
    promoted and the third is recomputed; with the third's retention hint, its
    promotion is reserved first and its chunks are in the CPU tier when vLLM
    schedules it (the step after the tier's answer), and the last one looked up is
    recomputed instead; unless the CPU tier measured retentions wrong (``distrusted``):
    then the hint ranks nothing."""
    entry = disk_entry(tmp_path / "disk", 512 * CHUNK)
    engine = make_engine(model, "TieringSpec", secondary_tiers=[entry])
    engine.attach_model()  # vLLM's worker connector moves real bytes (the tier needs rows)
    sizes = {"x1": 24, "x2": 24, "a": 20}
    try:
        for seed, name in enumerate(sizes, start=1):  # stored, written through
            assert engine.scheduler.reset_prefix_cache()
            engine.add(prompt(seed, sizes[name]))
            settle(engine)
        for seed in range(10, 26):  # 128 chunks: the three leave the CPU tier
            assert engine.scheduler.reset_prefix_cache()
            engine.add(prompt(seed))
            settle(engine)
        assert engine.manager.link.statistics()["cascade_dropped"] == 0
        assert engine.scheduler.reset_prefix_cache()
        for worker in engine.models:
            worker.wipe()  # the loads must bring the pages back
        if distrusted:  # as after clients' retentions were measured no better than chance
            engine.manager.tier.hints._follow[1] = False
        requests = {
            name: engine.add(
                prompt(seed, sizes[name]),
                kv_transfer_params=RETAIN if hinted and name == "a" else None,
            )
            for seed, name in enumerate(sizes, start=1)
        }
        keys = {name: keys_of(request, sizes[name]) for name, request in requests.items()}
        cpu = engine.manager.tier
        assert not any(cpu.holds(key) for name in keys for key in keys[name])
        loads: dict[str, tuple[int, int]] = {}  # the step of its load, chunks held then
        scheduled: dict[str, int] = {}  # the step its tokens were first scheduled
        for step in range(2000):  # the loads land on the worker's threads: a few steps
            output = engine.step()
            metadata = output.kv_connector_metadata
            loading = {job.req_id for job in metadata.load_jobs.values()} if metadata else set()
            for name, request in requests.items():
                if name not in loads and request.request_id in loading:
                    loads[name] = (step, sum(cpu.holds(key, ready=True) for key in keys[name]))
                if name not in scheduled and request.request_id in output.num_scheduled_tokens:
                    scheduled[name] = step
            if len(scheduled) == len(requests):
                break
            idle(engine)
        verified = engine.model.verified_blocks
        engine.run()
    finally:
        engine.scheduler.shutdown()
        for worker in engine.models:
            worker.connector.shutdown()
    assert set(scheduled) == set(sizes), (scheduled, loads)
    ahead = hinted and not distrusted
    first = "a" if ahead else "x1"
    second = "x1" if ahead else "x2"
    recomputed = "x2" if ahead else "a"
    # Asked at step 0, answered at 1, promoted at its end, loading at 2.
    assert loads == {first: (2, sizes[first]), second: (2, sizes[second])}, loads
    assert scheduled[recomputed] == 2  # no load: computed from its first token
    assert scheduled[first] > 2
    assert verified >= 2 * (sizes[first] + sizes[second])  # the pages loaded are right


def test_a_hinted_requests_chunks_reach_the_tier_below_with_its_hint(
    model: Path, tmp_path: Path
) -> None:
    """The write-throughs of a retained and of a released request carry their hint to
    the disk tier (``write_hinted``: its index spares or releases them); an unhinted
    request's and a malformed one's are plain writes."""
    entry = disk_entry(tmp_path / "disk", 256 * CHUNK)
    engine = make_engine(model, "TieringSpec", secondary_tiers=[entry])
    engine.attach_model()
    try:
        for seed, channels in enumerate(
            [{}, {"kv_transfer_params": RETAIN}, {"kv_transfer_params": RELEASE}, FAULTS[0][1]],
            start=1,
        ):
            assert engine.scheduler.reset_prefix_cache()
            engine.add(prompt(seed), **channels)
            settle(engine)
        (tier,) = engine.manager.link.tiers
        disk = tier.statistics().disk
    finally:
        engine.scheduler.shutdown()
        for worker in engine.models:
            worker.connector.shutdown()
    assert engine.manager.link.statistics()["cascade_written"] == 4 * PREFIX
    assert disk.hinted_total == 2 * PREFIX


@pytest.mark.parametrize("params", [None, RETAIN, RELEASE])
def test_a_prefix_found_in_the_cpu_tier_gets_the_requests_retention_in_the_tier_below(
    model: Path, tmp_path: Path, params: dict[str, Any] | None
) -> None:
    """A conversation's next turn finds its prefix in the CPU tier and loads it from
    there: nothing is written down again, so the values the disk tier holds get the
    turn's retention when it ends (one call, not a write); without a hint, or with a
    release (the prefix may be other conversations' too), no call."""
    entry = disk_entry(tmp_path / "disk", 256 * CHUNK)
    engine = make_engine(model, "TieringSpec", secondary_tiers=[entry])
    engine.attach_model()
    try:
        assert engine.scheduler.reset_prefix_cache()
        engine.add(prompt(1))  # stored, written through without a hint
        settle(engine)
        (tier,) = engine.manager.link.tiers
        written = tier.statistics().disk.write_calls
        assert engine.scheduler.reset_prefix_cache()
        before = engine.hit_tokens
        engine.add(prompt(1), kv_transfer_params=params)  # the next turn: a CPU hit
        settle(engine)
        assert engine.hit_tokens - before == PREFIX * 16
        stats = tier.statistics()
    finally:
        engine.scheduler.shutdown()
        for worker in engine.models:
            worker.connector.shutdown()
    assert stats.disk.write_calls == written  # nothing written again
    retained = params is RETAIN
    assert (stats.hint_calls, stats.disk.hinted_total) == ((1, PREFIX) if retained else (0, 0))
