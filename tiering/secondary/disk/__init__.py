"""`DiskTier`: a persistent local-disk tier that manages its own capacity and survives restarts.

A `SecondaryTier` over one folder of a local file system (an NVMe, say): one
file per chunk, self-checking as Redis values are (`tiering.secondary.codec`:
format, namespace, key, length, checksum), in the layout `files` describes.

Design note:

- **Capacity.** The tier never holds more than ``capacity_bytes`` of value
  files. Its index (what it holds, and the policy's order) lives in memory, on
  the event loop; a write that needs room evicts by a `tiering.policies`
  policy first (the engine's default unless told), tail before head as in the
  CPU tier, and reuses the victims' files for the new values (making a file
  costs ~10x reusing one on ext4) or deletes them, before it writes. A call
  evicts only once a worker thread is its own: one answered without I/O
  (down, busy) evicts nothing.
- **A file system smaller than the capacity.** The tier holds at most its
  *effective* capacity: the configured one, or less where its file system
  cannot hold that: what the tier's files take now plus what is free
  (``fstatvfs`` of its folder), less a reserve of max(one value, 1% of the
  file system), left for the file system's own needs and other writers (and
  so that a full disk is found by measuring, not by a failed write). It is
  measured at open (a folder found fuller than that is trimmed there, oldest
  values first, so a second run on a full folder writes new values), by a
  write every `SPACE_CHECK_S` at most, and at each write the disk refused for
  space (``ENOSPC``, ``EDQUOT``; a short write at the end of the file system
  is one: see `files`). Lowered, the tier evicts down to it and goes on
  writing (into the victims' files): that refusal does not back off writes
  unless nothing could be evicted. It rises again, up to the configured
  capacity, as space frees up. ``statistics()`` reports both. A user quota
  (``EDQUOT``) is not in ``fstatvfs``: refused for it, the tier holds at most
  what its files take then (evicting into their files) until its next measure.
- **Restarts.** Opening (`open`, or the first call, which waits for it at most
  its timeout, then answers busy) rebuilds the index from a scan of the
  files' heads in a thread of its own, oldest use first (a read sets a file's time):
  every value a previous process wrote is found, whole; half-written ones
  (temporary names) and ones that fail a check are deleted and counted
  (`open_report`). The payload's checksum is checked at each read, not at the
  scan: the scan reads 4 KiB a value (measured in ``bench/disk.py``), and a
  value that rots later is caught where it matters. An index file was not
  kept: it would have to be checked against the files anyway.
- **Crash safety.** A value is written under a temporary name and renamed
  into place: it is visible whole or not at all. ``fsync`` says what survives
  a power loss (`files.FSYNC_POLICIES`); a value whose data did not reach the
  disk fails its length or checksum and is never loaded.
- **Its folder only.** Every name is used relative to the folder held open
  (``openat``-style, ``O_NOFOLLOW``, reads ``O_NONBLOCK``, ``fstat`` checked to
  be a regular file), its 256 shard folders opened once each and held: the
  folder's contents are never trusted to be what the tier made (`files`).
- **One owner.** The folder is locked (``flock``) by the process that opens it;
  another gets a `ConfigError` naming the holder, unless it opens read-only
  (no lock, no writes, nothing deleted).
- **I/O off the event loop.** Every call is one job in a worker thread (at most
  ``max_concurrency`` threads live, counting those a hung disk still holds
  after their calls timed out; a call that finds none free within its
  timeout is *busy*). Reads land straight in the caller's row (``preadv``
  after the head was checked); with ``O_DIRECT`` (probed at open; by default
  for writes of rows of `DIRECT_WRITE_MIN` or more) an aligned row moves
  between memory and disk with no copy. Buffers are touched only under the
  call's `Guard`, so a call that times out or is cancelled has its buffers back
  at once (an abandon waits for at most one row's read or write in progress).
- **Faults.** A full disk (``ENOSPC``, ``EDQUOT``), a read-only or forbidden
  folder (``EROFS``, ``EACCES``, ``EPERM``) refuse writes (counted by code; writes
  back off, reads go on; a full disk lowers the effective capacity instead,
  where evicting makes room); a value deleted or truncated behind the tier's back
  is a counted miss (``lost_total``, a rejection) and leaves the index; the
  folder removed (or replaced) takes the tier down: calls are misses without
  I/O until the retry time, when the folder is made again and the index
  rebuilt from what is in it. Nothing wrong is ever loaded.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from tiering._types import Medium, OffloadKey
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError, ResourceClosedError
from tiering.policies import CachePolicy, create_policy
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import (
    UNWRITTEN_BACKING_OFF,
    UNWRITTEN_BUSY,
    UNWRITTEN_CANCELLED,
    UNWRITTEN_DOWN,
    UNWRITTEN_FAILED,
    UNWRITTEN_TIMEOUT,
    Guard,
    Locality,
    ReadItem,
    SecondaryStatistics,
    SecondaryTier,
    TierCounters,
    WriteItem,
    describe,
)
from tiering.secondary.checksum import Checksum
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, payload_row, writable_row
from tiering.secondary.disk.files import (
    FSYNC_POLICIES,
    FULL_ERRNOS,
    NOT_REGULAR,
    DirectoryGone,
    DiskFiles,
    NotRegular,
    ReadOutcome,
    ScanResult,
    WriteOutcome,
    head_bytes,
)
from tiering.secondary.health import Admission, HealthGate, TierState

__all__ = ["DEFAULT_FILE_MODE", "DIRECT_WRITE_MIN", "FSYNC_POLICIES", "DiskTier", "ScanResult"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Why chunks were not written, beyond the contract's causes.
UNWRITTEN_NO_ROOM = "no room"  # every value the tier holds is being read or written
UNWRITTEN_READ_ONLY = "read only"

#: The smallest row ``direct_io=None`` writes with ``O_DIRECT``. Measured with
#: ``bench/disk.py`` on this project's machines: 2 MiB rows wrote at about 2x raw
#: buffered writes with it, 256 KiB rows at 0.6-0.85x of the tier's buffered writes.
DIRECT_WRITE_MIN = 1 << 20

#: The mode of the tier's new files (its new folders: 0o700): its own user's alone, as
#: values hold users' prompts. ``file_mode`` widens it for a group that shares the tier.
DEFAULT_FILE_MODE = 0o600


def _check_file_mode(mode: object) -> None:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0o600 <= mode <= 0o777:
        shown = oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)
        raise ConfigError(
            f"file_mode must be a permission mode from 0o600 to 0o777 that lets the owner "
            f"read and write (0o600 by default; 0o640 or 0o660 to share with a group), "
            f"got {shown}"
        )


#: Errors that refuse writes (counted by code, writes back off) rather than fail the tier.
_REFUSALS = FULL_ERRNOS | {errno.EACCES, errno.EPERM}
#: Refusals for want of space: the tier measures its file system and fits into it.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

#: Seconds between two measures of the file system's free space by writes (at most one
#: a period; refusals for space and opening measure at once). A measure is one
#: ``fstatvfs``.
SPACE_CHECK_S = 1.0


class DiskTier(SecondaryTier):
    """A `SecondaryTier` of value files in the folder ``path``, at most ``capacity_bytes``.

    ``namespace`` is the engine's (`RemoteNamespace.from_config`); values of
    other namespaces in the same folder are left alone. ``policy`` orders
    evictions (a name or a `CachePolicy`). ``fsync``: ``none``, ``data`` or
    ``full`` (see `files.FSYNC_POLICIES`). ``direct_io``: ``None`` (the default)
    uses ``O_DIRECT`` where the file system takes it (probed at open) and where it
    helps: writes of rows of `DIRECT_WRITE_MIN` bytes or more (reads go through
    the page cache, which serves the recently written values again at memory
    speed); ``True`` requires it and uses it both ways; ``False`` never uses it.
    Only a row aligned to 4 KiB, in address and size, moves with ``O_DIRECT``.
    ``auth_key`` (an `AuthKey`): values are written with a tag under it and
    only values with a valid one are read (`tiering.secondary.codec`); the
    others are rejected (``unauthenticated``) and deleted at open.
    ``read_only`` opens without the lock and never writes or deletes.
    ``timeout_s`` bounds each call; ``max_concurrency`` worker threads do the
    I/O; ``backoff_s`` is the retry delay while the folder is gone or writes are
    refused.

    Constructing takes the folder's lock (a `ConfigError` if another process
    holds it) and does no other I/O; `open` (or the first call) scans it.

    The tier acts only inside its folder: every name in it is opened, renamed and
    deleted relative to the folder held open, never through a symbolic link
    (only ``path`` itself is looked up, and may be a link the operator made). A
    link, FIFO, socket, device or folder where a value or a shard folder belongs
    is never followed, read, written or deleted: counted
    (``rejected_by_reason["not a regular file"]``) and left alone; a ``.lock``
    that is a link is a `ConfigError` naming it. New files are made 0600 and new
    folders 0700 (whatever the umask: values hold users' prompts); ``file_mode``
    (0o600 to 0o777, the owner's read and write at least; 0o640 or 0o660 for a
    group that shares the tier) sets the files' mode, and the folders get it plus
    search where it has read. An existing folder open to other users beyond that
    gets one warning line at open, and is left as it is.
    """

    name = "disk"
    label = "disk"
    medium = Medium.STORAGE
    locality = Locality.LOCAL
    write_concurrency = 2  # a write's file work overlaps the next one's hand-off
    #: Seconds between a write's measures of free space (`SPACE_CHECK_S`).
    space_check_s = SPACE_CHECK_S

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: RemoteNamespace,
        *,
        policy: str | CachePolicy = DEFAULT_POLICY,
        fsync: str = "none",
        direct_io: bool | None = None,
        read_only: bool = False,
        timeout_s: float = 5.0,
        max_concurrency: int = 4,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        touch_reads: bool = True,
        checksum: Checksum = Checksum.XXH3,
        auth_key: AuthKey | None = None,
        file_mode: int = DEFAULT_FILE_MODE,
    ) -> None:
        _check_file_mode(file_mode)
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        threads = max_concurrency
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"max_concurrency must be a positive integer, got {threads!r}")
        self.codec = ChunkCodec(namespace, checksum, auth_key)
        value = self.codec.row_bytes + head_bytes(self.codec, OffloadKey(bytes(16)))
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(f"capacity_bytes must be an integer, got {capacity_bytes!r}")
        if capacity_bytes < value:
            raise ConfigError(
                f"capacity_bytes={capacity_bytes:,} holds no value: one chunk takes "
                f"{value:,} bytes on disk (its row and a 4 KiB head); give at least that"
            )
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"the disk tier folder {self.path} is a file, not a folder")
        #: The configured capacity; `effective_capacity_bytes` is what the tier holds
        #: at most now (less where its file system holds less: see the design note).
        self.capacity_bytes = capacity_bytes
        self.effective_capacity_bytes = capacity_bytes
        self._measured_at = -math.inf  # when a write last measured free space
        self._space_at_open: tuple[int, int] | None = None  # measured by the scan's thread
        self.read_only = read_only
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.touch_reads = touch_reads
        self._direct_asked = direct_io
        #: Whether values move with ``O_DIRECT`` (known once open).
        self.direct_io = False
        chunks = max(1, capacity_bytes // value)
        self.policy = create_policy(policy, chunks) if isinstance(policy, str) else policy
        self._files = DiskFiles(
            self.path, self.codec, fsync=fsync, direct=False, read_only=read_only,
            file_mode=file_mode,
        )  # fmt: skip
        self._health = HealthGate(backoff_s)
        self._write_gate = HealthGate(backoff_s)  # refused writes back off on their own
        if not read_only:
            self._files.lock()  # last: a bad option raised above leaves the folder free
        self._counters = TierCounters()
        self._closed = False
        self._opened = False
        self._scan: concurrent.futures.Future[ScanResult] | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._live = threading.BoundedSemaphore(max_concurrency)  # threads doing I/O
        self._idle: anyio.Event | None = None
        self._in_flight = 0
        #: What the last scan found (None until open).
        self.open_report: ScanResult | None = None
        # The index, on the event loop only.
        self._sizes: dict[OffloadKey, int] = {}  # value file bytes, by key
        self._used = 0
        self._reserved = 0  # bytes of new values being written
        self._reading: dict[OffloadKey, int] = {}  # reads in flight, by key
        self._writing: dict[OffloadKey, int] = {}  # writes in flight, by key
        self._unlinking: set[OffloadKey] = set()  # victims an unfinished call may delete
        self._rewritten: set[OffloadKey] = set()  # written anew while being read
        self._trash: list[OffloadKey] = []  # victims still on disk: the next write deletes them
        self._evictions = 0
        self._lost = 0
        self._warned_not_regular = False

    # -- life -------------------------------------------------------------------------

    @property
    def state(self) -> TierState:
        return TierState.CLOSED if self._closed else self._health.state

    async def open(self) -> ScanResult:
        """Scan the folder and build the index, however long the scan takes (once; later
        calls return the same report). Calls made before it ends wait for it at most
        their timeout, then answer as busy."""
        self._check_open()
        await self._ensure_open(timeout=None)
        assert self.open_report is not None
        return self.open_report

    async def _ensure_open(self, timeout: float | None = -1.0) -> bool:
        """Whether the index is built; waits for the scan (started on first need, in a
        thread of its own) at most ``timeout`` (the tier's, by default; None: for ever).
        Always a checkpoint; a scan that failed raises its `ConfigError` to each caller."""
        if self._opened:
            await anyio.lowlevel.checkpoint()
            return True
        if self._scan is None:
            self._scan = concurrent.futures.Future()
            threading.Thread(
                target=_fill, args=(self._scan, self._open_folder), daemon=True,
                name=f"tiering-disk-scan:{self.path}",
            ).start()  # fmt: skip
        scan = self._scan
        if not await _wait_done(scan, self.timeout_s if timeout == -1.0 else timeout):
            return False
        if not self._opened:
            victims = self._adopt(scan.result())  # raises the scan's ConfigError, if any
            if victims:  # over capacity (it was lowered): delete the oldest now
                removed = False
                with anyio.move_on_after(self.timeout_s):
                    await anyio.to_thread.run_sync(
                        self._files.remove, victims, abandon_on_cancel=True
                    )
                    removed = True
                if not removed:
                    self._trash.extend(victims)  # the next write deletes what is left
        return True

    def _open_folder(self) -> ScanResult:
        """In a thread: make the folder, probe ``O_DIRECT``, scan."""
        files = self._files
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
        if self._direct_asked is not False:
            supported = files.probe_direct()
            if self._direct_asked and not supported:
                raise ConfigError(
                    f"direct_io=True, but the file system of {self.path} does not take "
                    "O_DIRECT; pass direct_io=None (use it where supported) or False"
                )
            self.direct_io = supported
            if supported and self._direct_asked:  # asked for: both ways, every aligned row
                files.direct_read, files.direct_write_min = True, 0
            elif supported:  # where it helps (bench/disk.py): writes of large rows
                files.direct_write_min = DIRECT_WRITE_MIN
        report = files.scan()
        self._space_at_open = None if self.read_only else _measure(files)
        return report

    def _adopt(self, report: ScanResult) -> list[OffloadKey]:
        """Index what a scan found (oldest first), then trim to capacity; the victims,
        whose files the caller deletes (none for a read-only tier)."""
        self._sizes.clear()
        self.policy.clear()
        self._used = 0
        for key, size, _ in report.values:
            self._sizes[key] = size
            self._used += size
            self.policy.insert([key])
        self._opened = True
        self.open_report = report
        space, self._space_at_open = self._space_at_open, None
        if space is not None:  # a file system smaller than the capacity: fit into it
            self._measured_at = time.monotonic()
            self._fit(space)
        victims = self._evict(self._used - self.effective_capacity_bytes, protected=()) or []
        if report.dropped:
            logger.warning(
                "disk tier %s: dropped at open: %s",
                self.path,
                ", ".join(f"{n:,} {why}" for why, n in report.dropped.items()),
            )
        if report.not_regular:
            self._not_regular(report.not_regular, "at open")
        return [] if self.read_only else victims

    def _not_regular(self, n: int, where: str) -> None:
        """Count ``n`` entries that are not regular files where values (or shards) belong:
        links, FIFOs, sockets, devices, folders; never followed, read, written or deleted."""
        c = self._counters
        c.rejected_total += n
        c.rejected_by_reason[NOT_REGULAR] = c.rejected_by_reason.get(NOT_REGULAR, 0) + n
        c.last_rejection = f"{NOT_REGULAR}: {n} {where}"
        if self._warned_not_regular and where != "at open":
            return  # one line; the count goes on
        self._warned_not_regular = True
        logger.warning(
            "disk tier %s: %d entries %s are not regular files where its values belong "
            "(links, FIFOs, sockets, devices or folders): left alone, never followed",
            self.path,
            n,
            where,
        )

    async def aclose(self) -> None:
        """Wait (at most ``timeout_s``) for calls in flight, release the folder. Idempotent."""
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        self._health.close()
        self._write_gate.close()
        if self._in_flight:
            self._idle = self._idle or anyio.Event()
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout_s):
                await self._idle.wait()
        else:
            await anyio.lowlevel.checkpoint()
        if self._scan is not None and not self._scan.done():
            # The scan deletes half-written files: not once the folder is free for another.
            with anyio.CancelScope(shield=True):
                await _wait_done(self._scan, self.timeout_s)
        self._files.unlock()
        self._files.close_folder()

    def discard(self) -> None:
        """Release the folder now, for a tier that was built and will never be used."""
        self._closed = True
        self._health.close()
        self._write_gate.close()
        self._files.unlock()
        self._files.close_folder()

    # -- the contract ---------------------------------------------------------------------

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._check_open()
        c = self._counters
        c.contains_calls += 1
        if not keys:
            await anyio.lowlevel.checkpoint()
            return []
        if not await self._ensure_open():
            c.busy_total += 1  # still scanning the folder
            return c.found([False] * len(keys))
        ok, _ = await self._run(lambda guard: self._files.check_folder())
        if not ok:
            return c.found([False] * len(keys))
        sizes = self._sizes
        return c.found([key in sizes for key in keys])

    async def write(self, items: Sequence[WriteItem]) -> int:
        self._check_open()
        rows = [(key, payload_row(row, self.row_bytes)) for key, row in items]
        c = self._counters
        c.write_calls += 1
        if not rows:
            await anyio.lowlevel.checkpoint()
            return 0
        try:
            opened = await self._ensure_open()
        except BaseException:
            c.written(0, len(rows), self.row_bytes, cause=UNWRITTEN_CANCELLED)
            raise
        if not opened:
            c.busy_total += 1  # still scanning the folder
            return c.written(0, len(rows), self.row_bytes, cause=UNWRITTEN_BUSY)
        if self.read_only:
            await anyio.lowlevel.checkpoint()
            return c.written(0, len(rows), self.row_bytes, cause=UNWRITTEN_READ_ONLY)
        writing = self._write_gate.admit()
        if writing is None:  # the disk refused writes just before: not due to try again
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()
            return c.written(0, len(rows), self.row_bytes, cause=UNWRITTEN_BACKING_OFF)
        return await self._write(rows, writing)

    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        self._check_open()
        views = [(key, writable_row(buffer, self.row_bytes)) for key, buffer in items]
        c = self._counters
        c.read_calls += 1
        if not views:
            await anyio.lowlevel.checkpoint()
            return []
        if not await self._ensure_open():
            c.busy_total += 1  # still scanning the folder
            c.read_misses_total += len(views)
            return [False] * len(views)
        held = [i for i, (key, _) in enumerate(views) if key in self._sizes]
        filled = [False] * len(views)
        c.read_misses_total += len(views) - len(held)  # not held: answered from the index
        if not held:
            await anyio.lowlevel.checkpoint()
            return filled
        wanted = [views[i] for i in held]
        keys = [key for key, _ in wanted]
        for key in keys:
            self._reading[key] = self._reading.get(key, 0) + 1
        out = ReadOutcome(len(wanted))
        try:
            await self._run(lambda guard: self._files.read(guard, wanted, out, self.touch_reads))
        finally:
            rewritten = self._rewritten
            _uncount(self._reading, keys)
            # A write of a key that landed while it was read made a new file: what the
            # read found wrong with the old one says nothing of it.
            fresh = {k for k in keys if k in rewritten}
            for key in fresh:
                if key not in self._reading:
                    rewritten.discard(key)
        good: list[OffloadKey] = []
        vanished = set(out.vanished) | set(out.not_regular)
        for position, verdict in enumerate(out.verdicts):
            key = keys[position]
            if verdict is None:
                if position not in vanished and position not in out.errors:
                    c.read_misses_total += 1  # not reached: timed out, or the folder was gone
                continue
            if c.read(key, verdict, self.row_bytes):
                filled[held[position]] = True
                good.append(key)
            elif key not in fresh:
                self._forget(key)  # its file is deleted: never offered again
        for position in out.vanished:
            c.read_misses_total += 1
            if keys[position] not in fresh:
                self._lost += 1
                self._forget(keys[position])
        for exc in out.errors.values():
            c.read_misses_total += 1
            c.error(f"reading a value: {describe(exc)}")
        if out.not_regular:  # a rejection, as a value that fails a check; its entry stays
            self._not_regular(len(out.not_regular), "read")
            for position in out.not_regular:
                if keys[position] not in fresh:
                    self._forget(keys[position])
        if good:
            self.policy.touch(good)
        return filled

    def statistics(self) -> SecondaryStatistics:
        writes = "backing off" if self._write_gate.state is TierState.DOWN else "up"
        snapshot = self._counters.snapshot(self.name, self.state.value, writes)
        return _with_capacity(
            snapshot,
            capacity_bytes=self.capacity_bytes,
            effective_capacity_bytes=self.effective_capacity_bytes,
            used_bytes=self._used,
            chunks=len(self._sizes),
            evictions_total=self._evictions,
            lost_total=self._lost,
        )

    # -- writes ---------------------------------------------------------------------------

    async def _write(self, rows: list[tuple[OffloadKey, memoryview]], writing: Admission) -> int:
        c = self._counters
        plan = _WritePlan()

        def make_plan() -> None:
            """Choose what to write and what to evict, once a worker thread is ours: a
            call answered without I/O (down, busy, cancelled) evicts nothing."""
            # A key another call is writing or deleting now is left to that call.
            plan.items = [(k, r) for k, r in rows if not self._busy_key(k)]
            plan.busy = len(rows) - len(plan.items)
            plan.victims = self._room_for(plan)
            plan.no_room = len(rows) - plan.busy - len(plan.items)
            plan.victims += self._take_trash()
            plan.measure = self._measure_due()
            plan.reserved = sum(self._value_bytes(k) for k in plan.new)
            self._reserved += plan.reserved
            self._unlinking.update(plan.victims)
            for key, _ in plan.items:
                self._writing[key] = self._writing.get(key, 0) + 1
            plan.made = True

        out = WriteOutcome()

        def work(guard: Guard) -> None:
            self._files.write(guard, plan.victims, plan.items, out)
            if plan.measure or any(e.errno in _NO_SPACE for e in out.errors.values()):
                plan.space = _measure(self._files)

        cause = UNWRITTEN_CANCELLED
        try:
            _, cause = await self._run(work, plan=make_plan)
        finally:
            if not plan.made:  # no I/O: nothing chosen, nothing evicted
                self._write_gate.release(writing)
                written = c.written(0, len(rows), self.row_bytes, cause=cause)
            else:
                written = self._settle_plan(plan, out, writing, cause)
        return written

    def _busy_key(self, key: OffloadKey) -> bool:
        return key in self._writing or key in self._unlinking

    def _room_for(self, plan: _WritePlan) -> list[OffloadKey]:
        """Victims that make room for the plan's items, cutting them to the longest head
        that fits when not all do (a prefix is what gets reused)."""
        protected = self._protected(plan.items)
        victims, plan.new = self._make_room(plan.items, protected)
        if victims is not None:
            return victims
        # The longest fitting head, found in O(log n) tries; a failed try changes nothing.
        fits, fails = 0, len(plan.items)
        while fails - fits > 1:
            middle = (fits + fails) // 2
            if self._make_room(plan.items[:middle], protected, dry_run=True)[0] is None:
                fails = middle
            else:
                fits = middle
        plan.items = plan.items[:fits]
        victims, plan.new = self._make_room(plan.items, protected)
        if victims is None:  # the policy would not give what the count promised
            plan.items, plan.new = [], []
            return []
        return victims

    def _settle_plan(
        self, plan: _WritePlan, out: WriteOutcome, writing: Admission, cause: str
    ) -> int:
        c = self._counters
        self._reserved -= plan.reserved
        self._unlinking.difference_update(plan.victims)
        gone = set(out.gone)
        # Victims whose files are still on disk: the next write deletes them.
        self._trash.extend(v for i, v in enumerate(plan.victims) if i not in gone)
        _uncount(self._writing, [key for key, _ in plan.items])
        written = self._settle_write(plan.items, out)
        if out.not_regular:
            self._not_regular(out.not_regular, "written or evicted")
        quota = any(e.errno == errno.EDQUOT for e in out.errors.values())
        room = False if plan.space is None else self._refit(plan.space, quota)
        refused = self._refusals(plan.items, out, writing, cause, room)
        offered = len(plan.items) - out.blocked
        c.written(written, offered, self.row_bytes, cause=cause, refused=refused)
        for reason, n in (
            (UNWRITTEN_BUSY, plan.busy),
            (UNWRITTEN_NO_ROOM, plan.no_room),
            (NOT_REGULAR, out.blocked),  # a link where the value or its shard belongs
        ):
            if n:  # not written for reasons of their own: counted under them
                c.write_errors_total += n
                by_reason = c.write_errors_by_reason
                by_reason[reason] = by_reason.get(reason, 0) + n
        return written

    def _make_room(
        self,
        items: list[tuple[OffloadKey, memoryview]],
        protected: _Protected,
        *,
        dry_run: bool = False,
    ) -> tuple[list[OffloadKey] | None, list[OffloadKey]]:
        """Victims that make room for ``items``' new values (None: not possible), and those
        new keys. ``dry_run`` only says whether room can be made (victims stay)."""
        new = list(dict.fromkeys(k for k, _ in items if k not in self._sizes))
        need = self._used + self._reserved + sum(map(self._value_bytes, new))
        need -= self.effective_capacity_bytes
        if dry_run:
            evictable = len(self.policy) - sum(1 for k in set(protected) if k in self._sizes)
            value = self._value_bytes(OffloadKey(bytes(16)))
            return ([] if need <= 0 or math.ceil(need / value) <= evictable else None), new
        return self._evict(need, protected), new

    def _value_bytes(self, key: OffloadKey) -> int:
        return self.row_bytes + head_bytes(self.codec, key)

    def _settle_write(self, items: list[tuple[OffloadKey, memoryview]], out: WriteOutcome) -> int:
        """Index the values now on disk; their count."""
        added: list[OffloadKey] = []
        again: list[OffloadKey] = []
        for position in out.renamed:
            key = items[position][0]
            if key in self._reading:
                self._rewritten.add(key)
            if key in self._sizes:
                again.append(key)
                continue
            size = self._value_bytes(key)
            self._sizes[key] = size
            self._used += size
            added.append(key)
        if added:
            self.policy.insert(added)
        if again:
            self.policy.touch(again)
        return len(out.renamed)

    def _refusals(
        self,
        items: list[tuple[OffloadKey, memoryview]],
        out: WriteOutcome,
        writing: Admission,
        cause: str,
        room: bool = False,
    ) -> list[tuple[str, str]]:
        """``(code, message)`` per chunk the disk refused; the write gate learns of them.
        ``room``: the tier evicted to fit its file system (`_refit`), so refusals for
        space alone do not back writes off: the next write goes into the room made."""
        refused: list[tuple[str, str]] = []
        full: int | None = None
        space_only = True
        for position, exc in sorted(out.errors.items()):
            code = errno.errorcode.get(exc.errno or 0, "EIO")
            if exc.errno in _REFUSALS:
                refused.append((code, f"{code}: {describe(exc)}"))
                space_only = space_only and exc.errno in _NO_SPACE
                if exc.errno in FULL_ERRNOS:
                    full = position
            else:
                self._counters.error(f"writing a value: {describe(exc)}")
        if full is not None and cause == UNWRITTEN_FAILED:
            # The values after a full disk were not tried: refused alike.
            refused += [refused[-1]] * (len(items) - full - 1)
        if refused and not (room and space_only):
            if self._write_gate.failed(writing):
                logger.warning(
                    "disk tier %s refused %d writes (%s); writes back off, reads go on",
                    self.path,
                    len(refused),
                    refused[0][1],
                )
        elif out.renamed or refused:  # written, or refused for space with room made
            if self._write_gate.succeeded(writing):
                logger.warning("disk tier %s accepts writes again", self.path)
        else:
            self._write_gate.release(writing)
        return refused

    # -- fitting the file system ----------------------------------------------------------

    def _measure_due(self) -> bool:
        """Whether this write measures free space (once a `space_check_s` at most)."""
        now = time.monotonic()
        if now - self._measured_at < self.space_check_s:
            return False
        self._measured_at = now
        return True

    def _fit(self, space: tuple[int, int], quota: bool = False) -> None:
        """Set the effective capacity from ``(free, total)`` bytes of the file system: what
        the tier's files take (its values, and victims still on disk) plus what is free,
        less the reserve, at least one value and at most the configured capacity.
        ``quota``: the disk just refused a write for the user's quota (``EDQUOT``), which
        ``fstatvfs`` does not show: at most what the tier's files take now."""
        free, total = space
        value = self._value_bytes(OffloadKey(bytes(16)))
        own = self._used + value * (len(self._trash) + len(self._unlinking))
        fits = max(value, own + free - max(value, total // 100))
        if quota:
            fits = min(fits, max(value, own))
        before = self.effective_capacity_bytes
        now = self.effective_capacity_bytes = min(self.capacity_bytes, fits)
        if now < self.capacity_bytes <= before:
            logger.warning(
                "disk tier %s: its file system holds %s bytes of values, less than the "
                "configured %s: holding at most that (evicting) until space frees up",
                self.path,
                f"{now:,}",
                f"{self.capacity_bytes:,}",
            )
        elif before < self.capacity_bytes <= now:
            logger.warning(
                "disk tier %s: space freed up, back to its configured capacity (%s bytes)",
                self.path,
                f"{now:,}",
            )

    def _refit(self, space: tuple[int, int], quota: bool = False) -> bool:
        """`_fit`, then evict down to the effective capacity (the victims' files go with
        the next write); whether there is room made that the next write will use (or,
        at a quota, values it may evict: their files take the next values)."""
        self._fit(space, quota)
        need = self._used + self._reserved - self.effective_capacity_bytes
        victims = self._evict(need, _Protected(set(), self._reading, self._writing)) or []
        self._trash.extend(victims)
        return bool(self._trash) or (quota and len(self.policy) > 0)

    # -- the index ------------------------------------------------------------------------

    def _protected(self, items: list[tuple[OffloadKey, memoryview]]) -> _Protected:
        return _Protected({k for k, _ in items}, self._reading, self._writing)

    def _evict(self, need: int, protected: Any) -> list[OffloadKey] | None:
        """Victims that free at least ``need`` bytes, out of the index (None: not possible)."""
        if need <= 0:
            return []
        value = self._value_bytes(OffloadKey(bytes(16)))
        victims = self.policy.evict(math.ceil(need / value), protected)
        if victims is None:
            return None
        for key in victims:
            self._used -= self._sizes.pop(key)
        self._evictions += len(victims)
        self._removed(victims)
        return victims

    def _forget(self, key: OffloadKey) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self._used -= size
            self.policy.remove([key])
            self._removed([key])

    def _removed(self, keys: Sequence[OffloadKey]) -> None:
        if self.on_removed is not None and keys:
            try:
                self.on_removed(keys)
            except Exception:  # an announcement never fails the tier
                logger.exception("disk tier %s: announcing removed values failed", self.path)

    def _take_trash(self) -> list[OffloadKey]:
        trash = [k for k in self._trash if k not in self._sizes and k not in self._writing]
        self._trash.clear()
        return trash

    # -- the async shell ------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ResourceClosedError(f"{self!r} is closed")

    def _limiter(self) -> anyio.CapacityLimiter:
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(self.max_concurrency)
        return self._threads

    async def _take_thread(self) -> None:
        """Wait until fewer than ``max_concurrency`` of this tier's threads live (each
        call's thread gives its place back when it ends, abandoned or not)."""
        delay = 0.0005
        while not self._live.acquire(blocking=False):
            await anyio.sleep(delay)  # only under overload: every thread busy
            delay = min(2 * delay, 0.01)

    async def _run(
        self, work: Callable[[Guard], None], *, plan: Callable[[], None] | None = None
    ) -> tuple[bool, str]:
        """Run ``work(guard)`` in a worker thread within the timeout, unless the tier is
        down; ``plan()`` runs on the loop first, once a thread is ours (never for a call
        answered without I/O). Returns whether the work ran to its end, and why not (an
        ``UNWRITTEN_*`` cause). Counts every outcome.

        At most ``max_concurrency`` threads do this tier's I/O at once, counting the
        threads of calls that timed out and still wait for the disk: a hung disk
        holds its threads, and later calls are busy, not more threads.
        """
        c = self._counters
        admission = self._health.admit()
        if admission is None:
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()  # answered without I/O, but still a checkpoint
            return False, UNWRITTEN_DOWN
        guard = Guard()
        ticket = _Ticket(self._live)
        started = done = False
        failure: BaseException | None = None
        self._in_flight += 1
        try:
            with anyio.move_on_after(self.timeout_s):
                await self._take_thread()
                started = True
                if plan is not None:
                    plan()
                failure = await anyio.to_thread.run_sync(
                    _capture, work, guard, ticket, abandon_on_cancel=True,
                    limiter=self._limiter(),
                )  # fmt: skip
                done = True
        except BaseException:  # cancelled from outside: give the buffers back, then go
            guard.abandon()
            if started:
                ticket.abandon()
            self._health.release(admission)
            raise
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()
        if started and not done:
            ticket.abandon()
        if not done:
            guard.abandon()
            if not started:  # every worker busy for the whole timeout: overload, no fault
                self._health.release(admission)
                c.busy_total += 1
                return False, UNWRITTEN_BUSY
            c.timeouts_total += 1
            self._failed(admission, f"TimeoutError: no answer within {self.timeout_s} s")
            return False, UNWRITTEN_TIMEOUT
        if isinstance(failure, DirectoryGone):
            self._failed(admission, describe(failure))
            if admission is Admission.PROBE:
                await self._recover()
            return False, UNWRITTEN_FAILED
        if failure is not None:
            self._failed(admission, describe(failure))
            return False, UNWRITTEN_FAILED
        c.round_trips_total += 1
        if self._health.succeeded(admission):
            c.reconnects_total += 1
            logger.warning("disk tier %s answers again", self.path)
        return True, UNWRITTEN_FAILED

    async def _recover(self) -> None:
        """The folder is gone (or another): make it again and index what it holds; the
        values the index named and the new folder lacks are lost (announced as removed).
        The next call finds the tier up."""
        before = list(self._sizes)
        try:
            with anyio.move_on_after(self.timeout_s):
                report = await anyio.to_thread.run_sync(self._reopen, abandon_on_cancel=True)
                self._trash.extend(self._adopt(report))
                lost = [key for key in before if key not in self._sizes]
                self._lost += len(lost)
                self._removed(lost)
                self._health.retry_at = 0.0  # due now: the next call probes the new folder
                logger.warning(
                    "disk tier %s: the folder was gone; made again, %d values lost, %d found",
                    self.path,
                    len(lost),
                    len(report.values),
                )
        except (OSError, ConfigError) as exc:
            self._counters.error(f"making the folder again: {describe(exc)}")

    def _reopen(self) -> ScanResult:
        files = self._files
        files.relock()  # the root may be new: hold its lock, or stay down
        files.make_folder()
        report = files.scan()
        self._space_at_open = None if self.read_only else _measure(files)  # a reader: never
        return report

    def _failed(self, admission: Admission, message: str) -> None:
        self._counters.error(message)
        if self._health.failed(admission):
            logger.warning("disk tier %s is down: %s", self.path, message)

    def _capacity_text(self) -> str:
        effective, configured = self.effective_capacity_bytes, self.capacity_bytes
        if effective == configured:
            return f"{configured:,}"
        return f"{effective:,} (of {configured:,} configured)"

    def __repr__(self) -> str:
        c = self._counters
        return (
            f"<DiskTier [{self.state.value}; {self.path}; {len(self._sizes)} values, "
            f"{self._used:,}/{self._capacity_text()} bytes; {c.hits_total} hits, "
            f"{c.misses_total} misses, {c.reads_total} read, {c.writes_total} written, "
            f"{c.rejected_total} rejected, {c.errors_total} errors]>"
        )


def _uncount(counts: dict[OffloadKey, int], keys: Sequence[OffloadKey]) -> None:
    """One call fewer for each of ``keys`` (each counted once by that call)."""
    for key in keys:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]


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


def _fill(future: concurrent.futures.Future[ScanResult], scan: Callable[[], ScanResult]) -> None:
    """Run ``scan`` in its own thread, its result or error into ``future``."""
    try:
        future.set_result(scan())
    except BaseException as exc:  # a ConfigError, or a bug: each caller sees it
        future.set_exception(exc)


def _capture(work: Callable[[Guard], None], guard: Guard, ticket: _Ticket) -> BaseException | None:
    """Run ``work`` in the worker thread; its exception, returned rather than raised."""
    if not ticket.start():
        return None  # the call gave up before this thread began: nothing to do
    try:
        work(guard)
    except (OSError, ConfigError) as exc:
        return exc
    finally:
        ticket.live.release()  # this thread's place, given back when it really ends
    return None


class _Ticket:
    """One call's place among the tier's live threads: given back by its thread when it
    ends, or by the call when it gave up before the thread began."""

    __slots__ = ("live", "lock", "started", "void")

    def __init__(self, live: threading.BoundedSemaphore) -> None:
        self.live = live
        self.lock = threading.Lock()
        self.started = self.void = False

    def start(self) -> bool:
        with self.lock:
            if self.void:
                return False
            self.started = True
            return True

    def abandon(self) -> None:
        with self.lock:
            if not self.started and not self.void:
                self.void = True
                self.live.release()


class _Protected:
    """The keys a write may not evict: its own, and those being read or written now
    (looked up in place: no copy of the tier's in-flight keys per call)."""

    __slots__ = ("batch", "reading", "writing")

    def __init__(
        self, batch: set[OffloadKey], reading: dict[OffloadKey, int], writing: dict[OffloadKey, int]
    ) -> None:
        self.batch, self.reading, self.writing = batch, reading, writing

    def __contains__(self, key: object) -> bool:
        return key in self.batch or key in self.reading or key in self.writing

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.batch | self.reading.keys() | self.writing.keys())


class _WritePlan:
    """What a write chose once a thread was its own (see `DiskTier._write`)."""

    __slots__ = (
        "busy", "items", "made", "measure", "new", "no_room", "reserved", "space", "victims"
    )  # fmt: skip

    def __init__(self) -> None:
        self.made = self.measure = False
        self.space: tuple[int, int] | None = None  # (free, total) bytes, if measured
        self.items: list[tuple[OffloadKey, memoryview]] = []
        self.new: list[OffloadKey] = []
        self.victims: list[OffloadKey] = []
        self.busy = self.no_room = self.reserved = 0


def _measure(files: DiskFiles) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the tier's file system; None where it cannot say."""
    try:
        return files.space()
    except OSError:
        return None


def _with_capacity(snapshot: SecondaryStatistics, **fields: int) -> SecondaryStatistics:
    import msgspec

    return msgspec.structs.replace(snapshot, **fields)
