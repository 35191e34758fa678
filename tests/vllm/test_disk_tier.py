"""`DiskSecondaryTier` in vLLM 0.33's own ``TieringOffloadingSpec``, over a real folder.

vLLM's real scheduler (tests/vllm/harness.py) drives the spec, and vLLM's own
worker connectors move the bytes (`Engine.attach_model`): a block loaded back
is checked against what the "model" wrote for it. The restart test runs each
server in a process of its own over one folder, as an operator restarts
``vllm serve``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingKVEventsConfig,
    ReqContext,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.errors import ConfigError
from tiering.integrations.vllm.disk_tier import (
    METRIC_UP,
    METRIC_WRITES_DROPPED,
    DiskSecondaryTier,
    disk_options,
)
from tiering.integrations.vllm.extra import remote_namespace

from .harness import Engine, build_engine, disk_entry, write_model
from .test_redis_tier import CHUNK, CPU_CHUNKS, END, KEY, finished, job, stats_data

HERE = Path(__file__).resolve().parent
PROMPT = list(range(1, 32 * 16 + 1))  # 32 blocks: one chunk each
OTHER = list(range(5001, 5001 + 32 * 16))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def entry(
    folder: Path, capacity_bytes: Any = 256 * (CHUNK + 4096), **options: Any
) -> dict[str, Any]:
    """The tier's entry; by default room for every value of a test (and its header)."""
    return disk_entry(folder, capacity_bytes, **options)


def make_engine(model: Path, folder: Path, cpu_chunks: int = 32, **options: Any) -> Engine:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_chunks * CHUNK,
        "secondary_tiers": [entry(folder, **options)],
    }
    return build_engine(model, extra)


def disk_tier(engine: Engine) -> DiskSecondaryTier:
    (tier,) = engine.manager.secondary_tiers
    assert isinstance(tier, DiskSecondaryTier)
    return tier


# One server's life in a process of its own: built, fed its prompts, shut down. vLLM's
# own worker (CPUOffloadingWorker) needs CUDA, so the bytes a GPU store would put in a CPU
# row are put there as each store to the disk reads it (a pattern of the chunk's key),
# and each row a load from the disk filled is checked against its key's pattern. It
# prints what vLLM counted (prompt tokens served, by source), what was checked, the tier's.
_SERVER = textwrap.dedent(
    """
    import hashlib, json, pathlib, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from harness import build_engine
    model, extra, prompts = sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    engine = build_engine(pathlib.Path(model), extra)
    (tier,) = engine.manager.secondary_tiers
    view = engine.manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view.cast("B"), dtype=np.uint8).reshape(view.shape[0], -1)
    def pattern(key):
        return np.frombuffer(hashlib.shake_128(bytes(key)).digest(rows.shape[1]), np.uint8)
    loads, checked, by_source = {}, [0, 0], {}
    store, load, finished = tier.submit_store, tier.submit_load, tier.get_finished_jobs
    def submit_store(job):
        for key, chunk in zip(job.keys, job.chunk_ids):
            rows[chunk] = pattern(key)
        store(job)
    def submit_load(job):
        loads[job.job_id] = list(zip(job.keys, job.chunk_ids))
        load(job)
    def get_finished_jobs():
        results = list(finished())
        for result in results:
            for key, chunk in loads.pop(result.job_id, ()):
                if result.success or key in (result.successful_keys or ()):
                    checked[np.array_equal(rows[chunk], pattern(key))] += 1
        return results
    tier.submit_store, tier.submit_load = submit_store, submit_load
    tier.get_finished_jobs = get_finished_jobs
    count = engine._count_stats
    def counted(results):
        for outputs in results.values():
            stats = outputs.scheduler_stats
            connector = stats.connector_prefix_cache_stats if stats is not None else None
            for source, n in (connector.hits_by_source if connector else {}).items():
                by_source[source.value] = by_source.get(source.value, 0) + n
        count(results)
    engine._count_stats = counted
    for prompt in prompts:
        engine.scheduler.reset_prefix_cache()
        engine.add(prompt)
        engine.run()
    assert tier.wait_idle(30)
    engine.run()
    disk = tier.statistics().disk
    del rows
    engine.manager.shutdown()
    print(json.dumps({
        "hit_tokens": engine.hit_tokens, "by_source": by_source,
        "loaded_right": checked[1], "loaded_wrong": checked[0], "writes": disk.writes_total,
        "reads": disk.reads_total, "chunks": disk.chunks, "rejected": disk.rejected_total,
    }))
    """
)


def serve(model: Path, extra: dict[str, Any], *prompts: list[int]) -> dict[str, Any]:
    """One vLLM server in a new process over ``extra``: what it counted."""
    done = subprocess.run(
        [sys.executable, "-c", _SERVER, str(HERE), str(model), json.dumps(extra),
         json.dumps(list(prompts))],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "0", "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_restarted_server_is_served_what_the_last_one_stored(model, tmp_path):
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 32 * CHUNK,
        "secondary_tiers": [entry(tmp_path / "cache")],
    }
    first = serve(model, extra, PROMPT)
    assert first["hit_tokens"] == 0
    assert first["writes"] == 32  # written through, every chunk
    assert first["chunks"] == 32
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != ".lock"]
    assert len(files) == 32
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)

    second = serve(model, extra, PROMPT)  # a new process: its CPU tier starts empty
    assert second["hit_tokens"] == len(PROMPT)  # every block, from the folder
    assert second["by_source"] == {CacheHitSource.DISK.value: len(PROMPT)}
    assert second["reads"] == 32
    assert second["rejected"] == 0
    # Each chunk loaded into the CPU tier holds what the first server stored for its key.
    assert (second["loaded_right"], second["loaded_wrong"]) == (32, 0)

    # Another model in the same folder: another namespace, so nothing of it is a hit.
    other = write_model(tmp_path / "other-model", num_hidden_layers=3)
    third = serve(other, extra, PROMPT)
    assert third["hit_tokens"] == 0
    assert third["reads"] == 0


def test_its_hits_are_vllms_disk_source_and_a_local_storage_medium(model, tmp_path):
    engine = make_engine(model, tmp_path / "cache")
    tier = disk_tier(engine)
    try:
        assert tier.cache_hit_source is CacheHitSource.DISK
        assert tier.medium is Medium.STORAGE
        assert tier.locality is Locality.LOCAL
        config = engine.manager.secondary_tiers[0]._offloading_spec.config
        assert tier.namespace.digest() == remote_namespace(config, CHUNK).digest()
        assert remote_namespace(config, CHUNK, "b").digest() != tier.namespace.digest()
    finally:
        engine.manager.shutdown()


def test_a_prefix_only_the_disk_holds_is_loaded_within_two_steps_of_the_answer(model, tmp_path):
    """32 chunks only in the folder: one lookup step (all RETRY), the answer, then loaded."""
    engine = make_engine(model, tmp_path / "cache", cpu_chunks=32)
    tier = disk_tier(engine)
    try:
        engine.add(PROMPT)
        engine.run()
        assert tier.wait_idle(30)
        engine.add(OTHER)  # overflows the CPU tier: only the folder holds PROMPT now
        engine.run()
        assert tier.wait_idle(30)
        assert engine.scheduler.reset_prefix_cache()
        before = engine.hit_tokens
        request = engine.add(PROMPT)
        engine.step()  # looks the prefix up: every chunk asked in this one step
        assert tier.wait_idle(30)  # the folder answered
        steps = 0
        while request.num_computed_tokens < len(PROMPT) - 1 and steps < 10:
            engine.step()
            steps += 1
            assert tier.wait_idle(30)
        engine.run()
        assert engine.hit_tokens - before == len(PROMPT)
        assert steps <= 2  # the promotion from the folder, then the load
    finally:
        engine.manager.shutdown()


@pytest.mark.parametrize("hinted", [False, True])
def test_under_vllms_own_manager_and_policy_the_tier_reads_a_requests_hint(model, tmp_path, hinted):
    """vLLM's own CPU manager and LRU policy read no hint: the tier reads the request's
    retention itself and writes its cascaded chunks with it (once per request)."""
    engine = make_engine(model, tmp_path / "cache")
    tier = disk_tier(engine)
    params = {"tiering": {"version": 1, "retain_s": 600}} if hinted else None
    try:
        engine.add(PROMPT, kv_transfer_params=params)
        engine.run()
        assert tier.wait_idle(30)
        engine.run()
        stats = tier.statistics()
    finally:
        engine.manager.shutdown()
    assert stats.store_jobs > 0
    assert stats.disk.hinted_total == (stats.disk.writes_total if hinted else 0)
    assert stats.disk.writes_total > 0
    assert tier.request_hints.counts.taken == int(hinted)


def test_lookups_answer_retry_until_the_folder_is_scanned(model, tmp_path):
    engine = make_engine(model, tmp_path / "cache")
    tier = disk_tier(engine)
    try:
        tier.submit_store(job(1, [KEY], [0]))
        (result,) = finished(tier)
        assert result.success
        context = ReqContext(req_id="r")
        assert tier.lookup(KEY, context) is LookupResult.RETRY
        tier.on_schedule_end(END)
        assert tier.wait_idle(10)
        assert tier.lookup(KEY, context) is LookupResult.HIT
    finally:
        engine.manager.shutdown()


def test_stored_and_evicted_chunks_are_announced_as_local_storage(model, tmp_path):
    engine = make_engine(model, tmp_path / "unused")
    spec = copy.copy(disk_tier(engine)._offloading_spec)
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=False
    )
    view = engine.manager.primary_tier.get_kv_memoryview()
    config = entry(tmp_path / "cache", capacity_bytes=2 * (CHUNK + 4096), enable_kv_events=True)
    del config["type"], config["module_path"]
    tier = DiskSecondaryTier(
        offloading_spec=spec, primary_kv_view=view, tier_type="DiskSecondaryTier", **config
    )
    try:
        keys = [bytes([k]) * 32 + b"\x00\x00\x00\x00" for k in (1, 2, 3)]
        for number, key in enumerate(keys):
            tier.submit_store(job(number, [key], [number]))
            (result,) = finished(tier)
            assert result.success
        events = list(tier.take_events())
        stored = [event.keys for event in events if not event.removed]
        assert stored == [[keys[0]], [keys[1]], [keys[2]]]
        (evicted,) = [event for event in events if event.removed]
        assert evicted.keys == [keys[0]]  # two values fit: the oldest made room
        assert evicted.medium is Medium.STORAGE
        assert evicted.locality is Locality.LOCAL
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()
        engine.manager.shutdown()


def test_metrics_and_config_info_are_what_vllms_spec_declares(model, tmp_path):
    folder = tmp_path / "cache"
    extra = {"cpu_bytes_to_use": CPU_CHUNKS * CHUNK, "secondary_tiers": [entry(folder)]}
    definitions = TieringOffloadingSpec.build_metric_definitions(extra)
    engine = make_engine(model, folder)
    tier = disk_tier(engine)
    try:
        tier.submit_store(job(1, [KEY], [0]))
        finished(tier)
        data = stats_data(tier)
        assert data[METRIC_UP] == {(): 1}
        for name, values in data.items():
            assert name in definitions
            assert all(len(labels) == len(definitions[name].labelnames) for labels in values)
        keys = TieringOffloadingSpec.config_info_keys(extra)
        info = tier.config_info()
        assert set(info) <= set(keys)
        assert info["disk_path"] == str(folder)
        assert info["disk_capacity_bytes"] == 256 * (CHUNK + 4096)
    finally:
        engine.manager.shutdown()


def test_a_folder_another_server_holds_is_a_tier_of_misses(model, tmp_path):
    folder = tmp_path / "cache"
    first = make_engine(model, folder)
    try:
        second = make_engine(model, folder)  # the same folder: in use by this process
        tier = disk_tier(second)
        try:
            assert tier.unusable is not None
            assert "in use by" in tier.unusable
            assert tier.lookup(KEY, ReqContext(req_id="r")) is LookupResult.MISS
            tier.submit_store(job(1, [KEY], [0]))
            (result,) = tier.get_finished_jobs()
            assert not result.success
            assert stats_data(tier)[METRIC_WRITES_DROPPED] == {("down",): 1}
        finally:
            second.manager.shutdown()
        with pytest.raises(ConfigError, match="in use by"):
            make_engine(model, folder, open_on_start=True)
    finally:
        first.manager.shutdown()


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"capcity_bytes": 1}, "did you mean 'capacity_bytes'"),
        ({"capacity_bytes": "1GB"}, "'capacity_bytes' must be an integer"),
        ({"capacity_bytes": 2.5}, "'capacity_bytes' must be an integer"),
        ({"capacity_bytes": 10}, "holds no value"),
        ({"path": ""}, "'path' must be the path of the tier's folder"),
        ({"fsync": "always"}, "'fsync' must be 'none' or 'data' or 'full'"),
        ({"policy": "lfu2"}, "'policy' must be one of"),
        ({"timeout_s": 0}, "'timeout_s' must be a number of seconds above 0"),
        ({"hint_share": 1.5}, "'hint_share' must be a fraction from 0 to 1"),
        ({"hint_share": True}, "'hint_share' must be a fraction from 0 to 1"),
        ({"open_on_start": "no"}, "'open_on_start' must be"),
        ({"auth_key": "secret-key-in-the-entry"}, "unknown key"),
    ],
)
def test_a_bad_entry_value_is_one_error_naming_the_key(model, tmp_path, options, named):
    config = entry(tmp_path / "cache", **options)
    if "capcity_bytes" in options:
        del config["capacity_bytes"]
    checked = named != "holds no value"  # the tier's own check, once built
    if checked:
        with pytest.raises(ConfigError) as caught:
            DiskSecondaryTier.check_entry("DiskSecondaryTier", config)
        assert named in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        make_engine(model, tmp_path / "cache", **options)
    assert named in str(caught.value)
    assert "DiskSecondaryTier" in str(caught.value)
    assert "secret-key-in-the-entry" not in str(caught.value)


def test_hint_share_is_the_share_of_the_disk_retained_values_may_hold(tmp_path):
    def options(**keys: Any) -> dict[str, Any]:
        config = entry(tmp_path / "cache", **keys)
        del config["type"], config["module_path"]  # vLLM's keys
        return disk_options("DiskSecondaryTier", config)[1]

    assert options(hint_share=0.5)["hint_share"] == 0.5  # DiskTier's keyword
    assert "hint_share" not in options()  # DiskTier's default


def test_values_of_another_namespace_in_the_folder_are_misses_and_its_own_are_hits(model, tmp_path):
    """The same model and layout over one folder: only the operator ``namespace`` differs,
    so the values are byte-for-byte loadable, and only the namespace keeps them apart."""

    def hits(namespace: str) -> int:
        engine = make_engine(model, tmp_path / "cache", namespace=namespace)
        tier = disk_tier(engine)
        try:
            engine.add(PROMPT)
            engine.run()
            assert tier.wait_idle(30)
            engine.run()
            return engine.hit_tokens
        finally:
            engine.manager.shutdown()

    assert hits("model-a") == 0  # stores every chunk
    assert hits("model-b") == 0  # another namespace: none of model-a's is a hit
    assert hits("model-a") == len(PROMPT)  # a restart of model-a's server: every chunk
    folders = [p for p in (tmp_path / "cache").rglob("*") if p.is_dir()]
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in [tmp_path / "cache", *folders])


def test_a_store_waiting_for_a_scan_that_shutdown_cancels_is_failed_not_written(
    model, tmp_path, monkeypatch
):
    """The scan of a large folder is cut short by `shutdown`: what waited for it is never
    written into a folder the tier has not scanned (whose capacity it does not know)."""
    scanned = DiskSecondaryTier._start_tier

    async def long_scan(self: DiskSecondaryTier) -> None:
        await anyio.sleep(30)
        await scanned(self)

    monkeypatch.setattr(DiskSecondaryTier, "_start_tier", long_scan)
    engine = make_engine(model, tmp_path / "cache")
    tier = disk_tier(engine)
    tier.submit_store(job(1, [KEY], [0]))
    engine.manager.shutdown()
    (result,) = tier.get_finished_jobs()
    assert not result.success
    assert tier.statistics().disk.write_calls == 0
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != ".lock"]


def test_at_tp_2_the_up_gauge_is_1_only_while_every_ranks_tier_is_up(model, tmp_path, monkeypatch):
    """Each rank's adapter sends its ``up`` gauge when it changes; the tier's gauge is the
    least of the ranks' last values, not whichever rank spoke last."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from . import test_tp

    engine = test_tp.make_engine(model, 2, [disk_entry(tmp_path / "cache", test_tp.disk_room(2))])
    try:
        test_tp.run(engine, test_tp.PROMPT_A)
        tier = engine.manager.link.tiers[0]
        tier.get_stats()  # vLLM took each rank's "up" at its first steps: both 1
        said: dict[int, OffloadingConnectorStats | None] = {}
        for rank, adapter in enumerate(tier.ranks):
            monkeypatch.setattr(adapter, "get_stats", lambda rank=rank: said.pop(rank, None))

        def up(rank0: int | None, rank1: int | None) -> float | None:
            for rank, value in enumerate((rank0, rank1)):
                if value is not None:
                    said[rank] = OffloadingConnectorStats()
                    said[rank].set_gauge(METRIC_UP, value)
            stats = tier.get_stats()
            return None if stats is None else stats.reduce()[METRIC_UP]

        assert up(None, 0) == 0  # rank 1's tier went down
        assert up(1, None) == 0  # rank 0 says "up" again: rank 1's still is not
        assert up(None, None) is None  # nothing moved: nothing sent
        assert up(None, 1) == 1  # every rank up
    finally:
        test_tp.close(engine)
