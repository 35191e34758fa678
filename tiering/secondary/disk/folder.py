"""A `DiskTier`'s folder: made, held open, locked for one owner, checked, measured.

`DiskFolder` is the first part of `tiering.secondary.disk.files.DiskFiles`
(which adds the scan, `tiering.secondary.disk.scan`, and the values' reads and
writes). Everything here runs in worker threads (or at open); nothing touches
the tier's index, which lives on the event loop. The layout is in
`tiering.secondary.disk.layout`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import stat
import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary.codec import ChunkCodec
from tiering.secondary.disk.layout import (
    DIRECTORY,
    LOCK_NAME,
    MAX_NAMED_KEY,
    NOFOLLOW,
    SUFFIX,
    DirectoryGone,
    Held,
    NotRegular,
    dir_mode_of,
    open_at,
    read_pid,
)

__all__ = ["DiskFolder", "here", "holding"]

logger = logging.getLogger("tiering.secondary.disk")

_LOCAL = threading.local()  # the folder the running call holds (`holding`)


_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="DiskFolder")


def holding(
    method: Callable[Concatenate[_S, _P], _R],
) -> Callable[Concatenate[_S, _P], _R]:
    """Run ``method`` with the folder held (`DiskFolder._enter`), as `_LOCAL.held`, this
    thread's: its helpers find the folder's and the shards' descriptors there."""

    @functools.wraps(method)
    def call_holding(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        held = self._enter()
        outer = getattr(_LOCAL, "held", None)
        _LOCAL.held = held
        try:
            return method(self, *args, **kwargs)
        finally:
            _LOCAL.held = outer
            held.exit()

    return call_holding


def here() -> Held:
    """The folder the running call holds (see `holding`)."""
    held: Held = _LOCAL.held
    return held


class DiskFolder:
    """The folder of one tier's namespace under ``root``, its lock, its names. Thread-safe
    (no shared state but the directory identity and the folders held open, set at open).

    Every name in the folder is used relative to a folder held open (`Held`), never
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
        self._held: Held | None = None  # the folder, held open while the tier is
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

    def _enter(self) -> Held:
        """The folder held open, for one call (`Held.exit` when done)."""
        held = self._held
        if held is None:
            raise DirectoryGone(errno.ENOENT, f"the folder {self.folder} is not open")
        return held.enter(self._folder)

    def _shard(self, held: Held, shard: str, *, create: bool = False) -> int:
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
            holder = read_pid(fd)
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
        flags = os.O_RDWR | os.O_NONBLOCK | NOFOLLOW
        for _ in range(3):  # a lock removed between the two opens: try again
            try:
                return open_at(os, root, LOCK_NAME, flags | os.O_CREAT | os.O_EXCL), True
            except FileExistsError:
                pass
            try:
                return open_at(os, root, LOCK_NAME, flags), False
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
            fd = open_at(os, root, name, DIRECTORY)
            if made:
                os.fchmod(fd, self.dir_mode)
            st = os.fstat(fd)
            self._warn_if_open(((self.root, os.fstat(root)), (self.folder, st)))
        finally:
            os.close(root)
        self.close_folder()
        held = self._held = Held(fd)
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

    def path(self, key: OffloadKey) -> Path:
        """The file of chunk ``key``'s value."""
        return Path(self.name(key))

    def name(self, key: OffloadKey) -> str:
        """`path` as a string (for messages and tests; the tier itself uses `where`)."""
        shard, name = self.where(key)
        return f"{self._folder}/{shard}/{name}"

    def where(self, key: OffloadKey) -> tuple[str, str]:
        """Chunk ``key``'s shard folder and file name in it (made without `pathlib`,
        which is slow on this path: README.md, "Disk tier: speed")."""
        raw = bytes(key)
        name = raw.hex() if len(raw) <= MAX_NAMED_KEY else "h" + hashlib.blake2b(raw).hexdigest()
        return f"{zlib.crc32(raw) & 0xFF:02x}", name + SUFFIX

    # -- open: what is on disk --------------------------------------------------------
