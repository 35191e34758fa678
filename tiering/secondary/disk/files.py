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

Every name above is used relative to a folder held open (the namespace folder,
and each shard once opened), never through a symbolic link: only ``<path>``, the
operator's, is looked up as a path. What is not a regular file where a value,
a shard or the lock belongs (a link, FIFO, socket, device, folder) is never
followed, blocked on, written or deleted: counted (`NOT_REGULAR`) and left alone.
Files are made with the tier's ``file_mode`` (0600), folders with `dir_mode_of` it
(0700), whatever the umask.

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
import functools
import hashlib
import itertools
import logging
import mmap
import os
import stat
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import msgspec
import numpy as np

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary.base import Guard
from tiering.secondary.codec import ChunkCodec, Verdict

__all__ = [
    "BLOCK",
    "FSYNC_POLICIES",
    "NOT_REGULAR",
    "DirectoryGone",
    "DiskFiles",
    "NotRegular",
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
#: The verdict of a value the scan leaves on disk: a version this tier does not read.
_KEPT_VERSION = Verdict.BAD_VERSION.value

#: Why an entry where the tier's own file or shard folder belongs is left alone: a
#: symbolic link, FIFO, socket, device or folder (or a shard that is not a folder).
NOT_REGULAR = "not a regular file"
#: What opening such an entry with ``O_NOFOLLOW | O_NONBLOCK`` answers: a link
#: (``ELOOP``; ``ENOTDIR`` with ``O_DIRECTORY``), a socket or a FIFO opened to write
#: (``ENXIO``), a folder opened to write (``EISDIR``).
_NOT_REGULAR_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR})
#: Every name the tier opens is opened relative to a folder it holds, never through a link.
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
_READ = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW  # a FIFO never blocks an open
_SHARD_NAMES = frozenset(f"{n:02x}" for n in range(256))

logger = logging.getLogger("tiering.secondary.disk")


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


def _open_at(o: Any, dir_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    """``name`` opened relative to ``dir_fd``, never through a link (`NotRegular` for
    what is not a regular file, as far as the open tells: `_check_regular` the rest)."""
    try:
        return int(o.open(name, flags, mode, dir_fd=dir_fd))
    except OSError as exc:
        if exc.errno in _NOT_REGULAR_ERRNOS:
            raise NotRegular(name) from None
        raise


def _check_regular(fd: int, name: str) -> os.stat_result:
    """``fd``'s status, or `NotRegular` (closing nothing) unless it is a regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(name)
    return st


class _Held:
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

    def enter(self, folder: str) -> _Held:
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
            fd = _open_folder_at(self.fd, name, dir_mode, create=create)
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


def _check_replaceable(o: Any, folder: int, name: str) -> None:
    """`NotRegular` when what ``name`` holds in ``folder`` is not a regular file: a rename
    onto it would delete a link or FIFO the tier did not make (left alone instead)."""
    try:
        st = o.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular(name)


def _open_folder_at(parent: int, name: str, dir_mode: int, *, create: bool) -> int:
    """Folder ``name`` in ``parent``, opened without following a link; made (``dir_mode``,
    whatever the umask) when missing if ``create``."""
    try:
        return _open_at(os, parent, name, _DIRECTORY)
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
    fd = _open_at(os, parent, name, _DIRECTORY)
    if made:
        os.fchmod(fd, dir_mode)
    return fd


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


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _holding(
    method: Callable[Concatenate[DiskFiles, _P], _R],
) -> Callable[Concatenate[DiskFiles, _P], _R]:
    """Run ``method`` with the folder held (`DiskFiles._enter`), as `_LOCAL.held`, this
    thread's: its helpers find the folder's and the shards' descriptors there."""

    @functools.wraps(method)
    def holding(self: DiskFiles, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        held = self._enter()
        outer = getattr(_LOCAL, "held", None)
        _LOCAL.held = held
        try:
            return method(self, *args, **kwargs)
        finally:
            _LOCAL.held = outer
            held.exit()

    return holding


def _here() -> _Held:
    """The folder the running call holds (see `_holding`)."""
    held: _Held = _LOCAL.held
    return held


class DiskFiles:
    """The files of one tier's namespace under ``root``. Thread-safe (no shared state
    but the directory identity and the folders held open, set at open).

    Every name in the folder is used relative to a folder held open (`_Held`), never
    through a link: only ``root`` itself, the path the operator gave, is looked up as
    a path (it may be a link the operator made). New files get ``file_mode`` and new
    folders `dir_mode_of` it, whatever the process's umask.
    """

    def __init__(
        self,
        root: Path,
        codec: ChunkCodec,
        *,
        fsync: str,
        direct: bool,
        read_only: bool,
        file_mode: int = 0o600,
    ) -> None:
        self.root = root
        self.codec = codec
        self.folder = root / codec.digest.hex()[:16]
        self._folder = str(self.folder)
        self.fsync = fsync
        self.file_mode = file_mode
        self.dir_mode = dir_mode_of(file_mode)
        #: O_DIRECT reads (of aligned rows), and the smallest aligned row written with
        #: O_DIRECT (None: no O_DIRECT write).
        self.direct_read = direct
        self.direct_write_min: int | None = 0 if direct else None
        self.read_only = read_only
        self._identity: tuple[int, int] | None = None
        self._lock_fd: int | None = None
        self._release: Any = None  # the finalizer that closes the lock's fd
        self._held: _Held | None = None  # the folder, held open while the tier is
        self._folder_release: Any = None
        self._warned = False  # the one line about a folder open to other users
        #: The calls a test may replace to inject faults (`os` by default): ``open``,
        #: ``preadv``, ``pwritev``, ``rename``, ``unlink``, ``stat``, ``fdatasync``, ``fstatvfs``
        #: (``open``, ``rename``, ``unlink`` and ``stat`` take ``dir_fd`` arguments).
        self.os: Any = os
        #: Set by tests to hold every call at its start, as a disk that stops answering.
        self.answering = threading.Event()
        self.answering.set()

    @property
    def _folder_fd(self) -> int | None:
        """The namespace folder's descriptor (None: not open)."""
        return None if self._held is None else self._held.fd

    def _enter(self) -> _Held:
        """The folder held open, for one call (`_Held.exit` when done)."""
        held = self._held
        if held is None:
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} is not open")
        return held.enter(self._folder)

    def _shard(self, held: _Held, shard: str, *, create: bool = False) -> int:
        return held.shard(shard, self.dir_mode, create=create)

    # -- the folder and its owner -------------------------------------------------

    def _open_root(self, *, create: bool) -> int:
        """The root folder's descriptor: the path the operator gave, followed (it may be
        a link they made); made with `dir_mode` when missing if ``create``."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            return os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                raise
        missing = list(itertools.takewhile(lambda p: not p.exists(), self.root.parents))
        for parent in reversed(missing):  # the tier's too: `dir_mode` (the umask may narrow
            with contextlib.suppress(FileExistsError):  # it, never widen it to others)
                os.mkdir(parent, self.dir_mode)
        try:
            os.mkdir(self.root, self.dir_mode)
            made = True
        except FileExistsError:
            made = False
        fd = os.open(self.root, flags)
        if made:
            os.fchmod(fd, self.dir_mode)
        return fd

    def lock(self) -> None:
        """Take the folder (make it if needed) for this process alone, or raise `ConfigError`.

        The lock file is opened relative to the root, never through a link and never
        truncated unless it is a regular file of one name: a ``.lock`` that is a link
        (or a FIFO, a folder, a hard link) is a `ConfigError` naming it, left untouched.
        """
        path = self.root / LOCK_NAME
        try:
            root = self._open_root(create=True)
            try:
                fd, made = self._open_lock(root)
            finally:
                os.close(root)
        except NotRegular:
            raise ConfigError(
                f"the disk tier's lock {path} is a symbolic link (or a FIFO, socket or "
                "folder): the tier never follows links inside its folder; remove it "
                "(what it points to is left untouched)"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"cannot use {self.root} for the disk tier: {exc.strerror or exc}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                regular = stat.S_ISREG(st.st_mode)
                what = "has other names (hard links)" if regular else "is not a regular file"
                raise ConfigError(
                    f"the disk tier's lock {path} {what}: the tier writes its pid only "
                    "into a lock file of its own; remove it (it is left untouched)"
                )
            if made:
                os.fchmod(fd, self.file_mode)
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
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        # A tier dropped without aclose (its engine failed to build) frees the folder
        # when it is collected.
        self._release = weakref.finalize(self, os.close, fd)

    def _open_lock(self, root: int) -> tuple[int, bool]:
        """The lock file's descriptor (made if missing), and whether it was made now."""
        flags = os.O_RDWR | os.O_NONBLOCK | _NOFOLLOW
        for _ in range(3):  # a lock removed between the two opens: try again
            try:
                return _open_at(os, root, LOCK_NAME, flags | os.O_CREAT | os.O_EXCL), True
            except FileExistsError:
                pass
            try:
                return _open_at(os, root, LOCK_NAME, flags), False
            except FileNotFoundError:
                continue
        raise OSError(errno.EAGAIN, f"{LOCK_NAME} keeps changing")

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
            now = os.stat(self.root / LOCK_NAME, follow_symlinks=False)
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
        held = self._enter()
        try:
            if os.fstat(held.fd).st_nlink == 0:
                # Removed (the folder is held open, so its inode number cannot be reused
                # by a folder made again in its place, which would pass the check below).
                raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} was removed")
        finally:
            held.exit()
        try:
            # The root is the operator's path (followed); the folder in it never is.
            st = self.os.stat(self._folder, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} is gone") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise DirectoryGone(
                errno.ESTALE, f"the folder {self.folder} was replaced by another one"
            )

    def make_folder(self) -> None:
        """Make the namespace folder (and the root) if missing, and remember which it is.
        A link in the folder's place is refused (`NotRegular`); an existing folder open to
        other users beyond `dir_mode` gets one warning line."""
        root = self._open_root(create=not self.read_only)
        try:
            name = self.folder.name
            made = False
            if not self.read_only:
                try:
                    os.mkdir(name, self.dir_mode, dir_fd=root)
                    made = True
                except FileExistsError:
                    pass
            fd = _open_at(os, root, name, _DIRECTORY)
            if made:
                os.fchmod(fd, self.dir_mode)
            st = os.fstat(fd)
            self._warn_if_open(((self.root, os.fstat(root)), (self.folder, st)))
        finally:
            os.close(root)
        self.close_folder()
        held = self._held = _Held(fd)
        self._folder_release = weakref.finalize(self, held.release)
        self._identity = (st.st_dev, st.st_ino)

    def _warn_if_open(self, folders: Sequence[tuple[Path, os.stat_result]]) -> None:
        """One warning line (once) for the folders other users may enter beyond `dir_mode`."""
        wide = [(p, st.st_mode & 0o777) for p, st in folders if st.st_mode & 0o077 & ~self.dir_mode]
        if wide and not self._warned:
            self._warned = True
            logger.warning(
                "disk tier folder %s is open to other users (%s), beyond the tier's %s: "
                "they may read the cached KV data (users' prompts); chmod it %o, or give "
                "the tier a file_mode that shares it with them",
                self.folder,
                ", ".join(f"{p} {mode:o}" for p, mode in wide),
                f"{self.dir_mode:o}",
                self.dir_mode,
            )

    def close_folder(self) -> None:
        """Let go of the folder held open (at close; closed once no call uses it)."""
        if self._held is not None:
            self._folder_release.detach()
            self._held.release()
            self._held = None

    def space(self) -> tuple[int, int]:
        """``(bytes free to this process, bytes in all)`` of the folder's file system
        (``fstatvfs`` of the folder held open, through ``self.os``)."""
        held = self._enter()
        try:
            st = self.os.fstatvfs(held.fd)
        finally:
            held.exit()
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def probe_direct(self) -> bool:
        """Whether this file system takes ``O_DIRECT`` reads and writes (one small file)."""
        if not _O_DIRECT or self.read_only:
            return False
        name = f".direct-probe-{os.getpid()}{TMP_SUFFIX}"
        buffer = mmap.mmap(-1, BLOCK)
        held = self._enter()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _O_DIRECT
        try:
            fd = _open_at(os, held.fd, name, flags, self.file_mode)
        except FileExistsError:  # left by a process of this pid that died: a file of ours
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(name, dir_fd=held.fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=held.fd)
            try:
                fd = _open_at(os, held.fd, name, flags, self.file_mode)
            except OSError:
                held.exit()
                return False
        except OSError:
            held.exit()
            return False
        try:
            os.pwritev(fd, [buffer], 0)
            return os.preadv(fd, [buffer], 0) == BLOCK
        except OSError:
            return False
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=held.fd)
            held.exit()
            buffer.close()

    # -- names ----------------------------------------------------------------------

    def path(self, key: OffloadKey) -> Path:
        """The file of chunk ``key``'s value."""
        return Path(self.name(key))

    def name(self, key: OffloadKey) -> str:
        """`path` as a string (for messages and tests; the tier itself uses `where`)."""
        shard, name = self.where(key)
        return f"{self._folder}/{shard}/{name}"

    def where(self, key: OffloadKey) -> tuple[str, str]:
        """Chunk ``key``'s shard folder and file name in it (made without `pathlib`,
        which costs a third of a write)."""
        raw = bytes(key)
        name = raw.hex() if len(raw) <= _MAX_NAMED_KEY else "h" + hashlib.blake2b(raw).hexdigest()
        return f"{zlib.crc32(raw) & 0xFF:02x}", name + SUFFIX

    # -- open: what is on disk --------------------------------------------------------

    def scan(self) -> ScanResult:
        """Every sound value of this namespace, oldest use first; drop what is not sound.

        A value is sound when its header passes every check of the codec but
        the checksum (checked at each read) and its file has the right length.
        Half-written values (temporary names) and values that fail are deleted,
        unless the tier is read-only; but a value of a format version this tier
        does not read (a keyed value where no key is given, or a later
        release's) is only left out (counted ``bad_version``): a run started
        once without the key must not delete the keyed tier's values. What is not a
        regular file (a link, FIFO, socket, device or folder where a value or a
        shard belongs) is never opened through, never blocks the scan and is never
        deleted: counted, left alone.
        """
        start = time.perf_counter()
        values: list[tuple[OffloadKey, int, int]] = []
        dropped: dict[str, int] = {}
        odd = 0  # not regular files

        def drop(folder: int, name: str, reason: str) -> None:
            dropped[reason] = dropped.get(reason, 0) + 1
            if reason == _KEPT_VERSION:
                return  # another release's or another key's value: not this tier's to delete
            if not self.read_only:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=folder)

        held = self._enter()
        try:
            for shard in _entries(held.fd):
                name = shard.name
                if not shard.is_dir(follow_symlinks=False):
                    if name.endswith(TMP_SUFFIX) and shard.is_file(follow_symlinks=False):
                        drop(held.fd, name, "half-written")
                    elif name.endswith(TMP_SUFFIX) or name in _SHARD_NAMES:
                        odd += 1
                    continue
                try:
                    if name in _SHARD_NAMES:
                        folder, own = self._shard(held, name), False
                    else:  # not a shard the tier makes: looked into, not kept open
                        folder, own = _open_folder_at(held.fd, name, 0, create=False), True
                except NotRegular:  # replaced by a link since listed
                    odd += 1
                    continue
                except FileNotFoundError:
                    continue
                try:
                    odd += self._scan_shard(folder, name, values, drop)
                finally:
                    if own:
                        os.close(folder)
        finally:
            held.exit()
        values.sort(key=lambda v: v[2])
        foreign = sum(
            1
            for entry in _entries(self.root)
            if entry.is_dir(follow_symlinks=False) and entry.name != self.folder.name
        )
        return ScanResult(
            values=values,
            dropped=dropped,
            foreign_namespaces=foreign,
            seconds=time.perf_counter() - start,
            not_regular=odd,
        )

    def _scan_shard(
        self,
        folder: int,
        shard: str,
        values: list[tuple[OffloadKey, int, int]],
        drop: Any,
    ) -> int:
        """Scan one shard folder into ``values`` (dropping what is not sound); how many of
        its entries are not regular files."""
        odd = 0
        for entry in _entries(folder):
            name = entry.name
            if not name.endswith((SUFFIX, TMP_SUFFIX)):
                continue
            if not entry.is_file(follow_symlinks=False):  # the listing's type: no open
                odd += 1
            elif name.endswith(TMP_SUFFIX):
                drop(folder, name, "half-written")
            else:
                found = self._check_file(folder, name)
                if found == NOT_REGULAR:  # replaced since listed
                    odd += 1
                elif isinstance(found, str):
                    drop(folder, name, found)
                elif self.where(found[0]) != (shard, name):
                    drop(folder, name, "misnamed")
                else:
                    values.append(found)
        return odd

    def _check_file(self, folder: int, name: str) -> tuple[OffloadKey, int, int] | str:
        """``(key, bytes, mtime)`` of a sound value file, else why not."""
        try:
            fd = _open_at(os, folder, name, _READ)
        except NotRegular:
            return NOT_REGULAR
        except OSError:
            return "unreadable"
        try:
            st = _check_regular(fd, name)
            head = _head_buffer(BLOCK)
            got = os.preadv(fd, [head], 0)
            key_bytes = self.codec.peek_key_bytes(head[:got])
            if key_bytes is None:
                return Verdict.BAD_MAGIC.value
            view = head[:got]
            if key_bytes > got:  # a long key: its head spans more than one block
                view = memoryview(os.pread(fd, key_bytes, 0))
            long_key = self.codec.peek_key(view)
            if long_key is not None and self.codec.header_bytes(long_key) > view.nbytes:
                # the whole head: a keyed value's tag area follows its key
                view = memoryview(os.pread(fd, self.codec.header_bytes(long_key), 0))
        except NotRegular:
            return NOT_REGULAR
        except OSError:
            return "unreadable"
        finally:
            os.close(fd)
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
        held = self._enter()
        try:
            for key in keys:
                with contextlib.suppress(FileNotFoundError, NotRegular):
                    self._unlink(held, key)
                    removed += 1
        finally:
            held.exit()
        return removed

    def _unlink(self, held: _Held, key: OffloadKey) -> None:
        """Delete ``key``'s value file: only a regular file (`NotRegular` otherwise: a link
        or FIFO put in its place is left alone), in a shard that is a folder."""
        shard, name = self.where(key)
        folder = self._shard(held, shard)
        st = self.os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(name)
        self.os.unlink(name, dir_fd=folder)

    # -- calls ---------------------------------------------------------------------------

    @_holding
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
        spares = iter(enumerate(victims))  # evicted values' files, recycled for new ones
        for position, (key, row) in enumerate(items):
            if guard.abandoned:
                return
            try:
                self._write_one(guard, position, key, row, out, spares)
            except DirectoryGone:
                raise
            except NotRegular:  # a link in its shard's place: nothing written through it
                with guard.lock:
                    if guard.abandoned:
                        return
                    out.not_regular += 1
                    out.blocked += 1
                continue
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
                    self._unlink(_here(), victim)
                except FileNotFoundError:
                    pass
                except NotRegular:  # a link or FIFO put in its place: left alone
                    out.not_regular += 1
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
        held = _here()
        shard, final = self.where(key)
        tmp = f"{final}.{os.getpid()}-{next(_SEQUENCE)}{TMP_SUFFIX}"
        least = self.direct_write_min
        direct = least is not None and row.nbytes >= least and _aligned(row)
        flags = os.O_WRONLY | os.O_NONBLOCK | _NOFOLLOW | (_O_DIRECT if direct else 0)
        size = head_bytes(self.codec, key)
        folder = self._shard(held, shard, create=True)
        fd = self._recycle(guard, spares, folder, tmp, flags, out)
        if fd >= 0:
            try:
                os.ftruncate(fd, size + row.nbytes)  # a no-op when the sizes agree
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)
                raise
        if guard.abandoned:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            return
        if fd < 0:
            fd, folder = self._open_new(held, shard, folder, tmp, flags)
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
                _write_rest(o, fd, [head, row], written)
            if self.fsync != "none":
                o.fdatasync(fd)
            os.close(fd)
            fd = -1
            _check_replaceable(o, folder, final)
            with guard.lock:
                if guard.abandoned:
                    return
                o.rename(tmp, final, src_dir_fd=folder, dst_dir_fd=folder)
                renamed = True
                out.renamed.append(position)
            if self.fsync == "full":
                _fsync_folder(folder)
        finally:
            if fd >= 0:
                os.close(fd)
            if not renamed:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=folder)

    def _recycle(
        self,
        guard: Guard,
        spares: Iterator[tuple[int, OffloadKey]],
        folder: int,
        tmp: str,
        flags: int,
        out: WriteOutcome,
    ) -> int:
        """Move the next evicted value's file to ``tmp`` in ``folder``, opened with
        ``flags``: its descriptor (-1: none was moved). The victim's file is opened (never
        through a link, never blocking) and checked to be a regular file before it moves:
        a link, FIFO or folder in its place is left alone (``out.not_regular``), and only
        the file checked is ever written. Each victim whose file left its name is recorded
        in ``out.gone``; one that could not be moved (an error) stays on disk, for a later
        write to delete."""
        held = _here()
        for index, victim in spares:
            shard, name = self.where(victim)
            fd = -1
            odd = False
            try:
                source = self._shard(held, shard)
                fd = _open_at(self.os, source, name, flags)
                st = _check_regular(fd, name)
                if st.st_nlink != 1:  # a hard link: its data is another name's too
                    raise NotRegular(name)  # never written
                if stat.S_IMODE(st.st_mode) != self.file_mode:  # made by an older tier
                    os.fchmod(fd, self.file_mode)
            except (FileNotFoundError, NotRegular) as exc:
                odd = isinstance(exc, NotRegular)
            except OSError:
                if fd >= 0:
                    os.close(fd)
                continue
            if odd or fd < 0:  # gone already, or not the tier's to write or delete
                if fd >= 0:
                    os.close(fd)
                with guard.lock:
                    if guard.abandoned:
                        return -1
                    out.gone.append(index)
                    out.not_regular += odd
                continue
            with guard.lock:
                if guard.abandoned:
                    os.close(fd)
                    return -1
                try:
                    self.os.rename(name, tmp, src_dir_fd=source, dst_dir_fd=folder)
                except FileNotFoundError:  # its name was deleted since it was opened
                    os.close(fd)
                    out.gone.append(index)
                    continue
                except OSError:
                    os.close(fd)
                    continue
                out.gone.append(index)
                return fd
        return -1

    def _open_new(
        self, held: _Held, shard: str, folder: int, tmp: str, flags: int
    ) -> tuple[int, int]:
        """A new file ``tmp`` in shard ``folder`` (`file_mode`, whatever the umask), and the
        shard's descriptor: a new one, if the shard was removed behind the tier's back."""
        flags |= os.O_CREAT | os.O_EXCL  # never opens what is there, link or not
        try:
            fd = _open_at(self.os, folder, tmp, flags, self.file_mode)
        except FileNotFoundError:
            if not held.renew(shard, folder):
                raise
            folder = self._shard(held, shard, create=True)  # the shard made again
            fd = _open_at(self.os, folder, tmp, flags, self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, folder

    @_holding
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
        held = _here()
        for position in window:
            key, row = items[position]
            direct = self.direct_read and _aligned(row)
            try:
                shard, name = self.where(key)
                folder = self._shard(held, shard)
                fd = _open_at(self.os, folder, name, _READ | (_O_DIRECT if direct else 0))
            except OSError as exc:  # NotRegular among them: a link where the value was
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
        held = _here()
        for index, position in enumerate(window):
            key, row = items[position]
            if guard.abandoned:
                return False
            try:
                fd = opened[index]
                if fd is _LATER:  # no descriptor was free at the window's open
                    shard, name = self.where(key)
                    fd = opened[index] = _open_at(
                        self.os, self._shard(held, shard), name, _READ
                    )  # fmt: skip
                if isinstance(fd, OSError):
                    raise fd
                verdict = self._read_one(guard, position, key, row, out, fd)
            except NotRegular:  # never read, never deleted: left alone, counted
                with guard.lock:
                    if guard.abandoned:
                        return False
                    out.not_regular.append(position)
                continue
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
            with guard.lock:  # an abandoned call changes nothing more on disk
                if guard.abandoned:
                    return False
                with contextlib.suppress(OSError):
                    if verdict is Verdict.OK:
                        os.utime(fd)  # the file read, whatever its name holds now
                    else:
                        shard, name = self.where(key)
                        folder = self._shard(held, shard)
                        now = self.os.stat(name, dir_fd=folder, follow_symlinks=False)
                        if now.st_ino == os.fstat(fd).st_ino:  # not a rewrite since
                            self.os.unlink(name, dir_fd=folder)  # never loaded nor offered
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
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a FIFO, a device: never read
            raise NotRegular(bytes(key).hex())
        file_bytes = st.st_size
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


def _entries(path: str | Path | int) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def _write_rest(o: Any, fd: int, buffers: list[memoryview], written: int) -> None:
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


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return os.pread(fd, 32, 0).decode().strip()
    return ""


def _fsync_folder(folder: int) -> None:
    """Make a rename in the folder ``folder`` (a descriptor) survive a power loss."""
    os.fsync(folder)
