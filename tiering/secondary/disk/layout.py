"""The layout of a `DiskTier`'s folder, and the small calls all its file work shares.

Directory layout::

    <path>/.lock                       the owner's advisory lock (its pid inside)
    <path>/<namespace digest, 16 hex>/ one folder per namespace
        <2 hex>/                       256 shards, made on first use
            <chunk key, hex>.tkv       one value per chunk (a digest of the key
                                       for keys over 96 bytes)
            <name>.tkv.<pid>-<n>.tmp   a value being written

Every name above is used relative to a folder held open (the namespace folder,
and each shard once opened: `Held`), never through a symbolic link: only
``<path>``, the operator's, is looked up as a path. What is not a regular file
where a value, a shard or the lock belongs (a link, FIFO, socket, device,
folder) is never followed, blocked on, written or deleted: counted
(`NOT_REGULAR`) and left alone. Files are made with the tier's ``file_mode``
(0600), folders with `dir_mode_of` it (0700), whatever the umask.

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
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tiering._types import OffloadKey
from tiering.secondary.codec import ChunkCodec, Verdict
from tiering.secondary.refusals import Fault, Unwritten, errno_fault

__all__ = [
    "BLOCK",
    "FSYNC_POLICIES",
    "NOT_REGULAR",
    "DirectoryGone",
    "Held",
    "NotRegular",
    "ReadOutcome",
    "ScanResult",
    "WriteOutcome",
    "dir_mode_of",
    "file_bytes",
    "head_bytes",
]

#: The alignment of a value's payload on disk, and of ``O_DIRECT`` transfers.
BLOCK = 4096
SUFFIX = ".tkv"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
MAX_NAMED_KEY = 96  # bytes of key spelled out in a file name; longer keys are digested

#: ``fsync`` policies: ``none`` (rename only: a process that dies never leaves a
#: half value visible; after a power loss a renamed value may lack its data,
#: which its length and checksum catch), ``data`` (fdatasync each value before
#: its rename: a visible value is whole even after a power loss), ``full``
#: (also fsync its folder after the rename: a written value survives one).
FSYNC_POLICIES = ("none", "data", "full")


#: The verdict of a value the scan leaves on disk: a version this tier does not read.
KEPT_VERSION = Verdict.BAD_VERSION.value

#: Why an entry where the tier's own file or shard folder belongs is left alone: a
#: symbolic link, FIFO, socket, device or folder (or a shard that is not a folder).
NOT_REGULAR: str = Unwritten.NOT_REGULAR.value
#: Every name the tier opens is opened relative to a folder it holds, never through a link.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW
READ = os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW  # a FIFO never blocks an open
SHARD_NAMES = frozenset(f"{n:02x}" for n in range(256))


class DirectoryGone(OSError):
    """The tier's folder is missing, or is another folder than the one opened."""


class NotRegular(OSError):
    """A link, FIFO, socket, device or folder where the tier's own value file (or shard
    folder) belongs: never followed, read, written or deleted; counted as `NOT_REGULAR`."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.ELOOP, f"{NOT_REGULAR} (a link, FIFO, socket, device or folder)")
        self.filename = name


def dir_mode_of(file_mode: int) -> int:
    """The mode of the folders of a tier whose files get ``file_mode``: its bits, plus
    search (x) wherever read is set (0o600: 0o700; 0o640: 0o750)."""
    return file_mode | ((file_mode & 0o444) >> 2)


def open_at(o: Any, dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """``name`` opened relative to ``dir_fd``, never through a link (`NotRegular` for
    what is not a regular file, as far as the open tells: `check_regular` the rest)."""
    try:
        return int(o.open(name, flags, mode, dir_fd=dir_fd))
    except OSError as exc:
        if errno_fault(exc.errno) is Fault.NOT_REGULAR:  # ELOOP, ENXIO, EISDIR, ENOTDIR
            raise NotRegular(name) from None
        raise


def check_regular(fd: int, name: str) -> os.stat_result:
    """``fd``'s status, or `NotRegular` (closing nothing) unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(name)
    return st


class Held:
    """The namespace folder and its shard folders, held open: every name of the tier is
    opened, renamed, stat'ed and unlinked relative to one of these descriptors, so a link
    put where a shard belongs is never followed. Shards are opened once each (256 at
    most) and kept, as a path walk per call would cost more than the call; each use
    checks (one ``fstatat``) that the name still holds the folder opened, so a shard
    moved out of the folder is never written into. The descriptors are closed once the
    folder is let go (`release`), or no longer its shards, and no thread uses them, so
    a hung call that wakes late never uses a number given to another file."""

    __slots__ = ("fd", "ids", "lock", "released", "retired", "shards", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.shards: dict[str, int] = {}
        self.ids: dict[int, tuple[int, int]] = {}  # each shard descriptor's (device, inode)
        self.retired: list[int] = []  # shards removed behind the tier's back: closed once
        # no call holds the folder (a call may still use one)
        self.lock = threading.Lock()
        self.users = 0
        self.released = False

    def enter(self, folder: str) -> Held:
        with self.lock:
            if self.released:
                raise DirectoryGone(errno.ESTALE, f"the folder {folder} was let go")
            self.users += 1
        return self

    def exit(self) -> None:
        stale: list[int] = []
        with self.lock:
            self.users -= 1
            close = self.released and not self.users
            if not self.users and not close:  # no call holds a retired shard: close them
                stale, self.retired = self.retired, stale
                for fd in stale:
                    self.ids.pop(fd, None)
        if close:
            self._close()
        for fd in stale:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
            close = not self.users
        if close:
            self._close()

    def _close(self) -> None:
        for fd in (*self.shards.values(), *self.retired, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.shards.clear()
        self.retired.clear()

    def shard(self, name: str, dir_mode: int, *, create: bool) -> int:
        """The shard folder ``name``'s descriptor (made when missing if ``create``);
        `NotRegular` when a link or a file is in its place, `FileNotFoundError` when it
        is missing, `DirectoryGone` when the namespace folder is."""
        fd = self.shards.get(name)
        if fd is not None and self._still(name, fd):
            return fd
        with self.lock:
            now = self.shards.get(name)
            if now is not None and now == fd:  # moved, removed or replaced since opened
                self.retired.append(self.shards.pop(name))
            elif now is not None:
                return now  # opened again by another thread
            fd = open_folder_at(self.fd, name, dir_mode, create=create)
            st = os.fstat(fd)
            self.ids[fd] = (st.st_dev, st.st_ino)
            self.shards[name] = fd
        return fd

    def _still(self, name: str, fd: int) -> bool:
        """Whether ``name`` in the folder is still the shard folder ``fd`` (one ``fstatat``):
        a shard moved out of the folder, a link put in its place, is never written through."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ids.get(fd)

    def renew(self, name: str, stale: int) -> bool:
        """Forget shard ``name``'s descriptor ``stale`` if its folder was removed since
        (kept open until the folder is let go); whether it was."""
        with self.lock:
            if self.shards.get(name) != stale or os.fstat(stale).st_nlink:
                return False
            self.retired.append(self.shards.pop(name))
            return True


def check_replaceable(o: Any, folder: int, name: str) -> None:
    """`NotRegular` when what ``name`` holds in ``folder`` is not a regular file: a rename
    onto it would delete a link or FIFO the tier did not make (left alone instead)."""
    try:
        st = o.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(name)


def open_folder_at(parent: int, name: str, dir_mode: int, *, create: bool) -> int:
    """Folder ``name`` in ``parent``, opened without following a link; made (``dir_mode``,
    whatever the umask) when missing if ``create``."""
    try:
        return open_at(os, parent, name, DIRECTORY)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, dir_mode, dir_fd=parent)
        made = True
    except FileExistsError:
        made = False
    except FileNotFoundError:  # the folder that holds it was removed
        raise DirectoryGone(errno.ENOENT, f"the folder of {name} is gone") from None
    fd = open_at(os, parent, name, DIRECTORY)
    if made:
        os.fchmod(fd, dir_mode)
    return fd


def head_bytes(codec: ChunkCodec, key: OffloadKey) -> int:
    """Bytes of a value file before its payload: the codec's header, padded to `BLOCK`."""
    return -(-codec.header_bytes(key) // BLOCK) * BLOCK


def aligned(view: memoryview) -> bool:
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


def head_buffer(size: int) -> memoryview:
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
    #: Entries where a value or shard belongs that are not regular files (folders):
    #: links, FIFOs, sockets, devices; never opened through, never deleted.
    not_regular: int = 0


class WriteOutcome:
    """What a write did, filled in by its thread under the call's guard."""

    __slots__ = ("blocked", "errors", "gone", "not_regular", "renamed")

    def __init__(self) -> None:
        self.gone: list[int] = []  # victims whose files left their names, by position
        self.renamed: list[int] = []  # items now visible, by position
        self.errors: dict[int, OSError] = {}  # items that failed, by position
        self.not_regular = 0  # victims' names found holding no file of the tier's: left
        self.blocked = 0  # items not written: their name or shard is not the tier's (a link)


class ReadOutcome:
    """What a read found, filled in by its thread under the call's guard."""

    __slots__ = ("errors", "not_regular", "vanished", "verdicts")

    def __init__(self, n: int) -> None:
        self.verdicts: list[Verdict | None] = [None] * n  # None: not read (or gone)
        self.vanished: list[int] = []  # files missing (deleted behind the tier's back)
        self.errors: dict[int, OSError] = {}
        self.not_regular: list[int] = []  # no regular file in the value's place: left alone


def entries(path: str | Path | int) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def write_rest(o: Any, fd: int, buffers: list[memoryview], written: int) -> None:
    """Finish a write that ``pwritev`` cut short at ``written`` bytes: write the rest.

    A file system that fills up mid-write writes what fits and returns its
    count; the write of the rest then fails with the reason (``ENOSPC``), which
    is raised. A write of the rest that moves nothing is an ``EIO``: a short
    value is never taken for a whole one.
    """
    total = sum(b.nbytes for b in buffers)
    while written < total:
        rest: list[memoryview] = []
        skip = written
        for buffer in buffers:
            if skip >= buffer.nbytes:
                skip -= buffer.nbytes
                continue
            rest.append(buffer[skip:])
            skip = 0
        more = o.pwritev(fd, rest, written)
        if more <= 0:
            raise OSError(errno.EIO, f"short write: {written} of {total} bytes, then none")
        written += more


def read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return os.pread(fd, 32, 0).decode().strip()
    return ""
