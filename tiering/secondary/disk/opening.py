"""Opening a `DiskTier`'s folder, and making it again: the scan in a thread of its own.

`FolderOpening` starts the scan on first need, in a thread of its own (not
one of the tier's `ThreadCalls`: a big folder takes longer than any call's
timeout), and lets each call wait for it at most its own timeout. The scan's
thread makes the folder, probes ``O_DIRECT`` and measures the file system; the
tier indexes what it found (`tiering.secondary.disk.index.DiskIndex.adopt`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary.disk.files import DiskFiles
from tiering.secondary.disk.layout import NotRegular, ScanResult

__all__ = ["DIRECT_WRITE_MIN", "FolderOpening", "Scanned", "measure"]

#: The smallest row ``direct_io=None`` writes with ``O_DIRECT``: below it the page
#: cache's buffered writes were the faster (``bench/disk.py``; README.md, "Disk tier:
#: speed").
DIRECT_WRITE_MIN = 1 << 20

#: What a scan found, and the file system's ``(free, total)`` bytes (None: not measured).
Scanned = tuple[ScanResult, tuple[int, int] | None]


class FolderOpening:
    """The scan of one tier's folder: started once, waited for by each call in turn.

    ``direct_asked`` is the tier's ``direct_io`` option (None: where supported and
    where it helps); `direct_io` says what the probe found.
    """

    def __init__(self, files: DiskFiles, direct_asked: bool | None, read_only: bool) -> None:
        self.files = files
        self.direct_asked = direct_asked
        self.read_only = read_only
        #: Whether values move with ``O_DIRECT`` (known once open).
        self.direct_io = False
        #: What the last scan found, once the tier indexed it (None until then).
        self.report: ScanResult | None = None
        self._scan: concurrent.futures.Future[Scanned] | None = None

    async def scanned(self, timeout: float | None) -> Scanned | None:
        """What the scan found, once it ends within ``timeout`` seconds (None: for ever);
        None if it did not. Always a checkpoint; a scan that failed raises its
        `ConfigError` to each caller."""
        if self._scan is None:
            self._scan = concurrent.futures.Future()
            threading.Thread(
                target=_fill, args=(self._scan, self._open_folder), daemon=True,
                name=f"tiering-disk-scan:{self.files.root}",
            ).start()  # fmt: skip
        scan = self._scan
        if not await _wait_done(scan, timeout):
            return None
        return scan.result()

    async def wait_scan(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for a scan still running (at close: the scan
        deletes half-written files, not once the folder is free for another). Always a
        checkpoint."""
        if self._scan is not None and not self._scan.done():
            await _wait_done(self._scan, timeout)
        else:
            await anyio.lowlevel.checkpoint()

    async def remove(self, keys: Sequence[OffloadKey], timeout: float) -> bool:
        """Delete ``keys``' files (over capacity at open); whether that ended in time."""
        with anyio.move_on_after(timeout):
            await anyio.to_thread.run_sync(self.files.remove, keys, abandon_on_cancel=True)
            return True
        return False

    async def reopen(self) -> Scanned:
        """The folder is gone: hold the lock of the root as it is now, make the folder
        again and scan it (in a worker thread; the caller bounds the wait)."""
        return await anyio.to_thread.run_sync(self._reopen, abandon_on_cancel=True)

    def _open_folder(self) -> Scanned:
        """In a thread: make the folder, probe ``O_DIRECT``, scan."""
        files = self.files
        try:
            files.make_folder()
        except NotRegular:  # its message says "not a regular file": wrong for a folder
            raise ConfigError(
                f"the disk tier folder {files.folder} is a symbolic link or not a folder: the "
                "tier never follows links inside its folder; remove it (what it points to is "
                "left untouched)"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"cannot open the disk tier folder {files.folder}: {exc.strerror or exc}"
            ) from None
        if self.direct_asked is not False:
            supported = files.probe_direct()
            if self.direct_asked and not supported:
                raise ConfigError(
                    f"direct_io=True, but the file system of {files.root} does not take "
                    "O_DIRECT; pass direct_io=None (use it where supported) or False"
                )
            self.direct_io = supported
            if supported and self.direct_asked:  # asked for: both ways, every aligned row
                files.direct_read, files.direct_write_min = True, 0
            elif supported:  # where it helps (`DIRECT_WRITE_MIN`): writes of large rows
                files.direct_write_min = DIRECT_WRITE_MIN
        report = files.scan()
        return report, None if self.read_only else measure(files)

    def _reopen(self) -> Scanned:
        files = self.files
        files.relock()  # the root may be new: hold its lock, or stay down
        files.make_folder()
        report = files.scan()
        return report, None if self.read_only else measure(files)  # a reader: never


def measure(files: DiskFiles) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the tier's file system; None where it cannot say."""
    try:
        return files.space()
    except OSError:
        return None


async def _wait_done(future: concurrent.futures.Future[Any], limit: float | None) -> bool:
    """Whether ``future`` is done within ``limit`` seconds (None: for ever). Always a
    checkpoint; the thread that waits gives up within half a second of its caller."""
    deadline = None if limit is None else anyio.current_time() + limit
    while not future.done():
        left = 0.5 if deadline is None else min(0.5, deadline - anyio.current_time())
        if left <= 0:
            return False
        wait = functools.partial(concurrent.futures.wait, [future], timeout=left)
        await anyio.to_thread.run_sync(wait, abandon_on_cancel=True)
    await anyio.lowlevel.checkpoint()
    return True


def _fill(future: concurrent.futures.Future[Scanned], scan: Callable[[], Scanned]) -> None:
    """Run ``scan`` in its own thread, its result or error into ``future``."""
    try:
        future.set_result(scan())
    except BaseException as exc:  # a ConfigError, or a bug: each caller sees it
        future.set_exception(exc)
