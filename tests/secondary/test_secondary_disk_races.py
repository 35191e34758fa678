"""Regression tests of the disk tier and the chain of tiers: races, a disk that hangs,
a folder that goes away, and the events of a chain (review 19).

Each test keeps one promise that a reviewer found broken:

- a write answered without I/O (the tier down, or every worker thread busy)
  evicts nothing;
- a disk that stops answering holds at most ``max_concurrency`` threads, however
  many calls time out on it (later calls are busy);
- a victim whose recycling failed stays known (the trash), never an orphan file;
- a read that rejects a value does not forget a rewrite of it that landed
  meanwhile;
- values lost with the folder are announced as removed;
- a folder made again after its root was removed is never owned twice, even
  where the new folder gets the old one's inode number;
- the scan at open is bounded by each call's timeout and by its caller's deadline;
- an engine that failed to build frees the disk tier's lock;
- the write-through announces every store it wrote whole, one store a call;
- every tier of a chain describes a chunk alike.

A disk that hangs is ``tier._files.answering`` (white box), faults are injected
through ``tier._files.os``, and a tier backing off is made due (``retry_at``), as in
tests/secondary/test_secondary_disk.py. Nothing waits on a clock to order things:
threads are held at gates, and only the calls meant to time out do.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from tiering import ConfigError
from tiering._types import OffloadKey, make_offload_key
from tiering.engine import TieringEngine
from tiering.events import BlockStored, ChunkBlocks, EventSubscription, SequencedBatch
from tiering.secondary import (
    ChunkCodec,
    Locality,
    MemoryStore,
    MemoryTier,
    RemoteNamespace,
    SecondaryTier,
)
from tiering.secondary.disk import DiskTier
from tiering.secondary.disk.files import head_bytes
from tiering.specs import GPULoadStoreSpec

from ..test_engine import CHUNK_BYTES, config, kv_caches

pytestmark = pytest.mark.anyio

Row = np.ndarray[Any, np.dtype[np.uint8]]

#: Longer than any test; only ``due`` makes a tier try again.
BACKOFF = (60.0, 60.0)

#: How long a call meant to time out (or to find every thread busy) waits.
SHORT_S = 0.1


# -- helpers ---------------------------------------------------------------------------------


def row_of(key: OffloadKey, row_bytes: int) -> Row:
    """The row of chunk ``key``: derived from the key, so a read can be checked."""
    return np.frombuffer(hashlib.shake_128(bytes(key)).digest(row_bytes), dtype=np.uint8)


def items(keys: Sequence[OffloadKey], row_bytes: int) -> list[tuple[OffloadKey, memoryview]]:
    return [(k, row_of(k, row_bytes).data) for k in keys]


def value_bytes(namespace: RemoteNamespace) -> int:
    """Bytes of one value file on disk (a key of 20 bytes): its 4 KiB head and its row."""
    return head_bytes(ChunkCodec(namespace), make_offload_key(0)) + namespace.row_bytes


def disk(root: Path, namespace: RemoteNamespace, values: int, **options: Any) -> DiskTier:
    """A disk tier in ``root`` with room for ``values`` values."""
    options.setdefault("backoff_s", BACKOFF)
    options.setdefault("timeout_s", 10.0)
    return DiskTier(root, values * value_bytes(namespace), namespace, **options)


def due(tier: DiskTier) -> None:
    tier._health.retry_at = 0.0  # white box: the retry time has come
    tier._write_gate.retry_at = 0.0


def tkv_names(root: Path) -> set[str]:
    """The value files on disk under ``root``."""
    return {p.name for p in root.rglob("*.tkv")}


async def held_names(tier: DiskTier, keys: Sequence[OffloadKey]) -> set[str]:
    """The file names of the values among ``keys`` that the tier says it holds."""
    held = await tier.contains(keys)
    return {tier._files.path(k).name for k, h in zip(keys, held, strict=True) if h}


async def read_exact(tier: DiskTier, keys: Sequence[OffloadKey]) -> bool:
    """Whether every one of ``keys`` is read back, byte for byte."""
    buffers = [np.zeros(tier.row_bytes, dtype=np.uint8) for _ in keys]
    filled = await tier.read([(k, b.data) for k, b in zip(keys, buffers, strict=True)])
    rows = [row_of(k, tier.row_bytes) for k in keys]
    return all(filled) and all(np.array_equal(b, r) for b, r in zip(buffers, rows, strict=True))


class CountingGate:
    """A disk that stops answering (``tier._files.answering``), counting the threads it
    holds: ``most`` is the most held at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self.waiting = self.most = 0

    def wait(self) -> bool:
        with self._cond:
            self.waiting += 1
            self.most = max(self.most, self.waiting)
            self._cond.wait_for(lambda: self._open)
            self.waiting -= 1
        return True

    def set(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


class RenameFailsOnce:
    """The `os` calls of a disk tier, with the first recycling rename (a victim's value
    file moved to a new value's temporary name) failing with ``OSError(code)``."""

    def __init__(self, code: int) -> None:
        self.code = code
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def rename(self, src: str, dst: str, **dir_fds: Any) -> None:
        if not self.fired and str(src).endswith(".tkv") and str(dst).endswith(".tmp"):
            self.fired = True  # ext4 may say ENOSPC for a new directory block
            raise OSError(self.code, os.strerror(self.code))
        os.rename(src, dst, **dir_fds)


class HoldAfterUnlink:
    """The `os` calls of a disk tier, holding the thread that unlinks ``target`` (the
    first time) right after the unlink, until ``go`` is set."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.reached = threading.Event()
        self.go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def unlink(self, path: str, **dir_fd: Any) -> None:
        os.unlink(path, **dir_fd)  # a name in the shard folder held open (dir_fd)
        if os.path.basename(path) == os.path.basename(self.target) and not self.reached.is_set():
            self.reached.set()
            self.go.wait(10)


def flip_last_byte(path: str) -> None:
    """The payload rots: its last byte changes, its length does not."""
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x01]))


# -- writes answered without I/O -------------------------------------------------------------


async def test_a_write_answered_down_evicts_nothing(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    held, more = chunks.keys(4), chunks.keys(4)
    async with disk(tmp_path / "disk", namespace, 4) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(held, rb)) == 4
        removed: list[OffloadKey] = []
        tier.on_removed = removed.extend
        # The disk stops answering once: the call times out, the tier is down.
        tier.timeout_s = SHORT_S
        tier._files.answering.clear()
        try:
            assert await tier.contains(held[:1]) == [False]
        finally:
            tier._files.answering.set()
        tier.timeout_s = 10.0
        assert tier.statistics().state == "down"
        # Writes while down are answered without I/O, and take no room from anyone.
        for key in more:
            assert await tier.write(items([key], rb)) == 0
        s = tier.statistics()
        assert s.write_errors_by_reason == {"down": 4}
        assert (s.chunks, s.used_bytes, s.evictions_total) == (4, 4 * value_bytes(namespace), 0)
        assert removed == []
        # The disk answers again: every value it held is still there, whole.
        due(tier)
        assert await tier.contains(held) == [True] * 4
        assert await read_exact(tier, held)
        assert tier.statistics().state == "up"


async def test_a_write_that_finds_every_thread_busy_evicts_nothing(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    held, new = chunks.keys(2), chunks.keys(1)
    async with disk(tmp_path / "disk", namespace, 2, max_concurrency=1) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(held, rb)) == 2
        removed: list[OffloadKey] = []
        tier.on_removed = removed.extend
        hung: list[list[bool]] = []

        async def hung_contains() -> None:
            hung.append(await tier.contains(held))

        tier._files.answering.clear()  # the hung call holds the one thread
        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hung_contains)
                    await anyio.wait_all_tasks_blocked()
                    tier.timeout_s = SHORT_S  # the write waits at most this for a thread
                    assert await tier.write(items(new, rb)) == 0
                    s = tier.statistics()
                    assert s.write_errors_by_reason == {"busy": 1}
                    assert (s.chunks, s.evictions_total) == (2, 0)
                    assert removed == []
                    tier.timeout_s = 10.0
                    tier._files.answering.set()
        finally:
            tier._files.answering.set()
        assert hung == [[True, True]]
        assert await read_exact(tier, held)
        # With a thread free, the same write evicts the oldest to make room.
        assert await tier.write(items(new, rb)) == 1
        s = tier.statistics()
        assert (s.state, s.chunks, s.evictions_total, len(removed)) == ("up", 2, 1, 1)


# -- a disk that hangs -----------------------------------------------------------------------


async def test_a_hung_disk_holds_at_most_max_concurrency_threads(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    async with disk(tmp_path / "disk", namespace, 4, max_concurrency=2) as tier:
        assert await tier.write(items(keys, tier.row_bytes)) == 1
        gate = CountingGate()
        tier._files.answering = gate  # type: ignore[assignment]
        tier.timeout_s = SHORT_S
        try:
            # Calls time out on the disk until it holds as many threads as the tier has.
            for _ in range(100):
                if gate.waiting >= tier.max_concurrency:
                    break
                due(tier)
                assert await tier.contains(keys) == [False]
            assert gate.waiting == tier.max_concurrency
            s = tier.statistics()
            # Later calls find every thread still held by the disk: busy, no more threads.
            for _ in range(4):
                due(tier)
                assert await tier.contains(keys) == [False]
            after = tier.statistics()
            assert gate.most == tier.max_concurrency
            assert after.busy_total - s.busy_total == 4
            assert after.timeouts_total == s.timeouts_total
        finally:
            gate.set()
        # The disk answers: its threads end and give their places back.
        tier.timeout_s = 10.0
        due(tier)
        assert await tier.contains(keys) == [True]
        assert await read_exact(tier, keys)
        assert tier.statistics().state == "up"


async def test_a_probe_that_ends_once_the_tier_is_closing_changes_nothing(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    tier = disk(tmp_path / "disk", namespace, 4)
    assert await tier.write(items(keys, tier.row_bytes)) == 1
    tier.timeout_s = SHORT_S
    tier._files.answering.clear()  # the disk stops answering once: the tier goes down
    try:
        assert await tier.contains(keys) == [False]
    finally:
        tier._files.answering.set()
    tier.timeout_s = 10.0
    assert tier.statistics().state == "down"
    due(tier)
    tier._files.answering.clear()  # the probe's thread waits for the disk
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(tier.contains, keys)  # the probe
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(tier.aclose)  # closing: it waits for the probe
                await anyio.wait_all_tasks_blocked()
                tier._files.answering.set()  # the probe ends, its tier closing
    finally:
        tier._files.answering.set()
    s = tier.statistics()
    # Closed, and the probe that ended meanwhile brought nothing back up (review 27).
    assert (s.state, s.reconnects_total) == ("closed", 0)


# -- what a write leaves on disk -------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=errno.errorcode.get)
async def test_a_victim_whose_recycling_failed_is_deleted_later_not_orphaned(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, code: int
) -> None:
    root = tmp_path / "disk"
    old, new, later = chunks.keys(2), chunks.keys(2), chunks.keys(3)
    async with disk(root, namespace, 2) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(old, rb)) == 2
        fault = RenameFailsOnce(code)
        tier._files.os = fault
        await tier.write(items(new, rb))  # evicts both; moving the first one's file fails
        assert fault.fired
        tier._files.os = os
        for key in later:  # later writes delete what is left
            due(tier)
            assert await tier.write(items([key], rb)) == 1
        everything = [*old, *new, *later]
        assert tkv_names(root) == await held_names(tier, everything)  # no file unknown
        s = tier.statistics()
        assert s.chunks == len(tkv_names(root)) == 2
        assert sum(p.stat().st_size for p in root.rglob("*.tkv")) == s.used_bytes
        assert s.used_bytes is not None
        assert s.used_bytes <= tier.capacity_bytes
        assert await read_exact(tier, later[1:])


async def test_a_rejected_read_keeps_a_rewrite_that_landed_meanwhile(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    (key,) = chunks.keys(1)
    async with disk(root, namespace, 2, max_concurrency=2) as tier:
        rb = tier.row_bytes
        assert await tier.write(items([key], rb)) == 1
        path = tier._files.name(key)
        flip_last_byte(path)
        hook = HoldAfterUnlink(path)
        tier._files.os = hook
        read: list[list[bool]] = []

        async def reader() -> None:
            buffer = np.zeros(rb, dtype=np.uint8)
            read.append(await tier.read([(key, buffer.data)]))

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    # The read found the value wrong and deleted its file; it is held there.
                    assert await anyio.to_thread.run_sync(hook.reached.wait, 10)
                    # Meanwhile the engine writes the chunk again.
                    assert await tier.write(items([key], rb)) == 1
                    hook.go.set()
        finally:
            hook.go.set()
        tier._files.os = os
        assert read == [[False]]
        s = tier.statistics()
        assert (s.rejected_total, s.chunks) == (1, 1)
        # The fresh value is known, and whole: no file on disk the index forgot.
        assert tkv_names(root) == await held_names(tier, [key]) == {Path(path).name}
        assert await read_exact(tier, [key])


# -- the folder removed ----------------------------------------------------------------------


async def test_values_lost_with_the_folder_are_announced_as_removed(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(3)
    async with disk(root, namespace, 4) as tier:
        removed: list[OffloadKey] = []
        tier.on_removed = removed.extend
        assert await tier.write(items(keys, tier.row_bytes)) == 3
        shutil.rmtree(tier._files.folder)
        assert await tier.contains(keys[:1]) == [False]  # the folder is gone: down
        assert tier.statistics().state == "down"
        due(tier)
        assert await tier.contains(keys[:1]) == [False]  # the probe makes it again
        s = tier.statistics()
        assert (s.lost_total, s.chunks) == (3, 0)
        assert sorted(removed) == sorted(keys)  # subscribers learn the disk lost them


async def test_a_root_made_again_by_another_owner_is_left_to_it(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    mine, theirs = chunks.keys(1), chunks.keys(1)
    async with disk(root, namespace, 4) as first:
        rb = first.row_bytes
        assert await first.write(items(mine, rb)) == 1
        # The root goes away. Moved, not deleted: its folder keeps its inode number, so
        # the one made again has another (see the test below for a number reused).
        root.rename(tmp_path / "gone")
        assert await first.contains(mine) == [False]  # the folder is gone: down
        assert first.statistics().state == "down"
        async with disk(root, namespace, 4) as second:  # another engine takes the path
            await second.open()
            due(first)
            assert await first.contains(mine) == [False]  # the probe finds it owned
            assert await first.contains(mine) == [False]  # and it stays down
            # The first tier never writes into the folder the second owns.
            assert await first.write(items(mine, rb)) == 0
            assert first.statistics().state == "down"
            assert await second.write(items(theirs, rb)) == 1
            assert await second.contains([*mine, *theirs]) == [False, True]
        # Once free, the folder is the first tier's again, and locked by it.
        due(first)
        assert await first.contains(theirs) == [False]
        assert await first.contains(theirs) == [True]  # the new folder's index
        assert await first.write(items(mine, rb)) == 1
        assert first.statistics().state == "up"
        with pytest.raises(ConfigError, match="in use"):
            disk(root, namespace, 4)


class SameNumber:
    """The `os` calls of a disk tier, whose ``stat`` of ``path`` gives the inode number
    it had when made: a file system that hands a folder made again the number of the
    one removed (ext4 often does, for a folder removed and made again at once)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.number = os.stat(path).st_ino

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def stat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        st = os.stat(path, *args, **kwargs)
        return Renumbered(st, self.number) if str(path) == self.path else st


class Renumbered:
    """A stat result with another ``st_ino``."""

    def __init__(self, st: os.stat_result, number: int) -> None:
        self._st = st
        self.st_ino = number

    def __getattr__(self, name: str) -> Any:
        return getattr(self._st, name)


async def test_a_root_made_again_with_the_old_folders_inode_number_is_left_to_its_owner(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    mine, theirs = chunks.keys(1), chunks.keys(1)
    async with disk(root, namespace, 4) as first:
        rb = first.row_bytes
        assert await first.write(items(mine, rb)) == 1
        first._files.os = SameNumber(first._files.folder)
        shutil.rmtree(root)
        assert await first.contains(mine) == [False]  # the folder is gone: down
        async with disk(root, namespace, 4) as second:  # another engine takes the path
            await second.open()
            due(first)
            assert await first.contains(mine) == [False]  # lost with the old folder
            assert await first.write(items(theirs, rb)) == 0  # not into second's folder
            assert first.statistics().state == "down"


# -- the scan at open ------------------------------------------------------------------------


class HeldScan:
    """The folder's scan, held in its thread until ``release`` (a big folder on a slow
    disk), for ``HOLD_S`` at most: a tier that waits for it fails a test, never hangs it."""

    HOLD_S = 3.0

    def __init__(self, tier: DiskTier) -> None:
        self.release = threading.Event()
        self._scan = tier._files.scan
        tier._files.scan = self  # type: ignore[method-assign]

    def __call__(self) -> Any:
        self.release.wait(self.HOLD_S)
        return self._scan()


async def test_calls_made_while_the_folder_is_scanned_wait_at_most_their_timeout(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    async with disk(tmp_path / "disk", namespace, 4, timeout_s=SHORT_S) as tier:
        rb = tier.row_bytes
        scan = HeldScan(tier)
        try:
            with anyio.fail_after(HeldScan.HOLD_S / 2):
                assert await tier.contains(keys) == [False]
                assert await tier.write(items(keys, rb)) == 0
                buffer = np.zeros(rb, np.uint8).data
                assert await tier.read([(keys[0], buffer)]) == [False]
            s = tier.statistics()
            assert (s.state, s.busy_total, s.errors_total) == ("up", 3, 0)
            assert s.write_errors_by_reason == {"busy": 1}
        finally:
            scan.release.set()
        tier.timeout_s = 10.0
        report = await tier.open()  # the scan ends: the tier serves
        assert report.values == []
        assert await tier.write(items(keys, rb)) == 1
        assert await read_exact(tier, keys)


async def test_a_callers_deadline_ends_its_wait_for_the_scan(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(1)
    async with disk(tmp_path / "disk", namespace, 4) as tier:  # timeout_s: 10 s
        scan = HeldScan(tier)
        try:
            with anyio.fail_after(HeldScan.HOLD_S / 2):
                with anyio.move_on_after(SHORT_S) as deadline:
                    await tier.contains(keys)
                assert deadline.cancelled_caught
        finally:
            scan.release.set()
        await tier.open()
        assert await tier.contains(keys) == [False]


# -- the engine over the disk tier, and a chain ----------------------------------------------


def engine_key(i: int) -> OffloadKey:
    """Chunk ``i``'s key, as tests/test_engine.py's ``keys`` names it."""
    return make_offload_key(i.to_bytes(8, "big"))


def failing_factory(namespace: RemoteNamespace) -> SecondaryTier:
    raise ConfigError("this tier cannot be built")


@pytest.mark.parametrize(
    "after",
    [
        pytest.param(lambda ns: MemoryTier(ns, label="disk"), id="the-chain-refuses-them"),
        pytest.param(failing_factory, id="the-next-tier-fails"),
    ],
)
async def test_an_engine_that_failed_to_build_frees_the_disk_tiers_folder(
    tmp_path: Path, after: Callable[[RemoteNamespace], SecondaryTier]
) -> None:
    path = tmp_path / "disk"
    with pytest.raises(ConfigError):
        TieringEngine(
            config(),
            kv_caches(),
            cpu_bytes=16 * CHUNK_BYTES,
            secondary=[lambda ns: DiskTier(path, 64 << 20, ns), after],
        )
    # The corrected retry, in the same process, takes the folder.
    engine = TieringEngine(
        config(),
        kv_caches(),
        cpu_bytes=16 * CHUNK_BYTES,
        secondary=[lambda ns: DiskTier(path, 64 << 20, ns)],
    )
    async with engine:
        handle = await engine.submit_store([engine_key(1)], GPULoadStoreSpec([0]))
        assert (await handle).success
        with anyio.fail_after(10):
            await engine.wait_written_through()
        s = engine.statistics().secondary
        assert s is not None
        assert s.cascade_written == 1


async def block_stores(subscription: EventSubscription) -> list[BlockStored]:
    """Every `BlockStored` that ``subscription`` saw, to its end (its engine closed)."""
    seen: list[BlockStored] = []
    with anyio.fail_after(10):
        async for item in subscription:
            if isinstance(item, SequencedBatch):
                seen += [e for e in item.batch.events if isinstance(e, BlockStored)]
    return seen


class PickyTier(MemoryTier):
    """A memory tier that writes nothing until ``gate`` is set, then every chunk but
    ``bad`` (a refusal, or a key another call is writing)."""

    gate: anyio.Event
    bad: bytes

    async def write(self, items: Sequence[tuple[OffloadKey, Any]]) -> int:
        await self.gate.wait()
        return await super().write([(k, r) for k, r in items if bytes(k) != self.bad])


async def test_every_store_written_through_whole_is_announced(anyio_backend: str) -> None:
    cfg = msgspec.structs.replace(config(), enable_kv_cache_events=True)
    store = MemoryStore()
    gate = anyio.Event()

    def picky(namespace: RemoteNamespace) -> PickyTier:
        tier = PickyTier(namespace, store=store)
        tier.gate, tier.bad = gate, bytes(engine_key(3))
        return tier

    engine = TieringEngine(cfg, kv_caches(), cpu_bytes=16 * CHUNK_BYTES, secondary=picky)
    async with engine:
        subscription = engine.subscribe()
        for i in (1, 2, 3):  # queued behind the first, held at the gate
            handle = await engine.submit_store([engine_key(i)], GPULoadStoreSpec([i]))
            assert (await handle).success
        gate.set()
        with anyio.fail_after(10):
            await engine.wait_written_through()
        s = engine.statistics().secondary
        assert s is not None
        assert (s.cascade_written, len(store)) == (2, 2)
    seen = await block_stores(subscription)
    cpu = [e.block_hashes for e in seen if e.medium == "CPU"]
    below = [e.block_hashes for e in seen if e.medium != "CPU"]
    assert len(cpu) == 3
    assert below == cpu[:2]  # stores 1 and 2 landed on the tier whole; 3 did not


async def test_every_tier_of_a_chain_describes_a_chunk_alike(anyio_backend: str) -> None:
    cfg = msgspec.structs.replace(
        config(self_describing_kv_events=True), enable_kv_cache_events=True
    )
    engine = TieringEngine(
        cfg,
        kv_caches(),
        cpu_bytes=4 * CHUNK_BYTES,
        backend="mock",
        secondary=[
            lambda ns: MemoryTier(ns, store=MemoryStore(), label="disk"),
            lambda ns: MemoryTier(ns, store=MemoryStore(), locality=Locality.REMOTE),
        ],
    )
    tokens = list(range(16))
    async with engine:
        subscription = engine.subscribe()
        blocks = [ChunkBlocks(block_hashes=[101], block_size=16, token_ids=tokens)]
        handle = await engine.submit_store([engine_key(1)], GPULoadStoreSpec([0]), blocks=blocks)
        assert (await handle).success
        with anyio.fail_after(10):
            await engine.wait_written_through()
    seen = await block_stores(subscription)
    cpu = [(e.block_hashes, e.token_ids) for e in seen if e.medium == "CPU"]
    assert cpu == [([101], tokens)]
    # The two tiers write at once: their events come in either order.
    below = sorted((e for e in seen if e.medium != "CPU"), key=lambda e: str(e.locality))
    assert [(e.medium, e.locality, e.block_hashes, e.token_ids) for e in below] == [
        ("STORAGE", "LOCAL", [101], tokens),
        ("STORAGE", "REMOTE", [101], tokens),
    ]


# -- the second review: a read's open files, and the scan's waiting threads ---------------

_MANY_CHUNKS = """
import hashlib, resource, sys
import anyio, numpy as np
from tiering._types import make_offload_key
from tiering.secondary import RemoteNamespace
from tiering.secondary.disk import DiskTier

async def main(root, n):
    ns = RemoteNamespace(model="m", dtype="uint8", row_bytes=4096, blocks_per_chunk=1)
    async with DiskTier(root, n * 8192 * 2, ns, timeout_s=60) as tier:
        keys = [make_offload_key(i) for i in range(n)]
        rows = [np.frombuffer(hashlib.shake_128(bytes(k)).digest(4096), np.uint8) for k in keys]
        for i in range(0, n, 100):
            await tier.write([(k, r.data) for k, r in zip(keys[i:i + 100], rows[i:i + 100])])
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # fewer than the chunks
        bufs = [np.zeros(4096, np.uint8) for _ in keys]
        filled = await tier.read([(k, b.data) for k, b in zip(keys, bufs)])
        good = sum(bool(f) and np.array_equal(b, r) for f, b, r in zip(filled, bufs, rows))
        print(good, tier.statistics().errors_total)

anyio.run(main, sys.argv[1], int(sys.argv[2]))
"""


def test_a_read_of_more_chunks_than_open_files_allowed_reads_them_all(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MANY_CHUNKS, str(tmp_path / "disk"), "600"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["600", "0"]  # every chunk, byte-exact; no error


async def test_calls_during_a_slow_scan_leave_no_thread_waiting_for_it(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    tier = DiskTier(tmp_path / "disk", 1 << 24, namespace, timeout_s=0.02, max_concurrency=4)
    gate = threading.Event()
    real = tier._files.scan
    tier._files.scan = lambda: (gate.wait(), real())[1]  # a big folder: a long scan
    key = chunks.keys(1)
    try:
        before = threading.active_count()
        for _ in range(40):
            assert await tier.contains(key) == [False]  # busy: still scanning
        assert threading.active_count() <= before + 4  # not one waiting thread a call
        assert tier.statistics().busy_total == 40
    finally:
        gate.set()
    assert await tier.open() is not None
    await tier.aclose()
