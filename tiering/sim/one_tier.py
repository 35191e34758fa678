"""The CPU tier alone, one request at a time, as a server handles each.

Look up the request's chunks from the head until the first that is not ready
(those are hits), pin the hits (a load), store the rest while the hits are
pinned, unpin the hits, and commit the request's recency head to tail with its
retention hint, if it has one (the manager's touch: the hint applies to every
chunk of the request the tier then holds, those just stored included). One
chunk per hash id.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering._types import OffloadKey
from tiering.cpu.manager import CPUOffloadingManager
from tiering.hints import Hint

__all__ = ["OneTier"]


class OneTier:
    """One CPU tier over ``manager`` (a `tiering.sim.result.Simulation`)."""

    def __init__(self, manager: CPUOffloadingManager, *, policy: str, capacity_tokens: int) -> None:
        self.policy = policy
        self.capacity_tokens = capacity_tokens
        self.capacity_chunks = manager.capacity
        self._manager = manager
        self._store_failures = 0

    def __call__(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> int:
        hits = self._manager.lookup_prefix(keys)
        self._request(keys, hits, hint)
        return hits

    def _request(
        self, keys: Sequence[OffloadKey], hits: int, hint: Hint | None
    ) -> tuple[OffloadKey, ...]:
        """Load the ``hits`` leading keys, store the rest while they are pinned, commit
        the recency with ``hint``; the keys the store wrote."""
        manager = self._manager
        hit_keys = keys[:hits]
        if hits:
            manager.prepare_load(hit_keys)
        stored: tuple[OffloadKey, ...] = ()
        if hits < len(keys):
            output = manager.prepare_store(keys[hits:])
            if output is None:
                self._store_failures += 1
            elif output.keys_to_store:
                stored = output.keys_to_store
                manager.complete_store(stored)
        if hits:
            manager.complete_load(hit_keys)
        manager.touch(keys, hint)
        return stored

    def counts(self) -> dict[str, int]:
        return {
            "store_failures": self._store_failures,
            "evictions": self._manager.statistics().evictions_total,
        }
