"""The metric families of the retention hints, read from `HintStatistics` at scrape time.

A part of `tiering.metrics`, apart so that it stays small: the families of what
a tier's `HintBook` (`tiering.policies.hints`) holds and did, with the labels of
the tier's other manager families (``engine``, ``tier``).

A tier that never saw a hint has no `HintStatistics` (None), and these
families have no sample then, as the event families while events are off:
their names are always exported (dashboards and rules see the same names), but
a zero would say what is not so (that hints were dropped, or reused never),
and a rule on ``tiering_hint_followed == 0`` must stay quiet where nobody
gives hints. From the first hint on, every sample is there, until a reset of
the tier forgets its hints (`CPUOffloadingManager.reset`): none then until the
next hint, when the counters go on from their totals (kept through a reset, as
the tier's other counters are: they never go back).
"""

from __future__ import annotations

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tiering.policies.hints import HintStatistics

__all__ = ["HINT_FAMILIES", "HintFamilies"]

#: The families of the retention hints (exposition names).
HINT_FAMILIES: tuple[str, ...] = (
    "tiering_hint_chunks",
    "tiering_hint_retained_chunks_limit",
    "tiering_hint_followed",
    "tiering_hinted_chunks_total",
    "tiering_hint_released_evictions_total",
    "tiering_hint_retentions_dropped_total",
    "tiering_hint_retentions_overridden_total",
    "tiering_hint_reuse_ratio",
)

#: ``kind`` label of ``tiering_hint_reuse_ratio`` -> field of `HintStatistics`.
_REUSE = (
    ("release", "reuse_released"),
    ("retain", "reuse_retained"),
    ("none", "reuse_unhinted"),
)


class HintFamilies:
    """The hint families of one scrape (labels ``engine``, ``tier``, and their own)."""

    def __init__(self) -> None:
        tier = ("engine", "tier")
        self.chunks = GaugeMetricFamily(
            "tiering_hint_chunks",
            "Chunks the tier holds under a retention hint, by state: retained (kept from "
            "eviction until their hint's TTL ends, within the share limit; one whose TTL "
            "ended is counted until it leaves the tier or a newer retention needs its "
            "place), released (the client said the conversation is over: evicted first).",
            labels=(*tier, "state"),
        )
        self.limit = GaugeMetricFamily(
            "tiering_hint_retained_chunks_limit",
            "The most chunks retention hints may keep (hint_share of the tier's capacity); "
            "past it retentions whose TTL ended are dropped first, then the "
            "lowest-priority, oldest ones.",
            labels=tier,
        )
        self.followed = GaugeMetricFamily(
            "tiering_hint_followed",
            "1 while the tier follows this kind of hint (release, retain), 0 while it "
            "ignores it because the hints' chunks are not reused as the hints say (see "
            "tiering_hint_reuse_ratio): the clients' hints of that kind are wrong. While no "
            "hint of a kind comes, it keeps its last verdict.",
            labels=(*tier, "kind"),
        )
        self.hinted = CounterMetricFamily(
            "tiering_hinted_chunks",
            "Chunks the tier held that a retention hint named, by the hint's kind (release, "
            "retain, as tiering_hint_followed's): one per chunk per hint, not distinct "
            "chunks (a chunk named by its store's hint and again by its request's use counts "
            "twice; a release names the head it shares with other conversations too, which "
            "it leaves unreleased). Its rate is how much of the traffic clients hint, of "
            "each kind.",
            labels=(*tier, "kind"),
        )
        self.released_evicted = CounterMetricFamily(
            "tiering_hint_released_evictions",
            "Released chunks evicted before the policy's own choice (they make the room a "
            "store needed; a share of tiering_evictions_total).",
            labels=tier,
        )
        self.dropped = CounterMetricFamily(
            "tiering_hint_retentions_dropped",
            "Retentions dropped because more chunks were retained than the share limit "
            "allows (the chunks stay, unprotected). Steady growth: clients retain more "
            "than the tier keeps; raise hint_share or ask for shorter TTLs.",
            labels=tier,
        )
        self.overridden = CounterMetricFamily(
            "tiering_hint_retentions_overridden",
            "Retained chunks evicted before their TTL ended because nothing else could "
            "give a store room (every other chunk pinned, being written or retained).",
            labels=tier,
        )
        self.reuse = GaugeMetricFamily(
            "tiering_hint_reuse_ratio",
            "How often a request's chunks were used again by a later request (within a "
            "tier's worth of later chunks), by the hint the request gave: release, retain, "
            "none; each request weighs once, recent ones more. Releases are followed while "
            "released chunks are reused well below the others, retentions while retained "
            "ones are reused well above.",
            labels=(*tier, "kind"),
        )

    def all(self) -> list[Metric]:
        return [
            self.chunks,
            self.limit,
            self.followed,
            self.hinted,
            self.released_evicted,
            self.dropped,
            self.overridden,
            self.reuse,
        ]

    def add(self, tier: list[str], hints: HintStatistics | None) -> None:
        """The samples of one tier (``[engine, tier]``); none before its first hint."""
        if hints is None:
            return
        self.chunks.add_metric([*tier, "retained"], hints.retained)
        self.chunks.add_metric([*tier, "released"], hints.released)
        self.limit.add_metric(tier, hints.retained_limit)
        self.followed.add_metric([*tier, "release"], int(hints.following_releases))
        self.followed.add_metric([*tier, "retain"], int(hints.following_retentions))
        self.hinted.add_metric([*tier, "release"], hints.released_keys_total)
        self.hinted.add_metric([*tier, "retain"], hints.retained_keys_total)
        self.released_evicted.add_metric(tier, hints.released_evicted_total)
        self.dropped.add_metric(tier, hints.retention_overflow_total)
        self.overridden.add_metric(tier, hints.retention_overridden_total)
        for kind, field in _REUSE:
            self.reuse.add_metric([*tier, kind], getattr(hints, field))
