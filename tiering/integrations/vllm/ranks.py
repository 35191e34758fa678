"""`RankedTier`: one tier below `TieringSpec`'s CPU tier, over every worker's share of it.

At tensor-parallel size N on one node, each of vLLM's N workers holds its own
pages of every chunk, in a host pool of its own (``/dev/shm``, `worker.py`):
row ``c`` of worker ``r``'s pool is rank ``r``'s pages of the chunk in slot
``c``. The scheduler maps all N pools, and a tier below keeps a value per
rank: N adapters of the same entry, one over each pool, their values apart
(the Redis tier's namespace, the disk tier's folder, name the rank).

Design note, why per-rank values and not one value of all ranks' pages:
vLLM's native spec has one host region whose row holds every rank's pages, so
its tiers read one value per chunk; here the ranks' rows are N separate
mappings, and one value would need a gather copy per write and a scatter per
read on the scheduler's side. Per-rank values are read and written straight
from each rank's row, each checked on its own (the tiers' codec), and cost N
small values instead of one large one.

What makes the N values one chunk (`RankedTier` is the composite vLLM's
scheduler-side link sees as one ``SecondaryTierManager``):

- **Lookup.** The chunk is a ``HIT`` only when every rank's tier holds it, a
  ``MISS`` as soon as one rank's tier lacks it (so a value missing for one rank
  is a miss for the chunk), ``RETRY`` until then.
- **Write-through.** A store job goes to every rank's tier under the job's id;
  it is reported once, when every rank has reported it, successful only when
  every rank wrote every chunk (a rank that failed leaves the chunk a miss).
- **Promotion.** A load job goes to every rank's tier; a chunk loaded is one
  every rank loaded (``successful_keys``: the chunks all ranks loaded). A value
  missing or damaged for one rank fails the chunk, whose CPU slot the link
  then frees: what the other ranks read into their rows of that slot is never
  handed to a worker, so there is never a partial load.

Events (with the entry's ``enable_kv_events`` and vLLM's KV events on) say what
the chunk is, not what one rank's value is: a chunk is stored once every rank
wrote it in one job (a rank that failed its store leaves it unannounced, as it
leaves it a miss), and removed as soon as one rank's value goes (evicted from
that rank's folder: the chunk is a miss from then on); the ranks' own stored
records are dropped.

Each rank's adapter logs what it lost under its rank's name
(``RedisSecondaryTier rank 1``). The lines of a
tier's state (cannot be used, down, back up, backing off) are rank 0's alone:
every rank's adapter reaches the same store, so N ranks would say each change N
times; ranks above 0 are built inside `building_rank`, which keeps what they and
their tiers log at WARNING or below (on the scheduler's thread while built, on
their loop's thread and its workers after: those tasks keep the context they
were started in) out of the log. A rank's own state stays in its statistics
(`RankedTier.statistics`) and in vLLM's metrics; its errors (ERROR) are logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.integrations.vllm.polled import PolledSecondaryTier

__all__ = ["RankedTier", "building_rank"]

#: True while a rank above 0's adapter is built, and in its tier's loop's tasks after.
_QUIET = contextvars.ContextVar("tiering_quiet_rank", default=False)


class _QuietRanks(logging.Filter):
    """Drops what a rank above 0 logs at WARNING or below (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING or not _QUIET.get()


_FILTER = _QuietRanks()

#: A gauge's type in vLLM's offloading stats payload (``metric_sections``).
_GAUGE = "gauge"


def _filter_tiering_loggers() -> None:
    """`_FILTER` on every ``tiering`` logger made so far (a logger's filters see only
    its own records, not those of the loggers below it)."""
    names = [n for n in logging.Logger.manager.loggerDict if n.split(".")[0] == "tiering"]
    for name in ["tiering", *names]:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


@contextlib.contextmanager
def building_rank(rank: int) -> Iterator[None]:
    """Build rank ``rank``'s adapter of a tier inside: above rank 0, its lines of state
    are left to rank 0's (see the module docstring)."""
    if rank == 0:
        yield
        return
    _filter_tiering_loggers()
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
        _filter_tiering_loggers()  # the modules the factory imported meanwhile


class _Job:
    """A job handed to every rank: the ranks still to report it, and what they did."""

    __slots__ = ("bytes", "keys", "left", "loaded", "seconds", "store", "success")

    def __init__(self, keys: Collection[OffloadKey], ranks: int, *, store: bool) -> None:
        self.keys = tuple(keys)
        self.store = store
        self.left = ranks
        self.success = True
        self.loaded = set(self.keys)  # what every rank reported so far loaded (or wrote)
        self.seconds: float | None = None
        self.bytes: int | None = None

    def add(self, result: JobResult) -> None:
        self.left -= 1
        self.success = self.success and result.success
        if not result.success:
            self.loaded &= set(result.successful_keys or ())
        if result.transfer_time is not None:  # the ranks ran side by side: the slowest
            self.seconds = max(self.seconds or 0.0, result.transfer_time)
        if result.transfer_bytes is not None:
            self.bytes = (self.bytes or 0) + result.transfer_bytes

    def result(self, job_id: int) -> JobResult:
        some = [key for key in self.keys if key in self.loaded]
        return JobResult(
            job_id=job_id,
            success=self.success,
            successful_keys=None if self.success or not some else tuple(some),
            transfer_time=self.seconds,
            transfer_bytes=self.bytes,
        )


class RankedTier(SecondaryTierManager):
    """One tier below the CPU tier as ``ranks[r]`` (rank ``r``'s adapter over its own
    pool) make it: see the module's docstring. Owns the adapters (`shutdown`);
    ``events``: whether the adapters emit KV events (then so does this tier)."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        ranks: Sequence[SecondaryTierManager],
        *,
        events: bool = False,
    ) -> None:
        if len(ranks) < 2:
            raise ConfigError(
                f"a tier over every worker's rows needs two ranks or more, got {len(ranks)}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.ranks = tuple(ranks)
        for rank, tier in enumerate(ranks):  # what each rank's adapter logs names its rank
            tier.tier_type = f"{tier_type} rank {rank}"
        self.locality = ranks[0].locality
        self._jobs: dict[int, _Job] = {}  # in flight, by vLLM's job id
        self._done: list[JobResult] = []  # reported by every rank, not yet collected
        #: Each gauge's last value from each rank, by (name, labels).
        self._gauges: dict[tuple[str, tuple[str, ...]], dict[int, float]] = {}
        # Chunks every rank wrote, by store job, not yet announced (None: no events).
        self._whole: list[list[OffloadKey]] | None = [] if events else None

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        answer = LookupResult.HIT
        for tier in self.ranks:
            found = tier.lookup(key, req_context)
            if found is LookupResult.MISS:
                return LookupResult.MISS  # one rank lacks it: the chunk is a miss
            if found is not LookupResult.HIT:
                answer = LookupResult.RETRY
        return answer

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        contexts = [tier.on_new_request(req_context) for tier in self.ranks]
        return contexts[0]

    def on_request_finished(self, req_context: ReqContext) -> None:
        for tier in self.ranks:
            tier.on_request_finished(req_context)

    def on_schedule_end(self, context: Any) -> None:
        for tier in self.ranks:
            tier.on_schedule_end(context)

    # -- jobs -------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = _Job(job_metadata.keys, len(self.ranks), store=True)
        for tier in self.ranks:
            tier.submit_store(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = _Job(job_metadata.keys, len(self.ranks), store=False)
        for tier in self.ranks:
            tier.submit_load(job_metadata)

    def submit_hint(self, keys: Sequence[OffloadKey], hint: Hint) -> None:
        """A request's retention ``hint`` for the values of ``keys``: every rank's."""
        for tier in self.ranks:
            if isinstance(tier, PolledSecondaryTier):
                tier.submit_hint(keys, hint)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        for tier in self.ranks:
            for result in tier.get_finished_jobs():
                job = self._jobs.get(result.job_id)
                if job is None:
                    continue
                job.add(result)
                if job.left == 0:
                    del self._jobs[result.job_id]
                    self._done.append(job.result(result.job_id))
                    if job.store and self._whole is not None:
                        self._whole.append([key for key in job.keys if key in job.loaded])
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._done) or any(t.has_pending_work() for t in self.ranks)

    def drain_jobs(self) -> None:
        for tier in self.ranks:
            tier.drain_jobs()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The chunks every rank wrote since the last call, then those a rank's value of
        left (each once): see the module's docstring."""
        removed: list[OffloadingEvent] = []
        gone: set[OffloadKey] = set()
        for tier in self.ranks:
            for event in tier.take_events():  # a rank's stored records are not the chunk's
                keys = [key for key in event.keys if key not in gone] if event.removed else []
                if keys:
                    gone.update(keys)
                    removed.append(dataclasses.replace(event, keys=keys))
        stored: list[OffloadingEvent] = []
        if self._whole:
            medium = self.ranks[0].medium
            stored = [
                OffloadingEvent(keys=keys, medium=medium, removed=False, locality=self.locality)
                for keys in self._whole
                if keys
            ]
            self._whole.clear()
        return stored + removed

    # -- seeing state -----------------------------------------------------------

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The ranks' observations added up (each rank's tier counts its own calls); a
        gauge is the least of the ranks' last values (``up``: 1 only while every rank's
        tier is up), sent when one rank's moved (vLLM keeps a payload's last gauge)."""
        merged: OffloadingConnectorStats | None = None
        moved = False
        for rank, tier in enumerate(self.ranks):
            theirs = tier.get_stats()
            if theirs is None:
                continue
            types, values = theirs.metric_sections()
            for name, by_labels in values.items():
                if types.get(name) == _GAUGE:
                    moved = True
                    for labels, value in by_labels.items():
                        self._gauges.setdefault((name, labels), {})[rank] = value
            merged = theirs if merged is None else merged.aggregate(theirs)
        if merged is not None and moved:
            for (name, labels), by_rank in self._gauges.items():
                merged.set_gauge(name, min(by_rank.values()), labels)
        return merged

    def config_info(self) -> Mapping[str, str | int | float | bool]:
        info: Mapping[str, str | int | float | bool] = self.ranks[0].config_info()
        return info

    def statistics(self) -> tuple[Any, ...]:
        """Each rank's tier's statistics, by rank (those that have them)."""
        return tuple(tier.statistics() for tier in self.ranks if hasattr(tier, "statistics"))

    def shutdown(self) -> None:
        for tier in self.ranks:
            tier.shutdown()

    def __repr__(self) -> str:
        return f"<RankedTier {self.tier_type} over {len(self.ranks)} ranks; {len(self._jobs)} jobs>"
