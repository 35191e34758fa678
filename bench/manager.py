"""Chunk keys per second through the manager and policy, beside a bare OrderedDict LRU.

The manager's whole cycle per request (lookup, pin/unpin the hits, store the
rest, commit recency) runs over the conversation trace at 3,000,000 tokens of
capacity; a bare OrderedDict LRU loop does the same hits and evictions over the
same keys in the same run. Each is run ``--repeat`` times, interleaved, and the
best run counts (these machines are noisy). The figure that matters is the
ratio: manager keys/s over bare keys/s (target: at least 0.1).

    python bench/manager.py [--trace FILE] [--capacity-tokens N] [--repeat R] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from tiering._types import OffloadKey
from tiering.policies import POLICY_NAMES
from tiering.simulate import requests_to_keys, simulate_keys
from tiering.workload import Request, chat_workload, read_trace

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
)


def bare_lru(request_keys: Sequence[Sequence[OffloadKey]], capacity: int) -> tuple[int, float]:
    """Hit blocks and seconds of the plainest LRU loop over the same requests."""
    cache: OrderedDict[OffloadKey, None] = OrderedDict()
    move = cache.move_to_end
    popitem = cache.popitem
    hits = 0
    start = time.perf_counter()
    for keys in request_keys:
        n = 0
        for key in keys:
            if key not in cache:
                break
            n += 1
        hits += n
        for key in keys[n:]:
            if key not in cache:
                if len(cache) >= capacity:
                    popitem(last=False)
                cache[key] = None
        for key in reversed(keys):
            if key in cache:
                move(key)
    return hits, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity-tokens", type=int, default=3_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    requests: list[Request]
    if args.trace.exists():
        requests, source = read_trace(args.trace), str(args.trace.name)
    else:
        requests, source = chat_workload(12_000), "chat workload (trace not found)"
    request_keys = requests_to_keys(requests)
    blocks = sum(len(k) for k in request_keys)
    capacity = args.capacity_tokens // 512

    bare_best = 0.0
    best: dict[str, float] = dict.fromkeys(POLICY_NAMES, 0.0)
    hit_rates: dict[str, float] = {}
    for _ in range(args.repeat):
        _, seconds = bare_lru(request_keys, capacity)
        bare_best = max(bare_best, blocks / seconds)
        for policy in best:
            result = simulate_keys(
                request_keys, capacity_tokens=args.capacity_tokens, policy=policy
            )
            best[policy] = max(best[policy], result.keys_per_s)
            hit_rates[policy] = result.hit_rate

    rows = [
        {
            "policy": policy,
            "keys_per_s": round(kps),
            "baseline_keys_per_s": round(bare_best),
            "ratio": round(kps / bare_best, 4),
            "hit_rate": round(hit_rates[policy], 4),
            "blocks": blocks,
            "capacity_tokens": args.capacity_tokens,
        }
        for policy, kps in best.items()
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"{source}: {len(requests):,} requests, {blocks:,} chunk keys, "
          f"{args.capacity_tokens:,} tokens of capacity, best of {args.repeat}")  # fmt: skip
    print(f"  bare OrderedDict LRU    {bare_best:>12,.0f} keys/s")
    for row in rows:
        print(f"  manager + {row['policy']:<13} {row['keys_per_s']:>12,} keys/s  "
              f"ratio {row['ratio']:.3f}  hit rate {row['hit_rate']:.2%}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
