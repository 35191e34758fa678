"""Capacity planning without moving bytes: replay a trace through the chunk manager.

Each request is handled as a server would handle it: look up its chunks from
the head until the first that is not ready (those are hits), pin the hits (a
load), store the rest while the hits are pinned, unpin the hits, and commit the
request's recency head to tail. One chunk per hash id.

With ``disk_tokens`` a disk tier sits below the CPU tier, as in `tiering replay
--disk` (`tiering.secondary.chain.TierChain` over a `DiskTier`). Its index is a
second manager of ``disk_tokens // block_tokens`` chunks with a policy of its
own (a `DiskTier` of B bytes holds B // (row bytes + a 4 KiB head) chunks):

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
   (half of it, `CascadeLimits`'s default) is not written: the engine drops it.

Where it differs from the engine: here each write-through lands before the
next request. The engine writes through in the background and does not wait:
the next request can miss a chunk still being written, and stores that find
the write queue full are dropped, so a disk slower than the stores hits less
than predicted here, even at ``--concurrency 1`` (much less where its writes
fall far behind). With every write-through awaited before the next promotion,
the engine's hits by tier over a `DiskTier` were checked equal to these for
LRU, and within 1% for ARC and ASLRU (the `DiskTier` evicts before it inserts
the new chunks in its policy, the manager after).

`simulate_optimal` replays the same requests with the offline optimum (Belady's
MIN: evict the chunk whose next use is furthest in the future), under the same
pinning, as the reference every online policy is measured against (one tier
only: the optimum of two tiers is not two optima); `plot_hit_rates` draws hit
rate against capacity and `plot_hit_rates_by_tier` hit rate by tier against
disk capacity (matplotlib, an optional extra, imported only there).
`ProgressBar` shows a run's progress on a terminal, here and in `tiering replay`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol, TextIO

import msgspec

from tiering._types import OffloadKey, make_offload_key
from tiering.config import DEFAULT_POLICY
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import CapacityError, ConfigError, TieringError
from tiering.policies import POLICY_NAMES, create_policy

__all__ = [
    "OPTIMAL",
    "PlotUnavailableError",
    "Progress",
    "ProgressBar",
    "SimulationResult",
    "check_plotting",
    "expand_policies",
    "plot_hit_rates",
    "plot_hit_rates_by_tier",
    "requests_to_keys",
    "simulate",
    "simulate_keys",
    "simulate_optimal",
]

#: The name the offline optimum goes by in results, tables and plots.
OPTIMAL = "optimal"
#: What ``--policy all`` stands for: every online policy, then the offline optimum.
ALL_POLICIES: tuple[str, ...] = (*POLICY_NAMES, OPTIMAL)

#: ``progress(done, total, hit_blocks, blocks)``: requests done of ``total``, and
#: the hit and all blocks so far, reported now and then while a run goes on.
Progress = Callable[[int, int, int, int], None]
_PROGRESS_EVERY = 1024  # requests between two progress reports of a simulation


class _HasHashIds(Protocol):
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
    than half the CPU tier, which the engine would pin for the write: see the
    module's docstring).
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
        )


def requests_to_keys(requests: Iterable[_HasHashIds]) -> list[list[OffloadKey]]:
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


def _disk_manager(
    disk_tokens: int | None, disk_policy: str | None, policy: str, block_tokens: int
) -> CPUOffloadingManager | None:
    """The disk tier's index (None without one), after checking its arguments."""
    if policy == OPTIMAL and (disk_tokens is not None or disk_policy is not None):
        raise ConfigError(
            "the offline optimum models one tier; drop disk_tokens or the optimal policy "
            f"(an online one: {', '.join(POLICY_NAMES)})"
        )
    if disk_tokens is None:
        if disk_policy is not None:
            raise ConfigError(
                f"disk_policy {disk_policy!r} needs a disk tier; give disk_tokens too"
            )
        return None
    if isinstance(disk_tokens, bool) or not isinstance(disk_tokens, int):
        raise CapacityError(f"disk_tokens must be a number of tokens or None, got {disk_tokens!r}")
    num_chunks = capacity_chunks(disk_tokens, block_tokens, tier="disk")
    name = policy if disk_policy is None else disk_policy
    if name not in POLICY_NAMES:
        raise ConfigError(
            f"unknown disk tier policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        )
    return CPUOffloadingManager(num_chunks, create_policy(name, num_chunks))


def simulate_keys(
    request_keys: Sequence[Sequence[OffloadKey]],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
    progress: Progress | None = None,
    disk_tokens: int | None = None,
    disk_policy: str | None = None,
) -> SimulationResult:
    """Replay requests given as chunk keys (see `requests_to_keys`) through a fresh manager.

    ``policy`` is a policy name, or `OPTIMAL` for `simulate_optimal`. ``progress``
    is called every thousand requests or so, and once at the end. ``disk_tokens``
    puts a disk tier of that many tokens below the CPU tier (see the module's
    docstring), with the policy ``disk_policy`` (default: ``policy``); the offline
    optimum models one tier only (`ConfigError`). Without it the run is exactly
    the one-tier run.
    """
    if policy == OPTIMAL:
        _disk_manager(disk_tokens, disk_policy, policy, block_tokens)  # refuses a disk tier
        return simulate_optimal(
            request_keys,
            capacity_tokens=capacity_tokens,
            block_tokens=block_tokens,
            progress=progress,
        )
    num_chunks = capacity_chunks(capacity_tokens, block_tokens)
    manager = CPUOffloadingManager(num_chunks, create_policy(policy, num_chunks))
    disk = _disk_manager(disk_tokens, disk_policy, policy, block_tokens)
    if disk is not None and disk_tokens is not None:
        return _simulate_chain(
            request_keys,
            manager,
            disk,
            policy=policy,
            capacity_tokens=capacity_tokens,
            disk_tokens=disk_tokens,
            progress=progress,
        )
    lookup_prefix = manager.lookup_prefix
    prepare_load = manager.prepare_load
    complete_load = manager.complete_load
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    touch = manager.touch
    blocks = hit_blocks = store_failures = 0
    total = len(request_keys)
    start = time.perf_counter()
    for done, keys in enumerate(request_keys, 1):
        blocks += len(keys)
        hits = lookup_prefix(keys)
        hit_keys = keys[:hits]
        if hits:
            hit_blocks += hits
            prepare_load(hit_keys)
        if hits < len(keys):
            output = prepare_store(keys[hits:])
            if output is None:
                store_failures += 1
            elif output.keys_to_store:
                complete_store(output.keys_to_store)
        if hits:
            complete_load(hit_keys)
        touch(keys)
        if progress is not None and not done % _PROGRESS_EVERY:
            progress(done, total, hit_blocks, blocks)
    if progress is not None:
        progress(total, total, hit_blocks, blocks)
    return SimulationResult.of(
        policy=policy,
        capacity_tokens=capacity_tokens,
        capacity_chunks=num_chunks,
        requests=len(request_keys),
        blocks=blocks,
        hit_blocks=hit_blocks,
        store_failures=store_failures,
        evictions=manager.statistics().evictions_total,
        seconds=time.perf_counter() - start,
    )


def _simulate_chain(
    request_keys: Sequence[Sequence[OffloadKey]],
    cpu: CPUOffloadingManager,
    disk: CPUOffloadingManager,
    *,
    policy: str,
    capacity_tokens: int,
    disk_tokens: int,
    progress: Progress | None,
) -> SimulationResult:
    """`simulate_keys` with a disk tier below ``cpu``: promotion, then the one-tier
    steps, then the write-through of what the request stored (module docstring)."""
    lookup_prefix = cpu.lookup_prefix
    holds = cpu.holds
    prepare_load = cpu.prepare_load
    complete_load = cpu.complete_load
    prepare_store = cpu.prepare_store
    complete_store = cpu.complete_store
    touch = cpu.touch
    disk_holds = disk.holds
    disk_prepare_store = disk.prepare_store
    disk_complete_store = disk.complete_store
    disk_touch = disk.touch
    max_pinned = max(1, cpu.capacity // 2)  # CascadeLimits' default: half the CPU tier
    blocks = hit_blocks = disk_hit_blocks = store_failures = 0
    disk_writes_failed = disk_writes_dropped = 0
    total = len(request_keys)
    start = time.perf_counter()
    for done, keys in enumerate(request_keys, 1):
        n = len(keys)
        blocks += n
        hits = lookup_prefix(keys)
        end = hits  # the disk's leading run: keys[hits:end], none of them in the CPU tier
        while end < n and not holds(keys[end]) and disk_holds(keys[end]):
            end += 1
        if end > hits:  # promote, as SecondaryCascade.promote and _read do
            head, wanted = keys[:hits], keys[hits:end]
            output = prepare_store([*head, *wanted], count=False)
            while output is None and len(wanted) > 1:
                wanted = wanted[: len(wanted) // 2]
                output = prepare_store([*head, *wanted], count=False)
            if output is None:
                cpu.count_allocation_failure()
            else:
                read = output.keys_to_store
                complete_store(read)
                disk_touch(read)  # a read is a use of the disk's chunk
                ready = 0
                for key in keys[hits:]:  # the engine counts on past the run, as here
                    if not holds(key, ready=True):
                        break
                    ready += 1
                disk_hit_blocks += min(len(read), ready)
                hits += ready
        hit_keys = keys[:hits]
        if hits:
            hit_blocks += hits
            prepare_load(hit_keys)
        stored: tuple[OffloadKey, ...] = ()
        if hits < n:
            output = prepare_store(keys[hits:])
            if output is None:
                store_failures += 1
            elif output.keys_to_store:
                stored = output.keys_to_store
                complete_store(stored)
        if hits:
            complete_load(hit_keys)
        touch(keys)
        if len(stored) > max_pinned:  # the engine would pin too much of the CPU tier
            disk_writes_dropped += len(stored)
        elif stored:  # written through, as DiskTier.write does: the landed store only
            batch = stored
            written = disk_prepare_store(batch)
            while written is None and len(batch) > 1:  # no room for all: keep the head
                batch = batch[: len(batch) // 2]
                written = disk_prepare_store(batch)
            if written is None:
                disk_writes_failed += len(stored)
            else:
                disk_writes_failed += len(stored) - len(batch)
                new = written.keys_to_store
                if new:
                    disk_complete_store(new)  # new chunks join the disk's policy, not touched
                if len(new) < len(batch):  # a rewrite of a chunk the disk held is a use of it
                    fresh = set(new)
                    disk_touch([key for key in batch if key not in fresh])
        if progress is not None and not done % _PROGRESS_EVERY:
            progress(done, total, hit_blocks, blocks)
    if progress is not None:
        progress(total, total, hit_blocks, blocks)
    return SimulationResult.of(
        policy=policy,
        capacity_tokens=capacity_tokens,
        capacity_chunks=cpu.capacity,
        requests=total,
        blocks=blocks,
        hit_blocks=hit_blocks,
        store_failures=store_failures,
        evictions=cpu.statistics().evictions_total,
        seconds=time.perf_counter() - start,
        disk_tokens=disk_tokens,
        disk_capacity_chunks=disk.capacity,
        disk_hit_blocks=disk_hit_blocks,
        disk_writes_failed=disk_writes_failed,
        disk_writes_dropped=disk_writes_dropped,
        disk_evictions=disk.statistics().evictions_total,
    )


def simulate(
    requests: Iterable[_HasHashIds],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
    disk_tokens: int | None = None,
    disk_policy: str | None = None,
) -> SimulationResult:
    """Replay ``requests`` (anything with ``hash_ids``) through a fresh manager (and a
    disk tier of ``disk_tokens`` below it: see `simulate_keys`)."""
    return simulate_keys(
        requests_to_keys(requests),
        capacity_tokens=capacity_tokens,
        policy=policy,
        block_tokens=block_tokens,
        disk_tokens=disk_tokens,
        disk_policy=disk_policy,
    )


def expand_policies(names: Iterable[str]) -> list[str]:
    """``names`` with ``all`` replaced by every policy and the optimum, duplicates dropped."""
    out: list[str] = []
    for name in names:
        out.extend(ALL_POLICIES if name == "all" else (name,))
    return list(dict.fromkeys(out))


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
    next_use = _next_uses(request_keys)
    cache: dict[OffloadKey, int] = {}  # key -> flat index of its next use
    heap: list[tuple[int, OffloadKey]] = []  # (-next use, key), stale entries skipped
    blocks = hit_blocks = store_failures = evictions = 0
    position = 0
    total = len(request_keys)
    start = time.perf_counter()
    for done, keys in enumerate(request_keys, 1):
        blocks += len(keys)
        hits = 0
        for key in keys:
            if key not in cache:
                break
            hits += 1
        hit_blocks += hits
        new_keys = [key for key in dict.fromkeys(keys[hits:]) if key not in cache]
        need = len(new_keys) - (num_chunks - len(cache))
        if need > 0:
            offered = set(keys)
            if len(cache) - len(offered & cache.keys()) < need:
                store_failures += 1
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
                    evictions += 1
                for item in aside:
                    heapq.heappush(heap, item)
        for key in new_keys:
            cache[key] = -1
        for j, key in enumerate(keys):
            use = next_use[position + j]
            if cache.get(key, use) != use:
                cache[key] = use
                heapq.heappush(heap, (-use, key))
        position += len(keys)
        if len(heap) > 4 * len(cache) + 1024:  # drop stale entries now and then
            heap = [(-use, key) for key, use in cache.items()]
            heapq.heapify(heap)
        if progress is not None and not done % _PROGRESS_EVERY:
            progress(done, total, hit_blocks, blocks)
    if progress is not None:
        progress(total, total, hit_blocks, blocks)
    return SimulationResult.of(
        policy=OPTIMAL,
        capacity_tokens=capacity_tokens,
        capacity_chunks=num_chunks,
        requests=len(request_keys),
        blocks=blocks,
        hit_blocks=hit_blocks,
        store_failures=store_failures,
        evictions=evictions,
        seconds=time.perf_counter() - start,
    )


class PlotUnavailableError(TieringError):
    """``--plot`` was asked for but matplotlib (the ``plot`` extra) is not installed."""


def check_plotting(path: Path | str) -> str:
    """Before a long run: the file format ``path``'s suffix names (``png``, ``svg``...).

    Raises `PlotUnavailableError` unless matplotlib can be imported, and
    `TieringError` unless matplotlib writes that format and ``path``'s folder
    exists and is writable.
    """
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise PlotUnavailableError(_NO_MATPLOTLIB) from None
    suffix = Path(path).suffix
    if suffix.lower()[1:] not in FigureCanvasBase.get_supported_filetypes():
        what = f"matplotlib writes no format {suffix!r}" if suffix else "the name has no suffix"
        raise TieringError(
            f"cannot write plot {path}: {what}; end the name with .png, .svg or .pdf"
        )
    folder = Path(path).parent
    if not folder.is_dir():
        raise TieringError(f"cannot write plot {path}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise TieringError(f"cannot write plot {path}: folder {folder} is not writable")
    return suffix.lower()[1:]


_NO_MATPLOTLIB = "--plot needs matplotlib: pip install 'tiering[plot]' (or matplotlib>=3.8)"


def _short_tokens(tokens: int) -> str:
    """``3000000`` -> ``3M``, ``51200`` -> ``51.2k``."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}"
    return str(tokens)


def plot_hit_rates(results: Sequence[SimulationResult], path: Path | str, *, title: str) -> None:
    """Draw hit rate against capacity, a line per policy, the optimum dashed, and save
    it in the format the suffix of ``path`` names (`check_plotting`).

    Imports matplotlib here only (the ``plot`` extra); raises `PlotUnavailableError`
    when it is missing and `TieringError` when the file cannot be written.
    """
    file_format = check_plotting(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(_NO_MATPLOTLIB) from None
    by_policy: dict[str, list[SimulationResult]] = {}
    for result in results:
        by_policy.setdefault(result.policy, []).append(result)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        for policy, rows in by_policy.items():
            rows = sorted(rows, key=lambda r: r.capacity_tokens)
            xs = [r.capacity_tokens for r in rows]
            ys = [100.0 * r.hit_rate for r in rows]
            if policy == OPTIMAL:
                ax.plot(xs, ys, "k--", label="offline optimum (Belady)")
            else:
                label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log")
        capacities = sorted({r.capacity_tokens for r in results})
        ax.set_xticks(capacities, [_short_tokens(c) for c in capacities])
        ax.minorticks_off()
        ax.set_xlabel("CPU tier capacity (tokens)")
        ax.set_ylabel("hit rate (% of blocks)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            fig.savefig(path, format=file_format)
        except OSError as exc:
            raise TieringError(f"cannot write plot {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


def plot_hit_rates_by_tier(
    results: Sequence[SimulationResult], path: Path | str, *, title: str
) -> None:
    """Draw hit rate by tier against disk capacity (of the results with a disk tier),
    one panel per CPU capacity: at each disk capacity a bar per policy, its CPU
    tier's hits at the bottom and the disk tier's on top, the total above it;
    saved as `plot_hit_rates` saves.
    """
    file_format = check_plotting(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailableError(_NO_MATPLOTLIB) from None
    chained = [r for r in results if r.disk_tokens is not None]
    cpu_capacities = sorted({r.capacity_tokens for r in chained})
    disks = sorted({r.disk_tokens or 0 for r in chained})
    policies = list(dict.fromkeys(r.policy for r in chained))
    # Bars side by side around each disk capacity, in log space (the x axis is log).
    gaps = [math.log10(b / a) for a, b in itertools.pairwise(disks)]
    width = min(min(gaps, default=1.0) * 0.8 / max(1, len(policies)), 0.1)
    panels = max(1, len(cpu_capacities))
    fig, axes = plt.subplots(
        1, panels, figsize=(max(6.4, 4.2 * panels), 4.4), dpi=100, sharey=True, squeeze=False
    )
    try:
        for ax, capacity in zip(axes[0], cpu_capacities, strict=False):
            for i, policy in enumerate(policies):
                rows = [r for r in chained if r.policy == policy and r.capacity_tokens == capacity]
                offset = (i - (len(policies) - 1) / 2) * width
                lefts = [(r.disk_tokens or 1) * 10 ** (offset - width / 2) for r in rows]
                widths = [left * (10**width - 1) for left in lefts]
                cpu = [100.0 * r.hit_blocks_by_tier.get("cpu", 0) / (r.blocks or 1) for r in rows]
                total = [100.0 * r.hit_rate for r in rows]
                label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
                color = f"C{i}"
                ax.bar(lefts, cpu, widths, align="edge", color=color, label=f"{label}: CPU tier")
                ax.bar(lefts, [t - c for t, c in zip(total, cpu, strict=True)], widths,
                       bottom=cpu, align="edge", color=color, alpha=0.4, hatch="//",
                       edgecolor=color, label=f"{label}: disk tier")  # fmt: skip
                for left, w, t in zip(lefts, widths, total, strict=True):
                    ax.annotate(f"{t:.1f}", (left + w / 2, t), ha="center", va="bottom",
                                fontsize=6, xytext=(0, 1), textcoords="offset points")  # fmt: skip
            ax.set_xscale("log")
            ax.set_xticks(disks, [_short_tokens(d) for d in disks])
            ax.minorticks_off()
            ax.set_xlabel("disk tier capacity (tokens)")
            ax.set_title(f"CPU tier {_short_tokens(capacity)} tokens", fontsize=9)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][0].set_ylabel("hit rate (% of blocks)")
        axes[0][0].set_ylim(0, max((100.0 * r.hit_rate for r in chained), default=1.0) * 1.1)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=max(1, len(policies)), fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
        try:
            fig.savefig(path, format=file_format)
        except OSError as exc:
            raise TieringError(f"cannot write plot {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)


class ProgressBar:
    """A one-line progress bar on a terminal, redrawn at most every 0.1 s: a `Progress`.

    ``label`` names the run under way (drawn at least once each, whatever the
    time); the line ends once ``done`` reaches ``total``.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.label = ""
        self._drawn_label: str | None = None
        self._drawn = 0  # the length of the line on screen
        self._last = 0.0
        self._start = time.perf_counter()

    def __call__(self, done: int, total: int, hits: int, blocks: int) -> None:
        now = time.perf_counter()
        if now - self._last < 0.1 and done < total and self.label == self._drawn_label:
            return
        self._last = now
        self._drawn_label = self.label
        filled = math.floor(self.width * done / total) if total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        rate = done / (now - self._start) if now > self._start else 0.0
        hit = hits / blocks if blocks else 0.0
        line = (
            f"{self.label}[{bar}] {done:,}/{total:,} requests  hit rate {hit:.1%}  "
            f"{rate:,.0f} req/s"
        )
        self.stream.write("\r" + line.ljust(self._drawn))
        self._drawn = len(line)
        if done >= total:
            self.stream.write("\n")
            self._drawn = 0
        self.stream.flush()
