"""The scheduler: store and load jobs between the chunk manager and a transfer backend.

Three parts, from the bottom up:

- `_plan` (pure: no event loop, no I/O): `Planner` keeps the queues and the
  budgets of both directions, cuts loads into slices and decides which slice
  goes to the backend next; `SchedulerLimits` are its bounds.
- `_jobs`: what callers hold: `JobHandle`, `JobResult`, `JobOutcome`, and the
  statistics records.
- `_scheduler`: `Scheduler`, the anyio shell that prepares and completes jobs in
  the manager, carries out the planner's dispatches on the backend and turns
  completions into results.

Importing it loads neither torch nor a backend: the backend is built by the
factory the owner passes in.
"""

from __future__ import annotations

from typing import Any as _Any

from tiering._exports import load as _load
from tiering.scheduler._jobs import (
    LATENCY_BUCKETS,
    DirectionStatistics,
    JobHandle,
    JobOutcome,
    JobResult,
    SchedulerStatistics,
    manager_job,
)
from tiering.scheduler._plan import SchedulerLimits
from tiering.scheduler._scheduler import Scheduler
from tiering.specs import chunk_block_ranges, select_chunks

__all__ = [
    "LATENCY_BUCKETS",
    "DirectionStatistics",
    "JobHandle",
    "JobOutcome",
    "JobResult",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerStatistics",
    "chunk_block_ranges",
    "manager_job",
    "select_chunks",
]


#: Names kept from earlier shapes: each warns, naming its replacement.
_DEPRECATED = {"JobKind": ("tiering._types", "TransferDirection", "tiering.TransferDirection")}


def __getattr__(name: str) -> _Any:
    return _load(__name__, globals(), name, deprecated=_DEPRECATED)
