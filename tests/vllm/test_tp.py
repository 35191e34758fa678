"""`TieringSpec` with tiers below its CPU tier (a disk, a Redis, a disk then a Redis) at
tensor-parallel size 1, 2 and 4 on one node, driven by vLLM's real scheduler.

Real bytes: one vLLM worker connector per rank (`Engine.attach_model`) moves each rank's
pages between its "GPU" pages and its own host pool, the scheduler maps every rank's
pool, and the tiers keep a value per rank (`tiering.integrations.vllm.ranks`). Each
rank's pages of a block hold a pattern of their own (`block_pattern`), and every page a
request starts from is checked on every rank (`FakeModel.verify`): a chunk loaded on one
rank and not on another, or a rank's bytes in another's row, fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiering.integrations.vllm.link import CascadeMetrics

from ..secondary import conftest as secondary
from .harness import (
    Engine,
    attention_spec,
    build_engine,
    disk_entry,
    prometheus_text,
    redis_entry,
    tiering_extra,
    write_model,
)
from .test_spec_secondary import _keys_of

redis_server = secondary.redis_server

PROMPT_A = list(range(1, 257))  # 16 blocks: a quarter of the CPU tier
OTHERS = [list(range(1000 * i + 1, 1000 * i + 257)) for i in range(1, 5)]  # the other 3/4, +A


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def chunk_bytes(tp: int) -> int:
    """One 16-token block of both layers, on every worker."""
    return attention_spec(tp=tp).page_size_bytes * 2 * tp


def disk_room(tp: int) -> int:
    """A disk tier's capacity in which every value (and its header) fits."""
    return 256 * chunk_bytes(tp)


def tiers_of(kind: str, tp: int, url: str, folder: Path, namespace: str) -> list[dict[str, Any]]:
    return {
        "redis": [redis_entry(url, namespace=namespace)],
        "disk": [disk_entry(folder, disk_room(tp))],
        "disk+redis": [disk_entry(folder, disk_room(tp)), redis_entry(url, namespace=namespace)],
    }[kind]


def make_engine(model: Path, tp: int, tiers: list[dict[str, Any]]) -> Engine:
    # 64 chunks: with two tiers, each may pin 16 (a quarter): one prompt's batch.
    extra = tiering_extra(64 * chunk_bytes(tp), eviction_policy="lru", secondary_tiers=tiers)
    engine = build_engine(model, extra, tp=tp)
    engine.attach_model()
    assert [m.rank for m in engine.models] == list(range(tp))
    return engine


def run(engine: Engine, prompt: list[int]) -> int:
    """Hit tokens of one request of ``prompt`` (every GPU page of every rank dropped first)."""
    assert engine.scheduler.reset_prefix_cache()
    for worker in engine.models:
        worker.wipe()  # the GPUs lost every page: loads must bring them back
    before = engine.hit_tokens
    engine.add(prompt)
    engine.run()
    return engine.hit_tokens - before


def verified(engine: Engine) -> int:
    return sum(worker.verified_blocks for worker in engine.models)


def close(engine: Engine) -> None:
    engine.scheduler.shutdown()
    for worker in engine.models:
        worker.connector.shutdown()


def by_tier(engine: Engine, name: str) -> dict[str, float]:
    return {labels[0]: n for (metric, labels), n in engine.labelled.items() if metric == name}


def evict_a(engine: Engine) -> None:
    """A written through to every tier, then pushed out of the CPU tier by four others."""
    assert run(engine, PROMPT_A) == 0
    engine.run()  # the write-throughs land
    for prompt in OTHERS:
        assert run(engine, prompt) == 0
    assert not any(engine.manager.tier.holds(k) for k in _keys_of(engine, PROMPT_A))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["redis", "disk", "disk+redis"])
def test_a_prefix_evicted_from_the_cpu_tier_comes_back_on_every_rank(
    model, redis_server, tmp_path, tp, kind
):
    tiers = tiers_of(
        kind, tp, redis_server.url, tmp_path / "disk", f"tp-{os.getpid()}-{tmp_path.name}"
    )
    engine = make_engine(model, tp, tiers)
    link = engine.manager.link
    try:
        evict_a(engine)
        for index in range(len(tiers)):
            assert link.statistics(index)["cascade_written"] == 80  # A and the others
        before = verified(engine)
        assert run(engine, PROMPT_A) == 256  # promoted, loaded on every rank, checked
        assert verified(engine) - before == 30 * tp  # 15 blocks before the last, 2 layers
        first = link.labels[0]
        assert by_tier(engine, CascadeMetrics.PROMOTED) == {first: 16}  # the closest tier's
        assert by_tier(engine, CascadeMetrics.HITS)[first] == 16
        assert link.statistics()["promote_failed"] == 0
        assert engine.manager.tier.statistics().pinned == 0
        if tp > 1:
            assert [len(tier.ranks) for tier in link.tiers] == [tp] * len(tiers)  # one a rank
    finally:
        close(engine)
    if "disk" in kind and tp > 1:  # each rank's values in a folder of its own
        assert sorted(os.listdir(tmp_path / "disk")) == [f"rank{r}" for r in range(tp)]


def test_a_prefix_found_in_the_cpu_tier_gets_the_requests_retention_on_every_ranks_tier(
    model, tmp_path
):
    """The next turn, retained, finds its prefix in the CPU tier: each rank's disk tier
    gets the retention for the values it holds (nothing is written again)."""
    engine = make_engine(model, 2, [disk_entry(tmp_path / "disk", disk_room(2))])
    try:
        assert run(engine, PROMPT_A) == 0
        engine.run()  # the write-throughs land
        assert engine.scheduler.reset_prefix_cache()
        before = engine.hit_tokens
        engine.add(PROMPT_A, kv_transfer_params={"tiering": {"version": 1, "retain_s": 600}})
        engine.run()
        assert engine.hit_tokens - before == 256  # its 16 chunks, loaded from the CPU tier
        (tier,) = engine.manager.link.tiers
        assert all(rank.wait_idle(10) for rank in tier.ranks)
        stats = [rank.statistics() for rank in tier.ranks]
    finally:
        close(engine)
    assert [(s.hint_calls, s.disk.hinted_total) for s in stats] == [(1, 16), (1, 16)]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_second_scheduler_on_the_same_redis_namespace_hits_what_the_first_stored(
    model, redis_server, tmp_path, tp
):
    """And with a disk above it: the chunks come from Redis (its label counts them), and
    are written up to the new server's disk."""
    namespace = f"shared-{os.getpid()}-{tmp_path.name}"
    first = make_engine(model, tp, [redis_entry(redis_server.url, namespace=namespace)])
    try:
        assert run(first, PROMPT_A) == 0
        first.run()
        assert first.manager.link.statistics()["cascade_written"] == 16
    finally:
        close(first)
    tiers = [
        disk_entry(tmp_path / "disk", disk_room(tp)),
        redis_entry(redis_server.url, namespace=namespace),
    ]
    second = make_engine(model, tp, tiers)
    link = second.manager.link
    try:
        before = verified(second)
        assert run(second, PROMPT_A) == 256
        assert verified(second) - before == 30 * tp
        disk, redis = link.labels
        assert (disk, redis) == ("1:DiskSecondaryTier", "2:RedisSecondaryTier")
        assert by_tier(second, CascadeMetrics.PROMOTED).get(redis) == 16
        assert by_tier(second, CascadeMetrics.HITS) == {redis: 16}
        assert by_tier(second, CascadeMetrics.QUERIES) == {disk: 16, redis: 16}
        second.run()
        # Written up to the disk, which lacked them: the next lookup finds them closer.
        assert link.statistics(0)["cascade_written"] >= 16
    finally:
        close(second)


@pytest.mark.parametrize("fault", ["missing", "damaged"])
def test_a_value_missing_or_damaged_for_one_rank_is_a_miss_for_the_chunk(
    model, redis_server, tmp_path, fault
):
    tp = 2
    engine = make_engine(
        model, tp, [redis_entry(redis_server.url, namespace=f"fault-{tmp_path.name}")]
    )
    link = engine.manager.link
    client = redis_server.client()
    try:
        evict_a(engine)
        rank1 = link.tiers[0].ranks[1]
        key = _keys_of(engine, PROMPT_A)[4]  # the fifth chunk, rank 1's value
        name = rank1._tier.codec.remote_key(key)
        assert client.exists(name)
        if fault == "missing":
            client.delete(name)
        else:
            value = client.get(name)
            client.setrange(name, len(value) - 8, bytes(b ^ 0xFF for b in value[-8:]))
        before = verified(engine)
        # Four chunks come back on both ranks; the fifth is recomputed, on both ranks.
        assert run(engine, PROMPT_A) == 4 * 16
        # The four loaded blocks checked on both ranks' pages (a partial load would fail it).
        assert verified(engine) - before == 4 * 2 * tp
        if fault == "damaged":
            assert engine.counters.get("vllm:kv_offload_redis_rejected_values", 0) >= 1
            assert link.statistics()["promote_failed"] >= 1
        assert engine.manager.tier.statistics().pinned == 0
    finally:
        client.close()
        close(engine)


def test_a_worker_whose_pool_is_not_on_this_host_is_one_error_and_the_cpu_tier_serves_on(
    model, redis_server, tmp_path, caplog
):
    from tiering.integrations.vllm.spec import _shm_name
    from tiering.transfer.memory import SHM_DIR

    engine = make_engine(
        model, 2, [redis_entry(redis_server.url, namespace=f"away-{tmp_path.name}")]
    )
    spec = engine.models[1].connector.connector_worker.spec
    tag = f"{_shm_name(spec.config, 1)}-row"
    (away,) = [name for name in os.listdir(SHM_DIR) if tag in name]
    os.unlink(os.path.join(SHM_DIR, away))  # as if rank 1 ran on another node
    try:
        assert run(engine, PROMPT_A) == 0
        assert run(engine, PROMPT_A) == 256  # the CPU tier serves both ranks, checked
        assert engine.manager.link.unavailable
        # The operator's error: one line naming the ranks, no traceback in vLLM's log.
        (line,) = [r for r in caplog.records if "cannot be built" in r.getMessage()]
        assert "rank(s) [1] of 2 workers" in line.getMessage()
        assert line.levelname == "ERROR"
        assert not line.exc_info
    finally:
        close(engine)


def test_vllms_prometheus_metrics_show_each_tiers_counts_under_its_tier_label(
    model, redis_server, tmp_path
):
    """Through vLLM's own `OffloadPromMetrics` (what ``vllm serve``'s /metrics renders),
    over the metric definitions `TieringSpec` declares."""
    tiers = tiers_of("disk+redis", 2, redis_server.url, tmp_path / "disk", f"prom-{tmp_path.name}")
    engine = make_engine(model, 2, tiers)
    try:
        evict_a(engine)
        assert run(engine, PROMPT_A) == 256
    finally:
        close(engine)
    text = prometheus_text(engine)
    disk, redis = (
        '{engine="0",tier="1:DiskSecondaryTier"}',
        '{engine="0",tier="2:RedisSecondaryTier"}',
    )
    assert f"vllm:kv_offload_tiering_promoted_total{disk} 16.0" in text
    assert f"vllm:kv_offload_tiering_cascade_written_total{disk} 80.0" in text
    assert f"vllm:kv_offload_tiering_cascade_written_total{redis} 80.0" in text
    assert f"vllm:kv_offload_tiering_chunk_hits_total{disk} 16.0" in text


@pytest.mark.parametrize(("before", "after"), [(2, 4), (2, 1), (1, 2)])
def test_values_stored_at_another_tp_size_are_misses_not_loaded(
    model, redis_server, tmp_path, before, after
):
    """An operator restarts the server at another TP size over the same folder and Redis
    namespace: a rank's values of the old layout hold other heads (or are another size),
    so their lookups miss; nothing is read, rejected or loaded."""
    namespace = f"relayout-{tmp_path.name}"
    kind = "disk+redis"
    first = make_engine(
        model, before, tiers_of(kind, before, redis_server.url, tmp_path, namespace)
    )
    try:
        assert run(first, PROMPT_A) == 0
        first.run()
        assert first.manager.link.statistics(1)["cascade_written"] == 16
    finally:
        close(first)
    second = make_engine(model, after, tiers_of(kind, after, redis_server.url, tmp_path, namespace))
    link = second.manager.link
    try:
        assert run(second, PROMPT_A) == 0  # recomputed on every rank
        assert link.statistics()["promoted"] == link.statistics()["promote_failed"] == 0
        assert by_tier(second, CascadeMetrics.HITS) == {}
        assert set(by_tier(second, CascadeMetrics.QUERIES)) == set(link.labels)  # asked, missed
        rejected = [n for name, n in second.counters.items() if name.endswith("rejected_values")]
        assert sum(rejected) == 0
    finally:
        close(second)


@pytest.mark.parametrize("bad", [["--requests", "-3"], ["--rounds", "0"]])
def test_the_tp_bench_refuses_a_bad_count_in_one_line(bad):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "vllm_tp.py"), *bad],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"argument {bad[0]}: expected a positive integer" in done.stderr


def test_kv_events_announce_each_chunk_once_every_rank_wrote_it(model, redis_server, tmp_path):
    """With KV events on at TP 2: one stored record per chunk (not one per rank), of the
    tier's medium, only for what both ranks wrote."""
    from vllm.config import KVEventsConfig
    from vllm.v1.kv_offload.base import Medium

    tp = 2
    entry = redis_entry(
        redis_server.url, namespace=f"events-{tmp_path.name}", enable_kv_events=True
    )
    extra = tiering_extra(64 * chunk_bytes(tp), eviction_policy="lru", secondary_tiers=[entry])
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine = build_engine(model, extra, tp=tp, kv_events=events)
    engine.attach_model()
    link = engine.manager.link
    seen: list[Any] = []  # what the link hands vLLM's scheduler, which drains it each step
    taking = link.take_events

    def take_events() -> Any:
        events = list(taking())
        seen.extend(events)
        return iter(events)

    link.take_events = take_events  # type: ignore[method-assign]
    try:
        assert run(engine, PROMPT_A) == 0
        engine.run()
        assert link.statistics()["cascade_written"] == 16
        assert [len(tier.ranks) for tier in link.tiers] == [tp]
        stored = [
            key
            for event in seen
            if event.medium is not Medium.CPU and not event.removed
            for key in event.keys
        ]
        assert sorted(stored) == sorted(_keys_of(engine, PROMPT_A))  # once each
    finally:
        close(engine)
