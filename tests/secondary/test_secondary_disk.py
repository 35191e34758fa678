"""DiskTier's own promises, with real files in ``tmp_path`` (issue #19).

The secondary-tier contract (tests/secondary/test_secondary_contract.py) covers
what every tier does, checkpoints included; here, what only a disk does: its
capacity and eviction order, restarts, half-written and foreign files, a
process killed mid-write, one owner per folder, the faults of a file system
(injected as ``OSError``s through ``tier._files.os`` where a real full disk
cannot be made), ``O_DIRECT`` and a tier whose worker threads are all busy. No
test waits on a clock: a tier backing off is made due (``retry_at``, white
box), and file times are set where their order matters (a file system's clock
is coarse).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

from tiering._types import OffloadKey, make_offload_key
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.secondary import ChunkCodec, RemoteNamespace, Verdict
from tiering.secondary.disk import FSYNC_POLICIES, DiskTier
from tiering.secondary.disk import files as disk_files
from tiering.secondary.disk.files import DiskFiles, file_bytes, head_bytes

pytestmark = pytest.mark.anyio

Row = np.ndarray[Any, np.dtype[np.uint8]]

#: Longer than any disk test; only ``due`` makes a tier try again.
BACKOFF = (60.0, 60.0)


# -- helpers ---------------------------------------------------------------------------------


def row_of(key: OffloadKey, row_bytes: int) -> Row:
    """The row of chunk ``key``: derived from the key, so any process can check it."""
    return np.frombuffer(hashlib.shake_128(bytes(key)).digest(row_bytes), dtype=np.uint8)


def items(keys: list[OffloadKey], rows: list[Any]) -> list[tuple[OffloadKey, memoryview]]:
    return [(k, memoryview(r)) for k, r in zip(keys, rows, strict=True)]


def rows_of(keys: list[OffloadKey], row_bytes: int) -> list[Row]:
    return [row_of(k, row_bytes) for k in keys]


def value_bytes(namespace: RemoteNamespace) -> int:
    """Bytes of one value file on disk (a key of 20 bytes): its 4 KiB head and its row."""
    return head_bytes(ChunkCodec(namespace), make_offload_key(0)) + namespace.row_bytes


def tkv_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.tkv"))


def files_under(root: Path, suffix: str) -> list[Path]:
    return sorted(root.rglob(f"*{suffix}"))


def listing(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: its size, its time and its bytes."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def due(tier: DiskTier) -> None:
    tier._health.retry_at = 0.0  # white box: the retry time has come
    tier._write_gate.retry_at = 0.0


def disk(root: Path, namespace: RemoteNamespace, capacity: int, **options: Any) -> DiskTier:
    options.setdefault("backoff_s", BACKOFF)
    options.setdefault("timeout_s", 2.0)
    return DiskTier(root, capacity, namespace, **options)


async def read_back(tier: DiskTier, keys: list[OffloadKey]) -> tuple[list[bool], list[Row]]:
    buffers = [np.zeros(tier.row_bytes, dtype=np.uint8) for _ in keys]
    return await tier.read(items(keys, buffers)), buffers


def exact(keys: list[OffloadKey], buffers: list[Row], row_bytes: int) -> bool:
    return all(np.array_equal(b, row_of(k, row_bytes)) for k, b in zip(keys, buffers, strict=True))


class FaultyOs:
    """The `os` calls of a disk tier, with ``call`` raising ``OSError(code)`` where
    ``when(*args)`` holds; ``raised`` counts them (so a test knows the fault was hit)."""

    def __init__(self, call: str, code: int, when: Callable[..., bool] = lambda *a: True) -> None:
        self.call = call
        self.code = code
        self.when = when
        self.raised = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name != self.call:
            return real

        def faulty(*args: Any, **kwargs: Any) -> Any:
            if self.when(*args):
                self.raised += 1
                raise OSError(self.code, os.strerror(self.code))
            return real(*args, **kwargs)

        return faulty


def address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class RecordingOs:
    """The `os` calls of a disk tier, recording each ``open``'s flags, each ``fdatasync``,
    and the memory each ``preadv`` and ``pwritev`` moved."""

    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []
        self.datasyncs = 0
        self.moved: set[int] = set()  # buffer addresses

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        self.moved.update(map(address, buffers))
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list[Any], offset: int) -> int:
        self.moved.update(map(address, buffers))
        return os.pwritev(fd, buffers, offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        self.opened.append((str(path), flags))
        return os.open(path, flags, *args, **kwargs)

    def fdatasync(self, fd: int) -> None:
        self.datasyncs += 1
        os.fdatasync(fd)


def json_of(namespace: RemoteNamespace) -> str:
    return msgspec.json.encode(namespace).decode()


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60
    )


# -- capacity --------------------------------------------------------------------------------


async def test_it_never_holds_more_than_its_capacity_and_evicts_lru_tail_first(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    v = value_bytes(namespace)
    capacity = 4 * v + v // 2  # four values, and not a fifth

    async with disk(root, namespace, capacity, policy="lru") as tier:
        rb = tier.row_bytes

        def check() -> None:
            s = tier.statistics()
            assert s.capacity_bytes == capacity
            assert s.used_bytes is not None
            assert s.used_bytes <= capacity
            assert tkv_bytes(root) <= capacity
            assert tkv_bytes(root) == s.used_bytes  # the index says what is on disk
            assert s.chunks == len(files_under(root, ".tkv"))

        a, b, c, d, e, f, g, h = keys = chunks.keys(8)
        assert await tier.write(items([a, b, c], rows_of([a, b, c], rb))) == 3  # one request
        check()
        assert await tier.write(items([d], rows_of([d], rb))) == 1
        check()
        assert tier.statistics().evictions_total == 0
        await tier.write(items([e], rows_of([e], rb)))
        check()
        # The request's tail went first, its head stays.
        assert await tier.contains([a, b, c, d, e]) == [True, True, False, True, True]
        assert not tier._files.path(c).exists()
        await tier.write(items([f], rows_of([f], rb)))
        await tier.write(items([g], rows_of([g], rb)))
        check()
        assert await tier.contains([a, b, d, e, f, g]) == [False, False, True, True, True, True]
        # d is read: now e is the oldest used.
        assert (await read_back(tier, [d]))[0] == [True]
        await tier.write(items([h], rows_of([h], rb)))
        check()
        assert await tier.contains([d, e, f, g, h]) == [True, False, True, True, True]
        assert tier.statistics().evictions_total == 4
        # A value written again takes no more room, and evicts nothing.
        assert await tier.write(items([f], rows_of([f], rb))) == 1
        check()
        assert (tier.statistics().chunks, tier.statistics().evictions_total) == (4, 4)
        filled, buffers = await read_back(tier, [d, f, g, h])
        assert filled == [True] * 4
        assert exact([d, f, g, h], buffers, rb)

        # Many more, one at a time: the bound holds after every write.
        more = chunks.keys(12)
        for key in more:
            assert await tier.write(items([key], rows_of([key], rb))) == 1
            check()
        assert tier.statistics().evictions_total == 4 + 12
        assert await tier.contains(more) == [False] * 8 + [True] * 4
        assert await tier.contains(keys) == [False] * 8

        # A batch larger than the tier: the head of it is written, the rest counted.
        batch = chunks.keys(10)
        written = await tier.write(items(batch, rows_of(batch, rb)))
        check()
        assert 1 <= written <= 4
        assert await tier.contains(batch) == [True] * written + [False] * (10 - written)
        s = tier.statistics()
        assert s.write_errors_by_reason == {"no room": 10 - written}
        assert s.write_errors_total == 10 - written


async def test_a_smaller_capacity_at_open_evicts_the_oldest_used(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(6)
    async with disk(root, namespace, 64 << 20, policy="lru") as tier:
        rb, v = tier.row_bytes, value_bytes(namespace)
        for key in keys:
            await tier.write(items([key], rows_of([key], rb)))
    for i, key in enumerate(keys):  # written long ago, in this order
        os.utime(tier._files.path(key), ns=(10**18 + i * 10**9,) * 2)
    async with disk(root, namespace, 2 * v, policy="lru") as smaller:
        report = await smaller.open()
        assert len(report.values) == 6  # found, then trimmed
        s = smaller.statistics()
        assert (s.chunks, s.used_bytes, s.evictions_total) == (2, 2 * v, 4)
        assert tkv_bytes(root) == 2 * v
        assert await smaller.contains(keys) == [False] * 4 + [True] * 2


async def test_the_default_policy_is_the_engines(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    async with disk(tmp_path / "disk", namespace, 64 << 20) as tier:
        assert tier.policy.name == DEFAULT_POLICY


async def test_bad_options_are_config_errors_that_leave_the_folder_free(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    root = tmp_path / "disk"
    with pytest.raises(ConfigError, match="fsync"):
        disk(root, namespace, 64 << 20, fsync="sometimes")
    with pytest.raises(ConfigError, match="capacity_bytes"):
        disk(root, namespace, namespace.row_bytes)  # no room for a head
    with pytest.raises(ConfigError, match="backoff_s"):
        disk(root, namespace, 64 << 20, backoff_s=(0.0, 1.0))
    # None of them keeps the folder: an engine with good options opens it.
    async with disk(root, namespace, 64 << 20) as tier:
        assert await tier.open() is not None


# -- restarts --------------------------------------------------------------------------------


@pytest.mark.parametrize("fsync", FSYNC_POLICIES)
async def test_a_new_process_finds_every_value_it_wrote(
    tmp_path: Path,
    namespace: RemoteNamespace,
    chunks: Any,
    fsync: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(6)
    folder_syncs: list[int] = []  # the shard folders' descriptors
    real_fsync_folder = disk_files._fsync_folder

    def fsync_folder(folder: int) -> None:
        folder_syncs.append(folder)
        real_fsync_folder(folder)

    monkeypatch.setattr(disk_files, "_fsync_folder", fsync_folder)
    recording = RecordingOs()
    async with disk(root, namespace, 64 << 20, fsync=fsync) as tier:
        tier._files.os = recording
        rb, v = tier.row_bytes, value_bytes(namespace)
        assert await tier.write(items(keys[:4], rows_of(keys[:4], rb))) == 4
        assert await tier.write(items(keys[4:], rows_of(keys[4:], rb))) == 2
    assert recording.datasyncs == (0 if fsync == "none" else 6)
    assert len(folder_syncs) == (6 if fsync == "full" else 0)
    assert files_under(root, ".tmp") == []

    async with disk(root, namespace, 64 << 20) as again:
        report = await again.open()
        assert {key for key, _, _ in report.values} == set(keys)
        assert all(size == v for _, size, _ in report.values)
        assert (report.dropped, report.foreign_namespaces) == ({}, 0)
        s = again.statistics()
        assert (s.chunks, s.used_bytes) == (6, 6 * v)
        assert await again.contains(keys) == [True] * 6
        filled, buffers = await read_back(again, keys)
        assert filled == [True] * 6
        assert exact(keys, buffers, rb)
        assert again.statistics().rejected_total == 0


async def test_after_a_restart_the_order_follows_the_last_use(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    a, b, c, d, e, f = chunks.keys(6)
    async with disk(root, namespace, 64 << 20) as tier:
        rb, v = tier.row_bytes, value_bytes(namespace)
        for key in (a, b, c, d):
            await tier.write(items([key], rows_of([key], rb)))
    for i, key in enumerate((a, b, c, d)):  # written long ago, a first
        os.utime(tier._files.path(key), ns=(10**18 + i * 10**9,) * 2)
    async with disk(root, namespace, 4 * v, policy="lru") as tier:
        assert (await read_back(tier, [b]))[0] == [True]  # a read sets the file's time
        assert (await read_back(tier, [a]))[0] == [True]
    async with disk(root, namespace, 4 * v, policy="lru") as tier:
        await tier.write(items([e], rows_of([e], rb)))
        await tier.write(items([f], rows_of([f], rb)))
        # The ones read survive the ones only written, though written first.
        assert await tier.contains([a, b, c, d, e, f]) == [True, True, False, False, True, True]
        filled, buffers = await read_back(tier, [a, b])
        assert filled == [True, True]
        assert exact([a, b], buffers, rb)


# -- what a crash or another engine leaves ---------------------------------------------------


async def test_half_written_damaged_and_foreign_files_are_dropped_at_open(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    good = chunks.keys(3)
    trunc, tmp, foreign, renamed, shard, garbage, empty, other = chunks.keys(8)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        await tier.write(items([*good, trunc], rows_of([*good, trunc], rb)))
    codec, files = tier.codec, tier._files

    def put(key: OffloadKey, data: bytes) -> Path:
        path = files.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def value(key: OffloadKey, c: ChunkCodec = codec) -> bytes:
        return file_bytes(c, key, c.encode(key, row_of(key, rb)))

    alien = ChunkCodec(msgspec.structs.replace(namespace, dtype="float8_e4m3"))
    bad: dict[str, list[Path]] = {"half-written": [], "misnamed": []}
    with open(files.path(trunc), "r+b") as handle:  # a crash of the disk, or a copy cut short
        handle.truncate(head_bytes(codec, trunc) + rb // 2)
    bad["bad_length"] = [files.path(trunc)]
    half = files.path(tmp).with_name(files.path(tmp).name + ".4242-7.tmp")
    half.parent.mkdir(parents=True, exist_ok=True)
    half.write_bytes(value(tmp)[:5000])  # a process killed mid-write
    probe = files.folder / ".direct-probe-4242.tmp"
    probe.write_bytes(b"")
    bad["half-written"] += [half, probe]
    bad["foreign_namespace"] = [put(foreign, value(foreign, alien))]
    bad["misnamed"].append(put(renamed, value(good[0])))  # a sound value under another name
    wrong_shard = files.folder / "zz" / files.path(shard).name
    wrong_shard.parent.mkdir()
    wrong_shard.write_bytes(value(shard))
    bad["misnamed"].append(wrong_shard)
    bad["bad_magic"] = [put(garbage, np.random.default_rng(1).bytes(rb)), put(empty, b"")]
    # Another namespace's own folder under the same root: not this tier's to judge.
    others = DiskFiles(root, alien, fsync="none", direct=False, read_only=True)
    theirs = others.path(other)
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes(value(other, alien))

    async with disk(root, namespace, 64 << 20) as tier:
        report = await tier.open()
        assert report.dropped == {reason: len(paths) for reason, paths in bad.items()}
        assert {key for key, _, _ in report.values} == set(good)
        assert report.foreign_namespaces == 1
        for paths in bad.values():
            for path in paths:
                assert not path.exists(), path
        assert theirs.exists()
        assert files_under(root, ".tmp") == []
        # Nothing of them is ever loaded: not held, not a byte copied.
        named = [trunc, tmp, foreign, renamed, shard, garbage, empty, other]
        assert await tier.contains(named) == [False] * 8
        filled, buffers = await read_back(tier, named)
        assert filled == [False] * 8
        assert not any(buf.any() for buf in buffers)
        filled, buffers = await read_back(tier, good)
        assert filled == [True] * 3
        assert exact(good, buffers, rb)
        s = tier.statistics()
        assert (s.chunks, s.rejected_total, s.errors_total) == (3, 0, 0)


WRITER = """
import sys, hashlib, anyio, msgspec
from tiering._types import make_offload_key
from tiering.secondary import RemoteNamespace
from tiering.secondary.disk import DiskTier

root, capacity = sys.argv[1], int(sys.argv[2])
namespace = msgspec.json.decode(sys.argv[3], type=RemoteNamespace)

async def main():
    async with DiskTier(root, capacity, namespace, policy="lru") as tier:
        i = 0
        while True:
            key = make_offload_key(i)
            row = hashlib.shake_128(bytes(key)).digest(namespace.row_bytes)
            assert await tier.write([(key, row)]) == 1
            print(i, flush=True)
            i += 1

anyio.run(main)
"""


async def test_a_process_killed_mid_write_leaves_only_whole_values(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    root = tmp_path / "disk"
    capacity = 8 * value_bytes(namespace)
    command = [sys.executable, "-c", WRITER, str(root), str(capacity), json_of(namespace)]
    errors = tmp_path / "writer.err"
    with (
        errors.open("w") as err,
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True) as child,
    ):
        assert child.stdout is not None
        reported = -1
        while reported < 11:  # its own word that value 11 is written: past its capacity
            line = child.stdout.readline()
            if not line:
                child.wait(10)
                pytest.fail(f"the writer died: {errors.read_text()}")
            reported = int(line)
        child.send_signal(signal.SIGKILL)  # while it writes the next ones
        child.wait(10)
        assert child.returncode == -signal.SIGKILL
    half_written = len(files_under(root, ".tmp"))

    async with disk(root, namespace, capacity, policy="lru") as tier:  # the dead pid's lock is free
        report = await tier.open()
        assert report.dropped == ({"half-written": half_written} if half_written else {})
        assert files_under(root, ".tmp") == []
        assert (root / ".lock").read_text().strip() == str(os.getpid())
        found = sorted(int.from_bytes(bytes(key)[:8], "big") for key, _, _ in report.values)
        # The newest values, whole: oldest evicted first, the one in flight maybe not there.
        assert found[-1] >= reported
        assert found == list(range(found[0], found[-1] + 1))
        assert 7 <= len(found) <= 8
        keys = [key for key, _, _ in report.values]
        filled, buffers = await read_back(tier, keys)
        assert filled == [True] * len(keys)
        assert exact(keys, buffers, tier.row_bytes)
        assert tier.statistics().rejected_total == 0


# -- one owner -------------------------------------------------------------------------------


OPENER = """
import sys, msgspec
from tiering.errors import ConfigError
from tiering.secondary import RemoteNamespace
from tiering.secondary.disk import DiskTier

namespace = msgspec.json.decode(sys.argv[2], type=RemoteNamespace)
try:
    DiskTier(sys.argv[1], 64 << 20, namespace)
except ConfigError as exc:
    print(exc)
    sys.exit(3)
"""


async def test_one_owner_at_a_time_and_readers_change_nothing(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(4)
    owner = disk(root, namespace, 64 << 20)
    async with owner:
        rb = owner.row_bytes
        assert await owner.write(items(keys[:3], rows_of(keys[:3], rb))) == 3
        # In this process...
        with pytest.raises(ConfigError, match=str(os.getpid())) as same:
            disk(root, namespace, 64 << 20)
        assert str(root) in str(same.value)
        assert "read_only=True" in str(same.value)
        # ...and in another.
        child = run_child(OPENER, str(root), json_of(namespace))
        assert child.returncode == 3, child.stderr
        assert str(root) in child.stdout
        assert f"process {os.getpid()}" in child.stdout

        # A reader opens beside the owner; a bad file and a half-written one are there.
        garbage = owner._files.path(keys[3])
        garbage.parent.mkdir(exist_ok=True)
        garbage.write_bytes(b"not a value")
        half = garbage.with_name(garbage.name + ".1-1.tmp")
        half.write_bytes(b"half")
        flipped = owner._files.path(keys[2])
        data = bytearray(flipped.read_bytes())
        data[-1] ^= 0xFF
        flipped.write_bytes(bytes(data))
        before = listing(root)
        async with disk(root, namespace, 64 << 20, read_only=True) as reader:
            report = await reader.open()
            assert report.dropped == {"bad_magic": 1, "half-written": 1}  # seen, left there
            assert reader.direct_io is False  # not probed: that writes a file
            filled, buffers = await read_back(reader, keys[:3])
            assert filled == [True, True, False]
            assert exact(keys[:2], buffers[:2], rb)
            assert await reader.write(items(keys, rows_of(keys, rb))) == 0
            s = reader.statistics()
            assert s.write_errors_by_reason == {"read only": 4}
            assert s.rejected_by_reason == {Verdict.BAD_CHECKSUM.value: 1}
            assert (s.errors_total, s.state) == (0, "up")
        assert listing(root) == before  # nothing written, deleted or touched
    # The owner is gone: a new one opens, and drops what the reader left.
    async with disk(root, namespace, 64 << 20) as heir:
        report = await heir.open()
        assert report.dropped == {"bad_magic": 1, "half-written": 1}
        assert not garbage.exists()
        assert not half.exists()
        assert (root / ".lock").read_text().strip() == str(os.getpid())
        filled, _ = await read_back(heir, keys[:2])
        assert filled == [True, True]


async def test_a_reader_of_a_missing_folder_is_a_config_error(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    async with disk(tmp_path / "nothing", namespace, 64 << 20, read_only=True) as reader:
        with pytest.raises(ConfigError, match="nothing"):
            await reader.open()
    assert not (tmp_path / "nothing").exists()


# -- faults ----------------------------------------------------------------------------------


async def test_a_full_disk_refuses_writes_reads_go_on(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(5)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:2], rows_of(keys[:2], rb))) == 2
        full = FaultyOs("pwritev", errno.ENOSPC)
        tier._files.os = full
        assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 0
        assert full.raised == 1  # the rest not tried: they would fail alike
        s = tier.statistics()
        assert s.refused_by_reason == {"ENOSPC": 3}
        assert (s.write_state, s.state, s.errors_total) == ("backing off", "up", 0)
        assert files_under(root, ".tmp") == []  # no half value left behind
        assert await tier.write(items(keys[2:3], rows_of(keys[2:3], rb))) == 0
        assert full.raised == 1  # backing off: not tried
        assert tier.statistics().write_errors_by_reason["backing off"] == 1
        filled, buffers = await read_back(tier, keys[:3])
        assert filled == [True, True, False]
        assert exact(keys[:2], buffers[:2], rb)
        assert tier.statistics().used_bytes == tkv_bytes(root)
        tier._files.os = os
        assert await tier.write(items(keys[2:3], rows_of(keys[2:3], rb))) == 0  # not yet due
        due(tier)
        assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 3
        assert tier.statistics().write_state == "up"
        filled, buffers = await read_back(tier, keys)
        assert filled == [True] * 5
        assert exact(keys, buffers, rb)


async def test_a_forbidden_temporary_file_refuses_writes(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(4)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:1], rows_of(keys[:1], rb))) == 1
        denied = FaultyOs("open", errno.EACCES, lambda path, *_: str(path).endswith(".tmp"))
        tier._files.os = denied
        assert await tier.write(items(keys[1:], rows_of(keys[1:], rb))) == 0
        assert denied.raised == 3
        s = tier.statistics()
        assert s.refused_by_reason == {"EACCES": 3}
        assert s.write_errors_by_reason == {"refused EACCES": 3}
        assert (s.write_state, s.state, s.errors_total) == ("backing off", "up", 0)
        assert s.used_bytes == tkv_bytes(root) == value_bytes(namespace)
        filled, _ = await read_back(tier, keys[:1])  # reads open no temporary file
        assert filled == [True]
        tier._files.os = os
        due(tier)
        assert await tier.write(items(keys[1:], rows_of(keys[1:], rb))) == 3
        assert await tier.contains(keys) == [True] * 4


async def test_an_io_error_is_a_counted_error_and_a_miss(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(3)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:2], rows_of(keys[:2], rb))) == 2
        broken = FaultyOs("preadv", errno.EIO)
        tier._files.os = broken
        filled, buffers = await read_back(tier, keys[:2])
        assert filled == [False, False]
        assert broken.raised == 2
        assert not any(buf.any() for buf in buffers)
        s = tier.statistics()
        assert (s.errors_total, s.read_misses_total, s.reads_total) == (2, 2, 0)
        assert s.last_error is not None
        assert "reading a value" in s.last_error
        assert "Errno 5" in s.last_error
        # A write that fails so is an error too, not a refusal: writes do not back off.
        tier._files.os = FaultyOs("pwritev", errno.EIO)
        assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 0
        s = tier.statistics()
        assert (s.errors_total, s.refused_total, s.write_state) == (3, 0, "up")
        assert s.write_errors_by_reason == {"failed": 1}
        assert s.state == "up"
        tier._files.os = os  # the disk heals: the values were kept
        filled, buffers = await read_back(tier, keys[:2])
        assert filled == [True, True]
        assert exact(keys[:2], buffers, rb)
        assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 1


async def test_files_deleted_truncated_or_damaged_behind_its_back(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    gone, cut, flipped, kept = keys = chunks.keys(4)
    async with disk(root, namespace, 64 << 20) as tier:
        rb, v = tier.row_bytes, value_bytes(namespace)
        assert await tier.write(items(keys, rows_of(keys, rb))) == 4
        path = tier._files.path
        path(gone).unlink()
        with open(path(cut), "r+b") as handle:
            handle.truncate(v - 4096)
        data = bytearray(path(flipped).read_bytes())
        data[head_bytes(tier.codec, flipped) + 1234] ^= 0x01
        path(flipped).write_bytes(bytes(data))
        assert await tier.contains(keys) == [True] * 4  # the index cannot know yet

        filled, buffers = await read_back(tier, keys)
        assert filled == [False, False, False, True]
        assert not buffers[0].any()
        assert not buffers[1].any()  # failed at its head: not a byte copied
        assert exact([kept], buffers[3:], rb)
        s = tier.statistics()
        assert s.lost_total == 1
        assert s.rejected_by_reason == {
            Verdict.BAD_LENGTH.value: 1,
            Verdict.BAD_CHECKSUM.value: 1,
        }
        assert (s.read_misses_total, s.reads_total, s.errors_total) == (1, 1, 0)
        assert (s.state, s.chunks, s.used_bytes) == ("up", 1, v)
        assert not path(cut).exists()  # deleted: never offered again
        assert not path(flipped).exists()
        assert tkv_bytes(root) == v
        assert await tier.contains(keys) == [False, False, False, True]
        filled, _ = await read_back(tier, keys[:3])
        assert filled == [False] * 3
        assert tier.statistics().lost_total == 1  # counted once
        assert tier.statistics().rejected_total == 2


async def test_the_folder_removed_takes_the_tier_down_until_it_is_made_again(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(5)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:3], rows_of(keys[:3], rb))) == 3
        shutil.rmtree(root)
        assert await tier.contains(keys[:3]) == [False] * 3
        s = tier.statistics()
        assert (s.state, s.errors_total) == ("down", 1)
        filled, buffers = await read_back(tier, keys[:3])
        assert filled == [False] * 3
        assert not any(buf.any() for buf in buffers)
        assert await tier.write(items(keys[3:], rows_of(keys[3:], rb))) == 0
        assert not root.exists()  # while down and not due: no I/O at all
        s = tier.statistics()
        assert s.write_errors_by_reason == {"down": 2}
        assert s.unavailable_total == 2

        due(tier)
        assert await tier.contains(keys[:1]) == [False]  # the probe finds it gone: made again
        assert root.is_dir()
        assert tier._files.folder.is_dir()
        assert (root / ".lock").read_text().strip() == str(os.getpid())
        s = tier.statistics()
        assert (s.lost_total, s.chunks, s.used_bytes) == (3, 0, 0)
        assert await tier.write(items(keys[3:], rows_of(keys[3:], rb))) == 2
        s = tier.statistics()
        assert (s.state, s.reconnects_total) == ("up", 1)
        assert await tier.contains(keys) == [False] * 3 + [True] * 2
        filled, buffers = await read_back(tier, keys[3:])
        assert filled == [True, True]
        assert exact(keys[3:], buffers, rb)
        # Still the folder's one owner.
        with pytest.raises(ConfigError, match="in use"):
            disk(root, namespace, 64 << 20)


# -- O_DIRECT --------------------------------------------------------------------------------


def takes_direct_io(folder: Path) -> bool:
    """This test's own probe: whether ``folder``'s file system takes an O_DIRECT round trip."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = folder / "direct-probe"
    buffer = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o644)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buffer], 0)
        return os.preadv(fd, [buffer], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()
        buffer.close()


def aligned_rows(n: int, row_bytes: int) -> tuple[mmap.mmap, list[memoryview]]:
    """``n`` rows in one anonymous mapping: each on a page boundary."""
    memory = mmap.mmap(-1, n * row_bytes)
    view = memoryview(memory)
    return memory, [view[i * row_bytes : (i + 1) * row_bytes] for i in range(n)]


@pytest.fixture
def block_namespace(namespace: RemoteNamespace) -> RemoteNamespace:
    """Rows of four 4 KiB blocks: what O_DIRECT can move."""
    return msgspec.structs.replace(namespace, row_bytes=4 * 4096)


async def test_direct_io_is_probed_and_aligned_rows_round_trip(
    tmp_path: Path, block_namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    supported = takes_direct_io(tmp_path)
    async with disk(root, block_namespace, 64 << 20, direct_io=None) as tier:
        await tier.open()
        assert tier.direct_io is supported
    assert files_under(root, ".tmp") == []  # the tier's probe file is gone too

    rb = block_namespace.row_bytes
    keys = chunks.keys(13)
    odd = keys[12]
    modes = [False, True, False] if supported else [False]
    for n, direct in enumerate(modes):
        batch = keys[4 * n : 4 * n + 4]
        async with disk(root, block_namespace, 64 << 20, direct_io=direct) as tier:
            recording = RecordingOs()
            tier._files.os = recording
            await tier.open()
            assert tier.direct_io is direct
            _, sent = aligned_rows(4, rb)
            for row, key in zip(sent, batch, strict=True):
                row[:] = row_of(key, rb).tobytes()
            unaligned = memoryview(bytearray(rb + 1))[1:]  # never O_DIRECT: copied as is
            unaligned[:] = row_of(odd, rb).tobytes()
            assert await tier.write([*zip(batch, sent, strict=True), (odd, unaligned)]) == 5
            # Every value so far, written with O_DIRECT or without, is read both ways.
            held = keys[: 4 * n + 4]
            _, landed = aligned_rows(len(held), rb)
            assert await tier.read(list(zip(held, landed, strict=True))) == [True] * len(held)
            for key, row in zip(held, landed, strict=True):
                assert np.array_equal(np.frombuffer(row, np.uint8), row_of(key, rb))
            plain = [np.zeros(rb + 1, np.uint8)[1:] for _ in held]  # never aligned
            assert await tier.read(items(held, plain)) == [True] * len(held)
            assert exact(held, plain, rb)
            # Straight between the caller's rows and the disk: no copy on the way.
            rows = [*sent, unaligned, *landed, *plain]
            assert {address(row) for row in rows} <= recording.moved
            flag = getattr(os, "O_DIRECT", 0)
            directs = [path for path, flags in recording.opened if flag and flags & flag]
            if direct:
                # The aligned rows' writes (a shard's first open is tried twice) and
                # reads, none of the unaligned row's.
                assert len({p for p in directs if p.endswith(".tmp")}) == 4
                assert len([p for p in directs if p.endswith(".tkv")]) == len(held)
                assert not any(bytes(odd).hex() in p for p in directs)
            else:
                assert directs == []


@pytest.fixture
def shm_folder() -> Iterator[Path]:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tiering-disk-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def test_direct_io_required_where_tmpfs_refuses_it_is_a_config_error(
    shm_folder: Path, block_namespace: RemoteNamespace
) -> None:
    if takes_direct_io(shm_folder):
        pytest.skip("tmpfs takes O_DIRECT on this kernel (Linux 6.6 and later)")
    async with disk(shm_folder / "disk", block_namespace, 64 << 20, direct_io=True) as tier:
        with pytest.raises(ConfigError, match="O_DIRECT"):
            await tier.open()


async def test_direct_io_required_without_it_is_a_config_error(
    tmp_path: Path, block_namespace: RemoteNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_files, "_O_DIRECT", 0)  # a platform without O_DIRECT
    root = tmp_path / "disk"
    async with disk(root, block_namespace, 64 << 20, direct_io=True) as tier:
        with pytest.raises(ConfigError, match="O_DIRECT") as refused:
            await tier.open()
        assert str(root) in str(refused.value)
    async with disk(root, block_namespace, 64 << 20, direct_io=None) as tier:
        await tier.open()
        assert tier.direct_io is False  # where supported: here it is not


# -- worker threads --------------------------------------------------------------------------


async def test_a_call_that_finds_every_worker_busy_is_busy_not_down(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(3)
    async with disk(tmp_path / "disk", namespace, 64 << 20, max_concurrency=1) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:2], rows_of(keys[:2], rb))) == 2
        held: list[list[bool]] = []
        held_buffers = [np.zeros(rb, np.uint8) for _ in range(2)]

        async def hung_read() -> None:
            held.append(await tier.read(items(keys[:2], held_buffers)))

        tier.timeout_s = 30.0  # the hung call's own deadline: far beyond the test
        tier._files.answering.clear()
        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hung_read)
                    await anyio.wait_all_tasks_blocked()  # it holds the one worker
                    tier.timeout_s = 0.2  # the calls below wait at most this long
                    assert await tier.contains(keys) == [False] * 3
                    assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 0
                    filled, _ = await read_back(tier, keys[:1])
                    assert filled == [False]
                    s = tier.statistics()
                    assert s.busy_total == 3
                    assert (s.state, s.errors_total, s.timeouts_total) == ("up", 0, 0)
                    assert s.write_errors_by_reason == {"busy": 1}
                    assert s.read_misses_total == 1
                    tier._files.answering.set()  # the disk answers the one it held
        finally:
            tier._files.answering.set()
        assert held == [[True, True]]
        assert exact(keys[:2], held_buffers, rb)
        s = tier.statistics()
        assert (s.state, s.errors_total, s.busy_total) == ("up", 0, 3)
        assert await tier.write(items(keys[2:], rows_of(keys[2:], rb))) == 1


class CountingGate:
    """A disk that stops answering (``tier._files.answering``), counting the calls it holds."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self.waiting = self.most = 0

    def wait(self) -> bool:
        with self._cond:
            self.waiting += 1
            self.most = max(self.most, self.waiting)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._open)
            self.waiting -= 1
        return True

    def set(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def holding(self, n: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting >= n, timeout=10)


async def test_at_most_max_concurrency_calls_do_io_at_once(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(5)
    async with disk(tmp_path / "disk", namespace, 64 << 20, max_concurrency=2) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, rows_of(keys, rb))) == 5
        gate = CountingGate()
        tier._files.answering = gate  # type: ignore[assignment]
        tier.timeout_s = 30.0  # far beyond the test: they wait for the gate
        results: dict[int, tuple[list[bool], list[Row]]] = {}

        async def one(i: int) -> None:
            results[i] = await read_back(tier, keys[i : i + 1])

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(one, i)
                await anyio.wait_all_tasks_blocked()
                assert await anyio.to_thread.run_sync(gate.holding, 2)
                await anyio.wait_all_tasks_blocked()
                assert (gate.waiting, gate.most) == (2, 2)  # three wait for a worker
                gate.set()
        assert gate.most == 2
        for i in range(5):
            filled, buffers = results[i]
            assert filled == [True]
            assert exact(keys[i : i + 1], buffers, rb)
        s = tier.statistics()
        assert (s.state, s.busy_total, s.errors_total) == ("up", 0, 0)
