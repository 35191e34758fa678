"""What `tiering replay` reports: its result records, and the counts they are made of.

`Tally` counts the jobs of a replay as they finish; `Tally.result` adds the
engine's statistics after close (the last events and writes counted) and makes
the `ReplayResult`, with a `TierReport` per tier below the CPU tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from tiering.scheduler import JobOutcome, JobResult
from tiering.secondary.refusals import Unwritten

if TYPE_CHECKING:
    from tiering.cpu.manager import ManagerStatistics
    from tiering.engine import EngineStatistics, SecondaryTierStatistics
    from tiering.policies.hints import HintStatistics
    from tiering.replay import ReplayOptions
    from tiering.secondary.disk import ScanResult

__all__ = ["ReplayResult", "Tally", "TierReport", "format_bytes"]


class TierReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one tier below the CPU tier did in a replay (``label``: ``disk``, ``remote``)."""

    label: str
    hit_blocks: int  # hits read from this tier (part of the replay's hit_blocks)
    read_bytes: int
    write_bytes: int
    errors: int  # calls that failed (unreachable, timeout, I/O error): each once
    writes_dropped: int  # chunks whose write-through was not written, for any reason
    writes_dropped_by_reason: dict[str, int]  # adding up: behind, down, refused ENOSPC...
    rejected: int  # values read that failed a check: never loaded, counted as misses
    rejected_by_reason: dict[str, int]
    refused_by_reason: dict[str, int]  # what the store refused, by code: OOM, ENOSPC...
    lost: int = 0  # values the tier had and found gone (deleted behind its back)
    busy: int = 0  # calls answered at once, every worker thread of the tier busy: overload
    chunks: int | None = None  # what it holds at the end, where it knows
    used_bytes: int | None = None
    capacity_bytes: int | None = None
    found_at_open: int | None = None  # the disk tier: values a previous run left
    dropped_at_open: dict[str, int] = msgspec.field(default_factory=dict)
    #: What it holds at most now: capacity_bytes (as configured), or less where its file
    #: system holds less (the disk tier on a small file system).
    effective_capacity_bytes: int | None = None


class ReplayResult(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    blocks: int
    hit_blocks: int
    hit_rate: float
    stored_chunks: int
    loaded_chunks: int
    evictions: int
    store_bytes: int
    load_bytes: int
    store_gbps: float
    load_gbps: float
    failed_jobs: int
    no_room_stores: int
    corrupt_chunks: int
    job_latency_p50_ms: float
    job_latency_p99_ms: float
    seconds: float
    events_published: int  # KV cache events built (0 with events off)
    events_dropped: int  # events some sink or the manager's queue lost
    remote_hit_blocks: int  # hits read from the remote tier (part of hit_blocks)
    remote_read_bytes: int
    remote_write_bytes: int
    remote_errors: int  # remote calls that failed (unreachable, timeout, protocol): each once
    remote_writes_dropped: int  # chunks whose write-through was not written, for any reason
    #: Those by reason, adding up: ``behind`` (the tier's queue was full: it fell
    #: behind), ``down``, ``backing off``, ``timeout``, ``failed``, ``refused OOM``...
    remote_writes_dropped_by_reason: dict[str, int]
    remote_rejected: int  # values read that failed a check: never loaded, counted as misses
    remote_rejected_by_reason: dict[str, int]  # by verdict: bad_checksum, foreign_namespace...
    #: Commands the store refused (reads and lookups too), by its code: OOM, NOPERM, MOVED...
    remote_refused_by_reason: dict[str, int]
    #: Hit blocks by the tier they were loaded from: ``cpu`` (held by the CPU tier),
    #: then one key per tier below it (``disk``, ``remote``); they add up to hit_blocks.
    hit_blocks_by_tier: dict[str, int]
    tiers: list[TierReport]  # every tier below the CPU tier, in order
    capacity_chunks: int
    cpu_bytes: int
    policy: str
    backend: str
    concurrency: int
    #: The requests' retention hints (``none``, ``continuation``), the share given wrong,
    #: the CPU tier's keys they reached and the released ones it evicted first.
    hints: str = "none"
    hint_error: float = 0.0
    hinted_keys: int = 0
    released_evicted: int = 0
    #: Whether the CPU tier followed each kind of hint at the end (it follows a kind
    #: only while it measures it helping: `tiering.policies.hints`); None without hints.
    following_releases: bool | None = None
    following_retentions: bool | None = None


class Tally:
    """What a replay counts as its requests finish, and the `ReplayResult` it makes."""

    def __init__(self) -> None:
        self.done = self.blocks = self.hit_blocks = 0
        self.failed = self.no_room = self.corrupt = 0
        self.hit_blocks_by_tier: dict[str, int] = {}  # of the tiers below the CPU tier
        self.stored_chunks = self.loaded_chunks = 0
        self.store_bytes = self.load_bytes = 0
        self.store_seconds = self.load_seconds = 0.0
        self.latencies: list[float] = []

    def add(self, result: JobResult, *, load: bool) -> None:
        self.latencies.append(result.latency)
        if result.outcome is JobOutcome.NO_ROOM:
            self.no_room += 1
        elif not result.success:
            self.failed += 1
        elif load:
            self.loaded_chunks += result.chunks
            self.load_bytes += result.nbytes
            self.load_seconds += result.seconds
        else:
            self.stored_chunks += result.chunks
            self.store_bytes += result.nbytes
            self.store_seconds += result.seconds

    def result(
        self,
        options: ReplayOptions,
        stats: ManagerStatistics,
        final: EngineStatistics,
        opened: Mapping[str, ScanResult],
        hints: HintStatistics,
        *,
        requests: int,
        seconds: float,
        capacity_chunks: int,
        row_bytes: int,
        backend: str,
    ) -> ReplayResult:
        """The replay's result: these counts, the manager's ``stats`` at the end of the
        requests, the engine's ``final`` ones after close, what the disk tiers found at
        open (``opened``, by label), what the CPU tier's ``hints`` did."""
        events = final.events
        reports = [_tier_report(t, self.hit_blocks_by_tier, opened) for t in final.tiers]
        remote = next((r for r in reports if r.label == "remote"), None)
        events_dropped = stats.events_dropped_total
        if events is not None:
            events_dropped += sum(sink.dropped_total for sink in events.sinks)
        below = sum(r.hit_blocks for r in reports)
        by_tier = {"cpu": self.hit_blocks - below, **{r.label: r.hit_blocks for r in reports}}
        hinted = options.hints != "none"
        return ReplayResult(
            requests=requests,
            blocks=self.blocks,
            hit_blocks=self.hit_blocks,
            hit_rate=self.hit_blocks / self.blocks if self.blocks else 0.0,
            stored_chunks=self.stored_chunks,
            loaded_chunks=self.loaded_chunks,
            evictions=stats.evictions_total,
            store_bytes=self.store_bytes,
            load_bytes=self.load_bytes,
            store_gbps=_gbps(self.store_bytes, self.store_seconds),
            load_gbps=_gbps(self.load_bytes, self.load_seconds),
            failed_jobs=self.failed,
            no_room_stores=self.no_room,
            corrupt_chunks=self.corrupt,
            job_latency_p50_ms=_percentile_ms(self.latencies, 50),
            job_latency_p99_ms=_percentile_ms(self.latencies, 99),
            seconds=seconds,
            events_published=events.events_total if events is not None else 0,
            events_dropped=events_dropped,
            remote_hit_blocks=remote.hit_blocks if remote else 0,
            remote_read_bytes=remote.read_bytes if remote else 0,
            remote_write_bytes=remote.write_bytes if remote else 0,
            remote_errors=remote.errors if remote else 0,
            remote_writes_dropped=remote.writes_dropped if remote else 0,
            remote_writes_dropped_by_reason=remote.writes_dropped_by_reason if remote else {},
            remote_rejected=remote.rejected if remote else 0,
            remote_rejected_by_reason=remote.rejected_by_reason if remote else {},
            remote_refused_by_reason=remote.refused_by_reason if remote else {},
            hit_blocks_by_tier=by_tier,
            tiers=reports,
            capacity_chunks=capacity_chunks,
            cpu_bytes=capacity_chunks * row_bytes,
            policy=options.policy,
            backend=backend,
            concurrency=options.concurrency,
            hints=options.hints,
            hint_error=options.hint_error,
            hinted_keys=hints.hinted_keys_total,
            released_evicted=hints.released_evicted_total,
            following_releases=hints.following_releases if hinted else None,
            following_retentions=hints.following_retentions if hinted else None,
        )


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else 0.0


def _tier_report(
    stats: SecondaryTierStatistics, hit_blocks: dict[str, int], opened: Mapping[str, ScanResult]
) -> TierReport:
    t = stats.tier
    dropped = _writes_dropped(stats)
    scan = opened.get(stats.label)
    return TierReport(
        label=stats.label,
        hit_blocks=hit_blocks.get(stats.label, 0),
        read_bytes=t.read_bytes_total,
        write_bytes=t.write_bytes_total,
        errors=t.errors_total,
        writes_dropped=sum(dropped.values()),
        writes_dropped_by_reason=dropped,
        rejected=t.rejected_total,
        rejected_by_reason=t.rejected_by_reason,
        refused_by_reason=t.refused_by_reason,
        lost=t.lost_total,
        busy=t.busy_total,
        chunks=t.chunks,
        used_bytes=t.used_bytes,
        capacity_bytes=t.capacity_bytes,
        found_at_open=len(scan.values) if scan is not None else None,
        dropped_at_open=dict(scan.dropped) if scan is not None else {},
        effective_capacity_bytes=t.effective_capacity_bytes,
    )


def _writes_dropped(stats: SecondaryTierStatistics) -> dict[str, int]:
    """Write-throughs not written, by reason; they add up to every chunk not written."""
    dropped = {Unwritten.BEHIND.value: stats.cascade_dropped} if stats.cascade_dropped else {}
    dropped.update(stats.tier.write_errors_by_reason)
    # Handed to the tier but not written without the tier saying why: a write
    # cancelled at close, or by an error in the write-through task itself.
    other = stats.cascade_failed - stats.tier.write_errors_total
    if other > 0:
        cancelled = Unwritten.CANCELLED.value
        dropped[cancelled] = dropped.get(cancelled, 0) + other
    return dropped


def format_bytes(nbytes: float) -> str:
    """A byte count in decimal units, as the command line prints them: ``384.00 MB``."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes:,.0f} B"
