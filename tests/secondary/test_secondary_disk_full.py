"""A full file system is a refusal, not a failure (issue 26): the disk tier fits into it.

On a real, small file system (an 8 MiB tmpfs mounted for each test: the tests
and CI run as root; elsewhere they skip, except in CI, where
``TIERING_REQUIRE_SERVERS`` makes them fail) a `DiskTier` configured far larger
than the file system lowers its effective capacity to what the file system
holds, evicts down to it and keeps writing; a second tier on the full folder
writes new values; a replay says both capacities. A short write is a refusal
for space (``ENOSPC``), never a success: checked with an injected ``pwritev``.
No test waits on a clock: the free-space measure is made due by
``space_check_s`` (white box).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiering._types import OffloadKey
from tiering.secondary import RemoteNamespace
from tiering.secondary.disk import DiskTier

from .test_secondary_disk import (
    disk,
    due,
    exact,
    files_under,
    items,
    read_back,
    rows_of,
    value_bytes,
)

pytestmark = pytest.mark.anyio

FS_BYTES = 8 << 20
CONFIGURED = 1 << 30  # far more than the file system holds

# -- a small file system ---------------------------------------------------------------------


def _mount_tmpfs(folder: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` on ``folder``; skip where not permitted, fail in CI."""
    folder.mkdir()
    mount = shutil.which("mount")
    why = "no mount command"
    if mount is not None:
        done = subprocess.run(
            [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0:
            return
        why = done.stderr.strip() or f"mount exited {done.returncode}"
    message = f"cannot mount a tmpfs (needs root): {why}"
    if os.environ.get("TIERING_REQUIRE_SERVERS"):
        pytest.fail(f"{message}, and TIERING_REQUIRE_SERVERS is set")
    pytest.skip(message)


def _unmount(folder: Path) -> None:
    done = subprocess.run(["umount", str(folder)], capture_output=True, check=False)
    if done.returncode:  # still busy (a process of a failed test): detach it
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of this test's own."""
    folder = tmp_path / "fs"
    _mount_tmpfs(folder, "8m")
    try:
        yield folder
    finally:
        _unmount(folder)


def fill(path: Path, nbytes: int | None = None) -> int:
    """Write zeros into ``path`` until ``nbytes`` (None: until the file system is full);
    how many were written."""
    chunk = bytes(64 << 10)
    written = 0
    with open(path, "wb", buffering=0) as f:
        while nbytes is None or written < nbytes:
            try:
                n = f.write(chunk if nbytes is None else chunk[: nbytes - written])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
            assert n is not None
            written += n
    return written


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


async def write_all(
    tier: DiskTier, keys: list[OffloadKey], batch: int = 8
) -> tuple[list[int], list[OffloadKey]]:
    """Write ``keys`` in batches, one call at a time: each call's count, and what it wrote
    (a refused chunk is not retried within its call: the rest of its batch is not tried)."""
    counts: list[int] = []
    for first in range(0, len(keys), batch):
        part = keys[first : first + batch]
        counts.append(await tier.write(items(part, rows_of(part, tier.row_bytes))))
    return counts, keys


async def held_and_exact(tier: DiskTier, keys: list[OffloadKey]) -> list[OffloadKey]:
    """The keys the tier holds; each one read back byte for byte, none rejected."""
    held = [k for k, found in zip(keys, await tier.contains(keys), strict=True) if found]
    filled, buffers = await read_back(tier, held)
    assert filled == [True] * len(held)
    assert exact(held, buffers, tier.row_bytes)
    return held


# -- the rule: a short write is a refusal for space -------------------------------------------


class ShortOs:
    """`os`, but the ``pwritev`` that starts a value writes half of it, and the write of
    the rest fails with ``code`` (None: moves nothing, as no file system should)."""

    def __init__(self, code: int | None) -> None:
        self.code = code
        self.short = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        if offset == 0:
            self.short += 1
            half = sum(b.nbytes for b in buffers) // 2
            return os.pwritev(fd, [memoryview(bytes(buffers[0]) + bytes(buffers[1]))[:half]], 0)
        if self.code is None:
            return 0
        raise OSError(self.code, os.strerror(self.code))


async def test_a_short_write_then_enospc_is_a_refusal_never_a_success(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(4)
    async with disk(root, namespace, 64 << 20) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys[:1], rows_of(keys[:1], rb))) == 1
        short = ShortOs(errno.ENOSPC)
        tier._files.os = short
        assert await tier.write(items(keys[1:], rows_of(keys[1:], rb))) == 0
        assert short.short == 1  # the rest of the batch not tried: it would fail alike
        s = tier.statistics()
        assert s.refused_by_reason == {"ENOSPC": 3}
        assert s.write_errors_by_reason == {"refused ENOSPC": 3}
        assert s.errors_total == 0
        # This file system has room (the refusal measured it): nothing to evict, so the
        # tier backs off as after any refusal.
        assert s.effective_capacity_bytes == s.capacity_bytes == 64 << 20
        assert s.write_state == "backing off"
        assert files_under(root, ".tmp") == []  # the half value is gone, never renamed
        assert await tier.contains(keys) == [True, False, False, False]
        # A short write that then moves nothing is no success either: a counted failure.
        tier._files.os = ShortOs(None)
        tier._write_gate.retry_at = 0.0
        assert await tier.write(items(keys[1:2], rows_of(keys[1:2], rb))) == 0
        s = tier.statistics()
        assert s.write_errors_by_reason["failed"] == 1
        assert s.last_error is not None
        assert "short write" in s.last_error
        assert await tier.contains(keys) == [True, False, False, False]
        tier._files.os = os
        tier._write_gate.retry_at = 0.0
        assert await tier.write(items(keys[1:], rows_of(keys[1:], rb))) == 3
        assert len(await held_and_exact(tier, keys)) == 4


class MeasuredOs:
    """`os`, counting the measures of free space (``fstatvfs``)."""

    def __init__(self) -> None:
        self.measures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fstatvfs(self, fd: int) -> os.statvfs_result:
        self.measures += 1
        return os.fstatvfs(fd)


async def test_a_reader_never_measures_the_file_system_even_when_its_folder_comes_back(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    """A reader (``read_only``) holds the owner's values as they are: a measure of a full
    file system would trim its index, and it has nothing to evict to make room for."""
    root = tmp_path / "disk"
    keys = chunks.keys(4)
    async with disk(root, namespace, 64 << 20) as owner:
        assert await owner.write(items(keys, rows_of(keys, owner.row_bytes))) == 4
        async with disk(root, namespace, 64 << 20, read_only=True) as reader:
            measured = MeasuredOs()
            reader._files.os = measured
            await reader.open()
            shutil.rmtree(owner._files.folder)
            for tier in (owner, reader):  # the folder is gone: both down
                assert await tier.contains(keys) == [False] * 4
                due(tier)
            assert await owner.contains(keys[:1]) == [False]  # the owner makes it again
            assert await owner.write(items(keys, rows_of(keys, owner.row_bytes))) == 4
            assert await reader.contains(keys[:1]) == [False]  # the reader finds it again
            assert await reader.contains(keys) == [True] * 4
            assert measured.measures == 0
            assert reader.statistics().effective_capacity_bytes == 64 << 20


class QuotaOs:
    """`os` under a user quota of ``limit`` value files, which ``fstatvfs`` does not show:
    the first write into a new file (no blocks yet) past it is refused (``EDQUOT``)."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root = root
        self.limit = limit

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        new = offset == 0 and os.fstat(fd).st_blocks == 0
        if new and len(files_under(self.root, ".tkv")) >= self.limit:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return os.pwritev(fd, buffers, offset)


async def test_a_quota_the_file_system_does_not_show_is_fitted_into_too(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    """``EDQUOT`` with room on the file system: the tier holds what it has and evicts into
    it (reusing its files), as on a full file system; it once backed off for ever."""
    root = tmp_path / "disk"
    async with disk(root, namespace, CONFIGURED) as tier:
        await tier.open()
        tier._files.os = QuotaOs(root, 12)
        tier.space_check_s = math.inf
        counts, keys = await write_all(tier, chunks.keys(48), batch=4)
        assert counts == [4, 4, 4, 0] + [4] * 8  # refused once, then evicting
        s = tier.statistics()
        assert s.write_errors_by_reason == {"refused EDQUOT": 4}
        assert (s.errors_total, s.state, s.write_state, s.chunks) == (0, "up", "up", 12)
        assert s.effective_capacity_bytes == 12 * value_bytes(namespace)
        assert len(files_under(root, ".tkv")) == 12
        assert await held_and_exact(tier, keys) == keys[-12:]
        tier._files.os = os


# -- on a real small file system ------------------------------------------------------------


async def test_a_tier_larger_than_its_file_system_fits_into_it_and_keeps_writing(
    small_fs: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    value = value_bytes(namespace)
    async with disk(small_fs / "disk", namespace, CONFIGURED) as tier:
        await tier.open()
        s = tier.statistics()
        assert s.capacity_bytes == CONFIGURED
        assert s.effective_capacity_bytes is not None
        assert s.effective_capacity_bytes <= FS_BYTES  # measured at open
        at_open = s.effective_capacity_bytes
        # Another writer takes a quarter of the file system behind the tier's back, and
        # the tier does not measure again until the disk refuses: the file system fills
        # up mid-write (a short write, then ENOSPC).
        tier.space_check_s = math.inf
        fill(small_fs / "other", FS_BYTES // 4)
        keys = chunks.keys(8 * (3 * FS_BYTES // value // 8))  # whole batches
        counts, _ = await write_all(tier, keys)
        s = tier.statistics()
        assert s.refused_by_reason.get("ENOSPC", 0) >= 1  # it did fill up
        assert s.write_errors_by_reason.get("refused ENOSPC", 0) >= 1
        assert "failed" not in s.write_errors_by_reason
        assert (s.errors_total, s.rejected_total, s.state, s.write_state) == (0, 0, "up", "up")
        # Lowered to what the file system holds, evicting down to it; never backing off:
        # the writes after the first refusal went on, and the last ones were whole.
        assert s.effective_capacity_bytes < at_open - FS_BYTES // 8
        assert s.used_bytes is not None
        assert s.used_bytes <= s.effective_capacity_bytes
        assert s.evictions_total > 0
        assert "backing off" not in s.write_errors_by_reason
        assert counts[-4:] == [8, 8, 8, 8]
        assert sum(counts) > 2 * FS_BYTES // value  # far more than fits at once
        # Nothing corrupt is read back: every value held is whole and its own.
        held = await held_and_exact(tier, keys)
        assert len(held) == s.chunks
        # The other writer goes: the next write measures again and the tier grows back.
        (small_fs / "other").unlink()
        tier.space_check_s = 0.0
        more = chunks.keys(8)
        assert await tier.write(items(more, rows_of(more, tier.row_bytes))) == 8
        grown = tier.statistics().effective_capacity_bytes
        assert grown is not None
        assert grown > s.effective_capacity_bytes + FS_BYTES // 8
        assert grown < CONFIGURED
        assert "of 1,073,741,824 configured" in repr(tier)


async def test_a_second_tier_on_the_full_folder_writes_new_values(
    small_fs: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    value = value_bytes(namespace)
    old = chunks.keys(2 * FS_BYTES // value)
    async with disk(small_fs / "disk", namespace, CONFIGURED) as first:
        await write_all(first, old)
        kept = len(await held_and_exact(first, old))
    fill(small_fs / "other")  # and what the first tier left free, another takes
    assert free_bytes(small_fs) < value
    new = chunks.keys(16)
    async with disk(small_fs / "disk", namespace, CONFIGURED) as second:
        report = await second.open()
        assert len(report.values) == kept  # every value the first tier left
        s = second.statistics()
        assert s.effective_capacity_bytes is not None
        assert s.effective_capacity_bytes < kept * value  # trimmed at open: room made
        counts, _ = await write_all(second, new)
        assert counts == [8, 8]  # new values, evicting the oldest
        s = second.statistics()
        assert (s.errors_total, s.rejected_total, s.write_state) == (0, 0, "up")
        assert s.evictions_total >= 16
        assert await second.contains(new) == [True] * 16
        assert len(await held_and_exact(second, new + old)) == s.chunks


# -- a replay ---------------------------------------------------------------------------------

REPLAY = [
    "replay", "--workload", "chat", "--requests", "300", "--capacity-tokens", "20480",
    "--bytes-per-token", "16", "--verify", "--concurrency", "2",
    "--disk-bytes", str(CONFIGURED),
]  # fmt: skip


def replay(folder: Path, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tiering", *REPLAY, "--disk", str(folder), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def test_a_replay_on_a_small_file_system_says_both_capacities_and_runs_again(
    small_fs: Path,
) -> None:
    folder = small_fs / "disk"
    first = json.loads(replay(folder, "--json"))
    (d1,) = [t for t in first["tiers"] if t["label"] == "disk"]
    assert d1["capacity_bytes"] == CONFIGURED
    assert d1["effective_capacity_bytes"] <= FS_BYTES
    assert d1["used_bytes"] > FS_BYTES // 2  # it filled the file system
    assert (first["corrupt_chunks"], first["failed_jobs"], d1["errors"], d1["rejected"]) == (
        0, 0, 0, 0
    )  # fmt: skip
    assert "failed" not in d1["writes_dropped_by_reason"]
    assert "backing off" not in d1["writes_dropped_by_reason"]
    # A second run on the full folder finds it, writes new values and says both capacities.
    second = replay(folder)
    lines = {line.split("  ")[0]: line for line in second.splitlines()}
    line = lines["disk tier"]
    assert f"found {d1['chunks']:,} chunks at open" in line
    assert "1.07 GB configured" in line
    assert "MB effective (what its file system holds)" in line
    assert " 0 B written" not in line
    assert "kB written" in line or "MB written" in line
    assert "0 failed calls" in line
    assert " failed," not in line  # no chunk write failed
    assert " failed)" not in line
    assert "corrupt chunks  0" in second
