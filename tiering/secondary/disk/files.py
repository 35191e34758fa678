"""The blocking file work of a `DiskTier`: its values read, written and removed.

Everything here runs in worker threads (or at open); nothing touches the
tier's index, which lives on the event loop. A call's buffers are touched only
under its `Guard` (see `tiering.secondary.base`), so the loop can abandon a
call that ran out of time and have its buffers back at once.

`DiskFiles` is the whole of a tier's file work, in three parts: the folder, its
lock and names (`tiering.secondary.disk.folder`), the scan at open
(`tiering.secondary.disk.scan`), and here the values. The layout, and what a
value file holds: `tiering.secondary.disk.layout`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import stat
from collections.abc import Iterator, Sequence

from tiering._types import OffloadKey
from tiering.secondary.base import Guard
from tiering.secondary.codec import Verdict
from tiering.secondary.disk.folder import here, holding
from tiering.secondary.disk.layout import (
    BLOCK,
    FSYNC_POLICIES,
    NOFOLLOW,
    NOT_REGULAR,
    READ,
    TMP_SUFFIX,
    DirectoryGone,
    Held,
    NotRegular,
    ReadOutcome,
    ScanResult,
    WriteOutcome,
    aligned,
    check_regular,
    check_replaceable,
    file_bytes,
    head_buffer,
    head_bytes,
    open_at,
    write_rest,
)
from tiering.secondary.disk.scan import DiskScan
from tiering.secondary.refusals import errno_fault

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

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
#: Files a read opens (and asks the kernel for) at once.
READ_AHEAD = 32
_LATER = OSError(errno.EMFILE, "opened when read")  # a placeholder in a read's window
_SEQUENCE = itertools.count()


class DiskFiles(DiskScan):
    """The files of one tier's namespace under ``root``: its folder (`DiskFolder`), the
    scan (`DiskScan`), and its values' reads, writes and removals. Thread-safe."""

    def probe_direct(self) -> bool:
        """Whether this file system takes ``O_DIRECT`` reads and writes (one small file)."""
        if not _O_DIRECT or self.read_only:
            return False
        name = f".direct-probe-{os.getpid()}{TMP_SUFFIX}"
        buffer = mmap.mmap(-1, BLOCK)
        held = self._enter()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW | _O_DIRECT
        try:
            fd = open_at(os, held.fd, name, flags, self.file_mode)
        except FileExistsError:  # left by a process of this pid that died: a file of ours
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(name, dir_fd=held.fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=held.fd)
            try:
                fd = open_at(os, held.fd, name, flags, self.file_mode)
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

    def _unlink(self, held: Held, key: OffloadKey) -> None:
        """Delete ``key``'s value file: only a regular file (`NotRegular` otherwise: a link
        or FIFO put in its place is left alone), in a shard that is a folder."""
        shard, name = self.where(key)
        folder = self._shard(held, shard)
        st = self.os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(name)
        self.os.unlink(name, dir_fd=folder)

    # -- calls ---------------------------------------------------------------------------

    @holding
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
                if errno_fault(exc.errno).stops:  # ENOSPC, EDQUOT, EROFS
                    break  # the rest would fail alike: the caller counts them so
        for index, victim in spares:  # more room freed than the new values take
            with guard.lock:
                if guard.abandoned:
                    return
                try:
                    self._unlink(here(), victim)
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
        away from its name first: making a file costs far more than reusing one;
        README.md, "Disk tier: speed"), else a new file.
        """
        o = self.os
        held = here()
        shard, final = self.where(key)
        tmp = f"{final}.{os.getpid()}-{next(_SEQUENCE)}{TMP_SUFFIX}"
        least = self.direct_write_min
        direct = least is not None and row.nbytes >= least and aligned(row)
        flags = os.O_WRONLY | os.O_NONBLOCK | NOFOLLOW | (_O_DIRECT if direct else 0)
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
            head = head_buffer(size)
            with guard.lock:
                if guard.abandoned:
                    return
                head[:] = bytes(size)
                encoded = self.codec.encode_header(key, row)  # the checksum: reads the row
                head[: len(encoded)] = encoded
                written = o.pwritev(fd, [head, row], 0)  # the kernel reads the row
                write_rest(o, fd, [head, row], written)
            if self.fsync != "none":
                o.fdatasync(fd)
            os.close(fd)
            fd = -1
            check_replaceable(o, folder, final)
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
        held = here()
        for index, victim in spares:
            shard, name = self.where(victim)
            fd = -1
            odd = False
            try:
                source = self._shard(held, shard)
                fd = open_at(self.os, source, name, flags)
                st = check_regular(fd, name)
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
        self, held: Held, shard: str, folder: int, tmp: str, flags: int
    ) -> tuple[int, int]:
        """A new file ``tmp`` in shard ``folder`` (`file_mode`, whatever the umask), and the
        shard's descriptor: a new one, if the shard was removed behind the tier's back."""
        flags |= os.O_CREAT | os.O_EXCL  # never opens what is there, link or not
        try:
            fd = open_at(self.os, folder, tmp, flags, self.file_mode)
        except FileNotFoundError:
            if not held.renew(shard, folder):
                raise
            folder = self._shard(held, shard, create=True)  # the shard made again
            fd = open_at(self.os, folder, tmp, flags, self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd, folder

    @holding
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
        held = here()
        for position in window:
            key, row = items[position]
            direct = self.direct_read and aligned(row)
            try:
                shard, name = self.where(key)
                folder = self._shard(held, shard)
                fd = open_at(self.os, folder, name, READ | (_O_DIRECT if direct else 0))
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
        held = here()
        for index, position in enumerate(window):
            key, row = items[position]
            if guard.abandoned:
                return False
            try:
                fd = opened[index]
                if fd is _LATER:  # no descriptor was free at the window's open
                    shard, name = self.where(key)
                    fd = opened[index] = open_at(
                        self.os, self._shard(held, shard), name, READ
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
        head = head_buffer(size)
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


def _fsync_folder(folder: int) -> None:
    """Make a rename in the folder ``folder`` (a descriptor) survive a power loss."""
    os.fsync(folder)
