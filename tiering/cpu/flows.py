"""`Flows`: the bookkeeping of a CPU tier's write-throughs to the tiers below it and of
promotions from them, synchronous and in one place.

Two shells drive the same core; neither decides anything the core decides::

    tiering.engine ──> secondary.chain.TierChain ──────┐ promote: reserve, read, settle
                        └─> secondary.cascade.         │
                            SecondaryCascade (a tier) ─┤ stored: reserve, queue, write, settle
                                                       ├──> cpu.flows.Flows ──> cpu.manager
    vLLM's scheduler ─> integrations.vllm.manager      │     (pins, slots,      (CPUOffloading-
                         └─> integrations.vllm.link.   │      counts, resets)    Manager)
                             SecondaryLink ────────────┘ landed / lookup: reserve, submit,
                                                         collect: settle

The shells keep what is theirs: the engine's queue and write-through tasks and
the tiers' I/O; vLLM's polled jobs and its lookup answers. The core holds no
lock, awaits nothing and does no I/O (layer 2, as `tiering.scheduler._plan`):
every method returns at once, so it is tested without an event loop.

Why it is one core:

- **Write-through pins** (`reserve_write` -> a `WriteTicket` naming the chunk
  slots to read, or None with the chunks counted as dropped; `settle_write`
  unpins and counts). One drop rule: a landed batch that would take a tier's
  pins past its share of the bound is dropped whole (the GPU path never waits
  for a tier, and a slow tier never pins so much that stores find no room).
  Whole, not the head that fits: the simulation of a disk tier predicts the
  engine's hits by tier exactly with this rule (tests/test_simulate_disk.py).
  The bound is shared by the tiers below, split evenly: ``max(1, pin_bound //
  tiers)`` each (`default_pin_bound`: half the CPU tier).
- **Promotion slots** (`reserve_promotion` -> a `PromotionTicket` with fresh
  slots, or None with the allocation failure counted; `settle_promotion` keeps
  what loaded, frees the rest, and keeps nothing if a reset voided the job).
  `Keep.LEADING_RUN` (the engine's: a request's run after its hits) tries half
  the run, then half again, when there is no room for all, and keeps the
  leading run that loaded; `Keep.EACH_LOADED` (vLLM's: the chunks a step
  promotes) takes all or none and keeps every chunk that loaded.
- **Resets.** `reset` voids every ticket out: a write whose rows now belong to
  another chunk is not started (`begin_write` says so) and counts as failed; a
  promotion whose slots the reset freed keeps nothing. With ``fence`` nothing is
  written through or promoted until `reset_flushed` (vLLM's workers may still
  copy into freed rows until they report the reset's jobs flushed).
- **Counts** (`FlowCounts`, one per tier) always add up:
  ``cascade_queued = cascade_written + cascade_failed + cascade_pinned`` and
  ``promote_reserved = promoted + promote_failed + promoting``.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Sequence

import msgspec

from tiering._types import OffloadKey
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import ChunkStateError, ConfigError
from tiering.hints import Hint

__all__ = [
    "FlowCounts",
    "FlowJob",
    "FlowKind",
    "Flows",
    "Keep",
    "PromotionSettled",
    "PromotionTicket",
    "WriteTicket",
    "default_pin_bound",
]


def default_pin_bound(capacity: int) -> int:
    """The chunks write-throughs may pin at once in a CPU tier of ``capacity`` chunks
    unless told otherwise: half of it (at least one), so stores always find room."""
    return max(1, capacity // 2)


class FlowKind(enum.StrEnum):
    """What a job of the flows does in the CPU tier (a `str`: a job id hashes fast)."""

    WRITE = "write"  # pins landed chunks while a tier below reads their rows
    PROMOTE = "promote"  # fills fresh slots with chunks a tier below holds


_WRITE, _PROMOTE = FlowKind.WRITE, FlowKind.PROMOTE  # looked up once, not per job


class Keep(enum.Enum):
    """What a promotion keeps of the chunks it asked for (see the module's note)."""

    LEADING_RUN = "leading_run"
    EACH_LOADED = "each_loaded"


class FlowJob(msgspec.Struct, frozen=True, gc=False):
    """A job id of the flows in the CPU tier's manager (hashable, unique per `Flows`):
    its kind, the tier label it is for (a promotion's: every tier's, joined by ``+``)
    and its number (what vLLM's tier is told as its ``job_id``)."""

    kind: FlowKind
    tier: str
    number: int


class WriteTicket(msgspec.Struct, frozen=True, gc=False):
    """Chunks pinned for a write-through to tier ``tier`` (an index): the rows of
    ``chunk_ids`` hold ``keys`` until the ticket is settled or a reset voids it;
    ``hint`` is the retention hint of the store that made them (`tiering.hints`)."""

    job: FlowJob
    tier: int
    keys: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    generation: int
    hint: Hint | None = None


class PromotionTicket(msgspec.Struct, frozen=True, gc=False):
    """Fresh slots ``chunk_ids`` for ``keys`` (being written in the CPU tier), each to
    be read from tier ``sources[i]``; ``wanted`` are the keys asked for after the
    caller's head (a head chunk evicted since the lookup is read back too, from the
    first tier)."""

    job: FlowJob
    keys: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    sources: tuple[int, ...]
    wanted: frozenset[OffloadKey]
    keep: Keep


class PromotionSettled(msgspec.Struct, frozen=True, gc=False):
    """What a settled promotion kept (ready in the CPU tier now) and lost (slots freed);
    ``by_tier`` counts the kept chunks that were wanted, by tier label (only tiers that
    gave some); ``write_up[i]`` are the kept chunks tier ``i`` lacked (a lower tier gave
    them), to be written through to it."""

    kept: tuple[OffloadKey, ...] = ()
    lost: tuple[OffloadKey, ...] = ()
    by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    write_up: tuple[tuple[OffloadKey, ...], ...] = ()


class FlowCounts(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One tier's flows, in chunks. ``cascade_*`` count write-throughs: ``queued`` (pinned
    to be written), ``written``, ``dropped`` (never pinned: over the bound, intake
    closed, fenced, or the shell's queue full), ``failed`` (pinned and not written),
    ``pinned`` (now, at most ``max_pinned``). ``promote_*`` count promotions from
    this tier: ``reserved`` (given fresh slots), ``promoted``, ``failed`` (given
    slots and not kept), ``no_room`` (asked for and given no slot), ``promoting`` now.
    """

    cascade_queued: int = 0
    cascade_written: int = 0
    cascade_dropped: int = 0
    cascade_failed: int = 0
    cascade_pinned: int = 0
    cascade_max_pinned: int = 0
    promote_reserved: int = 0
    promoted: int = 0
    promote_failed: int = 0
    promote_no_room: int = 0
    promoting: int = 0


class _Tier:
    """A tier's live counts (`FlowCounts` is their snapshot)."""

    __slots__ = ("counts", "intake", "max_pinned", "reading")

    def __init__(self, max_pinned: int) -> None:
        self.max_pinned = max_pinned
        self.intake = False
        self.reading = 0  # chunks whose rows a write is reading now
        self.counts = dict.fromkeys(FlowCounts.__struct_fields__, 0)
        self.counts["cascade_max_pinned"] = max_pinned


class Flows:
    """The write-throughs from the CPU tier ``manager`` to the tiers ``labels`` (in order)
    and the promotions from them.

    ``pin_bound`` is how many chunks write-throughs may pin at once, split evenly
    between the tiers. Intake starts closed: `open_intake` before landed chunks
    are written through.
    """

    def __init__(
        self, manager: CPUOffloadingManager, labels: Sequence[str], *, pin_bound: int
    ) -> None:
        if not labels:
            raise ConfigError("the flows need at least one tier below the CPU tier")
        if len(set(labels)) != len(labels):
            raise ConfigError(
                f"every tier below the CPU tier needs its own label, got {list(labels)}; "
                "give each tier a label of its own (e.g. disk, remote)"
            )
        self.labels = tuple(labels)
        self._manager = manager
        share = max(1, pin_bound // len(labels))
        self._tiers = [_Tier(share) for _ in labels]
        self._all = "+".join(labels)
        self._numbers = itertools.count()
        self._writes: dict[FlowJob, bool] = {}  # open write tickets -> whether begun
        self._promotions: set[FlowJob] = set()  # open promotion tickets
        self._generation = 0  # bumped by a reset: tickets of older ones are void
        self._fenced = False

    # -- intake and resets ----------------------------------------------------------

    def open_intake(self, tier: int | None = None) -> None:
        """Write landed chunks through to ``tier`` (every tier if None) from now on."""
        for state in self._pick(tier):
            state.intake = True

    def close_intake(self, tier: int | None = None) -> None:
        """Drop (and count) what lands for ``tier`` (every tier if None) from now on."""
        for state in self._pick(tier):
            state.intake = False

    def _pick(self, tier: int | None) -> list[_Tier]:
        return self._tiers if tier is None else [self._tiers[tier]]

    @property
    def fenced(self) -> bool:
        """Whether a fenced reset is not flushed yet (nothing written through or promoted)."""
        return self._fenced

    def check_reset(self, *, force: bool) -> None:
        """Refuse (`ChunkStateError`) a reset of the CPU tier while write-throughs are
        pinned (unless ``force``) or read its rows (even forced: a reset would hand
        those rows out)."""
        reading = any(t.reading for t in self._tiers)
        if reading or (not force and self._writes):
            raise ChunkStateError(
                "cannot reset the tier while chunks are being written through to the "
                "secondary tier; wait for them (statistics().secondary)"
                + ("" if reading else " or pass force=True")
            )

    def reset(self, *, fence: bool = False) -> None:
        """The CPU tier was reset (or is about to be): every ticket out is void. With
        ``fence``, nothing is written through or promoted until `reset_flushed`."""
        self._generation += 1
        self._fenced = self._fenced or fence

    def reset_flushed(self) -> None:
        """Every copy into the CPU tier's rows from before the reset has ended."""
        self._fenced = False

    # -- write-through --------------------------------------------------------------

    def pinned(self, tier: int) -> int:
        return self._tiers[tier].counts["cascade_pinned"]

    def max_pinned(self, tier: int) -> int:
        return self._tiers[tier].max_pinned

    def reading(self, tier: int) -> int:
        """Chunks of ``tier``'s write-throughs whose rows are being read now."""
        return self._tiers[tier].reading

    def reserve_write(
        self, tier: int, keys: Sequence[OffloadKey], hint: Hint | None = None
    ) -> WriteTicket | None:
        """Pin landed ``keys`` to be written through to ``tier`` (with the ``hint`` of the
        store that made them); None (the chunks counted as dropped) when the intake is
        closed, fenced, or they would take the tier's pins past its bound (a batch is
        dropped whole), or one is no longer ready."""
        if not keys:
            return None
        state = self._tiers[tier]
        counts = state.counts
        n = len(keys)
        if self._fenced or not state.intake or counts["cascade_pinned"] + n > state.max_pinned:
            counts["cascade_dropped"] += n  # pins past the bound would leave stores no room
            return None
        job = FlowJob(_WRITE, self.labels[tier], next(self._numbers))
        try:
            spec = self._manager.prepare_load(keys, job=job, count=False)
        except ChunkStateError:  # evicted already (a tiny tier): nothing to write
            counts["cascade_dropped"] += n
            return None
        self._writes[job] = False
        counts["cascade_queued"] += n
        counts["cascade_pinned"] += n
        ids = tuple(spec.chunk_ids.tolist())
        return WriteTicket(job, tier, tuple(keys), ids, self._generation, hint)

    def refuse_write(self, ticket: WriteTicket) -> None:
        """The shell could not queue ``ticket`` (its queue is full or closed): unpin its
        chunks and count them as dropped, not queued."""
        begun = self._writes.pop(ticket.job, None)
        if begun is None:
            return
        self._manager.complete_load(job=ticket.job)
        state = self._tiers[ticket.tier]
        n = len(ticket.keys)
        if begun:
            state.reading -= n
        counts = state.counts
        counts["cascade_queued"] -= n
        counts["cascade_pinned"] -= n
        counts["cascade_dropped"] += n

    def begin_write(self, ticket: WriteTicket) -> bool:
        """Whether to read ``ticket``'s rows now: False if a reset voided it (the rows
        hold other chunks; settle it with nothing written)."""
        if ticket.generation != self._generation or self._writes.get(ticket.job) is not False:
            return False
        self._writes[ticket.job] = True
        self._tiers[ticket.tier].reading += len(ticket.keys)
        return True

    def settle_write(self, ticket: WriteTicket, written: int) -> bool:
        """The tier wrote ``written`` of ``ticket``'s chunks (the rest failed): unpin them
        all. Idempotent. Returns whether the batch was written whole."""
        begun = self._writes.pop(ticket.job, None)
        if begun is None:
            return False
        state = self._tiers[ticket.tier]
        n = len(ticket.keys)
        if begun:
            state.reading -= n
        self._manager.complete_load(job=ticket.job)  # a no-op after a reset
        written = max(0, min(written, n))
        counts = state.counts
        counts["cascade_pinned"] -= n
        counts["cascade_written"] += written
        counts["cascade_failed"] += n - written
        return written == n

    # -- promotion -------------------------------------------------------------------

    def reserve_promotion(
        self,
        head: Sequence[OffloadKey],
        wanted: Sequence[OffloadKey],
        sources: Sequence[int] | None = None,
        *,
        keep: Keep = Keep.LEADING_RUN,
    ) -> PromotionTicket | None:
        """Fresh CPU slots for ``wanted`` (each from tier ``sources[i]``, the first tier if
        None), never evicting the caller's ``head`` for them. None when fenced, when
        nothing is new, or when no room is found (one allocation failure, the chunks
        counted as ``promote_no_room``; `Keep.LEADING_RUN` first tries shorter runs)."""
        if self._fenced or not wanted:
            return None
        manager = self._manager
        source_of = dict(zip(wanted, sources or (0,) * len(wanted), strict=True))
        job = FlowJob(_PROMOTE, self._all, next(self._numbers))
        run = list(wanted)
        output = manager.prepare_store([*head, *run], job=job, count=False)
        while output is None and keep is Keep.LEADING_RUN and len(run) > 1:
            run = run[: len(run) // 2]
            output = manager.prepare_store([*head, *run], job=job, count=False)
        if output is None:
            manager.count_allocation_failure()  # one however many sizes were tried
            for key in dict.fromkeys(wanted):
                self._tiers[source_of[key]].counts["promote_no_room"] += 1
            return None
        keys = output.keys_to_store
        if not keys:
            return None  # all held already: no job was recorded
        # A head chunk evicted since the caller's lookup is read back from the first tier.
        ticket_sources = tuple(source_of.get(key, 0) for key in keys)
        for source in ticket_sources:
            counts = self._tiers[source].counts
            counts["promote_reserved"] += 1
            counts["promoting"] += 1
        self._promotions.add(job)
        ids = tuple(output.store_spec.chunk_ids.tolist())
        return PromotionTicket(job, keys, ids, ticket_sources, frozenset(run), keep)

    def settle_promotion(
        self, ticket: PromotionTicket, loaded: Collection[OffloadKey]
    ) -> PromotionSettled:
        """The tiers gave ``loaded`` of ``ticket``'s chunks: keep what the ticket's `Keep`
        says (nothing if a reset freed its slots), free the rest. Idempotent."""
        if ticket.job not in self._promotions:
            return PromotionSettled()
        self._promotions.discard(ticket.job)
        manager = self._manager
        keys = ticket.keys
        good: list[bool]
        if not manager.store_in_flight(ticket.job):  # reset since: the slots are another's
            good = [False] * len(keys)
        elif ticket.keep is Keep.LEADING_RUN:
            run = 0
            while run < len(keys) and keys[run] in loaded:
                run += 1
            good = [i < run for i in range(len(keys))]
        else:
            good = [key in loaded for key in keys]
        kept = tuple(k for k, ok in zip(keys, good, strict=True) if ok)
        lost = tuple(k for k, ok in zip(keys, good, strict=True) if not ok)
        if manager.store_in_flight(ticket.job):
            manager.complete_store(lost, success=False)  # frees their slots
            manager.complete_store(job=ticket.job, success=True)  # the rest
        by_tier: dict[str, int] = {}
        for key, source, ok in zip(keys, ticket.sources, good, strict=True):
            counts = self._tiers[source].counts
            counts["promoting"] -= 1
            counts["promoted" if ok else "promote_failed"] += 1
            if ok and key in ticket.wanted:
                label = self.labels[source]
                by_tier[label] = by_tier.get(label, 0) + 1
        source_of = dict(zip(keys, ticket.sources, strict=True))
        write_up = tuple(
            tuple(k for k in kept if source_of[k] > tier) for tier in range(len(self._tiers) - 1)
        )
        return PromotionSettled(kept=kept, lost=lost, by_tier=by_tier, write_up=write_up)

    # -- seeing state ----------------------------------------------------------------

    @property
    def open_jobs(self) -> int:
        """Tickets reserved and not settled (write-throughs and promotions)."""
        return len(self._writes) + len(self._promotions)

    def counts(self, tier: int = 0) -> FlowCounts:
        return FlowCounts(**self._tiers[tier].counts)

    def __repr__(self) -> str:
        parts = []
        for label, state in zip(self.labels, self._tiers, strict=True):
            c = state.counts
            parts.append(
                f"{label}: {c['cascade_pinned']}/{state.max_pinned} pinned, "
                f"{c['cascade_written']} written, {c['cascade_dropped']} dropped, "
                f"{c['promoted']} promoted"
            )
        fenced = "; fenced" if self._fenced else ""
        return f"<Flows [{'; '.join(parts)}{fenced}]>"
