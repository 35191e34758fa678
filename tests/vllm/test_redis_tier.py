"""`RedisSecondaryTier` in vLLM 0.33's own ``TieringOffloadingSpec``, on a real redis-server.

vLLM's real scheduler (tests/vllm/harness.py) drives the spec, whose
scheduler side builds its CPU tier on a shared-memory region (``/dev/shm``)
and hands the tier a memoryview of it: that works on a machine without a GPU,
so nothing of vLLM's is stubbed here. The harness moves no bytes between
"GPU" and the CPU tier, so the tests put bytes of their own in the CPU tier's
rows and follow them through Redis and back.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.errors import ConfigError
from tiering.integrations.vllm.redis_tier import (
    DROPPED_QUEUE_FULL,
    METRIC_FAILURES,
    METRIC_REJECTED,
    METRIC_UP,
    METRIC_WRITES_DROPPED,
    RedisSecondaryTier,
    remote_namespace,
)
from tiering.secondary.codec import ChunkCodec, Verdict

from ..secondary import conftest as secondary
from .harness import Engine, build_engine, write_model

CHUNK = 16 << 10  # one 16-token block of the harness's model (2 layers x 8 KiB)
CPU_CHUNKS = 16  # the CPU tier holds one prompt: the next one evicts it
PROMPT_A = list(range(1, 257))  # 16 blocks
PROMPT_B = list(range(1001, 1257))
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


# The secondary tests' servers (fixtures): the session's standalone one, shared (each
# test has a namespace of its own), and one of a test alone, to kill, freeze and start again.
redis_server = secondary.redis_server
own_redis_server = secondary.own_redis_server


def entry(url: str, **options: Any) -> dict[str, Any]:
    return {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "url": url,
        "namespace": options.pop("namespace", f"test-{uuid.uuid4().hex}"),
        **options,
    }


def make_engine(model: Path, url: str, **options: Any) -> Engine:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_CHUNKS * CHUNK,
        "secondary_tiers": [entry(url, **options)],
    }
    return build_engine(model, extra)


class Spy:
    """Wraps the engine's Redis tier: what each store read, where each load went, lookups."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tier: RedisSecondaryTier = engine.manager.secondary_tiers[0]
        assert isinstance(self.tier, RedisSecondaryTier)
        view = engine.manager.primary_tier.get_kv_memoryview()
        assert view.strides[0] == CHUNK
        self._flat = view.cast("B")
        self.rows = np.frombuffer(self._flat, dtype=np.uint8).reshape(-1, CHUNK)
        self.stored: dict[bytes, bytes] = {}  # key -> the row it was stored from
        self.loaded: dict[bytes, int] = {}  # key -> the chunk it was loaded into
        self.lookups: list[tuple[bytes, LookupResult]] = []
        #: Every stats payload vLLM took from the tier (it takes one a step), summed.
        self.reported = OffloadingConnectorStats()
        self.requests: list[Any] = []
        tier = self.tier
        store, load, lookup = tier.submit_store, tier.submit_load, tier.lookup
        get_stats = tier.get_stats

        def submit_store(job: TransferJob) -> None:
            for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
                self.stored[key] = self.rows[chunk].tobytes()
            store(job)

        def submit_load(job: TransferJob) -> None:
            self.loaded.update(zip(job.keys, map(int, job.chunk_ids), strict=True))
            load(job)

        def spied_lookup(key: bytes, req_context: ReqContext) -> LookupResult:
            result = lookup(key, req_context)
            self.lookups.append((key, result))
            return result

        def spied_get_stats() -> OffloadingConnectorStats | None:
            stats = get_stats()
            if stats is not None:
                self.reported.aggregate(copy.deepcopy(stats))
            return stats

        tier.get_stats = spied_get_stats  # type: ignore[method-assign]
        tier.submit_store = submit_store  # type: ignore[method-assign]
        tier.submit_load = submit_load  # type: ignore[method-assign]
        tier.lookup = spied_lookup  # type: ignore[method-assign]

    def shutdown(self) -> None:
        """vLLM's shutdown of the manager, the test's hold on the CPU tier's rows let go first."""
        del self.rows
        self._flat.release()
        self.engine.manager.shutdown()

    def fill(self, seed: int) -> None:
        """Bytes of the test's own in every row of the CPU tier, as a GPU store would put."""
        self.rows[:] = np.random.default_rng(seed).integers(0, 256, self.rows.shape, np.uint8)

    def run(self, prompt: list[int]) -> int:
        """Run ``prompt`` to its end; the prompt tokens the connector served."""
        before = self.engine.hit_tokens
        self.requests.append(self.engine.add(prompt))
        self.engine.run()
        return self.engine.hit_tokens - before

    def evict(self, prompt: list[int] = PROMPT_B) -> None:
        """Only Redis holds what ran before: the CPU tier overflowed, the GPU cache dropped."""
        self.run(prompt)
        assert self.engine.scheduler.reset_prefix_cache()

    def keys(self, request: Any) -> list[bytes]:
        """``request``'s chunk keys, in its prompt's order (one block a chunk, group 0)."""
        return [make_offload_key(bytes(h), 0) for h in request.block_hashes]

    def reported_data(self) -> dict[str, Any]:
        self.engine.step()  # vLLM takes the tier's stats of this step too
        return dict(self.reported.data["data"])


def stats_data(tier: RedisSecondaryTier) -> dict[str, Any]:
    stats = tier.get_stats()
    assert stats is not None
    return dict(stats.data["data"])


def test_a_prefix_only_redis_holds_is_promoted_and_loaded_byte_for_byte(model, redis_server):
    engine = make_engine(model, redis_server.url)
    spy = Spy(engine)
    tier = spy.tier
    try:
        spy.fill(seed=1)
        assert spy.run(PROMPT_A) == 0
        assert len(spy.stored) == 16
        stored = dict(spy.stored)
        # In Redis, under the namespace, each value self-checking and the row's bytes.
        codec = ChunkCodec(tier.namespace)
        client = redis_server.client()
        assert len(list(client.scan_iter(match=codec.key_prefix + b"*"))) == 16
        for key, row in stored.items():
            out = bytearray(CHUNK)
            value = client.get(codec.remote_key(key))
            assert codec.decode_into(key, value, memoryview(out)) is Verdict.OK
            assert bytes(out) == row

        spy.evict()
        spy.rows[:] = 0  # nothing of A's bytes is left in the CPU tier
        spy.lookups.clear()
        assert spy.run(PROMPT_A) == 256  # every block, from Redis

        assert set(spy.loaded) == set(stored)
        for key, chunk in spy.loaded.items():
            assert spy.rows[chunk].tobytes() == stored[key]
        for key in stored:  # asked once, answered on a later step
            answers = [result for k, result in spy.lookups if k == key]
            assert answers[0] is LookupResult.RETRY
            assert answers[-1] is LookupResult.HIT
        stats = tier.statistics()
        assert stats.redis.reads_total == 16
        assert stats.redis.rejected_total == 0
        assert stats.load_jobs_failed == 0
        assert spy.reported_data()[METRIC_UP] == {(): 1}
    finally:
        spy.shutdown()


def test_a_second_server_on_the_namespace_is_served_what_the_first_stored(model, redis_server):
    """Two vLLM schedulers, each with its own CPU tier, one Redis namespace between them."""
    shared = f"shared-{uuid.uuid4().hex}"
    first = Spy(make_engine(model, redis_server.url, namespace=shared))
    second = Spy(make_engine(model, redis_server.url, namespace=shared))
    try:
        first.fill(seed=4)
        assert first.run(PROMPT_A) == 0
        assert first.tier.wait_idle(10)
        first.engine.run()
        assert first.tier.statistics().redis.writes_total == 16
        second.rows[:] = 0  # nothing of A in the second server's CPU tier
        assert second.run(PROMPT_A) == 256  # every block, from what the first stored
        assert set(second.loaded) == set(first.stored)
        for key, chunk in second.loaded.items():
            assert second.rows[chunk].tobytes() == first.stored[key]
        assert second.tier.statistics().redis.reads_total == 16
        assert second.tier.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
    finally:
        second.shutdown()
        first.shutdown()


def test_lookup_is_retry_until_redis_answers_and_bounded_in_flight(model, redis_server):
    engine = make_engine(model, redis_server.url, max_lookups_in_flight=2)
    spy = Spy(engine)
    tier = spy.tier
    try:
        spy.run(PROMPT_A)
        first, second = list(spy.stored)[:2]
        absent = b"\x01" * 32 + b"\x00\x00\x00\x00"
        probe = ReqContext(req_id="probe")
        deferred = tier.statistics().lookups_deferred
        assert tier.lookup(first, probe) is LookupResult.RETRY
        assert tier.lookup(absent, probe) is LookupResult.RETRY
        # Two keys in flight: a third is not asked yet, and that is counted.
        assert tier.lookup(second, probe) is LookupResult.RETRY
        assert tier.statistics().lookups_deferred == deferred + 1
        assert tier.has_pending_work()
        tier.on_schedule_end(END)  # one call to Redis for the step's keys
        assert tier.wait_idle(10)
        assert tier.lookup(first, probe) is LookupResult.HIT
        assert tier.lookup(absent, probe) is LookupResult.MISS
        assert tier.lookup(second, probe) is LookupResult.RETRY  # asked now
        tier.on_schedule_end(END)
        assert tier.wait_idle(10)
        assert tier.lookup(second, probe) is LookupResult.HIT
        tier.on_request_finished(probe)
        assert not tier.has_pending_work()
    finally:
        spy.shutdown()


def test_redis_killed_mid_run_is_counted_requests_recompute_and_the_tier_recovers(
    model, own_redis_server
):
    engine = make_engine(model, own_redis_server.url, timeout_s=1.0, backoff_s=[0.01, 0.05])
    spy = Spy(engine)
    tier = spy.tier
    try:
        spy.fill(seed=2)
        spy.run(PROMPT_A)  # Redis holds A
        assert tier.statistics().redis.writes_total == 16
        engine.add(PROMPT_B)
        engine.step()  # B is being computed; its store comes in a later step
        own_redis_server.kill()
        engine.run()  # B's store to Redis fails: no crash
        assert engine.scheduler.reset_prefix_cache()
        assert spy.run(PROMPT_A) == 0  # Redis is away: A is recomputed
        stats = tier.statistics()
        assert stats.store_jobs_failed >= 1
        assert stats.redis.errors_total >= 1
        assert stats.redis.write_errors_total >= 16
        data = spy.reported_data()
        assert sum(data[METRIC_FAILURES].values()) >= 1
        assert sum(data[METRIC_WRITES_DROPPED].values()) >= 16
        assert data[METRIC_UP] == {(): 0}

        own_redis_server.start()  # back, empty: the tier probes it after its backoff
        deadline = time.monotonic() + 15
        prompts = iter(range(20_000, 10**6, 1000))
        while True:
            start = next(prompts)
            prompt = list(range(start, start + 256))
            written = tier.statistics().redis.writes_total
            spy.run(prompt)
            if tier.statistics().redis.writes_total == written + 16:
                break
            assert time.monotonic() < deadline, f"the tier did not recover: {tier!r}"
        assert tier.statistics().redis.state == "up"
        spy.evict()
        assert spy.run(prompt) == 256  # served from Redis again
        assert spy.reported_data()[METRIC_UP] == {(): 1}
    finally:
        spy.shutdown()


def test_a_corrupted_value_is_refused_counted_and_never_loaded(model, redis_server):
    engine = make_engine(model, redis_server.url)
    spy = Spy(engine)
    tier = spy.tier
    try:
        spy.fill(seed=3)
        spy.run(PROMPT_A)
        keys = spy.keys(spy.requests[-1])
        assert set(keys) == set(spy.stored)
        codec = ChunkCodec(tier.namespace)
        client = redis_server.client()
        remote = codec.remote_key(keys[8])
        value = client.get(remote)
        at = len(value) - 100  # a byte of the payload
        client.setrange(remote, at, bytes([value[at] ^ 0xFF]))

        spy.evict()
        assert spy.run(PROMPT_A) == 8 * 16  # the prefix up to the corrupted block
        stats = tier.statistics()
        assert stats.redis.rejected_by_reason == {Verdict.BAD_CHECKSUM.value: 1}
        assert stats.load_jobs_failed == 1
        assert stats.keys_not_loaded == 1
        assert spy.reported_data()[METRIC_REJECTED] == {(Verdict.BAD_CHECKSUM.value,): 1}
        for key in keys[:8]:
            assert spy.rows[spy.loaded[key]].tobytes() == spy.stored[key]
    finally:
        spy.shutdown()


def test_shutdown_stops_the_tiers_thread_and_is_idempotent(model, redis_server):
    before = {thread.ident for thread in threading.enumerate()}
    engine = make_engine(model, redis_server.url)
    spy = Spy(engine)
    spy.run(PROMPT_A)
    assert [t for t in threading.enumerate() if t.ident not in before]  # the tier's loop
    spy.shutdown()
    # The loop's own thread is joined; anyio's worker threads are told to stop as the
    # loop ends, and end a moment later (anyio does not join them).
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.01)
    assert spy.tier.statistics().state == "closed"
    assert spy.tier.statistics().redis.state == "closed"
    spy.tier.shutdown()  # again: nothing to do
    assert "closed" in repr(spy.tier)


# -- the tier alone, on a spec and a CPU tier vLLM built --------------------------


@pytest.fixture(scope="module")
def built(model, redis_server) -> Iterator[tuple[Any, memoryview]]:
    """vLLM's spec and the CPU tier's memoryview, for tiers made by the tests themselves."""
    engine = make_engine(model, redis_server.url)
    tier = engine.manager.secondary_tiers[0]
    yield tier._offloading_spec, engine.manager.primary_tier.get_kv_memoryview()
    engine.manager.shutdown()


@pytest.fixture
def make_tier(built) -> Iterator[Callable[..., RedisSecondaryTier]]:
    made: list[RedisSecondaryTier] = []

    def make(url: str, spec: Any = None, **options: Any) -> RedisSecondaryTier:
        config = entry(url, **options)
        del config["type"], config["module_path"]
        tier = RedisSecondaryTier(
            offloading_spec=spec or built[0],
            primary_kv_view=built[1],
            tier_type="RedisSecondaryTier",
            **config,
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.shutdown()


def job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunks, dtype=np.int32),
        is_promotion=promotion,
        req_context=ReqContext(req_id=f"job-{job_id}"),
    )


def finished(tier: RedisSecondaryTier) -> list[Any]:
    assert tier.wait_idle(10)
    return list(tier.get_finished_jobs())


def asked(tier: RedisSecondaryTier, key: bytes) -> LookupResult:
    """The tier's answer for ``key`` once Redis answered (a RETRY first)."""
    context = ReqContext(req_id=f"ask-{uuid.uuid4().hex}")
    assert tier.lookup(key, context) is LookupResult.RETRY
    tier.on_schedule_end(END)
    assert tier.wait_idle(10)
    answer = tier.lookup(key, context)
    tier.on_request_finished(context)
    return answer


KEY = b"\x07" * 32 + b"\x00\x00\x00\x00"


def test_namespaces_never_share_values(make_tier, redis_server, built):
    ours = make_tier(redis_server.url, namespace="a")
    theirs = make_tier(redis_server.url, namespace="b")
    assert ours.namespace.digest() != theirs.namespace.digest()
    ours.submit_store(job(1, [KEY], [3]))
    (result,) = finished(ours)
    assert result.success
    assert result.transfer_bytes == CHUNK
    assert asked(ours, KEY) is LookupResult.HIT
    assert asked(theirs, KEY) is LookupResult.MISS
    assert redis_server.client().exists(ChunkCodec(ours.namespace).remote_key(KEY)) == 1
    # Another model (or dtype, or layout) is another namespace, whatever the operator's.
    config = built[0].config
    other = dataclasses.replace(config, model=dataclasses.replace(config.model, name="other"))
    assert remote_namespace(other, CHUNK, "a").digest() != ours.namespace.digest()
    assert remote_namespace(config, CHUNK, "a").digest() == ours.namespace.digest()


def test_a_load_writes_the_rows_and_fails_only_the_keys_redis_lacks(make_tier, redis_server, built):
    tier = make_tier(redis_server.url)
    rows = np.frombuffer(built[1].cast("B"), dtype=np.uint8).reshape(-1, CHUNK)
    rows[4] = np.arange(CHUNK, dtype=np.uint8)
    tier.submit_store(job(1, [KEY], [4]))
    assert finished(tier)[0].success
    rows[5:7] = 0
    missing = b"\x08" * 32 + b"\x00\x00\x00\x00"
    tier.submit_load(job(2, [KEY, missing], [5, 6], promotion=True))
    (result,) = finished(tier)
    assert not result.success
    assert list(result.successful_keys) == [KEY]
    assert result.transfer_bytes == CHUNK
    assert rows[5].tobytes() == rows[4].tobytes()
    assert tier.statistics().redis.read_misses_total == 1


RELEASE = {"version": 1, "release": True}


def test_release_ttl_s_expires_the_values_a_released_request_writes(make_tier, redis_server):
    """The entry's ``release_ttl_s`` reaches the tier: a store of a request whose hint
    released its conversation writes values that expire within it; without a hint,
    never."""
    tier = make_tier(redis_server.url, namespace="release", release_ttl_s=30)
    released = dataclasses.replace(
        job(1, [KEY], [3]),
        req_context=ReqContext(req_id="r", kv_transfer_params={"tiering": RELEASE}),
    )
    tier.submit_store(released)
    plain_key = b"\x09" * 32 + b"\x00\x00\x00\x00"
    tier.submit_store(job(2, [plain_key], [4]))
    assert all(result.success for result in finished(tier))
    client, codec = redis_server.client(), ChunkCodec(tier.namespace)
    assert 0 < client.pttl(codec.remote_key(KEY)) <= 30_000
    assert client.pttl(codec.remote_key(plain_key)) == -1  # no expiry


def test_stores_past_the_bound_are_dropped_and_counted(make_tier, own_redis_server):
    tier = make_tier(own_redis_server.url, max_store_jobs=1, timeout_s=5.0)
    assert asked(tier, KEY) is LookupResult.MISS  # connected
    own_redis_server.freeze()  # the first store waits for an answer
    try:
        tier.submit_store(job(1, [KEY], [0]))
        tier.submit_store(job(2, [KEY], [1]))  # past the bound: failed at once
        (dropped,) = tier.get_finished_jobs()
        assert dropped.job_id == 2
        assert not dropped.success
    finally:
        own_redis_server.thaw()
    (landed,) = finished(tier)
    assert landed.job_id == 1
    assert landed.success
    stats = tier.statistics()
    assert stats.store_jobs_dropped == 1
    assert stats.chunks_dropped == 1
    assert stats_data(tier)[METRIC_WRITES_DROPPED] == {(DROPPED_QUEUE_FULL,): 1}


def test_stored_chunks_are_announced_as_remote_storage_when_events_are_on(
    make_tier, redis_server, built
):
    spec = copy.copy(built[0])
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=False
    )
    tier = make_tier(redis_server.url, spec=spec, enable_kv_events=True)
    assert list(tier.take_events()) == []
    tier.submit_store(job(1, [KEY], [2]))
    assert finished(tier)[0].success
    (event,) = tier.take_events()
    assert event.keys == [KEY]
    assert not event.removed
    assert event.medium is Medium.STORAGE
    assert event.locality is Locality.REMOTE
    assert list(tier.take_events()) == []


def test_metrics_and_config_info_are_what_vllms_spec_declares(make_tier, redis_server):
    extra = {"cpu_bytes_to_use": CPU_CHUNKS * CHUNK, "secondary_tiers": [entry(redis_server.url)]}
    definitions = TieringOffloadingSpec.build_metric_definitions(extra)
    tier = make_tier(redis_server.url)
    tier.submit_store(job(1, [KEY], [0]))
    finished(tier)
    for name, values in stats_data(tier).items():
        assert name in definitions
        assert all(len(labels) == len(definitions[name].labelnames) for labels in values)
    assert tier.get_stats() is None  # each payload is what changed since the last one
    keys = TieringOffloadingSpec.config_info_keys(extra)
    info = tier.config_info()
    assert set(info) <= set(keys)
    assert info["redis_url"] == redis_server.url
    assert info["redis_namespace"] == tier.namespace.digest().hex()[:16]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"url": None}, "'url' must be a Redis URL"),
        ({"url": "http://user:pw@host/0"}, "'url' must be a Redis URL"),
        ({"url": "redis://127.0.0.1:99999/0"}, "port out of range"),
        ({"namespace": 7}, "'namespace' must be a string"),
        ({"timeout_s": "2"}, "'timeout_s' must be a number of seconds"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"ttl_s": 0.0}, "ttl_s must be None or at least"),
        ({"release_ttl_s": 0}, "release_ttl_s must be None or at least 0.001 seconds, got 0"),
        ({"release_ttl_s": "30"}, "'release_ttl_s' must be a number of seconds"),
        ({"backoff_s": [1, 0.5]}, "'backoff_s' must be [first, longest]"),
        ({"checksum": "md5"}, "'checksum' must be 'xxh3' or 'ml64'"),
        ({"locality": "NEAR"}, "'locality' must be 'REMOTE'"),
        ({"max_store_jobs": 0}, "'max_store_jobs' must be an integer of at least 1"),
        ({"max_lookups_in_flight": True}, "'max_lookups_in_flight' must be an integer"),
        ({"enable_kv_events": "yes"}, "'enable_kv_events' must be true or false"),
        ({"cluster": "auto"}, "'cluster' must be true, false or null"),
        ({"colour": "blue"}, "unknown key(s) 'colour'"),
    ],
)
def test_a_bad_entry_value_is_one_error_naming_the_key(make_tier, redis_server, options, named):
    url = options.pop("url", redis_server.url)
    with pytest.raises(ConfigError) as caught:
        make_tier(url, **options)
    assert named in str(caught.value)
    assert "RedisSecondaryTier" in str(caught.value)
    assert "pw" not in str(caught.value)  # never a password


def test_connect_on_start_reports_a_server_that_is_not_there(make_tier):
    from ..secondary.conftest import free_port

    with pytest.raises(ConfigError, match="cannot reach the Redis tier"):
        make_tier(f"redis://127.0.0.1:{free_port()}/0", connect_on_start=True, timeout_s=0.5)
