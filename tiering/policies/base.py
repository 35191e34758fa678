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

One optional method: ``statistics()`` returns a `PolicyStatistics` snapshot
(tracked keys, remembered history such as ghost lists and its bound, an
estimate of the metadata's memory, and figures of the policy's own). The
default reports the tracked keys only; a policy with history overrides it.

Ordering: a prefix is only useful from its head, so policies evict a request's
tail before its head. `LRUPolicy` guarantees it for the keys of the latest
``insert`` or ``touch`` of a request. `ARCPolicy` guarantees it within each of
its lists; a head kept for its frequency in T2 may outlive a tail in T1, and
the reverse (a documented trade of the algorithm). `ASLRUPolicy` guarantees it
within each of its segments, and promotes a tail only with its head.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence

import msgspec

from tiering._types import OffloadKey

__all__ = ["CachePolicy", "PolicyStatistics", "estimate_entry_bytes"]

# Measured with tracemalloc on CPython 3.11-3.13, 64-bit: an OrderedDict entry,
# and what a remembered (evicted) key adds: its int value and the 12-byte key
# object, which only the history keeps alive once the tier dropped the chunk.
_ENTRY_BYTES = 105
_HISTORY_EXTRA_BYTES = 28 + 45


def estimate_entry_bytes(tracked: int, history: int = 0) -> int:
    """Bytes that ``tracked`` keys and ``history`` remembered keys take, roughly."""
    return tracked * _ENTRY_BYTES + history * (_ENTRY_BYTES + _HISTORY_EXTRA_BYTES)


class PolicyStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a policy's metadata; ``history`` never exceeds ``history_limit``."""

    name: str
    tracked: int
    history: int = 0
    history_limit: int = 0
    metadata_bytes: int = 0
    detail: dict[str, float] = msgspec.field(default_factory=dict)


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

    def statistics(self) -> PolicyStatistics:
        """A snapshot of the policy's metadata (tracked keys, history, an estimate of bytes)."""
        tracked = len(self)
        return PolicyStatistics(
            name=self.name, tracked=tracked, metadata_bytes=estimate_entry_bytes(tracked)
        )
