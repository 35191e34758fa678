"""What a lower tier under vLLM reports: its metrics to vLLM, its losses to vLLM's log.

`PolledSecondaryTier` (`tiering.integrations.vllm.polled`) hands a `TierReport`
the tier's latest snapshot (`SecondaryStatistics`) and its own counts; the
report keeps what it last said, and says only what changed: counters as deltas
in vLLM's ``OffloadingConnectorStats`` (one payload a step), the ``up`` gauge
when it changes, and one log line of losses at most every ``interval_s``
(`LossReport`: chunks not written and values rejected, by reason, counted
since the last line).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

from tiering.secondary.base import SecondaryStatistics

__all__ = [
    "ADAPTER_COUNTS",
    "LOSS_REPORT_S",
    "LossReport",
    "PolledTierStatistics",
    "TierReport",
    "metric_definitions",
]

#: Least seconds between two log lines of what a tier lost.
LOSS_REPORT_S = 60.0

#: The suffixes of the metrics every adapter reports, after its prefix.
FAILURES, TIMEOUTS, UNAVAILABLE, REFUSALS = "failures", "timeouts", "unavailable", "refusals"
REJECTED, READ_MISSES, WRITES_DROPPED = "rejected_values", "read_misses", "writes_dropped"
LOOKUPS_DEFERRED, UP = "lookups_deferred", "up"


class PolledTierStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """The adapter's own counts (each subclass adds its tier's snapshot).

    ``store_jobs_dropped`` (and ``chunks_dropped``) were failed at submit
    (``max_store_jobs`` reached, the tier unusable or closed);
    ``lookups_deferred`` were answered ``RETRY`` without asking
    (``max_lookups_in_flight`` reached); ``hint_calls`` handed requests' retention
    hints to the tier for values it already held (``hints_dropped``: not handed,
    as ``max_store_jobs`` of them were in flight; the values keep their old hint).
    """

    state: str
    store_jobs: int
    store_jobs_failed: int
    store_jobs_dropped: int
    chunks_dropped: int
    load_jobs: int
    load_jobs_failed: int
    keys_not_loaded: int
    lookups_deferred: int
    hint_calls: int
    hints_dropped: int
    unexpected_errors: int
    last_unexpected_error: str | None
    lookups_in_flight: int
    jobs_in_flight: int


#: The adapter's own counts of `PolledTierStatistics` (the others are its live state).
ADAPTER_COUNTS = (
    *("store_jobs", "store_jobs_failed", "store_jobs_dropped", "chunks_dropped"),
    *("load_jobs", "load_jobs_failed", "keys_not_loaded", "lookups_deferred"),
    *("hint_calls", "hints_dropped"),
)


def metric_definitions(prefix: str, store: str, refusals: str) -> dict[str, Any]:
    """vLLM's metadata of the metrics of a tier (``store``: "Redis tier"), by name;
    ``refusals``: what the store's refusals look like (``OOM, READONLY...``)."""

    def counter(text: str, *labels: str) -> Any:
        return OffloadingCounterMetadata(documentation=text, labelnames=labels)

    return {
        prefix + FAILURES: counter(
            f"Failed calls to the {store} (unreachable, timeout, protocol or I/O error)."
        ),
        prefix + TIMEOUTS: counter(f"Calls to the {store} that ran out of time."),
        prefix + UNAVAILABLE: counter(
            f"Calls answered without I/O because the {store} was down or backing off."
        ),
        prefix + REFUSALS: counter(
            f"Commands the {store} refused, by its error code ({refusals}).", "reason"
        ),
        prefix + REJECTED: counter(
            f"Values read from the {store} that failed a check and were not loaded, by reason.",
            "reason",
        ),
        prefix + READ_MISSES: counter(f"Chunks a load asked for that the {store} no longer held."),
        prefix + WRITES_DROPPED: counter(
            f"Chunks handed to the {store} that were not written, by reason.", "reason"
        ),
        prefix + LOOKUPS_DEFERRED: counter(
            "Lookups answered retry without asking: too many keys already in flight."
        ),
        prefix + UP: OffloadingGaugeMetadata(
            documentation=f"Whether the {store} is up (1) or down and backing off (0)."
        ),
    }


class LossReport:
    """What a tier lost, said at most once every ``interval_s``: the counts since the
    last line. Pure: `take` decides, the caller logs."""

    def __init__(self, interval_s: float = LOSS_REPORT_S) -> None:
        self.interval_s = interval_s
        self._said: dict[str, int] = {}
        self._said_at = -float("inf")

    def due(self, now: float) -> bool:
        """Whether a line may be said now (the interval since the last one has passed)."""
        return now >= self._said_at + self.interval_s

    def take(self, totals: Mapping[str, int], now: float) -> dict[str, int] | None:
        """The counts that grew since the last line (by name), if a line is due now."""
        if not self.due(now):
            return None
        said = self._said
        grown = {k: v - said.get(k, 0) for k, v in totals.items() if v > said.get(k, 0)}
        if not grown:
            return None
        self._said, self._said_at = dict(totals), now
        return grown


class TierReport:
    """What one tier said last (to vLLM's metrics, to its log); what changed since."""

    def __init__(self, prefix: str, first: SecondaryStatistics) -> None:
        self.prefix = prefix
        self.losses = LossReport()
        self._before = first
        self._dropped: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._up: int | None = None

    def lost(self, now: SecondaryStatistics, dropped: Mapping[str, int], at: float) -> str | None:
        """The text of a losses line, if one is due (``dropped``: chunks the adapter
        failed itself, by reason)."""
        if not self.losses.due(at):  # the common case, at every step: nothing to add up
            return None
        totals: dict[str, int] = {}
        for what, counts in (
            ("not written", now.write_errors_by_reason),
            ("not written", dropped),  # a reason the tier counts too (down): added
            ("rejected", now.rejected_by_reason),
        ):
            for reason, n in counts.items():
                name = f"{what} ({reason})"
                totals[name] = totals.get(name, 0) + n
        grown = self.losses.take(totals, at)
        if grown is None:
            return None
        return ", ".join(f"{n:,} chunks {what}" for what, n in sorted(grown.items()))

    def stats(
        self,
        now: SecondaryStatistics,
        dropped: Mapping[str, int],
        counts: Mapping[str, int],
        up: bool,
    ) -> OffloadingConnectorStats | None:
        """What changed since the last call, as vLLM's offloading stats (``None``: nothing).

        ``counts``: the adapter's own ``failures`` (calls that raised) and
        ``lookups_deferred``, totals.
        """
        before, p = self._before, self.prefix
        stats = OffloadingConnectorStats()
        for name, field in (
            (FAILURES, "errors_total"),
            (TIMEOUTS, "timeouts_total"),
            (UNAVAILABLE, "unavailable_total"),
            (READ_MISSES, "read_misses_total"),
        ):
            delta = getattr(now, field) - getattr(before, field)
            if delta:
                stats.increase_counter(p + name, delta)
        for name, new, old in (
            (REFUSALS, now.refused_by_reason, before.refused_by_reason),
            (REJECTED, now.rejected_by_reason, before.rejected_by_reason),
            (WRITES_DROPPED, now.write_errors_by_reason, before.write_errors_by_reason),
            (WRITES_DROPPED, dropped, self._dropped),
        ):
            for reason, count in new.items():
                if count - old.get(reason, 0):
                    stats.increase_counter(p + name, count - old.get(reason, 0), (reason,))
        for name, count in counts.items():
            if count - self._counts.get(name, 0):
                stats.increase_counter(p + name, count - self._counts.get(name, 0))
        if int(up) != self._up:  # a gauge keeps its value: sent when it changes
            stats.set_gauge(p + UP, int(up))
            self._up = int(up)
        self._before, self._dropped, self._counts = now, dict(dropped), dict(counts)
        return None if stats.is_empty() else stats
