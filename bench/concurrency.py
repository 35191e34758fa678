"""Hit rate against concurrency: the limit on the replay's hit rate is capacity, not concurrency.

`tiering replay` over the conversation trace (or the chat workload) with the
``cpu`` backend at concurrency 1, 8 and 32, at a small and at the default CPU
tier, with `--verify`. The rows give each run's hit rate and its ratio to
concurrency 1's at the same capacity, measured in the same run.

Concurrency costs a little hit rate by itself: requests in flight together
cannot load what the others have not stored yet, and their pinned chunks
shrink the room the policy has. It must never cost the hit rate (issue #15:
at concurrency 32 an await that did not yield let one task take every
request, every store found no room and the hit rate fell to 0.00 %).

Target: at concurrency 32, the hit rate >= 0.9 of concurrency 1's at every
capacity; 0 corrupt chunks and 0 failed jobs everywhere.

    python bench/concurrency.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tiering.replay import ReplayOptions, run_replay
from tiering.workload.chat import chat_workload
from tiering.workload.trace import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
CONCURRENCY = (1, 8, 32)
CAPACITIES = (200_000, 3_000_000)  # tokens
TARGET = 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, help="first N requests (default: all)")
    parser.add_argument("--bytes-per-token", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if TRACE.exists():
        requests = read_trace(TRACE, limit=args.requests)
        source = TRACE.name
    else:
        requests = chat_workload(args.requests or 12_000)
        source = "chat workload"
    rows: list[dict[str, Any]] = []
    ok = True
    for capacity in CAPACITIES:
        base = None
        for concurrency in CONCURRENCY:
            options = ReplayOptions(
                capacity_tokens=capacity,
                bytes_per_token=args.bytes_per_token,
                concurrency=concurrency,
                verify=True,
                backend="cpu",
            )
            r = run_replay(requests, options)
            base = r.hit_rate if base is None else base
            ratio = r.hit_rate / base if base else 1.0
            row = {
                "capacity_tokens": capacity,
                "concurrency": concurrency,
                "hit_rate": r.hit_rate,
                "ratio": ratio,
                "no_room_stores": r.no_room_stores,
                "failed_jobs": r.failed_jobs,
                "corrupt_chunks": r.corrupt_chunks,
                "seconds": r.seconds,
            }
            rows.append(row)
            good = ratio >= TARGET and r.failed_jobs == 0 and r.corrupt_chunks == 0
            ok &= good
            if args.json:
                print(json.dumps(row))
            else:
                print(
                    f"{capacity:>10,} tokens  concurrency {concurrency:>3}  hit rate "
                    f"{r.hit_rate:7.2%}  x{ratio:.3f} of concurrency 1  "
                    f"{r.no_room_stores:>5,} stores found no room  {r.failed_jobs} failed  "
                    f"{r.corrupt_chunks} corrupt  {r.seconds:6.1f} s  {'ok' if good else 'MISS'}"
                )
    if args.json:
        print(json.dumps({"source": source, "requests": len(requests), "target_met": ok}))
    else:
        print(
            f"{source}, {len(requests):,} requests: hit rate at concurrency 32 >= {TARGET} of "
            f"concurrency 1's at every capacity: {'met' if ok else 'NOT met'}"
        )


if __name__ == "__main__":
    main()
