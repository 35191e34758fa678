"""`tiering replay`: drive a whole engine over a request trace, moving real bytes.

An emulated inference server: ``concurrency`` requests are in flight at once on
one event loop, each owning a fixed region of an emulated GPU KV cache (CPU
tensors where there is no GPU). Per request, one chunk per hash id:

1. look up its chunks; the leading ready ones are hits;
2. "compute" the others: fill their pages with bytes derived from the chunk key;
3. submit the load of the hits into the first blocks and the store of the rest
   (the hits stay pinned while the store makes room, as in `tiering simulate`);
4. await the load; with ``verify``, compare every loaded byte with the bytes the
   key derives, counting mismatches (never hiding them);
5. flush (wait for the store to have read the blocks), commit the request's
   recency, and free the blocks for the next request.

With ``concurrency=1`` the hit rate equals `tiering.sim`'s for the same
trace, capacity and policy.

With retention hints (``hints="continuation"``: `tiering.workload.hints`),
each request's store carries its hint (to the CPU tier and the write-through
below it) and so does its touch. The engine's clock is real time, and the
replay does not pace requests by their timestamps: it serves them as fast as
it can, so its seconds are not the workload's. A hint's ``retain_s`` (workload
seconds) is therefore scaled by the replay's pace so far, real seconds per
workload second since the first request (`_Retention`), once a minute of
workload time has gone by (before that the estimate is noise, and the TTL is
given as is: longer than the workload's in a replay that runs faster, bounded
by the hints' share of the tier). So at ``concurrency=1`` a hinted replay is
close to, not exactly, `tiering.sim`'s, whose clock is the workload's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import msgspec
import numpy as np
import numpy.typing as npt
import torch

from tiering._checks import check_int
from tiering._types import OffloadKey
from tiering.cli.progress import ProgressBar
from tiering.config import (
    DEFAULT_POLICY,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from tiering.engine import TieringEngine
from tiering.errors import CapacityError, ChunkStateError, ConfigError
from tiering.events import KVEventsConfig
from tiering.hints import MAX_RETAIN_S, Hint
from tiering.replay_result import ReplayResult, Tally, TierReport, format_bytes
from tiering.scheduler import JobHandle
from tiering.secondary import RemoteNamespace, SecondaryTier
from tiering.secondary.auth import AuthKey
from tiering.secondary.disk import DiskTier, ScanResult
from tiering.sim import Progress, requests_to_keys
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import KVCacheTensor, KVLayout, available_host_bytes
from tiering.workload import Request
from tiering.workload.hints import HintSource, arrival_times_s, flip_mask, workload_hints

__all__ = [
    "ReplayOptions",
    "ReplayResult",
    "TierReport",
    "format_bytes",
    "replay",
    "run_replay",
]

_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # golden-ratio multiplier, as a signed int64
_POISON = -0x2152411021524111  # 0xDEADBEEFDEADBEEF: a constant page, which no key derives


class ReplayOptions(msgspec.Struct, frozen=True, kw_only=True):
    capacity_tokens: int | None = 3_000_000
    cpu_bytes: int | None = None  # overrides capacity_tokens
    policy: str = DEFAULT_POLICY
    bytes_per_token: int = 128
    block_tokens: int = 512
    concurrency: int = 4
    verify: bool = False
    backend: str = "auto"
    hold: float = 0.0  # seconds to stay up after the requests, the engine still open
    events_endpoint: str | None = None  # publish KV cache events there (ZMQ PUB)
    replay_endpoint: str | None = None  # and serve their replay there (ZMQ ROUTER)
    disk: str | None = None  # a folder: a persistent disk tier below the CPU tier
    disk_bytes: int | None = None  # its capacity (needed with disk)
    disk_fsync: str = "none"  # what survives a power loss (DiskTier's fsync)
    remote: str | None = None  # a Redis URL: a shared tier below the CPU tier (and the disk)
    remote_namespace: str = ""  # only engines with equal namespaces share chunks
    #: Or the name of an environment variable holding the URL (never both), and a
    #: file whose first line is the password: no secret in argv or in this struct.
    remote_url_env: str | None = None
    remote_password_file: str | None = None
    #: The disk and remote tiers' shared secret (`AuthKey`: its repr shows only its id).
    auth_key: AuthKey | None = None
    #: Retention hints per request (`tiering.workload.hints`): none, or continuation;
    #: the share of them given wrong, and the seed that picks which.
    hints: str = "none"
    hint_error: float = 0.0
    hint_seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.hold) and self.hold >= 0):
            raise ConfigError(f"hold must be a number of seconds >= 0, got {self.hold}")
        for name in ("bytes_per_token", "block_tokens", "concurrency"):
            check_int(name.replace("_", "-"), getattr(self, name), minimum=1)
        if (self.bytes_per_token * self.block_tokens) % 8:
            raise ConfigError(
                f"bytes-per-token x block-tokens must be a multiple of 8 bytes, got "
                f"{self.bytes_per_token} x {self.block_tokens}"
            )
        if self.cpu_bytes is None and self.capacity_tokens is None:
            raise ConfigError("give a capacity in tokens or in bytes")
        for name in ("capacity_tokens", "cpu_bytes"):
            if getattr(self, name) is not None:
                check_int(name.replace("_", "-"), getattr(self, name), minimum=1)
        if self.replay_endpoint is not None and self.events_endpoint is None:
            raise ConfigError("a replay endpoint needs an events endpoint to replay")
        if (self.disk is None) != (self.disk_bytes is None):
            raise ConfigError(
                "a disk tier needs both its folder and its size: give --disk DIR and "
                "--disk-bytes N together"
            )
        if self.disk_bytes is not None:
            check_int("disk-bytes", self.disk_bytes, minimum=1)
        if self.remote is not None and self.remote_url_env is not None:
            raise ConfigError(
                f"give the remote tier's URL once: remote ({self.redacted_remote!r}) or "
                "remote_url_env (the name of a variable holding it), not both"
            )
        if self.hints not in {source.value for source in HintSource}:
            known = ", ".join(source.value for source in HintSource)
            raise ConfigError(f"unknown hints {self.hints!r}; choose one of {known}")
        flip_mask(0, self.hint_error, self.hint_seed)  # the error and seed's own checks
        if self.hint_error and self.hints == HintSource.NONE.value:
            raise ConfigError(
                f"a hint error of {self.hint_error} spoils hints, and none were asked for: "
                f"give hints={HintSource.CONTINUATION.value!r}"
            )
        if self.remote_password_file is not None and not self.has_remote:
            raise ConfigError(
                f"remote_password_file {self.remote_password_file} is the remote tier's "
                "password, and no remote tier was given: give remote or remote_url_env too"
            )

    def __repr__(self) -> str:  # as msgspec's, but never the remote tier's password
        fields = ", ".join(
            f"{name}={self.redacted_remote if name == 'remote' else getattr(self, name)!r}"
            for name in self.__struct_fields__
        )
        return f"ReplayOptions({fields})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:  # as __repr__
        return [
            (name, self.redacted_remote if name == "remote" else getattr(self, name))
            for name in self.__struct_fields__
        ]

    @property
    def has_remote(self) -> bool:
        """Whether a remote tier is asked for (by its URL or the variable holding it)."""
        return self.remote is not None or self.remote_url_env is not None

    @property
    def redacted_remote(self) -> str | None:
        """``remote`` without its password, as it may be shown."""
        from tiering.secondary.redis.address import redact_url

        return None if self.remote is None else redact_url(self.remote)

    def remote_url(self) -> str | None:
        """The remote tier's URL, with its password (read now from the environment and
        the password file): for `RedisTier` only, never to be shown. `ConfigError` when
        the variable is unset or the file unreadable; None without a remote tier."""
        if not self.has_remote:
            return None
        from tiering.secondary.redis.address import resolve_url

        return resolve_url(
            self.remote, url_env=self.remote_url_env, password_file=self.remote_password_file
        )

    @property
    def events(self) -> KVEventsConfig | None:
        """The ZMQ settings of the events, or None when they are off."""
        if self.events_endpoint is None:
            return None
        return KVEventsConfig(endpoint=self.events_endpoint, replay_endpoint=self.replay_endpoint)


def replay_config(options: ReplayOptions) -> OffloadingConfig:
    """The engine config of an emulated model: one group, one KV tensor, one block a chunk."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=options.block_tokens, layer_names=("kv",)),),
        worker_kv_bytes_per_block=options.bytes_per_token * options.block_tokens,
        engine_id="replay",
        enable_kv_cache_events=options.events_endpoint is not None,
        model=OffloadingModelConfig(name="emulated", dtype="int64"),
        cache=OffloadingCacheConfig(tokens_per_hash=options.block_tokens, blocks_per_chunk=1),
    )


class _Pages:
    """Deterministic page contents derived from chunk keys, and their checks.

    A request's blocks are a contiguous range of rows of the emulated KV cache,
    so "computing" them is one in-place broadcast add (no temporary, no index)
    of the request's per-key seeds (`seeds`, derived once per request before
    the replay starts, as its keys are) to a ramp. The work is done by numpy
    on a view of the (CPU) KV tensor: its add runs on the calling thread at
    about three times torch's single-threaded speed here, and never wakes
    torch's OpenMP threads, which then spin on the cores the copies need.
    """

    def __init__(self, kv: torch.Tensor) -> None:
        self.rows: npt.NDArray[np.int64] = kv.numpy()  # the same memory
        self.base = np.arange(kv.shape[1], dtype=np.int64)

    @staticmethod
    def seeds(request_keys: Sequence[Sequence[OffloadKey]]) -> list[npt.NDArray[np.int64]]:
        """Per request, a column of one seed per key (a view into one array for them all)."""
        values = [
            int.from_bytes(k[:8], "big", signed=True) ^ len(k) for r in request_keys for k in r
        ]
        column = (np.array(values, dtype=np.int64) * np.int64(_MIX))[:, None]  # wraps
        ends = np.cumsum([len(r) for r in request_keys])
        return [
            column[end - len(r) : end] for r, end in zip(request_keys, ends.tolist(), strict=True)
        ]

    def fill(self, start: int, seeds: npt.NDArray[np.int64]) -> None:
        """Write the pages of the keys of ``seeds`` into rows ``start, start + 1, ...``."""
        np.add(seeds, self.base, out=self.rows[start : start + len(seeds)])

    def poison(self, start: int, count: int) -> None:
        """Fill rows with a constant that no key derives."""
        self.rows[start : start + count] = _POISON

    def corrupt(self, start: int, seeds: npt.NDArray[np.int64]) -> int:
        """How many of the rows from ``start`` do not hold exactly the bytes of their key."""
        got = self.rows[start : start + len(seeds)]
        return int(np.count_nonzero((got != seeds + self.base).any(axis=1)))


class _Retention:
    """Retention hints in the replay's own seconds (the module's docstring): a hint's
    ``retain_s`` times the real seconds the replay has taken per workload second,
    once ``_WARMUP_S`` workload seconds have gone by."""

    _WARMUP_S = 60.0

    def __init__(self, first_s: float, timer: Callable[[], float] = time.monotonic) -> None:
        self._first = first_s  # the first request's workload time
        self._timer = timer  # the manager's clock
        self._start: float | None = None

    def scaled(self, hint: Hint | None, time_s: float) -> Hint | None:
        """``hint`` for a request of the workload's ``time_s``, served now."""
        now = self._timer()
        if self._start is None:
            self._start = now
        if hint is None or hint.retain_s is None:
            return hint
        elapsed = time_s - self._first
        if elapsed < self._WARMUP_S:
            return hint
        retain = hint.retain_s * (now - self._start) / elapsed
        return Hint(retain_s=min(max(retain, 1e-3), MAX_RETAIN_S), priority=hint.priority)


async def _hold(
    engine: TieringEngine,
    seconds: float,
    on_hold: Callable[[TieringEngine, float], None] | None,
) -> None:
    """Stay up ``seconds``, or until SIGINT, the engine open; ``on_hold`` first."""
    await anyio.sleep(0)  # the last stores' events go out at the end of this turn
    if on_hold is not None:
        on_hold(engine, seconds)
    if threading.current_thread() is not threading.main_thread():
        await anyio.sleep(seconds)  # signals reach the main thread only
        return
    with anyio.open_signal_receiver(signal.SIGINT) as signals, anyio.move_on_after(seconds):
        async for _ in signals:
            return


async def replay(
    requests: Sequence[Request],
    options: ReplayOptions,
    *,
    progress: Progress | None = None,
    backend_options: Mapping[str, Any] | None = None,
    on_open: Callable[[TieringEngine], contextlib.AbstractAsyncContextManager[object]]
    | None = None,
    on_hold: Callable[[TieringEngine, float], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through a fresh engine; see the module docstring.

    ``on_open(engine)`` (a metrics server, say) is entered once the engine is
    open and exited after ``options.hold``, before the engine closes. With a
    hold, ``on_hold(engine, seconds)`` is called once the requests are done and
    their events published, as the hold begins; SIGINT (Ctrl-C) ends the hold
    early, and the replay then ends as it would have. Raises
    `CapacityError`, before allocating it, when the emulated KV cache does not
    fit in the available host memory.
    """
    config = replay_config(options)
    request_keys = requests_to_keys(requests)
    max_blocks = max((len(k) for k in request_keys), default=0) or 1
    page_words = options.bytes_per_token * options.block_tokens // 8
    _check_kv_fits(options, max_blocks)
    kv = torch.zeros((options.concurrency * max_blocks, page_words), dtype=torch.int64)
    if options.cpu_bytes is not None:
        cpu_bytes = options.cpu_bytes
    else:
        chunks = (options.capacity_tokens or 0) // options.block_tokens
        if chunks < 1:
            raise ConfigError(
                f"a capacity of {options.capacity_tokens} tokens holds no chunk of "
                f"{options.block_tokens} tokens; give at least {options.block_tokens}"
            )
        cpu_bytes = chunks * _row_bytes(config, kv)
    engine = TieringEngine(
        config,
        {"kv": kv},
        cpu_bytes=cpu_bytes,
        policy=options.policy,
        backend=options.backend,
        backend_options=backend_options,
        events=options.events,
        secondary=_tiers(options),
        remote_namespace=options.remote_namespace,
    )
    pages = _Pages(kv)
    request_seeds = _Pages.seeds(request_keys)
    hints = workload_hints(
        requests,
        options.hints,
        error=options.hint_error,
        seed=options.hint_seed,
        block_tokens=options.block_tokens,
    )
    times_s = arrival_times_s(requests)
    retention = _Retention(times_s[0] if times_s else 0.0)
    tally = Tally()
    order = iter(range(len(request_keys)))

    async def serve(worker: int) -> None:
        first = worker * max_blocks  # this worker's region: rows first .. first + max_blocks
        region = np.arange(first, first + max_blocks, dtype=np.int64)
        for index in order:
            keys, seeds = request_keys[index], request_seeds[index]
            hint = None if hints is None else retention.scaled(hints[index], times_s[index])
            blocks = region[: len(keys)]
            hits = engine.lookup(keys).ready
            below: dict[str, int] = {}
            if chained and hits < len(keys):
                promotion = await engine.promote(keys, hits)
                hits += promotion.ready
                below = promotion.by_tier
            load: JobHandle | None = None
            if hits:
                if options.verify:  # no key derives these bytes: a load that never lands shows
                    pages.poison(first, hits)
                try:
                    load = await engine.submit_load(keys[:hits], GPULoadStoreSpec(blocks[:hits]))
                except ChunkStateError:
                    # Evicted by another request while this one waited for queue
                    # room: a server would recompute them, and so does the replay.
                    hits = 0
            tally.blocks += len(keys)
            tally.hit_blocks += hits
            if hits:  # part of these hits
                for label, n in below.items():
                    tally.hit_blocks_by_tier[label] = tally.hit_blocks_by_tier.get(label, 0) + n
            store: JobHandle | None = None
            if hits < len(keys):
                pages.fill(first + hits, seeds[hits:])  # "compute" what was not loaded
                gpu = GPULoadStoreSpec(blocks[hits:])
                try:
                    # In the load's turn, as a server prepares one step: the hits
                    # stay pinned while this store evicts (a load that completed
                    # in between would leave them evictable, unlike `simulate`).
                    store = engine.submit_store_nowait(keys[hits:], gpu, hint=hint)
                except anyio.WouldBlock:
                    store = await engine.submit_store(keys[hits:], gpu, hint=hint)
            if load is not None:
                result = await load
                tally.add(result, load=True)
                if options.verify and result.success:
                    tally.corrupt += pages.corrupt(first, seeds[:hits])
            await engine.flush(blocks)  # the store has read the blocks: it is done
            if store is not None:
                tally.add(await store, load=False)
            engine.touch(keys, hint=hint)
            tally.done += 1
            if progress is not None:
                progress(tally.done, len(request_keys), tally.hit_blocks, tally.blocks)

    chained = bool(engine.tiers)
    opened: dict[str, ScanResult] = {}
    async with engine, contextlib.AsyncExitStack() as services:
        for tier in engine.tiers:
            if isinstance(tier, DiskTier):
                opened[tier.label] = await tier.open()  # what a previous run left, now
            connect = getattr(tier, "connect", None)
            if connect is not None:
                await connect()  # a wrong URL or password: one clear error, now
        if on_open is not None:
            await services.enter_async_context(on_open(engine))
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for worker in range(options.concurrency):
                tg.start_soon(serve, worker)
        seconds = time.perf_counter() - start
        stats = engine.manager.statistics()
        hint_stats = engine.manager.hints.statistics()
        if options.hold:
            await _hold(engine, options.hold, on_hold)
    final = engine.statistics()  # after close: the last batch and writes are counted
    return tally.result(
        options,
        stats,
        final,
        opened,
        hint_stats,
        requests=len(request_keys),
        seconds=seconds,
        capacity_chunks=engine.manager.capacity,
        row_bytes=engine.layout.row_bytes,
        backend=engine.backend_name,
    )


def _check_kv_fits(options: ReplayOptions, max_blocks: int) -> None:
    """Refuse an emulated KV cache larger than the host memory available (as the CPU
    tier's pool refuses its own size), before torch tries to allocate it."""
    page_bytes = options.bytes_per_token * options.block_tokens
    nbytes = options.concurrency * max_blocks * page_bytes
    available = available_host_bytes()
    if nbytes > available:
        raise CapacityError(
            f"the emulated GPU KV cache needs {format_bytes(nbytes)} (concurrency "
            f"{options.concurrency:,} x {max_blocks:,} blocks, the longest request, x "
            f"{format_bytes(page_bytes)} a block: bytes-per-token x block-tokens), but only "
            f"{format_bytes(available)} of host memory is available; lower concurrency or "
            "bytes-per-token"
        )


def _tiers(options: ReplayOptions) -> list[Callable[[RemoteNamespace], SecondaryTier]]:
    """The tiers below the CPU tier, in order: the disk, then the remote tier."""
    tiers: list[Callable[[RemoteNamespace], SecondaryTier]] = []
    if options.disk is not None and options.disk_bytes is not None:
        tiers.append(
            functools.partial(
                _disk_tier,
                options.disk,
                options.disk_bytes,
                fsync=options.disk_fsync,
                policy=options.policy,
                auth_key=options.auth_key,
            )
        )
    remote = options.remote_url()
    if remote is not None:
        from tiering.secondary.redis import RedisTier  # redis-py: only when used

        def remote_tier(namespace: RemoteNamespace) -> SecondaryTier:
            # not a partial: its repr would hold the URL
            return RedisTier(remote, namespace, auth_key=options.auth_key)

        tiers.append(remote_tier)
    return tiers


def _disk_tier(
    path: str,
    capacity_bytes: int,
    namespace: RemoteNamespace,
    *,
    fsync: str,
    policy: str,
    auth_key: AuthKey | None,
) -> DiskTier:
    """The disk tier of a replay: the CPU tier's policy, as `tiering simulate` models it."""
    return DiskTier(path, capacity_bytes, namespace, fsync=fsync, policy=policy, auth_key=auth_key)


def _row_bytes(config: OffloadingConfig, kv: torch.Tensor) -> int:
    page = kv.shape[1] * kv.element_size()
    layout = KVLayout([KVCacheTensor(kv, kv.shape[0], page)], config.cache.blocks_per_chunk)
    return layout.row_bytes


def run_replay(
    requests: Sequence[Request],
    options: ReplayOptions,
    *,
    show_progress: bool = False,
    on_open: Callable[[TieringEngine], contextlib.AbstractAsyncContextManager[object]]
    | None = None,
    on_hold: Callable[[TieringEngine, float], None] | None = None,
) -> ReplayResult:
    """Run `replay` on a fresh asyncio event loop (with a `ProgressBar` on stderr if asked)."""
    bar = ProgressBar() if show_progress else None
    return anyio.run(
        lambda: replay(requests, options, progress=bar, on_open=on_open, on_hold=on_hold)
    )
