"""Capacity planning without moving bytes: replay a trace through the chunk manager.

Each request is handled as a server would handle it: look up its chunks from
the head until the first that is not ready (those are hits), pin the hits (a
load), store the rest while the hits are pinned, unpin the hits, and commit the
request's recency head to tail. One chunk per hash id.

`simulate_optimal` replays the same requests with the offline optimum (Belady's
MIN: evict the chunk whose next use is furthest in the future), under the same
pinning, as the reference every online policy is measured against; and
`plot_hit_rates` draws hit rate against capacity (matplotlib, an optional
extra, imported only there). `ProgressBar` shows a run's progress on a
terminal, here and in `tiering replay`.
"""

from __future__ import annotations

import heapq
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
from tiering.errors import CapacityError, TieringError
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
    """Outcome of one (policy, capacity) simulation."""

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
    ) -> SimulationResult:
        """A result, with the hit rate and the speed derived from the counts."""
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


def capacity_chunks(capacity_tokens: int, block_tokens: int) -> int:
    """Chunks a tier of ``capacity_tokens`` holds, one ``block_tokens`` chunk per hash id."""
    if block_tokens < 1:
        raise CapacityError(f"block tokens must be at least 1, got {block_tokens}")
    if capacity_tokens < block_tokens:
        raise CapacityError(
            f"a capacity of {capacity_tokens} tokens holds no chunk of {block_tokens} tokens; "
            f"give at least {block_tokens}"
        )
    return capacity_tokens // block_tokens


def simulate_keys(
    request_keys: Sequence[Sequence[OffloadKey]],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
    progress: Progress | None = None,
) -> SimulationResult:
    """Replay requests given as chunk keys (see `requests_to_keys`) through a fresh manager.

    ``policy`` is a policy name, or `OPTIMAL` for `simulate_optimal`. ``progress``
    is called every thousand requests or so, and once at the end.
    """
    if policy == OPTIMAL:
        return simulate_optimal(
            request_keys,
            capacity_tokens=capacity_tokens,
            block_tokens=block_tokens,
            progress=progress,
        )
    num_chunks = capacity_chunks(capacity_tokens, block_tokens)
    manager = CPUOffloadingManager(num_chunks, create_policy(policy, num_chunks))
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


def simulate(
    requests: Iterable[_HasHashIds],
    *,
    capacity_tokens: int,
    policy: str = DEFAULT_POLICY,
    block_tokens: int = 512,
) -> SimulationResult:
    """Replay ``requests`` (anything with ``hash_ids``) through a fresh manager."""
    return simulate_keys(
        requests_to_keys(requests),
        capacity_tokens=capacity_tokens,
        policy=policy,
        block_tokens=block_tokens,
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
