"""A disk tier below the CPU tier, as `tiering replay --disk` runs one, without bytes.

As `tiering.secondary.chain.TierChain` over a `DiskTier`, the disk tier's index
is a second manager of ``disk_tokens // block_tokens`` chunks with a policy of
its own (a `DiskTier` of B bytes holds B // (row bytes + a 4 KiB head) chunks).
Each request:

1. Promotion: the chunks after the CPU tier's hits, up to the first the CPU
   tier holds, are looked up in the disk tier (no use of them), and its leading
   run of them is read into fresh CPU slots, never evicting the request's hits
   (half the run, then half again, when there is no room for all; a read is a
   use of the disk's chunk). The hits then go on over every chunk ready in the
   CPU tier, as the engine counts them: those read are the disk tier's.
2. The request as without a disk tier, from its hits on.
3. Write-through: the chunks the request stored (not the promoted ones) are
   written to the disk tier, the head of the batch when there is no room for
   all; a new chunk joins its policy, a rewrite of one it held is a use. A
   store of more chunks than the write-through may pin in the CPU tier at once
   (half of it, `tiering.cpu.flows.default_pin_bound`) is not written: the engine drops it.

A request's retention hint reaches both tiers as the engine's does: the CPU
tier's touch, and the disk tier's index with the write-through of the chunks
it stored (each chunk written, new or rewritten, noted once with the store's
hint, as `DiskIndex.written`). A read from the disk is a use without a hint, as
`DiskIndex.touch` (the engine's touch does no I/O: its hint reaches the CPU
tier only).

Where it differs from the engine: here each write-through lands before the
next request. The engine writes through in the background and does not wait:
the next request can miss a chunk still being written, and stores that find
the write queue full are dropped, so a disk slower than the stores hits less
than predicted here, even at ``--concurrency 1`` (much less where its writes
fall far behind). With every write-through awaited before the next promotion,
the engine's hits by tier over a `DiskTier` were checked equal to these for
LRU, and within 1% for ARC and ASLRU (the `DiskTier` evicts before it inserts
the new chunks in its policy, the manager after).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering._types import OffloadKey
from tiering.cpu.flows import default_pin_bound
from tiering.cpu.manager import CPUOffloadingManager
from tiering.hints import Hint
from tiering.sim.one_tier import OneTier

__all__ = ["Chain"]


class _Held:
    """The chunks a manager holds, as a container (`HintBook.note`'s ``held``)."""

    __slots__ = ("_holds",)

    def __init__(self, manager: CPUOffloadingManager) -> None:
        self._holds = manager.holds

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._holds(OffloadKey(key))


class Chain(OneTier):
    """The CPU tier ``cpu`` over the disk tier's index ``disk`` (a
    `tiering.sim.result.Simulation`): promotion, then the one-tier steps, then the
    write-through of what the request stored (module docstring)."""

    def __init__(
        self,
        cpu: CPUOffloadingManager,
        disk: CPUOffloadingManager,
        *,
        policy: str,
        capacity_tokens: int,
        disk_tokens: int,
    ) -> None:
        super().__init__(cpu, policy=policy, capacity_tokens=capacity_tokens)
        self._disk = disk
        self._disk_tokens = disk_tokens
        self._max_pinned = default_pin_bound(cpu.capacity)  # the engine's default bound
        self._disk_hit_blocks = self._writes_failed = self._writes_dropped = 0

    def __call__(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> int:
        hits = self._promote(keys, hint)
        stored = self._request(keys, hits, hint)
        if len(stored) > self._max_pinned:  # the engine would pin too much of the CPU tier
            self._writes_dropped += len(stored)
        elif stored:
            self._write_through(stored, hint)
        return hits

    def _promote(self, keys: Sequence[OffloadKey], hint: Hint | None) -> int:
        """The request's hits, after reading the disk's leading run into the CPU tier
        (as `TierChain.promote` and `_read` do)."""
        cpu, disk = self._manager, self._disk
        holds = cpu.holds
        n = len(keys)
        hits = cpu.lookup_prefix(keys)
        end = hits  # the disk's leading run: keys[hits:end], none of them in the CPU tier
        while end < n and not holds(keys[end]) and disk.holds(keys[end]):
            end += 1
        if end == hits:
            return hits
        head, wanted = keys[:hits], keys[hits:end]
        output = cpu.prepare_store([*head, *wanted], count=False)
        while output is None and len(wanted) > 1:
            wanted = wanted[: len(wanted) // 2]
            output = cpu.prepare_store([*head, *wanted], count=False)
        if output is None:
            cpu.count_allocation_failure()
            return hits
        read = output.keys_to_store
        cpu.complete_store(read)
        disk.touch(read)  # a read is a use of the disk's chunk, without a hint (the engine's)
        ready = 0
        for key in keys[hits:]:  # the engine counts on past the run, as here
            if not holds(key, ready=True):
                break
            ready += 1
        self._disk_hit_blocks += min(len(read), ready)
        return hits + ready

    def _write_through(self, stored: tuple[OffloadKey, ...], hint: Hint | None) -> None:
        """Write the landed store to the disk tier, as `DiskTier.write` does."""
        disk = self._disk
        batch = stored
        written = disk.prepare_store(batch)
        while written is None and len(batch) > 1:  # no room for all: keep the head
            batch = batch[: len(batch) // 2]
            written = disk.prepare_store(batch)
        if written is None:
            self._writes_failed += len(stored)
            return
        self._writes_failed += len(stored) - len(batch)
        new = written.keys_to_store
        if new:
            disk.complete_store(new)  # new chunks join the disk's policy, not touched
        if len(new) < len(batch):  # a rewrite of a chunk the disk held is a use of it
            fresh = set(new)
            disk.policy.touch([key for key in batch if key not in fresh])
        book = disk.hints
        if hint is not None or book.engaged:  # every chunk written, with the store's hint
            book.note(batch, hint, _Held(disk))

    def counts(self) -> dict[str, int]:
        return {
            **super().counts(),
            "disk_tokens": self._disk_tokens,
            "disk_capacity_chunks": self._disk.capacity,
            "disk_hit_blocks": self._disk_hit_blocks,
            "disk_writes_failed": self._writes_failed,
            "disk_writes_dropped": self._writes_dropped,
            "disk_evictions": self._disk.statistics().evictions_total,
        }
