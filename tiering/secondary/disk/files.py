"""The blocking file work of a `DiskTier`: its directory, its lock, its values on disk.

Everything here runs in worker threads (or at open); nothing touches the
tier's index, which lives on the event loop. A call's buffers are touched only
under its `Guard` (see `tiering.secondary.base`), so the loop can abandon a
call that ran out of time and have its buffers back at once.

Directory layout::

    <path>/.lock                       the owner's advisory lock (its pid inside)
    <path>/<namespace digest, 16 hex>/ one folder per namespace
        <2 hex>/                       256 shards, made on first use
            <chunk key, hex>.tkv       one value per chunk (a digest of the key
                                       for keys over 96 bytes)
            <name>.tkv.<pid>-<n>.tmp   a value being written

A value file is the Redis tier's value (`tiering.secondary.codec`) with its
header zero-padded to a multiple of 4 KiB: ``header, key, zeros`` in the first
`head_bytes`, then the row. The payload then starts on a block boundary, so it
is read straight into the caller's row (``preadv``) and, with ``O_DIRECT``,
moved between the row and the disk with no copy at all. A value becomes
visible only whole: it is written under a temporary name, then renamed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import mmap
import os
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary.base import Guard
from tiering.secondary.codec import ChunkCodec, Verdict

__all__ = [
    "BLOCK",
    "FSYNC_POLICIES",
    "DirectoryGone",
    "DiskFiles",
    "ReadOutcome",
    "ScanResult",
    "WriteOutcome",
    "file_bytes",
    "head_bytes",
]

#: The alignment of a value's payload on disk, and of ``O_DIRECT`` transfers.
BLOCK = 4096
SUFFIX = ".tkv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
_MAX_NAMED_KEY = 96  # bytes of key spelled out in a file name; longer keys are digested

#: ``fsync`` policies: ``none`` (rename only: a process that dies never leaves a
#: half value visible; after a power loss a renamed value may lack its data,
#: which its length and checksum catch), ``data`` (fdatasync each value before
#: its rename: a visible value is whole even after a power loss), ``full``
#: (also fsync its folder after the rename: a written value survives one).
FSYNC_POLICIES = ("none", "data", "full")

#: Errors after which the other values of a write are not tried: they would fail alike.
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
#: Files a read opens (and asks the kernel for) at once.
READ_AHEAD = 32
_LATER = OSError(errno.EMFILE, "opened when read")  # a placeholder in a read's window
_SEQUENCE = itertools.count()


class DirectoryGone(OSError):
    """The tier's folder is missing, or is another folder than the one opened."""


def head_bytes(codec: ChunkCodec, key: OffloadKey) -> int:
    """Bytes of a value file before its payload: the codec's header, padded to `BLOCK`."""
    return -(-codec.header_bytes(key) // BLOCK) * BLOCK


def _aligned(view: memoryview) -> bool:
    """Whether ``O_DIRECT`` may move ``view``: its address and size on `BLOCK` boundaries."""
    if view.nbytes % BLOCK:
        return False
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return int(address) % BLOCK == 0


def file_bytes(codec: ChunkCodec, key: OffloadKey, value: bytes) -> bytes:
    """The value file that holds ``value`` (a value as the Redis tier stores it, or any
    bytes) as chunk ``key``: its first `ChunkCodec.header_bytes` padded to `head_bytes`,
    then the rest. Tests use it to put a foreign or damaged value on disk."""
    header = codec.header_bytes(key)
    head = value[:header]
    return head + bytes(head_bytes(codec, key) - len(head)) + value[header:]


_LOCAL = threading.local()


def _head_buffer(size: int) -> memoryview:
    """A page-aligned buffer of at least ``size`` bytes, this thread's own (for headers)."""
    buffer: mmap.mmap | None = getattr(_LOCAL, "head", None)
    if buffer is None or len(buffer) < size:
        buffer = mmap.mmap(-1, max(size, BLOCK))
        _LOCAL.head = buffer
    return memoryview(buffer)[:size]


class ScanResult(msgspec.Struct, frozen=True, kw_only=True):
    """What opening found on disk: sound values, and what was dropped, by reason."""

    values: list[tuple[OffloadKey, int, int]]  # (key, file bytes, mtime ns), oldest first
    dropped: dict[str, int]  # by reason: a Verdict's value, "half-written", "misnamed"
    foreign_namespaces: int  # folders of other namespaces, left alone
    seconds: float


class WriteOutcome:
    """What a write did, filled in by its thread under the call's guard."""

    __slots__ = ("errors", "gone", "renamed")

    def __init__(self) -> None:
        self.gone: list[int] = []  # victims whose files left their names, by position
        self.renamed: list[int] = []  # items now visible, by position
        self.errors: dict[int, OSError] = {}  # items that failed, by position


class ReadOutcome:
    """What a read found, filled in by its thread under the call's guard."""

    __slots__ = ("errors", "vanished", "verdicts")

    def __init__(self, n: int) -> None:
        self.verdicts: list[Verdict | None] = [None] * n  # None: not read (or gone)
        self.vanished: list[int] = []  # files missing (deleted behind the tier's back)
        self.errors: dict[int, OSError] = {}


class DiskFiles:
    """The files of one tier's namespace under ``root``. Thread-safe (no shared state
    but the directory identity, set at open)."""

    def __init__(
        self, root: Path, codec: ChunkCodec, *, fsync: str, direct: bool, read_only: bool
    ) -> None:
        self.root = root
        self.codec = codec
        self.folder = root / codec.digest.hex()[:16]
        self._folder = str(self.folder)
        self.fsync = fsync
        #: O_DIRECT reads (of aligned rows), and the smallest aligned row written with
        #: O_DIRECT (None: no O_DIRECT write).
        self.direct_read = direct
        self.direct_write_min: int | None = 0 if direct else None
        self.read_only = read_only
        self._identity: tuple[int, int] | None = None
        self._lock_fd: int | None = None
        self._release: Any = None  # the finalizer that closes the lock's fd
        self._folder_fd: int | None = None  # the folder, held open while the tier is
        self._folder_release: Any = None
        #: The calls a test may replace to inject faults (`os` by default): ``open``,
        #: ``preadv``, ``pwritev``, ``rename``, ``unlink``, ``stat``, ``fdatasync``.
        self.os: Any = os
        #: Set by tests to hold every call at its start, as a disk that stops answering.
        self.answering = threading.Event()
        self.answering.set()

    # -- the folder and its owner -------------------------------------------------

    def lock(self) -> None:
        """Take the folder (make it if needed) for this process alone, or raise `ConfigError`."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"cannot use {self.root} for the disk tier: {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"cannot lock {self.root}: {exc.strerror or exc}") from None
            who = f"process {holder}" if holder else "another process"
            raise ConfigError(
                f"the disk tier folder {self.root} is in use by {who}: one owner at a time; "
                "give each engine its own folder, or open this one read_only=True"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        # A tier dropped without aclose (its engine failed to build) frees the folder
        # when it is collected.
        self._release = weakref.finalize(self, os.close, fd)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            if self._release is not None:
                self._release.detach()
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def relock(self) -> None:
        """Hold the lock of the folder as it is now: after the root was removed and made
        again, the old lock is of a file no longer there, and another process may hold
        the new one (then `ConfigError`: this tier never takes a folder someone owns)."""
        if self.read_only:
            return
        try:
            now = os.stat(self.root / LOCK_NAME)
        except FileNotFoundError:
            now = None
        if self._lock_fd is not None and now is not None:
            mine = os.fstat(self._lock_fd)
            if (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino):
                return
        self.unlock()
        self.lock()

    def check_folder(self) -> None:
        """Raise `DirectoryGone` unless the namespace folder is the one opened."""
        self.answering.wait()
        held = self._folder_fd
        if held is not None and os.fstat(held).st_nlink == 0:
            # Removed (the folder is held open, so its inode number cannot be reused by
            # a folder made again in its place, which would pass the check below).
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} was removed")
        try:
            st = self.os.stat(self.folder)
        except FileNotFoundError:
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} is gone") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise DirectoryGone(
                errno.ESTALE, f"the folder {self.folder} was replaced by another one"
            )

    def make_folder(self) -> None:
        """Make the namespace folder (and the root) if missing, and remember which it is."""
        if not self.read_only:
            self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        st = os.fstat(fd)
        self.close_folder()
        self._folder_fd = fd
        self._folder_release = weakref.finalize(self, os.close, fd)
        self._identity = (st.st_dev, st.st_ino)

    def close_folder(self) -> None:
        """Let go of the folder held open (at close)."""
        if self._folder_fd is not None:
            self._folder_release.detach()
            os.close(self._folder_fd)
            self._folder_fd = None

    def probe_direct(self) -> bool:
        """Whether this file system takes ``O_DIRECT`` reads and writes (one small file)."""
        if not _O_DIRECT or self.read_only:
            return False
        path = self.folder / f".direct-probe-{os.getpid()}{TMP_SUFFIX}"
        buffer = mmap.mmap(-1, BLOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
        except OSError:
            return False
        try:
            os.pwritev(fd, [buffer], 0)
            return os.preadv(fd, [buffer], 0) == BLOCK
        except OSError:
            return False
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            buffer.close()

    # -- names ----------------------------------------------------------------------

    def path(self, key: OffloadKey) -> Path:
        """The file of chunk ``key``'s value."""
        return Path(self.name(key))

    def name(self, key: OffloadKey) -> str:
        """`path` as a string (made without `pathlib`, which costs a third of a write)."""
        raw = bytes(key)
        name = raw.hex() if len(raw) <= _MAX_NAMED_KEY else "h" + hashlib.blake2b(raw).hexdigest()
        return f"{self._folder}/{zlib.crc32(raw) & 0xFF:02x}/{name}{SUFFIX}"

    # -- open: what is on disk --------------------------------------------------------

    def scan(self) -> ScanResult:
        """Every sound value of this namespace, oldest use first; drop what is not sound.

        A value is sound when its header passes every check of the codec but
        the checksum (checked at each read) and its file has the right length.
        Half-written values (temporary names) and values that fail are deleted,
        unless the tier is read-only.
        """
        start = time.perf_counter()
        values: list[tuple[OffloadKey, int, int]] = []
        dropped: dict[str, int] = {}

        def drop(path: str, reason: str) -> None:
            dropped[reason] = dropped.get(reason, 0) + 1
            if not self.read_only:
                with contextlib.suppress(OSError):
                    os.unlink(path)

        for shard in _entries(self.folder):
            if not shard.is_dir(follow_symlinks=False):
                if shard.name.endswith(TMP_SUFFIX):
                    drop(shard.path, "half-written")
                continue
            for entry in _entries(shard.path):
                name = entry.name
                if name.endswith(TMP_SUFFIX):
                    drop(entry.path, "half-written")
                elif name.endswith(SUFFIX):
                    found = self._check_file(entry.path)
                    if isinstance(found, str):
                        drop(entry.path, found)
                    elif self.path(found[0]).name != name or Path(shard.path).name != (
                        self.path(found[0]).parent.name
                    ):
                        drop(entry.path, "misnamed")
                    else:
                        values.append(found)
        values.sort(key=lambda v: v[2])
        foreign = sum(
            1
            for entry in _entries(self.root)
            if entry.is_dir(follow_symlinks=False) and entry.path != str(self.folder)
        )
        return ScanResult(
            values=values,
            dropped=dropped,
            foreign_namespaces=foreign,
            seconds=time.perf_counter() - start,
        )

    def _check_file(self, path: str) -> tuple[OffloadKey, int, int] | str:
        """``(key, bytes, mtime)`` of a sound value file, else why not."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return "unreadable"
        try:
            st = os.fstat(fd)
            head = _head_buffer(BLOCK)
            got = os.preadv(fd, [head], 0)
        except OSError:
            return "unreadable"
        finally:
            os.close(fd)
        key_bytes = self.codec.peek_key_bytes(head[:got])
        if key_bytes is None:
            return Verdict.BAD_MAGIC.value
        view = head[:got]
        if key_bytes > got:  # a long key: its head spans more than one block
            try:
                with open(path, "rb") as f:
                    view = memoryview(f.read(key_bytes))
            except OSError:
                return "unreadable"
        key = self.codec.peek_key(view)
        if key is None:
            return Verdict.BAD_LENGTH.value
        verdict = self._check_head(key, view, st.st_size)
        if verdict is not None:
            return verdict.value
        return key, st.st_size, st.st_mtime_ns

    def _check_head(self, key: OffloadKey, head: memoryview, file_bytes: int) -> Verdict | None:
        """The failed check of a value file's head (None: it passes), given its size."""
        codec = self.codec
        size = head_bytes(codec, key)
        if file_bytes < size:
            # Too short for its head: judged as the codec judges a short value.
            verdict = codec.check_head(key, head, min(file_bytes, head.nbytes))
            return verdict if isinstance(verdict, Verdict) else Verdict.BAD_LENGTH
        found = codec.check_head(key, head, file_bytes - size + codec.header_bytes(key))
        if isinstance(found, Verdict):
            return found
        pad = head[codec.header_bytes(key) : size]
        if pad.nbytes and pad != bytes(pad.nbytes):  # a C compare: any() took 28 us
            return Verdict.BAD_LENGTH  # not a head this format writes
        return None

    def remove(self, keys: Sequence[OffloadKey]) -> int:
        """Delete the values of ``keys`` (at open: over capacity); how many were there."""
        removed = 0
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self.os.unlink(self.path(key))
                removed += 1
        return removed

    # -- calls ---------------------------------------------------------------------------

    def write(
        self,
        guard: Guard,
        victims: Sequence[OffloadKey],
        items: Sequence[tuple[OffloadKey, memoryview]],
        out: WriteOutcome,
    ) -> None:
        """Remove ``victims``, then write each item's value (temporary name, then rename).

        The rows are read, and victims removed and values renamed into place,
        only under ``guard``: once the loop has abandoned the call, ``out``
        says exactly what was done. Per-item failures land in ``out.errors``;
        a missing folder raises `DirectoryGone` (the tier is down).
        """
        self.check_folder()
        o = self.os
        spares = iter(enumerate(victims))  # evicted values' files, recycled for new ones
        for position, (key, row) in enumerate(items):
            if guard.abandoned:
                return
            try:
                self._write_one(guard, position, key, row, out, spares)
            except DirectoryGone:
                raise
            except OSError as exc:
                with guard.lock:
                    if guard.abandoned:
                        return
                    out.errors[position] = exc
                if exc.errno in FULL_ERRNOS:
                    break  # the rest would fail alike: the caller counts them so
        for index, victim in spares:  # more room freed than the new values take
            with guard.lock:
                if guard.abandoned:
                    return
                try:
                    o.unlink(self.name(victim))
                except FileNotFoundError:
                    pass
                except OSError:
                    continue  # still there: the tier tries again with a later write
                out.gone.append(index)

    def _write_one(
        self,
        guard: Guard,
        position: int,
        key: OffloadKey,
        row: memoryview,
        out: WriteOutcome,
        spares: Iterator[tuple[int, OffloadKey]],
    ) -> None:
        """Write one value under a temporary name, then rename it into place.

        The temporary file is an evicted value's file when there is one (renamed
        away from its name first: making a file costs ten times what reusing one
        does on ext4), else a new file.
        """
        o = self.os
        final = self.name(key)
        tmp = f"{final}.{os.getpid()}-{next(_SEQUENCE)}{TMP_SUFFIX}"
        least = self.direct_write_min
        direct = least is not None and row.nbytes >= least and _aligned(row)
        flags = os.O_WRONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        size = head_bytes(self.codec, key)
        fd = -1
        if self._recycle(guard, spares, tmp, out):
            with contextlib.suppress(FileNotFoundError):
                fd = int(o.open(tmp, flags))
                os.ftruncate(fd, size + row.nbytes)  # a no-op when the sizes agree
        if guard.abandoned:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        if fd < 0:
            fd = self._open_in_shard(tmp, flags | os.O_CREAT | os.O_EXCL)
        renamed = False
        try:
            head = _head_buffer(size)
            with guard.lock:
                if guard.abandoned:
                    return
                head[:] = bytes(size)
                encoded = self.codec.encode_header(key, row)  # the checksum: reads the row
                head[: len(encoded)] = encoded
                written = o.pwritev(fd, [head, row], 0)  # the kernel reads the row
            if written != size + row.nbytes:
                raise OSError(errno.EIO, f"short write: {written} of {size + row.nbytes} bytes")
            if self.fsync != "none":
                o.fdatasync(fd)
            os.close(fd)
            fd = -1
            with guard.lock:
                if guard.abandoned:
                    return
                o.rename(tmp, final)
                renamed = True
                out.renamed.append(position)
            if self.fsync == "full":
                _fsync_folder(os.path.dirname(final))
        finally:
            if fd >= 0:
                os.close(fd)
            if not renamed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _recycle(
        self, guard: Guard, spares: Iterator[tuple[int, OffloadKey]], tmp: str, out: WriteOutcome
    ) -> bool:
        """Move the next evicted value's file to ``tmp``; whether one was moved. Each
        victim whose file left its name is recorded in ``out.gone``; one that could not
        be moved (an error) stays on disk, for a later write to delete."""
        for index, victim in spares:
            with guard.lock:
                if guard.abandoned:
                    return False
                try:
                    self.os.rename(self.name(victim), tmp)
                except FileNotFoundError:
                    if os.path.exists(self.name(victim)):  # the new name's shard is new
                        self._make_shard(os.path.dirname(tmp))
                        try:
                            self.os.rename(self.name(victim), tmp)
                        except OSError:
                            continue
                        out.gone.append(index)
                        return True
                    out.gone.append(index)  # gone already
                    continue
                except OSError:
                    continue
                out.gone.append(index)
                return True
        return False

    def _open_in_shard(self, path: str, flags: int) -> int:
        try:
            return int(self.os.open(path, flags, 0o644))
        except FileNotFoundError:
            pass
        self._make_shard(os.path.dirname(path))
        return int(self.os.open(path, flags, 0o644))

    def _make_shard(self, shard: str) -> None:
        try:
            os.mkdir(shard)  # never the namespace folder: gone means down
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} is gone") from None

    def read(
        self,
        guard: Guard,
        items: Sequence[tuple[OffloadKey, memoryview]],
        out: ReadOutcome,
        touch: bool,
    ) -> None:
        """Read each item's value: the head first (checked), then the payload straight into
        its row, under ``guard``; the checksum is checked in the row. ``touch`` sets each
        read file's time (the order the index is rebuilt in at the next open), unless
        read-only: a reader changes nothing on disk."""
        self.check_folder()
        # A window of files at a time: the read-ahead of a few dozen, and a bounded
        # number of open files however long the call.
        for first in range(0, len(items), READ_AHEAD):
            if guard.abandoned:
                return
            window = range(first, min(len(items), first + READ_AHEAD))
            opened: list[int | OSError] = []
            try:
                self._open_all(items, window, opened)
                if not self._read_all(guard, items, out, touch, window, opened):
                    return  # abandoned
            finally:
                for fd in opened:
                    if isinstance(fd, int):
                        os.close(fd)

    def _open_all(
        self,
        items: Sequence[tuple[OffloadKey, memoryview]],
        window: range,
        opened: list[int | OSError],
    ) -> None:
        """Each file of ``window`` opened into ``opened`` (or why not); the buffered ones
        asked of the kernel at once (``WILLNEED``), so the disk reads them all while the
        first is copied out. Out of file descriptors, the rest are opened one by one."""
        for position in window:
            key, row = items[position]
            direct = self.direct_read and _aligned(row)
            try:
                fd = int(
                    self.os.open(
                        self.name(key), os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
                    )
                )
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    opened.append(_LATER)
                    continue
                opened.append(exc)
                continue
            opened.append(fd)
            if not direct and _WILLNEED is not None:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, _WILLNEED)

    def _read_all(
        self,
        guard: Guard,
        items: Sequence[tuple[OffloadKey, memoryview]],
        out: ReadOutcome,
        touch: bool,
        window: range,
        opened: list[int | OSError],
    ) -> bool:
        """Read the values of ``window`` from their ``opened`` files; False: abandoned."""
        for index, position in enumerate(window):
            key, row = items[position]
            if guard.abandoned:
                return False
            try:
                fd = opened[index]
                if fd is _LATER:  # no descriptor was free at the window's open
                    fd = opened[index] = int(
                        self.os.open(self.name(key), os.O_RDONLY | os.O_CLOEXEC)
                    )
                if isinstance(fd, OSError):
                    raise fd
                verdict = self._read_one(guard, position, key, row, out, fd)
            except FileNotFoundError:
                with guard.lock:
                    if guard.abandoned:
                        return False
                    out.vanished.append(position)
                continue
            except OSError as exc:
                with guard.lock:
                    if guard.abandoned:
                        return False
                    out.errors[position] = exc
                continue
            if verdict is None:
                return False
            if self.read_only or (verdict is Verdict.OK and not touch):
                continue
            path = self.name(key)
            with guard.lock:  # an abandoned call changes nothing more on disk
                if guard.abandoned:
                    return False
                with contextlib.suppress(OSError):
                    if verdict is Verdict.OK:
                        os.utime(path)
                    elif os.stat(path).st_ino == os.fstat(fd).st_ino:  # not a rewrite since
                        self.os.unlink(path)  # never loaded, and never offered again
        return True

    def _read_one(
        self,
        guard: Guard,
        position: int,
        key: OffloadKey,
        row: memoryview,
        out: ReadOutcome,
        fd: int,
    ) -> Verdict | None:
        """One value's verdict, recorded in ``out`` under the guard (None: abandoned)."""
        o = self.os
        codec = self.codec
        size = head_bytes(codec, key)
        file_bytes = os.fstat(fd).st_size
        head = _head_buffer(size)
        got = o.preadv(fd, [head], 0)
        verdict = self._check_head(key, head[:got], file_bytes)
        with guard.lock:
            if guard.abandoned:
                return None
            if verdict is None:
                found = codec.check_head(key, head, codec.header_bytes(key) + row.nbytes)
                assert not isinstance(found, Verdict)  # checked just above
                kind, expected = found
                got = o.preadv(fd, [row], size)  # straight into the caller's row
                if got != row.nbytes:
                    verdict = Verdict.BAD_LENGTH  # truncated since its size was taken
                else:
                    verdict = codec.check_payload(kind, expected, row)
            out.verdicts[position] = verdict
            return verdict


def _entries(path: str | Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return os.pread(fd, 32, 0).decode().strip()
    return ""


def _fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
