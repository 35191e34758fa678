"""Generate ``dashboards/tiering.json``, the Grafana dashboard of `tiering`.

The panels and their PromQL live here, as data; the JSON is derived, so every
panel has the same datasource, selectors and layout conventions. Run
``make dashboards`` (or ``python dashboards/generate.py``) after an edit;
``--check`` exits 1 when the JSON on disk is not what this script makes
(tests/test_dashboards.py checks the same).

Every query selects ``instance=~"$instance", engine=~"$engine"``; rates use
Grafana's ``$__rate_interval``. The datasource is the ``datasource`` variable:
no datasource uid is written into the JSON. The row of a tier below the CPU
tier repeats once per value of the ``tier`` variable (every tier an engine
has below its CPU tier: ``disk``, ``remote``), its queries selecting
``tier=~"$tier"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "tiering.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance", engine=~"$engine"'
#: The selector of a tier row's queries: its one tier (the row repeats per tier).
BELOW = f'tier=~"$tier", {SEL}'
RATE = "$__rate_interval"
WHO = "{{instance}} {{engine}}"
BUCKETS = "tiering_transfer_seconds_bucket"
BY_LE = "instance, engine, direction, le"  # legend prefix: which engine of which process


def legend(*parts: str) -> str:
    """A legend: the engine, then ``{{label}}`` for each label name, or the text of a word."""
    labels = ("tier", "direction", "outcome", "sink", "kind", "state")
    words = [f"{{{{{p}}}}}" if p in labels else p for p in parts]
    return " ".join([WHO, *words])


def rate(family: str, by: str, matchers: str = "") -> str:
    inner = f"{matchers}, {SEL}" if matchers else SEL
    return f"sum by ({by}) (rate({family}{{{inner}}}[{RATE}]))"


def target(expr: str, legend: str, ref: str, *, instant: bool = False) -> dict[str, Any]:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "format": "table" if instant else "time_series",
        "instant": instant,
        "legendFormat": legend,
        "range": not instant,
        "refId": ref,
    }


def targets(*queries: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(
    title: str,
    description: str,
    queries: list[dict[str, Any]],
    *,
    unit: str = "short",
    w: int = 12,
    h: int = 8,
    axis: str = "",
    max_value: float | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "axisLabel": axis,
            "drawStyle": "line",
            "fillOpacity": 10,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": queries,
    }


def gauge(title: str, description: str, query: dict[str, Any], *, w: int, h: int) -> dict[str, Any]:
    return {
        "type": "gauge",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {
            "defaults": {
                "unit": "percentunit",
                "min": 0,
                "max": 1,
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": "green", "value": None}],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "showThresholdLabels": False,
            "showThresholdMarkers": False,
        },
        "targets": [query],
    }


def stat(
    title: str,
    description: str,
    query: dict[str, Any],
    *,
    unit: str,
    w: int,
    h: int,
    mappings: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if mappings is not None:
        defaults["mappings"] = mappings
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": "none",
            "graphMode": "none",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "value_and_name",
        },
        "targets": [query],
    }


def table(title: str, description: str, query: dict[str, Any], *, w: int, h: int) -> dict[str, Any]:
    hidden = ["Time", "Value", "__name__", "job", "tier"]
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": w},
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True, "cellHeight": "sm"},
        "transformations": [
            {"id": "organize", "options": {"excludeByName": dict.fromkeys(hidden, True)}}
        ],
        "targets": [query],
    }


def row(title: str, *, repeat: str | None = None) -> dict[str, Any]:
    """A row; with ``repeat``, Grafana repeats it and the panels under it per value of
    that variable."""
    panel: dict[str, Any] = {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1},
    }
    if repeat is not None:
        panel["repeat"] = repeat
    return panel


#: The value mappings of ``tiering_tier_up``.
UP_DOWN = [
    {
        "type": "value",
        "options": {
            "0": {"text": "down", "color": "red", "index": 0},
            "1": {"text": "up", "color": "green", "index": 1},
        },
    }
]


def tier_row() -> list[dict[str, Any]]:
    """A tier below the CPU tier: is it paying off (hits served), and is it healthy?

    One row, repeated per value of ``tier``: each copy answers for one tier.
    """
    by = "instance, engine, tier"
    return [
        row("Tier $tier (below the CPU tier)", repeat="tier"),
        timeseries(
            "Tier hit ratio",
            "Chunks this tier held when asked, over all it was asked about (CPU-tier "
            "misses, or the misses of the tiers above it in the chain).",
            targets(
                (
                    rate("tiering_lookups_total", by, f'result="hit", {BELOW}')
                    + " / "
                    + rate("tiering_lookups_total", by, BELOW),
                    legend("tier"),
                )
            ),
            unit="percentunit",
            max_value=1,
            w=6,
            h=7,
        ),
        timeseries(
            "Hits served/s",
            "Chunks promoted from this tier into the CPU tier per second: its hits as the "
            "engine served them (each saves recomputing a chunk). Failed: chunks it claimed "
            "but could not give.",
            targets(
                (
                    rate("tiering_jobs_total", by, f'direction="load", outcome="ok", {BELOW}'),
                    legend("tier", "promoted"),
                ),
                (
                    rate("tiering_jobs_total", by, f'direction="load", outcome="failed", {BELOW}'),
                    legend("tier", "promote failed"),
                ),
            ),
            axis="chunks/s",
            w=6,
            h=7,
        ),
        timeseries(
            "Tier throughput",
            "Bytes per second read from this tier into the CPU tier (load) and written "
            "through to it (store).",
            targets(
                (
                    rate("tiering_transfer_bytes_total", f"{by}, direction", BELOW),
                    legend("tier", "direction"),
                ),
            ),
            unit="Bps",
            w=6,
            h=7,
        ),
        timeseries(
            "Write-throughs/s",
            "Chunks written through to this tier per second, by outcome: ok, failed (handed "
            "to the tier and not written), rejected (dropped before, the tier being behind).",
            targets(
                (
                    rate("tiering_jobs_total", f"{by}, outcome", f'direction="store", {BELOW}'),
                    legend("tier", "outcome"),
                ),
            ),
            axis="chunks/s",
            w=6,
            h=7,
        ),
        timeseries(
            "Tier errors/s",
            "What the tier did not serve, by kind: failed calls (unreachable, timeout), "
            "unavailable (answered at once while down), busy (every worker busy), refused "
            "(the store refused a command, e.g. OOM), rejected (a value that failed its "
            "check: corruption; never loaded), lost (a value found gone: deleted behind its "
            "back).",
            targets(
                (
                    rate("tiering_tier_errors_total", f"{by}, kind", BELOW),
                    legend("tier", "kind"),
                ),
            ),
            axis="errors/s",
            w=9,
            h=6,
        ),
        stat(
            "Tier up",
            "Whether the tier is up; while down, it is asked nothing (misses, writes dropped) "
            "but a probe now and then.",
            target(f"tiering_tier_up{{{BELOW}}}", WHO, "A"),
            unit="none",
            w=3,
            h=6,
            mappings=UP_DOWN,
        ),
        gauge(
            "Tier occupancy",
            "Bytes held over capacity, for a tier that manages its own (disk). No data for "
            "one that does not say (Redis evicts by its own policy).",
            target(f"tiering_occupancy_ratio{{{BELOW}}}", WHO, "A"),
            w=3,
            h=6,
        ),
        stat(
            "Tier chunks",
            "Chunks the tier holds, where it says (disk).",
            target(f"tiering_chunks_used{{{BELOW}}}", WHO, "A"),
            unit="short",
            w=3,
            h=6,
        ),
        timeseries(
            "Tier evictions/s",
            "Chunks the tier evicted per second to make room, where it manages its capacity "
            "(disk).",
            targets((rate("tiering_evictions_total", by, BELOW), legend("tier"))),
            axis="chunks/s",
            w=6,
            h=6,
        ),
    ]


def hints_row() -> list[dict[str, Any]]:
    """The CPU tier's retention hints: what they hold, whether the tier follows them and
    why. No data until a client gives a hint."""
    cpu = f'tier="cpu", {SEL}'
    by = "instance, engine"
    return [
        row("Retention hints (CPU tier)"),
        timeseries(
            "Hinted chunks",
            "Chunks held under a hint, by state: retained (kept until their TTL ends; one "
            "whose TTL ended counts until it leaves or makes room) against the most that "
            "may be retained (hint_share of the tier), released (the conversation is over: "
            "evicted first). No data until a client gives a hint.",
            targets(
                (f"tiering_hint_chunks{{{cpu}}}", legend("state")),
                (f"tiering_hint_retained_chunks_limit{{{cpu}}}", legend("retained limit")),
            ),
            axis="chunks",
            w=6,
            h=7,
        ),
        timeseries(
            "Hints followed",
            "Whether the tier follows each kind of hint (1) or ignores it (0): it follows "
            "releases while released chunks are reused well below the others, retentions "
            "while retained ones are reused well above (see Reuse by hint). Ignored for "
            "long: the clients' hints of that kind are wrong.",
            targets((f"tiering_hint_followed{{{cpu}}}", legend("kind"))),
            max_value=1,
            w=6,
            h=7,
        ),
        timeseries(
            "Hint flows/s",
            "Chunks per second: hinted, by the hint's kind (release, retain; a hint naming "
            "a chunk held, once per hint), released chunks evicted first, retentions "
            "dropped past the share limit (more retained than hint_share keeps), retained "
            "chunks evicted before their TTL (nothing else could give room).",
            targets(
                (
                    rate("tiering_hinted_chunks_total", f"{by}, kind", 'tier="cpu"'),
                    legend("hinted", "kind"),
                ),
                (
                    rate("tiering_hint_released_evictions_total", by, 'tier="cpu"'),
                    legend("released evicted"),
                ),
                (
                    rate("tiering_hint_retentions_dropped_total", by, 'tier="cpu"'),
                    legend("retentions dropped"),
                ),
                (
                    rate("tiering_hint_retentions_overridden_total", by, 'tier="cpu"'),
                    legend("retained evicted"),
                ),
            ),
            axis="chunks/s",
            w=6,
            h=7,
        ),
        timeseries(
            "Reuse by hint",
            "How often a request's chunks were used again by a later request, by the hint "
            "it gave (release, retain, none): what decides following the hints. Right "
            "hints: release well below none, retain well above.",
            targets((f"tiering_hint_reuse_ratio{{{cpu}}}", legend("kind"))),
            unit="percentunit",
            max_value=1,
            w=6,
            h=7,
        ),
    ]


def panels() -> list[dict[str, Any]]:
    cpu = f'tier="cpu", {SEL}'
    cpu_only = 'tier="cpu"'
    return [
        row("CPU tier"),
        timeseries(
            "CPU tier occupancy",
            "Chunks held by the CPU tier (being written or ready) against its capacity.",
            targets(
                (f"tiering_chunks_used{{{cpu}}}", legend("used")),
                (f"tiering_chunks_capacity{{{cpu}}}", legend("capacity")),
            ),
            axis="chunks",
        ),
        gauge(
            "Occupancy ratio",
            "Used chunks over capacity. A cache runs full: this alone is no alarm; "
            "refused stores (allocation failures) are.",
            target(f"tiering_occupancy_ratio{{{cpu}}}", WHO, "A"),
            w=6,
            h=8,
        ),
        stat(
            "Tier size",
            "Host memory of the CPU tier.",
            target(f"tiering_tier_bytes{{{cpu}}}", WHO, "A"),
            unit="bytes",
            w=6,
            h=8,
        ),
        timeseries(
            "Writing, pinned and evictable chunks",
            "Writing: stores in progress (not readable yet). Pinned: chunks being loaded "
            "(never evicted). Evictable: ready and unpinned; when it reaches 0 stores are refused.",
            targets(
                (f"tiering_chunks_writing{{{cpu}}}", legend("writing")),
                (f"tiering_chunks_pinned{{{cpu}}}", legend("pinned")),
                (f"tiering_chunks_evictable{{{cpu}}}", legend("evictable")),
            ),
            axis="chunks",
        ),
        timeseries(
            "Lookup hit ratio",
            "Chunk lookups that found a ready chunk, over all lookups (hit, pending, miss), "
            "per tier: cpu, and each tier below it (asked about the misses above it) if any.",
            targets(
                (
                    rate("tiering_lookups_total", "instance, engine, tier", 'result="hit"')
                    + " / "
                    + rate("tiering_lookups_total", "instance, engine, tier"),
                    legend("tier"),
                )
            ),
            unit="percentunit",
            max_value=1,
        ),
        timeseries(
            "Evictions/s",
            "Chunks evicted per second to make room for new stores.",
            targets((rate("tiering_evictions_total", "instance, engine", cpu_only), WHO)),
            axis="chunks/s",
        ),
        timeseries(
            "Allocation failures/s",
            "Stores refused per second because no room could be made: every chunk was "
            "pinned or being written. Sustained, the tier is too small for the load.",
            targets((rate("tiering_allocation_failures_total", "instance, engine"), WHO)),
            axis="stores/s",
        ),
        *hints_row(),
        *tier_row(),
        row("Transfers"),
        timeseries(
            "Transfer throughput",
            "Bytes moved per second by finished jobs: store is GPU to CPU, load is CPU to GPU; "
            "for a tier below, store is written through from CPU and load read back into it.",
            targets(
                (
                    rate("tiering_transfer_bytes_total", "instance, engine, tier, direction"),
                    legend("tier", "direction"),
                ),
            ),
            unit="Bps",
        ),
        timeseries(
            "Job latency p50 / p99",
            "Latency of a job from submission to completion, from the histogram.",
            targets(
                *(
                    (
                        f"histogram_quantile({q}, {rate(BUCKETS, BY_LE)})",
                        legend("direction", f"p{round(q * 100)}"),
                    )
                    for q in (0.5, 0.99)
                )
            ),
            unit="s",
        ),
        timeseries(
            "Jobs queued and in flight",
            "Jobs waiting in the scheduler's queues, and jobs with bytes at the backend.",
            targets(
                (f"tiering_jobs_queued{{{cpu}}}", legend("direction", "queued")),
                (f"tiering_jobs_in_flight{{{cpu}}}", legend("direction", "in flight")),
            ),
            axis="jobs",
        ),
        timeseries(
            "Jobs/s by outcome",
            "ok, failed (a transfer error), cancelled (before any byte moved), "
            "rejected (a store that found no room; a tier below: a write-through dropped, the "
            "tier being behind). Series of the tiers below count chunks.",
            targets(
                (
                    rate("tiering_jobs_total", "instance, engine, tier, direction, outcome"),
                    legend("tier", "direction", "outcome"),
                ),
            ),
            axis="jobs/s",
        ),
        timeseries(
            "Failed jobs",
            "Transfer jobs that failed (a copy error in the backend), per interval.",
            targets(
                (
                    "sum by (instance, engine, tier, direction) "
                    f'(increase(tiering_jobs_total{{outcome="failed", {SEL}}}[{RATE}]))',
                    legend("tier", "direction"),
                )
            ),
            axis="jobs",
        ),
        row("Events"),
        timeseries(
            "Events published/s",
            "KV cache events published per second, by sink (no data while events are off).",
            targets(
                (
                    rate("tiering_events_published_total", "instance, engine, sink"),
                    legend("sink"),
                )
            ),
            axis="events/s",
        ),
        timeseries(
            "Events dropped",
            "KV cache events a sink dropped (a slow subscriber, a full buffer), per interval. "
            "A subscriber that lost events must resynchronise.",
            targets(
                (
                    "sum by (instance, engine, sink) "
                    f"(increase(tiering_events_dropped_total{{{SEL}}}[{RATE}]))",
                    legend("sink"),
                )
            ),
            axis="events",
        ),
        row("Engines"),
        table(
            "Tiers",
            "Static facts of each engine's CPU tier (tiering_info).",
            target(f"tiering_info{{{SEL}}}", "", "A", instant=True),
            w=24,
            h=6,
        ),
    ]


def layout(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Number the panels and place them left to right, in rows of 24 columns."""
    x = y = line = 0
    for panel_id, panel in enumerate(items, start=1):
        grid = panel["gridPos"]
        grid.setdefault("w", 24)
        if panel["type"] == "row" or x + grid["w"] > 24:
            x, y, line = 0, y + line, 0
        grid["x"], grid["y"] = x, y
        panel["id"] = panel_id
        if panel["type"] == "row":
            y += grid["h"]
        else:
            x += grid["w"]
            line = max(line, grid["h"])
    return items


def variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, promql: str, all_value: str | None = ".*") -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": promql,
            "query": {"query": promql, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "regex": "",
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": all_value,
            "current": {},
            "options": [],
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "current": {},
            "options": [],
            "hide": 0,
        },
        query("instance", "Instance", "label_values(tiering_info, instance)"),
        query("engine", "Engine", 'label_values(tiering_info{instance=~"$instance"}, engine)'),
        # The tiers below the CPU tier (tiering_tier_up has no cpu series). All of them
        # by default: the tier row repeats per value. "All" lists them, never cpu.
        {
            **query("tier", "Tier below", f"label_values(tiering_tier_up{{{SEL}}}, tier)", None),
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        },
    ]


def dashboard() -> dict[str, Any]:
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "gauge", "name": "Gauge", "version": ""},
            {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
            {"type": "panel", "id": "table", "name": "Table", "version": ""},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "tiering: the KV-cache CPU tier of each engine: occupancy, transfers, "
        "lookups, evictions, retention hints and KV cache events; a row per tier below it "
        "(disk, remote): hits served, flows, errors.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": layout(panels()),
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["tiering", "kv-cache"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "tiering: KV-cache CPU tier",
        "uid": "tiering-kv-cache",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is stale: run make dashboards", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
