"""`TieringSpec` with tiering's Redis tier below its CPU tier, driven by vLLM's scheduler.

Real bytes: vLLM's own worker connector moves them between CPU "GPU" pages and
the worker's host pool (shared with the scheduler in /dev/shm), the link writes
landed chunks through to a real redis-server and promotes them back, and every
page a request starts from is checked (`FakeModel.verify`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tiering.errors import ConfigError
from tiering.integrations.vllm import RedisSecondaryTier
from tiering.integrations.vllm.link import CascadeMetrics
from tiering.transfer.memory import SHM_DIR, SHM_NAME_PATTERN, shm_file_name

from ..secondary import conftest as secondary
from .harness import Engine, attention_spec, build_engine, tiering_extra, write_model

redis_server = secondary.redis_server
own_redis_server = secondary.own_redis_server

CHUNK = attention_spec().page_size_bytes * 2  # one 16-token block, both layers
PROMPT_A = list(range(1, 257))  # 16 blocks: half the CPU tier
PROMPT_B = list(range(1001, 1257))
PROMPT_C = list(range(2001, 2257))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("model"))


def entry(url: str, **options):
    return {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "url": url,
        "namespace": f"test-{os.getpid()}-{id(options)}",
        **options,
    }


def make_engine(model, url: str, **options) -> Engine:
    engine = build_engine(
        model,
        tiering_extra(32 * CHUNK, eviction_policy="lru", secondary_tiers=[entry(url, **options)]),
    )
    engine.attach_model()
    return engine


def run(engine: Engine, prompt: list[int]) -> int:
    """Hit tokens of one request of ``prompt`` (the GPU prefix cache dropped first)."""
    assert engine.scheduler.reset_prefix_cache()
    engine.model.wipe()  # the GPU lost every page: loads must bring them back
    before = engine.hit_tokens
    engine.add(prompt)
    engine.run()
    return engine.hit_tokens - before


def test_a_prefix_evicted_from_the_cpu_tier_comes_back_from_redis_byte_for_byte(
    model, redis_server
):
    engine = make_engine(model, redis_server.url)
    link = engine.manager.link
    try:
        assert run(engine, PROMPT_A) == 0
        engine.run()  # the write-through lands
        assert link.statistics()["cascade_written"] == 16
        assert run(engine, PROMPT_B) == 0
        assert run(engine, PROMPT_C) == 0  # B and C take the whole CPU tier: A is in Redis only
        assert not any(engine.manager.tier.holds(k) for k in _keys_of(engine, PROMPT_A))
        verified = engine.model.verified_blocks
        assert run(engine, PROMPT_A) == 256  # promoted from Redis, loaded, checked
        assert engine.model.verified_blocks - verified == 30
        stats = link.statistics()
        assert stats["promoted"] == 16
        assert stats["promote_failed"] == 0
        assert stats["cascade_pinned"] == 0
        assert engine.manager.tier.statistics().pinned == 0
        assert engine.counters[CascadeMetrics.PROMOTED] == 16
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()


def test_redis_killed_mid_run_costs_only_the_hits_and_is_counted(model, own_redis_server, caplog):
    engine = make_engine(model, own_redis_server.url, timeout_s=1.0, backoff_s=[0.01, 0.05])
    link = engine.manager.link
    try:
        run(engine, PROMPT_A)
        engine.run()
        assert link.statistics()["cascade_written"] == 16
        own_redis_server.kill()
        assert run(engine, PROMPT_B) == 0  # their write-throughs fail: no crash
        assert run(engine, PROMPT_C) == 0  # A is out of the CPU tier now
        engine.run()
        assert link.statistics()["cascade_failed"] == 32
        assert run(engine, PROMPT_A) == 0  # Redis is away: A is recomputed, correctly
        reported = engine.counters
        # A's recomputed chunks failed too: vLLM's metrics got every failure the link saw.
        assert reported[CascadeMetrics.FAILED] == link.statistics()["cascade_failed"] == 48
        # ...and vLLM's log says so (once a minute at most), where an operator looks first.
        warnings = [r.getMessage() for r in caplog.records if r.name.endswith("vllm.link")]
        assert warnings
        assert warnings[0].startswith(
            "secondary tier 1:RedisSecondaryTier lost, since its last report: 16 chunks not "
            "written through (failed by the tier);"
        )
        assert reported["vllm:kv_offload_redis_failures"] >= 1
        assert engine.manager.tier.statistics().pinned == 0
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()


def shared_files(engine: Engine) -> list[str]:
    """The engine's files in /dev/shm: ``tiering-<pid>-<tag>-row<row bytes>``."""
    spec = engine.model.connector.connector_worker.spec
    names = [(name, SHM_NAME_PATTERN.fullmatch(name)) for name in os.listdir(SHM_DIR)]
    return [n for n, m in names if m and m["tag"].startswith(f"{spec.shm_name}-row")]


def test_the_shared_rows_are_unnamed_once_mapped_and_unmapped_at_shutdown(model, redis_server):
    engine = make_engine(model, redis_server.url)
    pool = engine.model.worker.pool  # the worker's host pool is the shared file
    assert len(shared_files(engine)) == 1
    run(engine, PROMPT_A)
    spec = engine.manager.link.secondary._offloading_spec  # the scheduler's TieringSpec
    (rows,) = spec._shared_rows  # the scheduler mapped the worker's rows...
    assert shared_files(engine) == []  # ...and removed the name: no crash leaves it behind
    engine.scheduler.shutdown()
    assert rows.closed
    engine.model.connector.shutdown()
    assert pool.closed


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _tag_of(engine: Engine) -> str:
    from types import SimpleNamespace

    from tiering.integrations.vllm.spec import _shm_name

    config = SimpleNamespace(
        engine_id=engine.vllm_config.kv_transfer_config.engine_id,
        parallel=SimpleNamespace(rank=0),
    )
    return _shm_name(config)


def test_a_file_left_by_a_killed_engine_is_swept_at_the_next_start(model, redis_server):
    """Before: a file a killed worker left stayed in /dev/shm (its RAM held until a reboot)
    and the next start with that engine_id failed; now the next start removes it."""
    engine = build_engine(
        model, tiering_extra(32 * CHUNK, secondary_tiers=[entry(redis_server.url)])
    )
    stale = os.path.join(SHM_DIR, shm_file_name(f"{_tag_of(engine)}-row16384", _dead_pid()))
    with open(stale, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        engine.attach_model()
        assert not os.path.exists(stale)  # swept by the worker's start
        assert len(shared_files(engine)) == 1  # its own, named after its pid
        assert shared_files(engine)[0].startswith(f"tiering-{os.getpid()}-")
        assert run(engine, PROMPT_A) == 0
        assert engine.manager.link.secondary is not None  # the scheduler mapped its rows
        assert shared_files(engine) == []
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)


def test_a_file_of_a_live_engine_with_the_same_id_is_kept_and_named(model, redis_server, caplog):
    engine = build_engine(
        model, tiering_extra(32 * CHUNK, secondary_tiers=[entry(redis_server.url)])
    )
    other = os.getppid()  # alive: its file is not this engine's to remove
    live = os.path.join(SHM_DIR, shm_file_name(f"{_tag_of(engine)}-row16384", other))
    with open(live, "wb"):
        pass
    try:
        engine.attach_model()
        assert run(engine, PROMPT_A) == 0  # the CPU tier serves on, without the tier below
        assert os.path.exists(live)
        assert engine.manager.link.unavailable
        # One line in vLLM's log, naming the cause; no traceback (the operator's error).
        (line,) = [r for r in caplog.records if "cannot be built" in r.getMessage()]
        assert "two engines run with the same engine_id" in line.getMessage()
        assert not line.exc_info
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()
        os.unlink(live)


def test_until_vllm_reports_the_reset_flushed_nothing_is_promoted_or_written(model, redis_server):
    engine = make_engine(model, redis_server.url)
    link = engine.manager.link
    try:
        run(engine, PROMPT_A)
        engine.run()
        assert link.statistics()["cascade_written"] == 16
        key = _keys_of(engine, PROMPT_A)[0]
        context = ReqContext(req_id="probe")
        engine.manager.reset_cache()  # as vLLM resets it; its workers may still copy
        assert link.lookup(key, context) is LookupResult.MISS  # Redis has it: not now
        dropped = link.statistics()["cascade_dropped"]
        link.landed([key], context)
        assert link.statistics()["cascade_dropped"] == dropped + 1
        engine.manager.on_reset_flushed()
        assert link.lookup(key, context) is LookupResult.RETRY  # asking Redis again
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()


def test_a_tier_that_cannot_be_built_mid_serving_leaves_the_cpu_tier_serving(model, caplog):
    dead = "redis://127.0.0.1:1/0"
    engine = make_engine(model, dead, connect_on_start=True, connect_timeout_s=0.5)
    try:
        assert run(engine, PROMPT_A) == 0
        assert run(engine, PROMPT_A) == 256  # from the CPU tier, as without a secondary
        assert engine.manager.link.unavailable
        (line,) = [r for r in caplog.records if "cannot be built" in r.getMessage()]
        assert "127.0.0.1:1" in line.getMessage()
        assert not line.exc_info  # the operator's error: one line
    finally:
        engine.scheduler.shutdown()
        engine.model.connector.shutdown()


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        ([{"type": "FileSystemTier", "module_path": "vllm"}], r"\[0\] is type 'FileSystemTier'"),
        ("redis, then vLLM's", r"\[1\] is type 'example'.*TieringOffloadingSpec"),
        ([{"type": "RedisSecondaryTier", "module_path": "tiering.integrations.vllm"}], "url"),
        ({"type": "RedisSecondaryTier"}, "secondary_tiers"),
    ],
)
def test_a_secondary_tier_tieringspec_cannot_serve_is_one_config_error(model, tiers, message):
    from tiering.integrations.vllm.spec import _secondary_entries

    good = entry("redis://127.0.0.1:1/0")
    given = [good, {"type": "example"}] if tiers == "redis, then vLLM's" else tiers
    with pytest.raises(ConfigError, match=message):
        _secondary_entries({"secondary_tiers": given})
    assert RedisSecondaryTier.check_entry("RedisSecondaryTier", good) is None


def test_two_redis_entries_are_two_tiers_each_with_its_own_namespace_and_label(model):
    from tiering.integrations.vllm.spec import _rank_entry, _secondary_entries

    first, second = entry("redis://127.0.0.1:1/0"), entry("redis://127.0.0.1:1/1")
    entries = _secondary_entries({"secondary_tiers": [first, second]})
    assert [e["namespace"] for e in entries] == [
        f"TieringSpec/{first['namespace']}",
        f"TieringSpec/{second['namespace']}",
    ]
    assert _rank_entry(entries[0], 0, 1) == entries[0]  # world size 1: as it was
    assert _rank_entry(entries[0], 3, 4)["namespace"] == f"TieringSpec/{first['namespace']}/rank3"


def _keys_of(engine: Engine, prompt: list[int]) -> list[bytes]:
    """The CPU tier's keys of ``prompt``'s blocks (vLLM's own block hashes, group 0)."""
    from vllm import SamplingParams
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    request = Request(
        request_id="probe",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=engine.block_hasher,
    )
    return [make_offload_key(bytes(h), 0) for h in request.block_hashes]


def test_what_the_link_lost_is_one_line_a_minute_in_vllms_log_with_the_counts(model):
    from .vllm_log import vllm_logging

    with vllm_logging() as log:
        engine = make_engine(model, "redis://127.0.0.1:1/0", backoff_s=[0.01, 0.05])
        try:
            run(engine, PROMPT_A)  # its write-throughs fail: Redis is not there
            engine.run()
            run(engine, PROMPT_B)  # 16 more, within the minute: said in the next line
            engine.run()
            assert engine.manager.link.statistics()["cascade_failed"] == 32
        finally:
            engine.scheduler.shutdown()
            engine.model.connector.shutdown()
    [line] = log.lines("WARNING", "secondary tier 1:RedisSecondaryTier lost")
    assert line.file == "link.py"
    assert "16 chunks not written through (failed by the tier)" in line.message
    assert line.message.endswith(
        'counted in vllm:kv_offload_tiering_cascade_failed{tier="1:RedisSecondaryTier"}'
    )
