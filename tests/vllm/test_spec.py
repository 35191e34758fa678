"""`TieringSpec` loaded by vLLM 0.33 by name, driven by vLLM's real scheduler on CPU."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiering.errors import ConfigError, ResourceClosedError
from tiering.integrations.vllm import (
    TieringOffloadingManager,
    TieringOffloadingWorker,
    TieringSpec,
)

from .harness import (
    LAYERS,
    TRACE,
    attention_spec,
    build_engine,
    native_extra,
    replay,
    tiering_extra,
    trace_prompts,
    write_model,
)

PROMPT = list(range(1, 257))  # 16 blocks of 16 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def test_vllm_loads_tiering_spec_by_name_and_module_path(model):
    assert OffloadingSpecFactory.get_spec_cls(tiering_extra(1 << 20)) is TieringSpec
    engine = build_engine(model, tiering_extra(64 << 20))
    assert isinstance(engine.manager, TieringOffloadingManager)


def test_a_repeated_prompt_gets_its_prefix_from_the_cpu_tier(model):
    engine = build_engine(model, tiering_extra(64 << 20))
    engine.add(PROMPT)
    engine.run()
    assert engine.manager.tier.statistics().ready == 16
    assert engine.scheduler.reset_prefix_cache()  # only the CPU tier has it now
    engine.add(PROMPT)
    engine.run()
    assert engine.hit_tokens == 256
    stats = engine.manager.tier.statistics()
    assert stats.loaded_total == 16
    assert stats.pinned == 0
    assert stats.open_load_jobs == 0


def test_the_same_bytes_give_the_same_number_of_chunks_as_vllms_native_spec(model):
    for cpu_bytes in (1 << 20, 64 << 20, 12_345_678):
        native = build_engine(model, native_extra(cpu_bytes))
        tiering = build_engine(model, tiering_extra(cpu_bytes))
        assert tiering.manager.tier.capacity == native.manager._num_chunks


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cpu_bytes_to_use": None}, "cpu_bytes_to_use'] is missing"),
        ({"cpu_bytes_to_use": -5}, "must be a positive number of bytes, got -5"),
        ({"cpu_bytes_to_use": "lots"}, "got 'lots'"),
        ({"cpu_bytes_to_use": 100}, "holds no chunk"),
        ({"eviction_policy": "aslur"}, "did you mean 'aslru'"),
        ({"transfer_backend": "gpu"}, "choose one of auto, cpu, cuda$"),
        ({"canonical_layout": True}, "canonical"),
        ({"secondary_tiers": [{"type": "RedisSecondaryTier"}]}, "TieringOffloadingSpec"),
        ({"store_threshold": 2}, "store_threshold'\\]=2"),
    ],
)
def test_a_bad_extra_config_value_is_one_clear_config_error(model, extra, message):
    config = tiering_extra(64 << 20)
    config.update(extra)
    if config["cpu_bytes_to_use"] is None:
        del config["cpu_bytes_to_use"]
    with pytest.raises(ConfigError, match=message):
        build_engine(model, config)


def test_the_worker_moves_real_bytes_through_vllms_own_worker_connector(model):
    engine = build_engine(model, tiering_extra(64 << 20))
    fake = engine.attach_model()
    assert isinstance(fake.worker, TieringOffloadingWorker)
    engine.add(PROMPT)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    fake.wipe()  # the GPU lost every page: only the CPU tier holds them
    engine.add(PROMPT)
    engine.run()
    assert engine.hit_tokens == 256
    # 15 full blocks a request starts from (the 16th is recomputed), both layers.
    assert fake.verified_blocks == 30
    assert fake.worker.backend.statistics().failed == 0


def test_the_byte_check_catches_a_corrupted_cpu_tier(model):
    engine = build_engine(model, tiering_extra(64 << 20))
    fake = engine.attach_model()
    engine.add(PROMPT)
    engine.run()
    fake.worker.pool.tensor.fill_(0x5A)  # every stored byte is now wrong
    assert engine.scheduler.reset_prefix_cache()
    fake.wipe()
    engine.add(PROMPT)
    with pytest.raises(AssertionError, match="does not hold its KV"):
        engine.run()


def test_events_leave_through_vllms_publisher_and_decode(model, tmp_path):
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVEventBatch

    # vLLM's publisher binds a wildcard or ipc endpoint (it connects to a host
    # address); an ipc socket keeps the test off the network.
    endpoint = f"ipc://{tmp_path}/kv-events"
    events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        engine = build_engine(model, tiering_extra(64 << 20), kv_events=events_config)
        sub.connect(endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher
        engine.add(PROMPT)
        engine.run()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(stored) < 16:
            frames = sub.recv_multipart()
            batch = decoder.decode(frames[-1])
            stored += [
                e for e in batch.events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU
            ]
        # As vLLM describes a CPU-tier store: one event per key, no token ids.
        assert len(stored) == 16
        assert all(e.block_size == 0 and e.token_ids == [] for e in stored)
        # A reset removes what the CPU tier held, with medium CPU.
        assert engine.scheduler.reset_prefix_cache(reset_connector=True)
        engine.add(list(range(5000, 5032)))  # events leave with the next step's output
        engine.run()
        removed: list[BlockRemoved] = []
        while sum(len(e.block_hashes) for e in removed) < 16:
            batch = decoder.decode(sub.recv_multipart()[-1])
            # (vLLM's own AllBlocksCleared of the GPU prefix cache comes first.)
            removed += [e for e in batch.events if isinstance(e, BlockRemoved)]
        assert {e.medium for e in removed} == {MEDIUM_CPU}
        hashes = sorted(h for e in stored for h in e.block_hashes)
        assert sorted(h for e in removed for h in e.block_hashes) == hashes
        engine.scheduler.shutdown()
    finally:
        sub.close(linger=0)
        context.term()


def test_a_reset_empties_the_tier_and_shutdown_stops_the_worker(model):
    engine = build_engine(model, tiering_extra(64 << 20))
    fake = engine.attach_model()
    engine.add(PROMPT)
    engine.run()
    assert engine.manager.tier.statistics().used == 16
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    assert engine.manager.tier.statistics().used == 0
    engine.add(PROMPT)
    engine.run()
    assert engine.hit_tokens == 0  # nothing left to load
    engine.scheduler.shutdown()
    fake.connector.shutdown()
    assert fake.worker.backend.statistics().in_flight == 0
    with pytest.raises(ResourceClosedError):
        fake.worker.backend.submit(0, *_store_specs())


def _store_specs():
    from tiering.cpu.common import CPULoadStoreSpec
    from tiering.specs import GPULoadStoreSpec

    return GPULoadStoreSpec([0]), CPULoadStoreSpec([0])


def test_a_trace_through_vllms_scheduler_native_lru_and_tiering_lru_hit_alike(model):
    """The first 3,000 requests of the Mooncake trace, with vLLM's native CPU spec and with
    TieringSpec at the same capacity: tiering's LRU hits exactly as vLLM's own LRU does,
    and its default policy more."""
    if not TRACE.exists():
        pytest.skip(f"the Mooncake trace is absent: {TRACE}")
    prompts = trace_prompts(TRACE, 3000)
    chunk_bytes = attention_spec().page_size_bytes * len(LAYERS)
    capacity = 1500 * chunk_bytes  # 768,000 trace tokens: eviction decides the hits
    hits = {}
    for name, extra in (
        ("native", native_extra(capacity)),
        ("lru", tiering_extra(capacity, eviction_policy="lru")),
        ("default", tiering_extra(capacity)),
    ):
        engine = build_engine(
            model, extra, num_gpu_blocks=2048, max_model_len=8192, max_num_batched_tokens=8192
        )
        replay(engine, prompts)
        hits[name] = engine.hit_tokens
        if name != "native":
            assert engine.manager.tier.statistics().pinned == 0
    print(f"\nhit tokens: {hits}")
    assert hits["native"] > 0
    assert hits["lru"] == hits["native"]
    assert hits["default"] > 1.1 * hits["native"]


def test_metrics_port_serves_tierings_own_cpu_tier_gauges(model):
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    engine = build_engine(model, tiering_extra(64 << 20, metrics_port=0))
    url = engine.manager.metrics_url
    assert url is not None
    engine.add(PROMPT)
    engine.run()
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tiering_chunks_capacity", "cpu")] == engine.manager.tier.capacity
    assert samples[("tiering_chunks_used", "cpu")] == 16
    assert samples[("tiering_chunks_pinned", "cpu")] == 0
    engine.scheduler.shutdown()  # closes the server with the manager
    with pytest.raises(urllib.error.URLError, match="refused"):
        urllib.request.urlopen(url, timeout=5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"metrics_port": 70000}, "metrics_port'] must be a port from 0 to 65535"),
        ({"metrics_port": "9100"}, "got '9100'"),
        ({"metrics_port": 0, "metrics_host": ""}, "metrics_host'] must be a host"),
    ],
)
def test_a_bad_metrics_setting_is_one_config_error(model, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_engine(model, tiering_extra(64 << 20, **extra))
