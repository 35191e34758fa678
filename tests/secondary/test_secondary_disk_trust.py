"""The disk tier never acts outside its folder (issue 26): links, FIFOs, sockets and folders
where its values, shards or lock belong, and the modes of what it makes.

Whoever can write into the tier's folder may put a symbolic link, a FIFO, a socket
or a folder where a value file or a shard folder belongs: the tier never follows
it, never blocks on it, never writes or deletes it; it counts it
(``rejected_by_reason["not a regular file"]``) and leaves it alone. What it makes
is its own user's alone (0600 files, 0700 folders) unless ``file_mode`` says
otherwise, whatever the umask. Every test here failed on the tier that opened
paths (it followed links, blocked on FIFOs, made 0644 files).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary import ChunkCodec, RemoteNamespace
from tiering.secondary.disk import DiskTier
from tiering.secondary.disk.files import NOT_REGULAR, head_bytes

pytestmark = pytest.mark.anyio

BACKOFF = (60.0, 60.0)
SECRET = b"an outside file the tier must never touch\n"


def disk(root: Path, namespace: RemoteNamespace, values: int, **options: Any) -> DiskTier:
    """A tier in ``root`` that holds ``values`` values."""
    options.setdefault("backoff_s", BACKOFF)
    options.setdefault("timeout_s", 5.0)
    options.setdefault("policy", "lru")
    value = namespace.row_bytes + head_bytes(ChunkCodec(namespace), OffloadKey(bytes(20)))
    return DiskTier(root, values * value + value // 2, namespace, **options)


def row_of(key: OffloadKey, row_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(hashlib.shake_128(bytes(key)).digest(row_bytes), dtype=np.uint8)


def items(keys: list[OffloadKey], row_bytes: int) -> list[tuple[OffloadKey, memoryview]]:
    return [(k, row_of(k, row_bytes).data) for k in keys]


async def read(tier: DiskTier, keys: list[OffloadKey]) -> list[bool]:
    buffers = [np.zeros(tier.row_bytes, dtype=np.uint8) for _ in keys]
    filled = await tier.read([(k, b.data) for k, b in zip(keys, buffers, strict=True)])
    for key, buffer, ok in zip(keys, buffers, filled, strict=True):
        assert not ok or np.array_equal(buffer, row_of(key, tier.row_bytes))
    return filled


def outside_file(tmp_path: Path) -> Path:
    outside = tmp_path / "outside" / "precious.txt"
    outside.parent.mkdir(exist_ok=True)
    outside.write_bytes(SECRET)
    return outside


def not_regular(tier: DiskTier) -> int:
    return tier.statistics().rejected_by_reason.get(NOT_REGULAR, 0)


def same_shard_keys(tier: DiskTier, chunks: Any, n: int) -> list[OffloadKey]:
    """``n`` keys whose values share one shard folder."""
    by_shard: dict[str, list[OffloadKey]] = {}
    while True:
        for key in chunks.keys(64):
            group = by_shard.setdefault(tier._files.where(key)[0], [])
            group.append(key)
            if len(group) == n:
                return group


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def make_socket(where: Path) -> None:
    """A Unix socket at ``where`` (bound in a short folder, moved: socket paths are short)."""
    short = Path(tempfile.mkdtemp(prefix="s", dir=where.parent if len(str(where)) < 100 else None))
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(short / "s"))
            try:
                os.rename(short / "s", where)
            except OSError as exc:  # another file system than the tier's
                pytest.skip(f"cannot move a socket into the tier's folder: {exc}")
    finally:
        shutil.rmtree(short, ignore_errors=True)


# -- value files -----------------------------------------------------------------------------


async def test_a_value_replaced_by_a_link_is_never_read_written_or_deleted_through_it(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    outside = outside_file(tmp_path)
    async with disk(root, namespace, 2) as tier:
        rb = tier.row_bytes
        a, b, c, d = chunks.keys(4)
        assert await tier.write(items([a, b], rb)) == 2
        for key in (a, b):
            path = tier._files.path(key)
            path.unlink()
            path.symlink_to(outside)
        # A read: a miss, counted, the link left where it is.
        assert await read(tier, [a]) == [False]
        assert not_regular(tier) == 1
        assert tier._files.path(a).is_symlink()
        assert await tier.contains([a]) == [False]  # forgotten
        # A write that evicts b: its file is not recycled through the link.
        assert await tier.write(items([c, d], rb)) == 2
        assert not_regular(tier) == 2
        assert tier._files.path(b).is_symlink()
        assert await read(tier, [c, d]) == [True, True]
        # Written again: the link at its name is neither written through nor replaced.
        assert await tier.write(items([a], rb)) == 0
        assert not_regular(tier) == 3
        assert tier._files.path(a).is_symlink()
        assert tier.statistics().errors_total == 0
    assert outside.read_bytes() == SECRET
    # A new process: the scan counts the links, never opens through them.
    async with disk(root, namespace, 4) as again:
        report = await again.open()
        assert report.not_regular == 2
        found = {k for k, _, _ in report.values}  # the write of a evicted one of them
        assert len(found) == 1
        assert found < {c, d}
        assert not_regular(again) == 2
        assert again._files.path(a).is_symlink()
    assert outside.read_bytes() == SECRET


@pytest.mark.parametrize("kind", ["fifo", "folder", "socket", "device"])
async def test_a_fifo_socket_device_or_folder_where_a_value_belongs_is_counted_and_left(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, kind: str
) -> None:
    root = tmp_path / "disk"
    async with disk(root, namespace, 2) as tier:
        rb = tier.row_bytes
        a, b, c, d = chunks.keys(4)
        assert await tier.write(items([a, b], rb)) == 2
        for key in (a, b):
            path = tier._files.path(key)
            path.unlink()
            if kind == "fifo":
                os.mkfifo(path)
            elif kind == "folder":
                path.mkdir()
            elif kind == "socket":
                make_socket(path)
            else:  # a character device: the null device's numbers
                null = os.stat("/dev/null").st_rdev
                try:
                    os.mknod(path, stat.S_IFCHR | 0o600, null)
                except PermissionError:
                    pytest.skip("making a device node needs root (CAP_MKNOD)")
        with anyio.fail_after(30):  # a FIFO opened to read or write blocks: fail, never hang
            assert await read(tier, [a]) == [False]
            assert await tier.write(items([c, d], rb)) == 2  # evicts b: its place is left
        assert not_regular(tier) == 2
        assert tier.statistics().errors_total == 0
        for key in (a, b):
            st = os.lstat(tier._files.path(key))
            assert not stat.S_ISREG(st.st_mode)  # left alone, never replaced
    async with disk(root, namespace, 4) as again:
        with anyio.fail_after(30):
            report = await again.open()
        assert (report.not_regular, len(report.values)) == (2, 2)


async def test_a_fifo_named_like_a_value_never_blocks_the_open_scan(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    async with disk(root, namespace, 4) as tier:
        keys = chunks.keys(2)
        assert await tier.write(items(keys, tier.row_bytes)) == 2
        fifo = tier._files.path(keys[0])
    fifo.unlink()
    os.mkfifo(fifo)
    stray = fifo.parent / ("0" * 40 + ".tkv")  # a FIFO under no key the tier wrote
    os.mkfifo(stray)
    try:
        async with disk(root, namespace, 4) as again:
            with anyio.fail_after(30):  # the old scan blocked here for ever
                report = await again.open()
            assert report.not_regular == 2
            assert [k for k, _, _ in report.values] == keys[1:]
            assert not_regular(again) == 2
            assert await read(again, keys) == [False, True]
    finally:
        for path in (fifo, stray):  # a scan blocked on a FIFO (a regression) is let go
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISFIFO(os.lstat(stray).st_mode)


# -- shard folders ---------------------------------------------------------------------------


async def test_a_shard_replaced_by_a_link_never_gets_a_file(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with disk(root, namespace, 8) as tier:
        rb = tier.row_bytes
        first, *later = same_shard_keys(tier, chunks, 4)
        assert await tier.write(items([first], rb)) == 1
        shard = tier._files.path(first).parent
        # The shard the tier made (and holds open) is removed, a link put in its place.
        shutil.copy(tier._files.path(first), elsewhere / tier._files.path(first).name)
        shutil.rmtree(shard)
        shard.symlink_to(elsewhere, target_is_directory=True)
        assert await tier.write(items(later, rb)) == 0
        assert not_regular(tier) == 3
        assert await read(tier, [first]) == [False]
        s = tier.statistics()
        assert (s.state, s.errors_total, s.chunks) == ("up", 0, 0)
        assert s.write_errors_by_reason == {NOT_REGULAR: 3}  # not "failed": none failed
    assert sorted(p.name for p in elsewhere.iterdir()) == [tier._files.path(first).name]
    # A new process: the link is counted, never scanned through, never written through.
    async with disk(root, namespace, 8) as again:
        report = await again.open()
        assert (report.not_regular, report.values, report.dropped) == (1, [], {})
        assert await again.write(items(later, rb)) == 0
        assert not_regular(again) == 1 + 3
        assert again.statistics().errors_total == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == [tier._files.path(first).name]
    assert shard.is_symlink()


async def test_a_shard_moved_away_and_replaced_by_a_link_after_it_was_opened_never_gets_a_file(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    """The shard's descriptor is held: moved out of the folder (not removed), it still names
    the moved folder, which the tier wrote into through the link put in its place."""
    root = tmp_path / "disk"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with disk(root, namespace, 8) as tier:
        rb = tier.row_bytes
        first, *later = same_shard_keys(tier, chunks, 4)
        assert await tier.write(items([first], rb)) == 1
        shard = tier._files.path(first).parent
        os.rename(shard, elsewhere / "moved")  # the folder the tier holds open, moved out
        shard.symlink_to(elsewhere / "moved", target_is_directory=True)
        assert await tier.write(items(later, rb)) == 0
        s = tier.statistics()
        assert not_regular(tier) == 3
        # Counted under their own reason, never as failed writes.
        assert s.write_errors_by_reason == {NOT_REGULAR: 3}
        assert (s.state, s.errors_total) == ("up", 0)
        assert await read(tier, [first]) == [False]  # not read through the link either
    assert [p.name for p in (elsewhere / "moved").iterdir()] == [tier._files.path(first).name]
    assert shard.is_symlink()


async def test_a_shard_removed_again_and_again_leaks_no_descriptor(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    async with disk(root, namespace, 8) as tier:
        (key,) = chunks.keys(1)
        assert await tier.write(items([key], tier.row_bytes)) == 1
        shard = tier._files.path(key).parent
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):  # whoever can write the folder swaps the shard under the tier
            shutil.rmtree(shard)
            shard.mkdir()
            assert await read(tier, [key]) == [False]
            assert await tier.write(items([key], tier.row_bytes)) == 1
        assert len(os.listdir("/proc/self/fd")) - before < 5
        assert await read(tier, [key]) == [True]


async def test_a_hard_link_where_a_value_belongs_is_never_written_through(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    """An evicted value's file is reused for a new value: a hard link in its place (to a
    file outside the folder) would have that file overwritten with the new value."""
    root = tmp_path / "disk"
    outside = outside_file(tmp_path)
    async with disk(root, namespace, 2) as tier:
        rb = tier.row_bytes
        a, b, c, d = chunks.keys(4)
        assert await tier.write(items([a, b], rb)) == 2
        for key in (a, b):
            path = tier._files.path(key)
            path.unlink()
            os.link(outside, path)
        assert await tier.write(items([c, d], rb)) == 2  # evicts a and b: new files
        assert not_regular(tier) == 2
        assert await read(tier, [c, d]) == [True, True]
        assert tier.statistics().errors_total == 0
        for key in (a, b):
            assert tier._files.path(key).samefile(outside)  # left alone
    assert outside.read_bytes() == SECRET


async def test_a_namespace_folder_that_is_a_link_is_refused_at_open(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    root = tmp_path / "disk"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    async with disk(root, namespace, 2) as tier:
        await tier.open()
        folder = tier._files.folder
    folder.rmdir()
    folder.symlink_to(elsewhere, target_is_directory=True)
    async with disk(root, namespace, 2) as again:
        with pytest.raises(ConfigError, match=f"{folder} is a symbolic link or not a folder"):
            await again.open()
    assert list(elsewhere.iterdir()) == []
    assert folder.is_symlink()


# -- the lock --------------------------------------------------------------------------------


def test_a_lock_that_is_a_link_is_a_config_error_naming_it(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    outside = outside_file(tmp_path)
    (root / ".lock").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link") as caught:
        disk(root, namespace, 2)
    assert str(root / ".lock") in str(caught.value)
    assert outside.read_bytes() == SECRET
    assert (root / ".lock").is_symlink()


@pytest.mark.parametrize("kind", ["fifo", "hard link"])
def test_a_lock_that_is_not_a_file_of_its_own_is_never_written(
    tmp_path: Path, namespace: RemoteNamespace, kind: str
) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    outside = outside_file(tmp_path)
    if kind == "fifo":
        os.mkfifo(root / ".lock")
    else:
        os.link(outside, root / ".lock")
    with pytest.raises(ConfigError, match=r"\.lock"):
        disk(root, namespace, 2)
    assert outside.read_bytes() == SECRET


# -- modes -----------------------------------------------------------------------------------


def made_by(root: Path) -> tuple[set[int], set[int]]:
    """The modes of the files and of the folders under ``root`` (itself included)."""
    files: set[int] = set()
    folders = {mode(root)}
    for path in root.rglob("*"):
        (folders if path.is_dir() else files).add(mode(path))
    return files, folders


@pytest.mark.parametrize("mask", [0o022, 0o000], ids=["umask 022", "umask 000"])
async def test_what_it_makes_is_its_users_alone(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, mask: int
) -> None:
    root = tmp_path / "disk"
    with umask(mask):
        async with disk(root, namespace, 4) as tier:
            assert await tier.write(items(chunks.keys(4), tier.row_bytes)) == 4
            assert await tier.write(items(chunks.keys(2), tier.row_bytes)) == 2  # reused
        files, folders = made_by(root)
    assert files == {0o600}  # values and the lock
    assert folders == {0o700}  # the root, the namespace folder, the shards
    assert len(list(root.rglob("*.tkv"))) == 4


def test_missing_folders_above_the_tier_are_its_users_alone(
    tmp_path: Path, namespace: RemoteNamespace
) -> None:
    """A world-writable folder above the tier's would let anyone swap the tier's folder."""
    root = tmp_path / "a" / "b" / "disk"
    tmp_path.chmod(0o755)
    with umask(0):
        disk(root, namespace, 2)
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", root)] == [0o700] * 3
    assert mode(tmp_path) == 0o755  # an existing folder is left as it was


async def test_a_value_file_an_older_tier_made_wider_is_reused_with_the_tiers_mode(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any
) -> None:
    root = tmp_path / "disk"
    async with disk(root, namespace, 2) as tier:
        a, b, c = chunks.keys(3)
        assert await tier.write(items([a, b], tier.row_bytes)) == 2
        for key in (a, b):
            tier._files.path(key).chmod(0o644)  # as the tier before issue 26 made them
        assert await tier.write(items([c], tier.row_bytes)) == 1  # into an evicted one's file
        assert mode(tier._files.path(c)) == 0o600


@pytest.mark.parametrize("mask", [0o077, 0o000], ids=["umask 077", "umask 000"])
async def test_file_mode_shares_the_tier_with_a_group(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, mask: int
) -> None:
    root = tmp_path / "disk"
    with umask(mask):
        async with disk(root, namespace, 4, file_mode=0o640) as tier:
            assert await tier.write(items(chunks.keys(2), tier.row_bytes)) == 2
        files, folders = made_by(root)
    assert (files, folders) == ({0o640}, {0o750})


@pytest.mark.parametrize("bad", [0o644 - 0o200, 0o400, 0o1700, -1, True, "0640", 6.4e2])
def test_a_bad_file_mode_is_one_clear_config_error(
    tmp_path: Path, namespace: RemoteNamespace, bad: Any
) -> None:
    with pytest.raises(ConfigError, match=r"file_mode must be .* 0o600 to 0o777") as caught:
        disk(tmp_path / "disk", namespace, 2, file_mode=bad)
    shown = oct(bad) if type(bad) is int else repr(bad)
    assert str(caught.value).endswith(f"got {shown}")
    assert not (tmp_path / "disk").exists()  # refused before anything was made


async def test_an_existing_folder_open_to_others_gets_one_warning_line(
    tmp_path: Path,
    namespace: RemoteNamespace,
    chunks: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    root.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.disk"):
        async with disk(root, namespace, 4) as tier:
            await tier.open()
            assert await tier.write(items(chunks.keys(2), tier.row_bytes)) == 2
    lines = [r.getMessage() for r in caplog.records if "open to other users" in r.getMessage()]
    assert len(lines) == 1
    assert f"{root} 755" in lines[0]
    assert mode(root) == 0o755  # the operator's folder: warned of, not changed
    caplog.clear()
    root.chmod(0o700)  # now the tier's own: no warning
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.disk"):
        async with disk(root, namespace, 4) as tier:
            await tier.open()
    assert not [r for r in caplog.records if "open to other users" in r.getMessage()]


# -- a replay --------------------------------------------------------------------------------


def test_a_replay_leaves_links_and_fifos_alone_and_says_so(tmp_path: Path) -> None:
    """The audit's case: a replay on a folder whose files were swapped for links and FIFOs."""
    folder = tmp_path / "disk"
    outside = outside_file(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    replay = [
        sys.executable, "-m", "tiering", "replay", "--workload", "chat", "--requests", "120",
        "--capacity-tokens", "20480", "--bytes-per-token", "16", "--verify", "--concurrency",
        "2", "--disk", str(folder), "--disk-bytes", str(1 << 30),
    ]  # fmt: skip
    first = subprocess.run(replay, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    values = sorted(folder.rglob("*.tkv"))
    assert len(values) > 8
    shards = sorted({v.parent for v in values})
    link, fifo = values[0], values[-1]
    link.unlink()
    link.symlink_to(outside)
    fifo.unlink()
    os.mkfifo(fifo)
    shard = next(s for s in shards if s not in (link.parent, fifo.parent))
    shutil.rmtree(shard)
    shard.symlink_to(elsewhere, target_is_directory=True)
    try:
        second = subprocess.run(replay, capture_output=True, text=True, timeout=120)
    finally:
        with contextlib.suppress(OSError):  # a replay blocked on the FIFO is let go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert second.returncode == 0, second.stderr
    (line,) = [x for x in second.stdout.splitlines() if x.strip().startswith("disk tier")]
    # Three found at open; the writes of keys whose shard is now a link are counted too.
    found = re.search(rf"(\d+) values rejected \((\d+) {NOT_REGULAR}\)", line)
    assert found is not None, line
    assert int(found[1]) == int(found[2]) >= 3
    assert re.search(r"corrupt chunks +0\n", second.stdout), second.stdout
    assert outside.read_bytes() == SECRET
    assert list(elsewhere.iterdir()) == []
    assert link.is_symlink()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
