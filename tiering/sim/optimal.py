"""The offline optimum (Belady's MIN) under the manager's pinning: every policy's reference.

`simulate_optimal` replays the requests evicting, at every store, the chunks
whose next use is furthest in the future, under the same pinning as
`tiering.sim.simulate_keys` (a request's hits stay pinned while its missing
chunks are stored). It models one tier only: the optimum of two tiers is not
two optima. It ignores retention hints: it knows every next use, which is more
than any hint says.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from tiering._types import OffloadKey
from tiering.hints import Hint
from tiering.sim.result import (
    OPTIMAL,
    Progress,
    SimulationResult,
    capacity_chunks,
    run_simulation,
)

__all__ = ["simulate_optimal"]


def _next_uses(request_keys: Sequence[Sequence[OffloadKey]]) -> list[int]:
    """For each key occurrence (flattened), the flat index of the key's next occurrence
    in a later request; for a key never used again, a distinct value past every
    occurrence (so eviction order is always total, and deterministic)."""
    total = sum(len(keys) for keys in request_keys)
    next_use = [0] * total
    later: dict[OffloadKey, int] = {}
    end = total
    for keys in reversed(request_keys):
        start = end - len(keys)
        for j, key in enumerate(keys):
            next_use[start + j] = later.get(key, 2 * total - start - j)
        for j in range(len(keys) - 1, -1, -1):
            later[keys[j]] = start + j
        end = start
    return next_use


class _Optimal:
    """The optimum's tier, one request at a time (a `tiering.sim.result.Simulation`)."""

    policy = OPTIMAL

    def __init__(
        self,
        request_keys: Sequence[Sequence[OffloadKey]],
        capacity_tokens: int,
        num_chunks: int,
    ) -> None:
        self.capacity_tokens = capacity_tokens
        self.capacity_chunks = num_chunks
        self._next_use = _next_uses(request_keys)
        self._cache: dict[OffloadKey, int] = {}  # key -> flat index of its next use
        self._heap: list[tuple[int, OffloadKey]] = []  # (-next use, key), stale ones skipped
        self._position = 0
        self._store_failures = self._evictions = 0

    def __call__(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> int:
        cache, heap = self._cache, self._heap  # the hint is ignored: the future is known
        hits = 0
        for key in keys:
            if key not in cache:
                break
            hits += 1
        new_keys = [key for key in dict.fromkeys(keys[hits:]) if key not in cache]
        need = len(new_keys) - (self.capacity_chunks - len(cache))
        if need > 0:
            offered = set(keys)
            if len(cache) - len(offered & cache.keys()) < need:
                self._store_failures += 1
                new_keys = []
            else:
                aside = []
                while need:
                    negative, key = heapq.heappop(heap)
                    if cache.get(key) != -negative:
                        continue  # stale: the key left or its next use moved
                    if key in offered:
                        aside.append((negative, key))
                        continue
                    del cache[key]
                    need -= 1
                    self._evictions += 1
                for item in aside:
                    heapq.heappush(heap, item)
        for key in new_keys:
            cache[key] = -1
        next_use, position = self._next_use, self._position
        for j, key in enumerate(keys):
            use = next_use[position + j]
            if cache.get(key, use) != use:
                cache[key] = use
                heapq.heappush(heap, (-use, key))
        self._position = position + len(keys)
        if len(heap) > 4 * len(cache) + 1024:  # drop stale entries now and then
            self._heap = [(-use, key) for key, use in cache.items()]
            heapq.heapify(self._heap)
        return hits

    def counts(self) -> dict[str, int]:
        return {"store_failures": self._store_failures, "evictions": self._evictions}


def simulate_optimal(
    request_keys: Sequence[Sequence[OffloadKey]],
    *,
    capacity_tokens: int,
    block_tokens: int = 512,
    progress: Progress | None = None,
) -> SimulationResult:
    """The offline optimum (Belady's MIN) over the same requests and pinning as `simulate_keys`.

    It sees the future: each store evicts the evictable chunks whose next use is
    furthest away. As in the manager, a request's hits are pinned while its
    missing chunks are stored, the keys it offers are never its own victims, and
    a store that cannot make room stores nothing. It is the reference an online
    policy is measured against (exactly optimal for independent chunks; with
    prefix hits it is a close upper reference, not a proven bound). O(log n) per
    key with a lazy max-heap.
    """
    num_chunks = capacity_chunks(capacity_tokens, block_tokens)
    optimum = _Optimal(request_keys, capacity_tokens, num_chunks)
    return run_simulation(request_keys, optimum, progress)
