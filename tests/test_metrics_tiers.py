"""tiering.metrics: one set of series per tier below the CPU tier (disk, remote), by its label."""

from __future__ import annotations

import subprocess
import threading
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from tiering.engine import TieringEngine
from tiering.metrics import FAMILIES, render_metrics
from tiering.secondary import (
    Locality,
    MemoryTier,
    RemoteNamespace,
    SecondaryStatistics,
    SecondaryTierStatistics,
)
from tiering.specs import GPULoadStoreSpec

from .conftest import require_binary
from .test_engine import CHUNK_BYTES, config, keys, kv_caches
from .test_metrics import FakeEngine, Series, families_of, parse, value

#: Where a tier that manages its own capacity says what it holds (a disk tier does).
DISK_CAPACITY = 1 << 30


def tier_statistics(label: str, n: int = 1, *, holds: bool = False, **fields: Any) -> Any:
    """A tier below the CPU tier as the engine reports it, its counts ``n`` times a base.

    ``holds``: it says what it holds (capacity, used bytes, chunks, evictions),
    as a disk tier does; Redis does not.
    """
    counts: dict[str, Any] = {
        "name": "disk" if holds else "redis", "state": "up", "contains_calls": 3 * n,
        "hits_total": 6 * n, "misses_total": 4 * n, "read_calls": 2 * n, "reads_total": 5 * n,
        "read_misses_total": n, "rejected_total": n, "read_bytes_total": 500 * n,
        "write_calls": 2 * n, "writes_total": 8 * n, "write_bytes_total": 800 * n,
        "write_errors_total": 2 * n, "errors_total": 2 * n, "timeouts_total": n,
        "unavailable_total": 7 * n, "busy_total": 3 * n, "reconnects_total": 0,
        "round_trips_total": 9 * n, "last_error": None, "last_rejection": None,
        "refused_total": 4 * n, "lost_total": 2 * n,
    }  # fmt: skip
    if holds:
        counts.update(
            capacity_bytes=DISK_CAPACITY,
            used_bytes=DISK_CAPACITY // 4,
            chunks=100 + n,
            evictions_total=10 * n,
        )
    counts.update(fields)
    return SecondaryTierStatistics(
        tier=SecondaryStatistics(**counts),
        label=label,
        cascade_queued=10 * n,
        cascade_written=8 * n,
        cascade_dropped=n,
        cascade_failed=2 * n,
        cascade_pinned=0,
        cascade_max_pinned=4,
        promoted=5 * n,
        promote_failed=n,
    )


class ChainEngine(FakeEngine):
    """A duck-typed engine with a disk tier, then a remote one, below its CPU tier.

    Every `statistics` call counts one more round of work, so each scrape finds
    the counters grown (rates are not zero).
    """

    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id, None)
        self._calls = 0
        self._lock = threading.Lock()

    def statistics(self) -> SimpleNamespace:
        with self._lock:
            self._calls += 1
            n = self._calls
        stats = super().statistics()
        tiers = (tier_statistics("disk", n, holds=True), tier_statistics("remote", n))
        return SimpleNamespace(**vars(stats), secondary=tiers[0], tiers=tiers)


def below(series: Series, name: str, tier: str, **labels: str) -> float:
    return value(series, name, tier=tier, **labels)


def samples_of(series: Series, tier: str) -> set[str]:
    return {n for (n, ls) in series if ("tier", tier) in ls}


# -- a duck-typed chain ----------------------------------------------------------


def test_every_tier_below_the_cpu_tier_has_its_own_series() -> None:
    text = render_metrics(ChainEngine("chain"))  # the first snapshot: n = 1
    series, types = parse(text)
    assert families_of(text) == set(FAMILIES)
    for tier in ("disk", "remote"):
        assert below(series, "tiering_transfer_bytes_total", tier, direction="store") == 800
        assert below(series, "tiering_transfer_bytes_total", tier, direction="load") == 500
        assert below(series, "tiering_lookups_total", tier, result="hit") == 6
        assert below(series, "tiering_lookups_total", tier, result="miss") == 4
        jobs = {
            (d, o): below(series, "tiering_jobs_total", tier, direction=d, outcome=o)
            for d, o in (("store", "ok"), ("store", "failed"), ("store", "rejected"),
                         ("load", "ok"), ("load", "failed"))
        }  # fmt: skip
        assert jobs == {
            ("store", "ok"): 8, ("store", "failed"): 2, ("store", "rejected"): 1,
            ("load", "ok"): 5, ("load", "failed"): 1,
        }  # fmt: skip
        assert below(series, "tiering_tier_up", tier) == 1
        errors = {
            kind: below(series, "tiering_tier_errors_total", tier, kind=kind)
            for kind in ("failed", "unavailable", "busy", "refused", "rejected", "lost")
        }
        # Each counted once: failed calls (timeouts among them), not the timeouts again.
        assert errors == {
            "failed": 2, "unavailable": 7, "busy": 3, "refused": 4, "rejected": 1, "lost": 2,
        }  # fmt: skip
        # Transfers of the tiers below have no queue or latency of the CPU tier's kind.
        assert not samples_of(series, tier) & {
            "tiering_jobs_queued",
            "tiering_jobs_in_flight",
            "tiering_transfer_seconds_count",
            "tiering_info",
            "tiering_allocation_failures_total",
        }
    # The disk tier says what it holds; Redis does not: no sample, not a zero.
    assert below(series, "tiering_chunks_used", "disk") == 101
    assert below(series, "tiering_tier_bytes", "disk") == DISK_CAPACITY
    assert below(series, "tiering_occupancy_ratio", "disk") == 0.25
    assert below(series, "tiering_evictions_total", "disk") == 10
    held = {
        "tiering_chunks_used",
        "tiering_tier_bytes",
        "tiering_occupancy_ratio",
        "tiering_evictions_total",
    }
    assert not samples_of(series, "remote") & held
    assert types["tiering_tier_up"] == "gauge"
    assert types["tiering_tier_errors"] == "counter"
    # The CPU tier's series are as they were.
    cpu = {"engine": "chain", "tier": "cpu"}
    assert value(series, "tiering_chunks_capacity", **cpu) == 10
    assert value(series, "tiering_occupancy_ratio", **cpu) == 0.5
    assert value(series, "tiering_evictions_total", **cpu) == 4
    assert value(series, "tiering_lookups_total", result="hit", **cpu) == 7
    assert not samples_of(series, "cpu") & {"tiering_tier_up", "tiering_tier_errors_total"}


def test_counters_of_the_tiers_below_grow_from_scrape_to_scrape() -> None:
    engine = ChainEngine("grow")
    first, _ = parse(render_metrics(engine))
    second, _ = parse(render_metrics(engine))
    for tier in ("disk", "remote"):
        for name, labels in (
            ("tiering_lookups_total", {"result": "hit"}),
            ("tiering_jobs_total", {"direction": "load", "outcome": "ok"}),
            ("tiering_tier_errors_total", {"kind": "rejected"}),
        ):
            assert below(second, name, tier, **labels) > below(first, name, tier, **labels)


def test_a_source_with_only_secondary_is_read_as_one_tier() -> None:
    class OneTier(FakeEngine):
        def __init__(self, engine_id: str, entry: Any, **more: Any) -> None:
            super().__init__(engine_id, None)
            self.entry, self.more = entry, more

        def statistics(self) -> SimpleNamespace:
            return SimpleNamespace(**vars(super().statistics()), secondary=self.entry, **self.more)

    # No ``tiers`` at all (an older source), or an empty one beside a ``secondary``.
    for engine in (
        OneTier("old", tier_statistics("disk")),
        OneTier("empty", tier_statistics("disk"), tiers=()),
    ):
        series, _ = parse(render_metrics(engine))
        assert below(series, "tiering_lookups_total", "disk", result="hit") == 6
        assert not samples_of(series, "remote")
    # An entry without a label: the one tier of old, ``remote``.
    unlabelled = SimpleNamespace(**{
        f: getattr(tier_statistics("x"), f)
        for f in SecondaryTierStatistics.__struct_fields__ if f != "label"
    })  # fmt: skip
    series, _ = parse(render_metrics(OneTier("unlabelled", unlabelled)))
    assert below(series, "tiering_jobs_total", "remote", direction="store", outcome="ok") == 8
    # None below: nothing but the CPU tier.
    series, _ = parse(render_metrics(OneTier("none", None)))
    assert {dict(ls).get("tier") for (_, ls) in series} == {"cpu"}


def test_a_tier_that_is_down_or_closed_is_not_up() -> None:
    class Down(FakeEngine):
        def statistics(self) -> SimpleNamespace:
            tiers = (
                tier_statistics("disk", state="closed"),
                tier_statistics("remote", state="down"),
            )
            return SimpleNamespace(**vars(super().statistics()), tiers=tiers)

    series, _ = parse(render_metrics(Down("down", None)))
    assert below(series, "tiering_tier_up", "disk") == 0
    assert below(series, "tiering_tier_up", "remote") == 0


def test_a_tier_of_unknown_or_zero_capacity_has_no_occupancy() -> None:
    class Odd(FakeEngine):
        def statistics(self) -> SimpleNamespace:
            tiers = (
                tier_statistics("disk", holds=True, capacity_bytes=0, used_bytes=0),
                tier_statistics("remote", chunks=3, evictions_total=2),  # capacity unknown
            )
            return SimpleNamespace(**vars(super().statistics()), tiers=tiers)

    series, _ = parse(render_metrics(Odd("odd", None)))
    assert below(series, "tiering_tier_bytes", "disk") == 0
    assert "tiering_occupancy_ratio" not in samples_of(series, "disk")
    assert below(series, "tiering_chunks_used", "remote") == 3
    assert below(series, "tiering_evictions_total", "remote") == 2
    assert not samples_of(series, "remote") & {"tiering_tier_bytes", "tiering_occupancy_ratio"}


def test_promtool_finds_no_problem_in_a_chains_exposition() -> None:
    promtool = require_binary("promtool", "prometheus")
    text = render_metrics(ChainEngine("lint"))
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, b"")


# -- a real engine over MemoryTiers ------------------------------------------------


class DiskLikeTier(MemoryTier):
    """A `MemoryTier` reporting as a disk tier does: what it holds, its evictions."""

    def statistics(self) -> SecondaryStatistics:
        store = self.store
        capacity = (store.capacity or 0) * self.row_bytes
        return msgspec.structs.replace(
            super().statistics(),
            capacity_bytes=capacity,
            used_bytes=len(store) * self.row_bytes,
            chunks=len(store),
            evictions_total=store.evictions,
        )


#: Label chains of tiers below the CPU tier: one tier (passed alone), and two (a list).
CHAINS = [
    pytest.param(("remote",), id="one-tier"),
    pytest.param(("disk", "remote"), id="disk-then-remote"),
]


def chain_engine(
    labels: tuple[str, ...], *, engine_id: str, chunks: int = 4
) -> tuple[TieringEngine, list[MemoryTier]]:
    """An engine whose tiers below are MemoryTiers with ``labels``; a one-tier chain is
    passed as the tier itself, a longer one as a list."""
    cfg, kv = config(), kv_caches()
    namespace: RemoteNamespace = TieringEngine(cfg, kv, cpu_bytes=CHUNK_BYTES).namespace
    tiers = [
        DiskLikeTier(namespace, capacity=4, label=label)  # a round's last four chunks
        if label == "disk"
        else MemoryTier(namespace, locality=Locality.REMOTE, label=label)
        for label in labels
    ]
    assert [t.label for t in tiers] == list(labels)
    secondary: Any = tiers if len(tiers) > 1 else tiers[0]
    engine = TieringEngine(
        cfg, kv, cpu_bytes=chunks * CHUNK_BYTES, secondary=secondary, engine_id=engine_id
    )
    return engine, tiers


async def work(engine: TieringEngine, tiers: list[MemoryTier], round_: int) -> None:
    """One round of traffic: stores that evict what the CPU tier held (written through
    below), a promotion of chunks it lost, and a damaged value that is rejected."""
    base = 100 * round_
    ids = list(range(base, base + 6))  # more than the CPU tier holds
    for i, chunk in enumerate(ids):
        result = await (await engine.submit_store(keys(chunk), GPULoadStoreSpec([i])))
        assert result.success
    await engine.wait_written_through()
    # Evicted from the CPU tier, and from a small disk tier: read from the last tier.
    await engine.promote(keys(ids[0], ids[1]))
    # Evicted from the CPU tier by that promotion, still on disk: read from the first.
    await engine.promote(keys(ids[2], ids[3]))
    damaged = keys(base + 99)
    for tier in tiers:
        tier.store[tier.codec.remote_key(damaged[0])] = b"not a value"
    await engine.promote(damaged)


@pytest.mark.anyio
@pytest.mark.parametrize("labels", CHAINS)
async def test_a_real_engine_exports_each_tier_below_as_its_statistics_say(
    anyio_backend: str, labels: tuple[str, ...]
) -> None:
    engine, tiers = chain_engine(labels, engine_id=f"real-{'-'.join(labels)}")
    async with engine:
        with anyio.fail_after(20):
            await work(engine, tiers, 1)
        text = render_metrics(engine)
        stats = engine.statistics()
    series, _ = parse(text)
    assert tuple(t.label for t in stats.tiers) == labels
    assert stats.secondary == stats.tiers[0]
    for entry in stats.tiers:
        t, tier = entry.tier, entry.label
        assert below(series, "tiering_transfer_bytes_total", tier, direction="store") == (
            t.write_bytes_total
        )
        assert below(series, "tiering_transfer_bytes_total", tier, direction="load") == (
            t.read_bytes_total
        )
        assert below(series, "tiering_lookups_total", tier, result="hit") == t.hits_total
        assert below(series, "tiering_lookups_total", tier, result="miss") == t.misses_total
        for direction, outcome, count in (
            ("store", "ok", entry.cascade_written),
            ("store", "failed", entry.cascade_failed),
            ("store", "rejected", entry.cascade_dropped),
            ("load", "ok", entry.promoted),
            ("load", "failed", entry.promote_failed),
        ):
            got = below(series, "tiering_jobs_total", tier, direction=direction, outcome=outcome)
            assert got == count, (tier, direction, outcome)
        assert below(series, "tiering_tier_errors_total", tier, kind="rejected") == (
            t.rejected_total
        )
        assert below(series, "tiering_tier_up", tier) == 1
    first = stats.tiers[0]
    assert first.cascade_written > 0
    assert all(e.promoted > 0 for e in stats.tiers)  # each tier served hits of its own
    assert sum(e.tier.rejected_total for e in stats.tiers) > 0  # the damaged value
    if "disk" in labels:
        disk = next(e for e in stats.tiers if e.label == "disk").tier
        assert below(series, "tiering_chunks_used", "disk") == disk.chunks
        assert below(series, "tiering_occupancy_ratio", "disk") == (
            (disk.used_bytes or 0) / (disk.capacity_bytes or 1)
        )
    # A MemoryTier says nothing of what it holds: no occupancy for it.
    assert "tiering_occupancy_ratio" not in samples_of(series, "remote")
