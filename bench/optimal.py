"""The offline optimum (Belady's MIN) as a reference: how far each online policy is from it.

`tiering.sim.simulate_optimal` replays a workload evicting, at every store,
the evictable chunk whose next use is furthest in the future, under the same
pinning as `tiering simulate` (a request's hits stay pinned while its missing
chunks are stored; the keys it offers are never its own victims; a store that
cannot make room stores nothing). This script first checks it against a plain,
slow transcription of the same rule on the first ``--check`` requests (they must
agree exactly), then prints, per capacity, the optimum's hit rate, every
policy's, and each policy's share of the optimum.

    python bench/optimal.py [--trace FILE | --workload chat|documents]
                            [--capacity-tokens N,N] [--check R] [--json]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tiering._types import OffloadKey
from tiering.policies import POLICY_NAMES
from tiering.sim import requests_to_keys, simulate_keys, simulate_optimal
from tiering.workload import Request, load_workload, read_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)


def plain_optimal(request_keys: Sequence[Sequence[OffloadKey]], capacity: int) -> tuple[int, int]:
    """Hit blocks and evictions of MIN, written as plainly as possible (O(capacity) a victim)."""
    uses: dict[OffloadKey, list[int]] = {}
    for i, keys in enumerate(request_keys):
        for j, key in enumerate(keys):
            uses.setdefault(key, []).append(i * 1_000_000 + j)  # (request, position)

    def next_use(key: OffloadKey, after_request: int) -> float:
        times = uses[key]
        k = bisect.bisect_left(times, (after_request + 1) * 1_000_000)
        return times[k] if k < len(times) else float("inf")  # never again: furthest

    cache: set[OffloadKey] = set()
    hits = evictions = 0
    for i, keys in enumerate(request_keys):
        n = 0
        while n < len(keys) and keys[n] in cache:
            n += 1
        hits += n
        new = [key for key in dict.fromkeys(keys[n:]) if key not in cache]
        need = len(new) - (capacity - len(cache))
        offered = set(keys)
        candidates = [key for key in cache if key not in offered]
        if need > len(candidates):
            continue  # no room: the store stores nothing
        for _ in range(max(need, 0)):
            victim = max(candidates, key=lambda key: next_use(key, i))
            candidates.remove(victim)
            cache.remove(victim)
            evictions += 1
        cache.update(new)
    return hits, evictions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, default=None)
    source.add_argument("--workload", choices=("chat", "documents"))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--capacity-tokens", default="1000000,3000000,10000000")
    parser.add_argument("--check", type=int, default=1500, help="requests to cross-check")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    requests: list[Request]
    if args.workload:
        requests, name = load_workload(args.workload, args.requests), f"{args.workload} workload"
    else:
        trace = args.trace or DEFAULT_TRACE
        requests, name = read_trace(trace, limit=args.requests), trace.name
    request_keys = requests_to_keys(requests)
    capacities = [int(c) for c in args.capacity_tokens.split(",")]

    # Cross-check on a prefix, at a capacity small enough to evict a lot.
    head = request_keys[: args.check]
    for chunks in (16, 256):
        fast = simulate_optimal(head, capacity_tokens=chunks * 512)
        plain = plain_optimal(head, chunks)
        if plain != (fast.hit_blocks, fast.evictions):
            print(f"MISMATCH at {chunks} chunks: plain {plain} vs heap "
                  f"{(fast.hit_blocks, fast.evictions)}", file=sys.stderr)  # fmt: skip
            return 1
    if not args.json:
        print(f"optimum cross-checked on {len(head):,} requests at 16 and 256 chunks")
        blocks = sum(len(k) for k in request_keys)
        print(f"{name}: {len(requests):,} requests, {blocks:,} blocks")
    for capacity in capacities:
        start = time.perf_counter()
        best = simulate_optimal(request_keys, capacity_tokens=capacity)
        seconds = time.perf_counter() - start
        rates = {
            p: simulate_keys(request_keys, capacity_tokens=capacity, policy=p).hit_rate
            for p in POLICY_NAMES
        }
        if args.json:
            print(json.dumps({"capacity_tokens": capacity, "optimal": round(best.hit_rate, 5),
                              "optimal_seconds": round(seconds, 3),
                              **{p: round(r, 5) for p, r in rates.items()}}))  # fmt: skip
            continue
        shares = "  ".join(
            f"{p} {100 * r:.2f}% ({100 * r / best.hit_rate:.0f}%)" for p, r in rates.items()
        )
        print(f"  {capacity:>12,} tokens: optimal {100 * best.hit_rate:.2f}% "
              f"in {seconds:.1f} s;  {shares}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
