"""What a simulation reports, and the loop every simulation shares.

`run_simulation` feeds each request to a `Simulation` (one step per request,
with its retention hint if the run has hints, which returns its hit blocks),
sets the run's `TraceClock` to each request's arrival first, reports progress
now and then, and builds the `SimulationResult` from what the simulation
counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import msgspec

from tiering._types import OffloadKey, make_offload_key
from tiering.errors import CapacityError, ConfigError
from tiering.hints import Hint

__all__ = [
    "OPTIMAL",
    "Progress",
    "Simulation",
    "SimulationResult",
    "TraceClock",
    "capacity_chunks",
    "requests_to_keys",
    "run_simulation",
]

#: The name the offline optimum goes by in results, tables and plots.
OPTIMAL = "optimal"

#: ``progress(done, total, hit_blocks, blocks)``: requests done of ``total``, and
#: the hit and all blocks so far, reported now and then while a run goes on.
Progress = Callable[[int, int, int, int], None]
_PROGRESS_EVERY = 1024  # requests between two progress reports of a simulation


class HasHashIds(Protocol):
    @property
    def hash_ids(self) -> Sequence[int]: ...


class SimulationResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of one (policy, capacity[, disk capacity]) simulation.

    ``hit_blocks`` and ``hit_rate`` count the hits of every tier;
    ``hit_blocks_by_tier`` splits them (``cpu``, and ``disk`` with a disk tier)
    and adds up to ``hit_blocks``. ``store_failures`` and ``evictions`` are the
    CPU tier's; ``disk_writes_failed`` counts chunks whose write-through found no
    room in the disk tier (all of it offered again by the same write), and
    ``disk_writes_dropped`` those of stores too big to write through (more chunks
    than half the CPU tier, which the engine would pin for the write: see
    `tiering.sim.chain`). ``hints`` names where the requests' retention hints came
    from (``none``: no hint, or ``continuation``: `tiering.workload.hints`), and
    ``hint_error`` the share of them flipped; the offline optimum ignores hints
    (its rows say ``none``).
    """

    policy: str
    capacity_tokens: int
    capacity_chunks: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_rate: float
    store_failures: int
    evictions: int
    seconds: float
    keys_per_s: float
    disk_tokens: int | None = None
    disk_capacity_chunks: int = 0
    hit_blocks_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    disk_writes_failed: int = 0
    disk_evictions: int = 0
    disk_writes_dropped: int = 0
    hints: str = "none"
    hint_error: float = 0.0

    @classmethod
    def of(
        cls,
        *,
        policy: str,
        capacity_tokens: int,
        capacity_chunks: int,
        requests: int,
        blocks: int,
        hit_blocks: int,
        store_failures: int,
        evictions: int,
        seconds: float,
        disk_tokens: int | None = None,
        disk_capacity_chunks: int = 0,
        disk_hit_blocks: int = 0,
        disk_writes_failed: int = 0,
        disk_writes_dropped: int = 0,
        disk_evictions: int = 0,
        hints: str = "none",
        hint_error: float = 0.0,
    ) -> SimulationResult:
        """A result, with the hit rate, the hits by tier and the speed derived from the
        counts (``disk_hit_blocks`` of ``hit_blocks`` came from the disk tier)."""
        by_tier = {"cpu": hit_blocks - disk_hit_blocks}
        if disk_tokens is not None:
            by_tier["disk"] = disk_hit_blocks
        return cls(
            policy=policy,
            capacity_tokens=capacity_tokens,
            capacity_chunks=capacity_chunks,
            requests=requests,
            blocks=blocks,
            hit_blocks=hit_blocks,
            hit_rate=hit_blocks / blocks if blocks else 0.0,
            store_failures=store_failures,
            evictions=evictions,
            seconds=seconds,
            keys_per_s=blocks / seconds if seconds > 0 else 0.0,
            disk_tokens=disk_tokens,
            disk_capacity_chunks=disk_capacity_chunks,
            hit_blocks_by_tier=by_tier,
            disk_writes_failed=disk_writes_failed,
            disk_evictions=disk_evictions,
            disk_writes_dropped=disk_writes_dropped,
            hints=hints,
            hint_error=hint_error,
        )


class TraceClock:
    """The time of a simulated run, in seconds: the arrival of the request being served
    (set by `run_simulation`), for the managers' retention deadlines."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation(Protocol):
    """One run's tiers: called once per request, in order, with the request's
    retention hint (None: none), it returns the request's hit blocks; ``counts``
    gives the rest of the `SimulationResult`'s counts at the end
    (``store_failures``, ``evictions``; with a disk tier ``disk_tokens`` and the
    other ``disk_`` fields, and ``disk_hit_blocks``, the part of the hits it
    gave)."""

    policy: str
    capacity_tokens: int
    capacity_chunks: int

    def __call__(self, keys: Sequence[OffloadKey], hint: Hint | None = None) -> int: ...

    def counts(self) -> dict[str, int]: ...


def run_simulation(
    request_keys: Sequence[Sequence[OffloadKey]],
    simulation: Simulation,
    progress: Progress | None,
    *,
    hints: Sequence[Hint | None] | None = None,
    times_s: Sequence[float] | None = None,
    clock: TraceClock | None = None,
    labels: tuple[str, float] = ("none", 0.0),
) -> SimulationResult:
    """Every request through ``simulation``, one at a time, each with its hint of
    ``hints`` (one per request; None: no hint at all); before each, ``clock`` is set
    to its arrival in ``times_s`` (seconds, one per request; hints with a clock and no
    arrivals are refused, `ConfigError`: their retentions would never end).
    ``progress`` is called every thousand requests or so, and once at the end.
    ``labels`` is the result's ``hints`` and ``hint_error``."""
    total = len(request_keys)
    for name, given in (("hints", hints), ("times_s", times_s)):
        if given is not None and len(given) != total:
            raise ConfigError(
                f"{name} must hold one entry per request ({total:,}), got {len(given):,}"
            )
    if hints is not None and clock is not None and times_s is None:
        raise ConfigError(  # the clock would stay at 0: no retention would ever end
            "hints need the requests' arrivals: give times_s (seconds, one per request) "
            "with them, the clock their retentions count in"
        )
    blocks = hit_blocks = 0
    start = time.perf_counter()
    for index, keys in enumerate(request_keys):
        if clock is not None and times_s is not None:
            clock.now = times_s[index]
        blocks += len(keys)
        hit_blocks += simulation(keys, None if hints is None else hints[index])
        done = index + 1
        if progress is not None and not done % _PROGRESS_EVERY:
            progress(done, total, hit_blocks, blocks)
    if progress is not None:
        progress(total, total, hit_blocks, blocks)
    seconds = time.perf_counter() - start
    return SimulationResult.of(
        policy=simulation.policy,
        capacity_tokens=simulation.capacity_tokens,
        capacity_chunks=simulation.capacity_chunks,
        requests=total,
        blocks=blocks,
        hit_blocks=hit_blocks,
        seconds=seconds,
        hints=labels[0],
        hint_error=labels[1],
        **simulation.counts(),
    )


def requests_to_keys(requests: Iterable[HasHashIds]) -> list[list[OffloadKey]]:
    """The chunk keys of each request: one key per hash id, equal ids giving one shared key.

    Hash ids are unsigned 64-bit integers (the trace reader checks it); a key is
    the id's 8 big-endian bytes and group 0.
    """
    cache: dict[int, OffloadKey] = {}
    out = []
    for request in requests:
        keys = []
        for hash_id in request.hash_ids:
            key = cache.get(hash_id)
            if key is None:
                key = cache[hash_id] = make_offload_key(hash_id.to_bytes(8, "big"))
            keys.append(key)
        out.append(keys)
    return out


def capacity_chunks(capacity_tokens: int, block_tokens: int, *, tier: str = "") -> int:
    """Chunks a tier of ``capacity_tokens`` holds, one ``block_tokens`` chunk per hash id
    (``tier`` names the tier in the message of a capacity that holds none: ``disk``)."""
    if block_tokens < 1:
        raise CapacityError(f"block tokens must be at least 1, got {block_tokens}")
    if capacity_tokens < block_tokens:
        what = f"{tier} tier capacity" if tier else "capacity"
        raise CapacityError(
            f"a {what} of {capacity_tokens} tokens holds no chunk of {block_tokens} tokens; "
            f"give at least {block_tokens}"
        )
    return capacity_tokens // block_tokens
