"""`TierChain`: the tiers below a CPU tier, in order (a disk, then a shared Redis, say).

- **Write-through, per tier.** Every store that lands in the CPU tier is
  queued to each tier's own `SecondaryCascade`: each is bounded on its own (a
  full queue drops and counts, per tier), so a slow Redis never holds back the
  disk and the GPU path never waits for either. The pins they may hold are one
  bound (half the CPU tier by default) split evenly between them.
- **Promotion, tier by tier.** A request's chunks that follow what the CPU tier
  holds are asked about in the first tier in one round trip, those it lacks in
  the next, and so on (one round trip per tier per request). The leading run
  that some tier holds is read into fresh CPU slots, each chunk from the first
  tier that has it (one read per tier). A chunk read from a lower tier is then
  written through to the tiers above it that lacked it, so the next lookup
  finds it closer.

Hints (`tiering.hints`): a store that lands hands the chain the keys it wrote
with the retention hint it was submitted with (the scheduler's job carries it,
see `Scheduler`'s ``on_stored``; a failed store hands nothing), and their
write-through carries it to every tier (`SecondaryTier.write_hinted`). `hint`
applies one to values the tiers hold already, one round trip per tier (a value
whose write-through is still on its way gets its store's hint, not this one).

Attribution: each tier counts what it gave (`SecondaryTierStatistics.promoted`),
and a `Promotion` says how many chunks came from which tier, by label.

Every decision (pins, the drop rule, the bound split between the tiers, the
slots of a promotion and what it keeps, resets, the counts) is one
`tiering.cpu.flows.Flows` shared by the tiers' cascades; the chain asks the
tiers and reads the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio
import anyio.abc
import anyio.lowlevel

from tiering._types import OffloadKey
from tiering.cpu.flows import Flows, Keep
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.secondary.base import SecondaryTier
from tiering.secondary.cascade import (
    CascadeLimits,
    Promotion,
    SecondaryCascade,
    SecondaryTierStatistics,
)

__all__ = ["TierChain"]


class TierChain:
    """The write-throughs to ``tiers`` (in order) and the promotions from them.

    ``manager``, ``row`` and ``row_bytes`` are the CPU tier's (see
    `SecondaryCascade`); ``on_written(tier)`` (if given) makes each tier's
    announcer of batches written whole. The chain owns the tiers: `aclose` closes
    them.
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        manager: CPUOffloadingManager,
        row: Callable[[int], memoryview],
        *,
        row_bytes: int,
        limits: CascadeLimits | None = None,
        on_written: Callable[[SecondaryTier], Callable[[Sequence[OffloadKey]], None]] | None = None,
    ) -> None:
        if not tiers:
            raise ConfigError("a chain of tiers needs at least one tier")
        limits = limits or CascadeLimits()
        labels = [tier.label for tier in tiers]
        self.flows = Flows(manager, labels, pin_bound=limits.max_pinned(manager.capacity))
        self.cascades = [
            SecondaryCascade(
                tier,
                manager,
                row,
                row_bytes=row_bytes,
                limits=limits,
                on_written=on_written(tier) if on_written is not None else None,
                flows=self.flows,
                index=index,
            )
            for index, tier in enumerate(tiers)
        ]
        self.tiers = tuple(tiers)
        self._manager = manager
        self._row = row

    # -- life: each cascade's --------------------------------------------------------

    def start(self, task_group: anyio.abc.TaskGroup) -> None:
        for cascade in self.cascades:
            cascade.start(task_group)

    def stop_intake(self) -> None:
        for cascade in self.cascades:
            cascade.stop_intake()

    async def aclose(self) -> None:
        """Stop every write-through and close every tier (even when cancelled). Idempotent."""
        with anyio.CancelScope(shield=True):
            for cascade in self.cascades:
                cascade.stop_intake()
            for cascade in self.cascades:
                await cascade.aclose()

    async def wait_idle(self) -> None:
        for cascade in self.cascades:
            await cascade.wait_idle()

    def stored(self, keys: tuple[OffloadKey, ...], hint: Hint | None = None) -> None:
        """A store of ``keys`` with ``hint`` (or none) landed in the CPU tier: queue them
        to every tier, with the hint."""
        for cascade in self.cascades:
            cascade.stored(keys, hint)

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """Apply ``hint`` to the values of ``keys`` every tier holds (one round trip per
        tier that honours hints; counted as ignored by the others). A checkpoint."""
        for cascade in self.cascades:
            await cascade.hint(keys, hint)

    def check_reset(self, *, force: bool) -> None:
        """Refuse (`ChunkStateError`) a reset while write-throughs hold the CPU tier's
        rows (see `Flows.check_reset`)."""
        self.flows.check_reset(force=force)

    def tier_reset(self) -> None:
        """The CPU tier was reset: every write-through and promotion out is void."""
        self.flows.reset()

    # -- promotion --------------------------------------------------------------------

    async def promote(self, keys: Sequence[OffloadKey], start: int = 0) -> Promotion:
        """Bring the chunks after the first ``start`` of ``keys`` in from the tiers.

        The chunks that follow and are in no tier above are asked about tier by
        tier (one round trip each; a tier is asked only about what the tiers
        above it lack). The leading run the tiers hold is read into fresh CPU
        slots, never evicting the request's first ``start`` chunks for them.
        Always a checkpoint.
        """
        manager = self._manager
        candidates: list[OffloadKey] = []
        for key in keys[start:]:
            if manager.holds(key):
                break  # in the CPU tier already (or being written): the run ends here
            candidates.append(key)
        source: list[int | None] = [None] * len(candidates)
        asked = False
        missing = list(range(len(candidates)))
        for index, cascade in enumerate(self.cascades):
            if not missing:
                break  # the tiers above have them all
            present = await cascade.tier.contains([candidates[i] for i in missing])
            asked = True
            for position, found in zip(missing, present, strict=True):
                if found:
                    source[position] = index
            missing = [i for i in missing if source[i] is None]
        if not asked:
            await anyio.lowlevel.checkpoint()  # every promotion yields, even with nothing to ask
        run = 0
        while run < len(source) and source[run] is not None:
            run += 1
        by_tier: dict[str, int] = {}
        if run:
            by_tier = await self._read(keys[:start], candidates[:run], source[:run])
        ready = 0
        for key in keys[start:]:
            if not manager.holds(key, ready=True):
                break
            ready += 1
        return Promotion(ready=ready, promoted=min(sum(by_tier.values()), ready), by_tier=by_tier)

    async def _read(
        self,
        head: Sequence[OffloadKey],
        wanted: Sequence[OffloadKey],
        source: Sequence[int | None],
    ) -> dict[str, int]:
        """Read ``wanted`` (each from its ``source`` tier) into fresh slots; the request's
        ``head`` is never evicted for them. Returns the chunks promoted, by tier label."""
        sources = [s or 0 for s in source]
        ticket = self.flows.reserve_promotion(head, wanted, sources, keep=Keep.LEADING_RUN)
        if ticket is None:
            return {}  # no room in the CPU tier: the request recomputes
        loaded: set[OffloadKey] = set()
        try:
            for index, cascade in enumerate(self.cascades):
                mine = [i for i, s in enumerate(ticket.sources) if s == index]
                if not mine:
                    continue
                rows = [(ticket.keys[i], self._row(ticket.chunk_ids[i])) for i in mine]
                for i, ok in zip(mine, await cascade.tier.read(rows), strict=True):
                    if ok:
                        loaded.add(ticket.keys[i])
        finally:
            settled = self.flows.settle_promotion(ticket, loaded)
        for cascade, keys in zip(self.cascades, settled.write_up, strict=False):
            if keys:  # a lower tier gave them: written through to this one, which lacked them
                cascade.stored(keys)
        return settled.by_tier

    # -- seeing state -----------------------------------------------------------------

    def statistics(self) -> tuple[SecondaryTierStatistics, ...]:
        return tuple(cascade.statistics() for cascade in self.cascades)

    def __repr__(self) -> str:
        return f"<TierChain [{', '.join(t.label for t in self.tiers)}]>"
