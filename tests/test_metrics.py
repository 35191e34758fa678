"""tiering.metrics: the collector over statistics(), its registries and its exposition."""

from __future__ import annotations

import contextlib
import gc
import math
import socket
import subprocess
import urllib.error
import urllib.request
import weakref
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tiering import (
    ConfigError,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    make_offload_key,
)
from tiering._types import TransferDirection
from tiering.cli import main
from tiering.config import DEFAULT_POLICY
from tiering.cpu.common import CPUOffloadingInfo
from tiering.cpu.manager import ManagerStatistics
from tiering.engine import TieringEngine
from tiering.metrics import (
    FAMILIES,
    MetricsCollector,
    MetricsServer,
    metrics_app,
    metrics_registry,
    render_metrics,
    serve_metrics,
)
from tiering.replay import ReplayOptions, replay
from tiering.scheduler import (
    LATENCY_BUCKETS,
    DirectionStatistics,
    JobOutcome,
    SchedulerLimits,
    SchedulerStatistics,
)
from tiering.specs import GPULoadStoreSpec
from tiering.transfer.mock import MockBackend, MockJob
from tiering.workload import chat_workload

from .conftest import require_binary

PAGE_WORDS = 512  # 4 KiB pages
CHUNK_BYTES = 2 * PAGE_WORDS * 8


def config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("k", "v")),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        engine_id="test",
        model=OffloadingModelConfig(name="m", dtype="int64"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
    )


def make_engine(chunks: int = 4, **kwargs: Any) -> TieringEngine:
    kv = {name: torch.zeros((64, PAGE_WORDS), dtype=torch.int64) for name in ("k", "v")}
    return TieringEngine(config(), kv, cpu_bytes=chunks * CHUNK_BYTES, **kwargs)


def keys(*ids: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(8, "big")) for i in ids]


def spec(*blocks: int) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(list(blocks))


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: bytes) -> tuple[Series, dict[str, str]]:
    """The samples of an exposition, and the type of each family."""
    series: Series = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text.decode()):
        types[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in series, f"duplicate series {key}"
            series[key] = sample.value
    return series, types


def value(series: Series, name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def families_of(text: bytes) -> set[str]:
    """Exposition names of the families (as HELP lines name them), samples or not."""
    return {line.split()[2] for line in text.decode().splitlines() if line.startswith("# HELP")}


# -- the collector over a real engine -----------------------------------------


@pytest.mark.anyio
async def test_exposition_after_jobs_has_every_family_label_and_value(
    anyio_backend: str,
) -> None:
    failing: set[TransferDirection] = set()

    def fail(job: MockJob) -> bool:
        return job.direction in failing

    engine = make_engine(
        4,
        backend="mock",
        backend_options={"fail": fail},
        limits=SchedulerLimits(max_inflight_bytes=CHUNK_BYTES),
        engine_id="rank-0",
    )
    async with engine:
        backend = engine.backend
        assert isinstance(backend, MockBackend)
        with anyio.fail_after(10):
            assert (await (await engine.submit_store(keys(1, 2, 3), spec(0, 1, 2)))).success
            failing.add(TransferDirection.STORE)
            failed = await (await engine.submit_store(keys(4), spec(3)))
            assert failed.outcome is JobOutcome.FAILED
            failing.clear()
            backend.close_gate()
            load = engine.submit_load_nowait(keys(1, 2, 3), spec(10, 11, 12))  # pins 1, 2, 3
            full = engine.submit_store_nowait(keys(5, 6), spec(5, 6))
            assert full.result().outcome is JobOutcome.NO_ROOM
            store = engine.submit_store_nowait(keys(7), spec(7))  # the last free slot
            queued = engine.submit_load_nowait(keys(1), spec(20))  # behind the first load
            assert engine.lookup(keys(7)).pending == 1

            now, _ = parse(render_metrics(engine))
            assert value(now, "tiering_chunks_used") == 4
            assert value(now, "tiering_chunks_pinned") == 3
            assert value(now, "tiering_chunks_writing") == 1
            assert value(now, "tiering_chunks_evictable") == 0
            assert value(now, "tiering_jobs_queued", direction="load") == 1
            assert value(now, "tiering_jobs_in_flight", direction="load") == 1
            assert value(now, "tiering_jobs_in_flight", direction="store") == 1

            assert queued.cancel()
            backend.open_gate()
            assert (await load).success
            assert (await store).success
            assert engine.lookup(keys(1, 2, 99)).ready == 2
            assert (await (await engine.submit_store(keys(10, 11), spec(4, 5)))).success

        text = render_metrics(engine)
        stats = engine.statistics()
    series, types = parse(text)

    assert families_of(text) == set(FAMILIES)
    for (_, labels), _v in series.items():
        assert ("engine", "rank-0") in labels
    # Occupancy.
    cpu = {"engine": "rank-0", "tier": "cpu"}
    assert value(series, "tiering_chunks_capacity", **cpu) == 4
    assert value(series, "tiering_chunks_used", **cpu) == 4
    assert value(series, "tiering_chunks_writing", **cpu) == 0
    assert value(series, "tiering_chunks_pinned", **cpu) == 0
    assert value(series, "tiering_chunks_evictable", **cpu) == 4
    assert value(series, "tiering_occupancy_ratio", **cpu) == 1.0
    assert value(series, "tiering_tier_bytes", **cpu) == 4 * CHUNK_BYTES
    # Transfers, by direction and outcome.
    assert value(series, "tiering_transfer_bytes_total", direction="store") == 6 * CHUNK_BYTES
    assert value(series, "tiering_transfer_bytes_total", direction="load") == 3 * CHUNK_BYTES
    jobs = {
        (d, o): value(series, "tiering_jobs_total", direction=d, outcome=o)
        for d in ("store", "load")
        for o in ("ok", "failed", "cancelled", "rejected")
    }
    assert jobs == {
        ("store", "ok"): 3, ("store", "failed"): 1, ("store", "cancelled"): 0,
        ("store", "rejected"): 1, ("load", "ok"): 1, ("load", "failed"): 0,
        ("load", "cancelled"): 1, ("load", "rejected"): 0,
    }  # fmt: skip
    # The histogram: started jobs that ended (the rejected and cancelled never started).
    for direction, count in (("store", 4), ("load", 1)):
        d = {"direction": direction}
        assert value(series, "tiering_transfer_seconds_count", **d) == count
        assert value(series, "tiering_transfer_seconds_bucket", le="+Inf", **d) == count
        latency = getattr(stats.scheduler, "stores" if direction == "store" else "loads")
        assert value(series, "tiering_transfer_seconds_sum", **d) == latency.latency_seconds
        cumulative = [
            value(series, "tiering_transfer_seconds_bucket", le=repr(b), **d)
            for b in LATENCY_BUCKETS
        ]
        assert cumulative == sorted(cumulative)
    assert value(series, "tiering_jobs_queued", direction="store") == 0
    assert value(series, "tiering_jobs_in_flight", direction="load") == 0
    # Cache.
    assert value(series, "tiering_lookups_total", result="hit") == 2
    assert value(series, "tiering_lookups_total", result="miss") == 1
    assert value(series, "tiering_lookups_total", result="pending") == 1
    assert value(series, "tiering_evictions_total", **cpu) == 2
    assert value(series, "tiering_allocation_failures_total", **cpu) == 1
    # Static facts.
    info = next(dict(ls) for (n, ls) in series if n == "tiering_info")
    assert info == {
        "engine": "rank-0",
        "tier": "cpu",
        "cpu_num_chunks": "4",
        "cpu_blocks_per_chunk": "1",
        "cpu_kv_cache_size_bytes": str(4 * CHUNK_BYTES),
        # no cpu_kv_cache_size_tokens: the model's length is not known (never an empty value)
        "policy": DEFAULT_POLICY,
        "backend": "mock",
        "version": info["version"],
    }
    assert info["version"]
    assert types["tiering_transfer_seconds"] == "histogram"
    assert types["tiering_jobs"] == "counter"
    assert types["tiering_chunks_used"] == "gauge"
    # Events are off: the families are there, without samples.
    assert not [n for (n, _) in series if n.startswith("tiering_events_")]


# -- a fake engine: histogram buckets and event statistics ---------------------


class SinkStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    published_total: int
    dropped_total: int


class EventStatistics(msgspec.Struct, frozen=True, kw_only=True):
    events_total: int
    batches_total: int
    sinks: tuple[SinkStatistics, ...]


def direction(buckets: tuple[int, ...], **counts: Any) -> DirectionStatistics:
    fields: dict[str, Any] = {
        "queued": 0, "in_flight": 0, "inflight_bytes": 0, "succeeded": 0, "failed": 0,
        "cancelled": 0, "no_room": 0, "bytes": 0, "seconds": 0.0,
    }  # fmt: skip
    fields.update(counts)
    return DirectionStatistics(
        latency_buckets=buckets, latency_seconds=float(sum(buckets)), **fields
    )


class FakeEngine:
    """Shaped like a TieringEngine, with statistics that carry events (or None)."""

    def __init__(self, engine_id: str, events: EventStatistics | None) -> None:
        self.engine_id = engine_id
        self.info = CPUOffloadingInfo(
            cpu_num_chunks=10,
            cpu_blocks_per_chunk=2,
            cpu_kv_cache_size_bytes=10 << 20,
            cpu_kv_cache_size_tokens=4096,
        )
        self.backend_name = "cuda"
        self.manager = SimpleNamespace(policy=SimpleNamespace(name="arc"))
        self.events = events
        self.stores = (1, 0, 2) + (0,) * (len(LATENCY_BUCKETS) - 3) + (3,)

    def statistics(self) -> SimpleNamespace:
        manager = ManagerStatistics(
            capacity=10, used=5, free=5, writing=1, ready=4, pinned=2, evictable=2,
            lookups_hit_total=7, lookups_miss_total=3, lookups_pending_total=1,
            stored_total=9, store_failed_total=0, loaded_total=7, evictions_total=4,
            allocation_failures_total=2, events_pending=0, events_dropped_total=0,
        )  # fmt: skip
        scheduler = SchedulerStatistics(
            state="open",
            stores=direction(self.stores, succeeded=5, failed=1, bytes=123),
            loads=direction((0,) * (len(LATENCY_BUCKETS) + 1)),
        )
        return SimpleNamespace(manager=manager, scheduler=scheduler, events=self.events)


EVENTS = EventStatistics(
    events_total=12,
    batches_total=4,
    sinks=(
        SinkStatistics(name="zmq", published_total=12, dropped_total=0),
        SinkStatistics(name="subscriber", published_total=9, dropped_total=3),
    ),
)


def test_the_histogram_is_cumulative_from_per_bucket_counts() -> None:
    series, _ = parse(render_metrics(FakeEngine("h", None)))
    store = {"engine": "h", "direction": "store"}
    buckets = {
        le: value(series, "tiering_transfer_seconds_bucket", le=le, **store)
        for le in [*map(repr, LATENCY_BUCKETS), "+Inf"]
    }
    assert buckets[repr(LATENCY_BUCKETS[0])] == 1
    assert buckets[repr(LATENCY_BUCKETS[1])] == 1
    assert buckets[repr(LATENCY_BUCKETS[2])] == 3
    assert buckets[repr(LATENCY_BUCKETS[-1])] == 3
    assert buckets["+Inf"] == 6  # the last bucket counts everything above the bounds
    assert value(series, "tiering_transfer_seconds_count", **store) == 6
    assert value(series, "tiering_transfer_seconds_sum", **store) == 6.0
    assert value(series, "tiering_jobs_total", outcome="ok", **store) == 5
    assert value(series, "tiering_jobs_total", outcome="failed", **store) == 1
    assert value(series, "tiering_occupancy_ratio", engine="h") == 0.5


def test_event_families_have_one_series_per_sink_when_events_are_on() -> None:
    series, _ = parse(render_metrics(FakeEngine("ev", EVENTS)))
    for sink, published, dropped in (("zmq", 12, 0), ("subscriber", 9, 3)):
        labels = {"engine": "ev", "sink": sink}
        assert value(series, "tiering_events_published_total", **labels) == published
        assert value(series, "tiering_events_dropped_total", **labels) == dropped
    # What the manager's own bounded queue lost, before any sink saw it.
    assert value(series, "tiering_events_dropped_total", engine="ev", sink="manager") == 0
    off = render_metrics(FakeEngine("off", None))
    assert families_of(off) == set(FAMILIES)  # same names, no samples
    assert b"tiering_events_published_total{" not in off


def test_info_has_the_fields_of_cpu_offloading_info_policy_backend_and_version() -> None:
    series, _ = parse(render_metrics(FakeEngine("i", None)))
    info = next(dict(ls) for (n, ls) in series if n == "tiering_info")
    assert set(info) == {
        "engine", "tier", *CPUOffloadingInfo.__struct_fields__, "policy", "backend", "version",
    }  # fmt: skip
    assert (info["policy"], info["backend"], info["cpu_kv_cache_size_tokens"]) == (
        "arc",
        "cuda",
        "4096",
    )


# -- registries ---------------------------------------------------------------


def test_the_engine_label_is_the_engine_id_and_no_label_value_is_empty() -> None:
    text = render_metrics(make_engine(4)).decode()  # no engine_id given: the config's
    series, _ = parse(text.encode())
    assert {dict(ls)["engine"] for (_, ls) in series} == {config().engine_id}
    info = next(dict(ls) for (n, ls) in series if n == "tiering_info")
    assert "cpu_kv_cache_size_tokens" not in info  # the model's length is not known
    assert info["cpu_kv_cache_size_bytes"] == str(4 * CHUNK_BYTES)
    assert '=""' not in text
    assert all(value for (_, ls) in series for (_, value) in ls)


def test_two_engines_in_one_process_have_their_own_registries() -> None:
    first, second = make_engine(4), make_engine(8)
    assert metrics_registry(first) is metrics_registry(first)  # no double registration
    assert metrics_registry(first) is not metrics_registry(second)
    one, _ = parse(render_metrics(first))
    two, _ = parse(render_metrics(second))
    assert {dict(ls)["engine"] for (_, ls) in one} == {first.engine_id}
    assert {dict(ls)["engine"] for (_, ls) in two} == {second.engine_id}
    assert value(two, "tiering_chunks_capacity") == 8


@pytest.mark.anyio
async def test_a_new_engine_under_a_closed_ones_id_gets_a_fresh_registry(
    anyio_backend: str,
) -> None:
    async with make_engine(4, engine_id="same") as old:
        before = render_metrics(old)
    async with make_engine(6, engine_id="same") as new:
        assert metrics_registry(new) is not metrics_registry(old)
        series, _ = parse(render_metrics(new))
    assert value(series, "tiering_chunks_capacity", engine="same") == 6
    assert value(parse(before)[0], "tiering_chunks_capacity", engine="same") == 4
    assert render_metrics(old)  # a closed engine still reports its last state


def test_the_registry_does_not_keep_the_engine_alive() -> None:
    engine = make_engine(4)
    registry = metrics_registry(engine)
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    assert list(registry.collect()) == []  # the engine is gone: nothing to report


def test_a_collector_registers_once_per_registry() -> None:
    from prometheus_client import CollectorRegistry

    engine = FakeEngine("shared", None)
    registry = CollectorRegistry()
    registry.register(MetricsCollector(engine))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(MetricsCollector(engine))  # prometheus-client refuses, loudly
    assert "shared" in repr(MetricsCollector(engine))


# -- exposition: HTTP server, ASGI app, promtool --------------------------------


def scrape(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read()


@pytest.mark.anyio
async def test_serve_metrics_on_a_free_loopback_port(anyio_backend: str) -> None:
    async with make_engine(4, engine_id="served") as engine:
        async with serve_metrics(engine, port=0) as server:
            assert isinstance(server, MetricsServer)
            assert (server.host, server.port > 0) == ("127.0.0.1", True)
            assert server.url == f"http://127.0.0.1:{server.port}/metrics"
            content_type, body = await anyio.to_thread.run_sync(scrape, server.url)
            assert content_type.startswith("text/plain")
            assert b'tiering_chunks_capacity{engine="served",tier="cpu"} 4.0' in body
            assert "serving" in repr(server)
        assert server.closed
        server.close()  # idempotent
        with pytest.raises(urllib.error.URLError):
            await anyio.to_thread.run_sync(scrape, server.url)


@pytest.mark.parametrize("port", [-1, 65536, True, "9400", 1.5])
def test_a_port_out_of_range_is_a_config_error(port: Any) -> None:
    with pytest.raises(ConfigError, match="metrics port must be an integer from 0 to 65535"):
        serve_metrics(FakeEngine("p", None), port=port)


def test_a_port_in_use_is_a_config_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: the port is in use"):
            serve_metrics(FakeEngine("p", None), port=port)


@pytest.mark.anyio
async def test_the_asgi_app_serves_the_same_exposition(anyio_backend: str) -> None:
    engine = FakeEngine("asgi", EVENTS)
    app = metrics_app(engine)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": [],
             "query_string": b""}  # fmt: skip
    await app(scope, receive, send)
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == render_metrics(engine)


@pytest.mark.parametrize("events", [None, EVENTS], ids=["events-off", "events-on"])
def test_promtool_finds_no_problem_in_the_exposition(events: EventStatistics | None) -> None:
    promtool = require_binary("promtool", "prometheus")
    text = render_metrics(FakeEngine("lint", events))
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, b"")


@pytest.mark.anyio
async def test_promtool_finds_no_problem_in_a_real_engines_exposition(
    anyio_backend: str,
) -> None:
    promtool = require_binary("promtool", "prometheus")
    async with make_engine(4) as engine:
        await (await engine.submit_store(keys(1), spec(0)))
        text = render_metrics(engine)
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, b"")


# -- replay and the command line ------------------------------------------------


@pytest.mark.anyio
async def test_replay_serves_metrics_until_the_hold_ends(anyio_backend: str) -> None:
    seen: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def on_open(engine: TieringEngine) -> AsyncIterator[None]:
        seen["open"] = engine.statistics().state
        async with serve_metrics(engine, port=0) as server:
            yield
            # After the requests and the hold, before the engine closes.
            seen["state"] = engine.statistics().state
            seen["body"] = (await anyio.to_thread.run_sync(scrape, server.url))[1]

    result = await replay(
        chat_workload(40, seed=3),
        ReplayOptions(capacity_tokens=20 * 512, bytes_per_token=16, hold=0.01),
        on_open=on_open,
    )
    assert seen["open"] == seen["state"] == "open"
    series, _ = parse(seen["body"])
    assert value(series, "tiering_transfer_bytes_total", direction="store") == result.store_bytes
    assert value(series, "tiering_transfer_bytes_total", direction="load") == result.load_bytes
    assert value(series, "tiering_evictions_total") == result.evictions
    assert value(series, "tiering_chunks_capacity") == result.capacity_chunks


@pytest.mark.parametrize("hold", [-1.0, math.nan, math.inf])
def test_a_bad_hold_is_a_config_error(hold: float) -> None:
    with pytest.raises(ConfigError, match="hold must be a number of seconds"):
        ReplayOptions(hold=hold)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--metrics-port", "70000"], "expected a port from 0 to 65535"),
        (["--metrics-port", "x"], "expected a port from 0 to 65535"),
        (["--hold", "-1"], "expected a number of seconds >= 0"),
        (["--hold", "inf"], "expected a number of seconds >= 0"),
    ],
)
def test_bad_metrics_options_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--workload", "chat", "--requests", "5", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err


def test_a_metrics_port_in_use_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["replay", "--workload", "chat", "--requests", "5", "--cpu-bytes", "1000000"]
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--metrics-port", str(port)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"tiering: error: cannot serve metrics on 127.0.0.1:{port}: the port is in use; "
        "choose another port, or 0 for any free one\n"
    )


def test_replay_with_metrics_and_hold_prints_the_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["replay", "--workload", "chat", "--requests", "10", "--cpu-bytes", "1000000"]
    assert main([*args, "--metrics-port", "0", "--hold", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert msgspec.json.decode(out)["requests"] == 10
    assert err.startswith("tiering: serving metrics at http://127.0.0.1:")
