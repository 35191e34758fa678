"""The cache-policy contract: which chunks to evict, in which order.

A policy tracks the keys of the chunks in the tier (from the moment a store
allocates them); the manager keeps states, slots and pins and asks the policy
for victims, protecting the chunks it may not give up (pinned, being written,
offered by the store asking for room). The contract is five methods, kept small
so a new policy is easy to write and to test against the shared contract suite:

- ``insert(keys)``: chunks joined the tier, in request order (head first);
- ``touch(keys)``: a request used these chunks; commit their recency, head first;
- ``evict(n, protected)``: choose and forget exactly ``n`` victims, or nothing;
- ``remove(keys)``: chunks left the tier without being evicted;
- ``clear()``: forget everything.

Ordering: a prefix is only useful from its head, so policies evict a request's
tail before its head. `LRUPolicy` guarantees it for the keys of the latest
``insert`` or ``touch`` of a request. `ARCPolicy` guarantees it within each of
its lists; a head kept for its frequency in T2 may outlive a tail in T1, and
the reverse (a documented trade of the algorithm).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence

from tiering._types import OffloadKey

__all__ = ["CachePolicy"]


class CachePolicy(ABC):
    """Eviction order over the ready chunks of one tier."""

    #: Short name used on the command line and in statistics.
    name: str = ""

    @abstractmethod
    def insert(self, keys: Sequence[OffloadKey]) -> None:
        """Track ``keys`` (not tracked yet), which just joined the tier, head first."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """A request used ``keys`` (head first); untracked keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[OffloadKey]) -> list[OffloadKey] | None:
        """Choose ``n`` tracked keys not in ``protected`` and stop tracking them.

        All or nothing: when fewer than ``n`` candidates exist, return ``None``
        and change nothing. ``protected`` holds the keys that must stay (pinned
        chunks, keys of the store asking for room); it is not kept.
        """

    @abstractmethod
    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Stop tracking ``keys`` (left the tier without eviction); unknown keys are ignored."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history such as ghost lists)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked keys."""
