"""Hit rate of every cache policy beside the offline optimum, on three workloads of unlike shape.

The figures behind the choice of `tiering.config.DEFAULT_POLICY` (README, "Cache
policies"): the Mooncake conversation trace at 1, 3 and 10 million tokens, the
built-in ``chat`` workload (multi-turn chat over shared system prompts) and the
``documents`` workload (short questions over long shared documents), each at
capacities from a small fraction of its working set to most of it. For every row
it prints the hit rate of each policy, the ratio to LRU and the share of the
offline optimum, then checks the targets of the issue that introduced the
policy: on the trace, the default at 3,000,000 tokens hits at least 1.25x LRU,
and nowhere (trace or workload) does it fall below LRU. Exits 1 if a target is
missed.

    python bench/policy.py [--trace FILE] [--requests N] [--json] [--plot DIR]

``--plot DIR`` also draws one PNG per workload into DIR (matplotlib), the
conversation trace's as ``policies.png`` (the README's figure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiering.config import DEFAULT_POLICY
from tiering.policies import POLICY_NAMES
from tiering.simulate import OPTIMAL, SimulationResult, requests_to_keys, simulate_keys
from tiering.workload import Request, chat_workload, documents_workload, read_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)
TRACE_CAPACITIES = (1_000_000, 3_000_000, 10_000_000)
# The synthetic workloads' working sets are smaller: from a few percent of it up.
CHAT_CAPACITIES = (25_600, 51_200, 102_400, 204_800, 409_600)
DOCUMENT_CAPACITIES = (51_200, 153_600, 512_000, 1_536_000)


def run(
    requests: list[Request], capacities: tuple[int, ...]
) -> dict[int, dict[str, SimulationResult]]:
    keys = requests_to_keys(requests)
    return {
        capacity: {
            policy: simulate_keys(keys, capacity_tokens=capacity, policy=policy)
            for policy in (*POLICY_NAMES, OPTIMAL)
        }
        for capacity in capacities
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, default=12_000, help="per synthetic workload")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--plot", type=Path, metavar="DIR", help="draw a PNG per workload")
    args = parser.parse_args()

    workloads: list[tuple[str, list[Request], tuple[int, ...]]] = []
    if args.trace.exists():
        workloads.append(("trace", read_trace(args.trace), TRACE_CAPACITIES))
    else:
        print(f"no trace at {args.trace}: the trace's targets are not checked", file=sys.stderr)
    workloads.append(("chat", chat_workload(args.requests), CHAT_CAPACITIES))
    workloads.append(("documents", documents_workload(args.requests), DOCUMENT_CAPACITIES))

    failures: list[str] = []
    for name, requests, capacities in workloads:
        table = run(requests, capacities)
        if not args.json:
            blocks = next(iter(next(iter(table.values())).values())).blocks
            print(f"\n{name}: {len(requests):,} requests, {blocks:,} blocks")
            head = "".join(f"{p:>16}" for p in (*POLICY_NAMES, OPTIMAL))
            print(f"{'capacity tokens':>16}{head}   {DEFAULT_POLICY}/lru  {DEFAULT_POLICY}/optimal")
        for capacity, row in table.items():
            lru = row["lru"].hit_rate
            best = row[OPTIMAL].hit_rate
            mine = row[DEFAULT_POLICY].hit_rate
            ratio = mine / lru if lru else float("inf")
            if mine < lru:
                failures.append(f"{name} at {capacity:,}: {DEFAULT_POLICY} below lru")
            if name == "trace" and capacity == 3_000_000 and ratio < 1.25:
                failures.append(f"trace at 3,000,000: {DEFAULT_POLICY} is {ratio:.2f}x lru < 1.25x")
            if args.json:
                print(json.dumps({
                    "workload": name, "capacity_tokens": capacity,
                    **{p: round(r.hit_rate, 5) for p, r in row.items()},
                    "keys_per_s": {p: round(r.keys_per_s) for p, r in row.items()},
                }))  # fmt: skip
                continue
            cells = "".join(f"{100 * r.hit_rate:>15.2f}%" for r in row.values())
            share = mine / best if best else 1.0
            print(f"{capacity:>16,}{cells}   {ratio:>9.2f}x  {100 * share:>14.0f}%")
        if args.plot is not None:
            from tiering.simulate import plot_hit_rates  # matplotlib: only when asked for

            args.plot.mkdir(parents=True, exist_ok=True)
            out = args.plot / ("policies.png" if name == "trace" else f"policies-{name}.png")
            source = "conversation trace" if name == "trace" else f"{name} workload"
            results = [r for row in table.values() for r in row.values()]
            title = f"{source}: {len(requests):,} requests, {results[0].blocks:,} blocks"
            plot_hit_rates(results, out, title=title)
            print(f"wrote {out}", file=sys.stderr)
    for failure in failures:
        print(f"TARGET MISSED: {failure}", file=sys.stderr)
    if not failures and not args.json:
        print(f"\nall targets held by the default policy, {DEFAULT_POLICY}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
