"""dashboards/: the row of each tier below the CPU tier, run against a real Prometheus
scraping an engine with a disk tier and a remote one below its CPU tier: a duck-typed
one, a TieringEngine over MemoryTiers, and a real `tiering replay` over a real disk
tier and a real Redis."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from tiering.metrics import serve_metrics

from .conftest import require_binary
from .secondary import conftest as secondary
from .secondary.conftest import RedisServer
from .test_dashboards import (
    check_every_query_and_rule,
    event_queries_only,
    families_in,
    free_port,
    quiet_queries_only,
    servers,
    wait_until_scraped,
)
from .test_metrics_tiers import CHAINS, ChainEngine, chain_engine, work

#: What only a tier that says what it holds (a disk tier) has samples of.
HELD = {"tiering_chunks_used", "tiering_occupancy_ratio", "tiering_evictions_total"}

# The secondary tests' server of a test alone (a fixture).
own_redis_server = secondary.own_redis_server


def test_every_tier_rows_query_runs_against_a_real_prometheus(tmp_path: Path) -> None:
    """A duck-typed engine: a disk tier that says what it holds, a remote one that does not."""
    require_binary("prometheus", "prometheus")
    engine = ChainEngine("chain")
    with serve_metrics(engine, port=0) as metrics, servers(tmp_path) as running:
        target = f"127.0.0.1:{metrics.port}"
        base = running.start_prometheus(target)
        wait_until_scraped(running, base)
        untested = check_every_query_and_rule(
            running, base, target, engine="chain", tiers=["disk", "remote"]
        )
        assert quiet_queries_only(untested), untested  # every other query had data


@pytest.mark.anyio
@pytest.mark.parametrize("labels", CHAINS)
async def test_a_real_engines_tier_rows_run_against_a_real_prometheus(
    anyio_backend: str, tmp_path: Path, labels: tuple[str, ...]
) -> None:
    """A TieringEngine over MemoryTiers, kept busy while Prometheus scrapes it."""
    require_binary("prometheus", "prometheus")
    name = f"prom-{'-'.join(labels)}"
    engine, tiers = chain_engine(labels, engine_id=name)
    async with engine, serve_metrics(engine, port=0) as metrics:
        target = f"127.0.0.1:{metrics.port}"

        def check() -> None:
            with servers(tmp_path) as running:
                base = running.start_prometheus(target)
                wait_until_scraped(running, base)
                untested = check_every_query_and_rule(
                    running, base, target, engine=name, tiers=list(labels)
                )
                # Without a disk tier, nothing says what it holds: those panels are empty.
                held = HELD if "disk" not in labels else set()
                assert all(quiet_queries_only({e}) or families_in(e) <= held for e in untested)

        async def traffic() -> None:
            for round_ in range(1, 10_000):
                await work(engine, tiers, round_)
                await anyio.sleep(0.1)  # paces the traffic; nothing waits on it

        async with anyio.create_task_group() as tg:
            tg.start_soon(traffic)
            await anyio.to_thread.run_sync(check)
            tg.cancel_scope.cancel()


def test_a_real_replay_over_disk_then_redis_fills_every_tier_row(
    tmp_path: Path, own_redis_server: RedisServer
) -> None:
    """`tiering replay --disk DIR --remote URL --hints continuation`: a real DiskTier, then a
    real Redis, the requests hinted."""
    require_binary("prometheus", "prometheus")
    metrics_port = free_port()
    target = f"127.0.0.1:{metrics_port}"
    replay_args = ["--workload", "chat", "--requests", "1000", "--bytes-per-token", "16",
                   "--capacity-tokens", str(20 * 512), "--disk", str(tmp_path / "disk"),
                   "--disk-bytes", str(1 << 30), "--remote", own_redis_server.url,
                   "--metrics-port", str(metrics_port), "--hold", "300",
                   "--hints", "continuation", "--json"]  # fmt: skip
    with servers(tmp_path) as running:
        running.start("replay", [sys.executable, "-m", "tiering", "replay", *replay_args])
        base = running.start_prometheus(target)
        wait_until_scraped(running, base)
        untested = check_every_query_and_rule(
            running, base, target, engine="replay", tiers=["disk", "remote"]
        )
        # The disk tier says what it holds, and the requests are hinted: only the events'
        # queries (events off) may have no data, the hints' row read beside two tiers.
        assert event_queries_only(untested), untested
