"""`DiskTier`: a persistent local-disk tier that manages its own capacity and survives restarts.

A `SecondaryTier` over one folder of a local file system (an NVMe, say): one
file per chunk, self-checking as Redis values are (`tiering.secondary.codec`:
format, namespace, key, length, checksum), in the layout
`tiering.secondary.disk.layout` describes. Three parts: the index
(`tiering.secondary.disk.index`: what the tier holds, its capacity, each
write's plan; no I/O), the file work (`tiering.secondary.disk.files`, in
worker threads) and this shell, on the event loop, which admits each call,
runs its file work through `tiering.secondary._threads.ThreadCalls` and
reports back to the index. Opening and recovering the folder:
`tiering.secondary.disk.opening`. Measured speeds: README.md, "Disk tier: speed".

Design note:

- **Capacity.** The tier never holds more than ``capacity_bytes`` of value
  files. A write that needs room evicts by a `tiering.policies` policy first
  (the engine's default unless told), tail before head as in the CPU tier, and
  reuses the victims' files for the new values (cheaper than making new ones)
  or deletes them, before it writes. A call evicts only once a worker thread
  is its own: one answered without I/O (down, busy) evicts nothing.
- **A file system smaller than the capacity.** The tier holds at most its
  *effective* capacity: the configured one, or less where its file system
  cannot hold that (`DiskIndex.fit`: what the tier's files take now plus what
  is free, less a reserve left for the file system's own needs and other
  writers, so that a full disk is found by measuring, not by a failed write).
  It is measured at open (a folder found fuller than that is trimmed there,
  oldest values first, so a second run on a full folder writes new values), by
  a write every `SPACE_CHECK_S` at most, and at each write the disk refused for
  space (``ENOSPC``, ``EDQUOT``; a short write at the end of the file system is
  one). Lowered, the tier evicts down to it and goes on writing (into the
  victims' files): that refusal does not back off writes unless nothing could
  be evicted. It rises again, up to the configured capacity, as space frees
  up. ``statistics()`` reports both. A user quota (``EDQUOT``) is not in
  ``fstatvfs``: refused for it, the tier holds at most what its files take then
  (evicting into their files) until its next measure.
- **Restarts.** Opening (`open`, or the first call, which waits for it at most
  its timeout, then answers busy) rebuilds the index from a scan of the files'
  heads in a thread of its own, oldest use first (a read sets a file's time):
  every value a previous process wrote is found, whole; half-written ones
  (temporary names) and ones that fail a check are deleted and counted
  (`open_report`). The payload's checksum is checked at each read, not at the
  scan, which reads only each value's head: a value that rots later is caught
  where it matters. An index file was not kept: it would have to be checked
  against the files anyway.
- **Crash safety.** A value is written under a temporary name and renamed into
  place: it is visible whole or not at all. ``fsync`` says what survives a
  power loss (`FSYNC_POLICIES`); a value whose data did not reach the disk
  fails its length or checksum and is never loaded.
- **Its folder only.** Every name is used relative to the folder held open
  (``openat``-style, ``O_NOFOLLOW``, reads ``O_NONBLOCK``, ``fstat`` checked to
  be a regular file), its 256 shard folders opened once each and held: the
  folder's contents are never trusted to be what the tier made.
- **One owner.** The folder is locked (``flock``) by the process that opens it;
  another gets a `ConfigError` naming the holder, unless it opens read-only (no
  lock, no writes, nothing deleted).
- **I/O off the event loop.** Every call is one job in a worker thread (at most
  ``max_concurrency`` threads live, counting those a hung disk still holds
  after their calls timed out; a call that finds none free within its timeout
  is *busy*: `ThreadCalls`). Reads land straight in the caller's row
  (``preadv`` after the head was checked); with ``O_DIRECT`` (probed at open;
  by default for writes of rows of `DIRECT_WRITE_MIN` or more) an aligned row
  moves between memory and disk with no copy. Buffers are touched only under
  the call's `Guard`, so a call that times out or is cancelled has its buffers
  back at once (an abandon waits for at most one row's read or write in
  progress).
- **Faults.** A full disk (``ENOSPC``, ``EDQUOT``), a read-only or forbidden
  folder (``EROFS``, ``EACCES``, ``EPERM``) refuse writes (counted by code;
  writes back off, reads go on; a full disk lowers the effective capacity
  instead, where evicting makes room; `tiering.secondary.refusals` says which
  errno means what); a value deleted or truncated behind the tier's back is a
  counted miss (``lost_total``, a rejection) and leaves the index; the folder
  removed (or replaced) takes the tier down: calls are misses without I/O until
  the retry time, when the folder is made again and the index rebuilt from what
  is in it. Nothing wrong is ever loaded.
- **Hints.** A retention hint (`tiering.hints`) a write carries, or `hint`
  applies, steers the index's evictions (`tiering.secondary.disk.index`):
  released values go first, retained ones are spared until their deadline
  within ``hint_share`` of the capacity. Held in memory, not in the files.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel

from tiering._checks import check_int, is_int
from tiering._closing import AsyncLifecycle
from tiering._types import Medium, OffloadKey
from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.policies import CachePolicy
from tiering.policies.hints import DEFAULT_HINT_SHARE
from tiering.secondary._threads import ThreadCalls
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import (
    Guard,
    Locality,
    ReadItem,
    TierCounters,
    WriteItem,
    describe,
)
from tiering.secondary.checksum import Checksum
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, payload_row, writable_row
from tiering.secondary.disk.files import DiskFiles
from tiering.secondary.disk.index import DiskIndex, WritePlan
from tiering.secondary.disk.layout import (
    FSYNC_POLICIES,
    ReadOutcome,
    ScanResult,
    WriteOutcome,
)
from tiering.secondary.disk.opening import DIRECT_WRITE_MIN, FolderOpening, measure
from tiering.secondary.disk.shell import DiskShell
from tiering.secondary.health import Admission, HealthGate
from tiering.secondary.refusals import Fault, Unwritten, errno_fault

__all__ = ["DEFAULT_FILE_MODE", "DIRECT_WRITE_MIN", "SPACE_CHECK_S", "DiskTier"]

logger = logging.getLogger("tiering.secondary.disk")

#: Why chunks were not written, beyond the contract's causes (`Unwritten`'s members).
UNWRITTEN_NO_ROOM = Unwritten.NO_ROOM  # every value the tier holds is being read or written
UNWRITTEN_READ_ONLY = Unwritten.READ_ONLY

#: The mode of the tier's new files (its new folders: 0o700): its own user's alone, as
#: values hold users' prompts. ``file_mode`` widens it for a group that shares the tier.
DEFAULT_FILE_MODE = 0o600

#: Seconds between two measures of the file system's free space by writes (at most one
#: a period; refusals for space and opening measure at once). A measure is one
#: ``fstatvfs``.
SPACE_CHECK_S = 1.0


def _check_file_mode(mode: object) -> int:
    """``mode`` if it is a permission mode from 0o600 to 0o777 (else one line that says so,
    shown in octal)."""
    try:
        return check_int("file_mode", mode, minimum=0o600, maximum=0o777)
    except ConfigError:
        shown = format(mode, "#o") if is_int(mode) else repr(mode)
        raise ConfigError(
            f"file_mode must be a permission mode from 0o600 to 0o777 that lets the owner "
            f"read and write (0o600 by default; 0o640 or 0o660 to share with a group), "
            f"got {shown}"
        ) from None


class DiskTier(DiskShell):
    """A `SecondaryTier` of value files in the folder ``path``, at most ``capacity_bytes``.

    ``namespace`` is the engine's (`RemoteNamespace.from_config`); values of
    other namespaces in the same folder are left alone. ``policy`` orders
    evictions (a name or a `CachePolicy`). ``fsync``: ``none``, ``data`` or
    ``full`` (see `FSYNC_POLICIES`). ``direct_io``: ``None`` (the default)
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
    gets one warning line at open, and is left as it is. ``hint_share`` is the
    share of the capacity retained values may hold, spared from evictions
    (`tiering.policies.hints`).
    """

    name = "disk"
    label = "disk"
    medium = Medium.STORAGE
    locality = Locality.LOCAL
    write_concurrency = 2  # a write's file work overlaps the next one's hand-off
    honours_hints = True
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
        hint_share: float = DEFAULT_HINT_SHARE,
    ) -> None:
        file_mode = _check_file_mode(file_mode)
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        self._calls = ThreadCalls(max_concurrency, timeout_s, capture=(OSError, ConfigError))
        self.codec = ChunkCodec(namespace, checksum, auth_key)
        capacity_bytes = check_int("capacity_bytes", capacity_bytes)
        self._index = DiskIndex(
            policy, capacity_bytes, self._value_bytes, self._removed, hint_share=hint_share
        )
        self.policy = self._index.policy
        value = self._index.unit
        if capacity_bytes < value:
            raise ConfigError(
                f"capacity_bytes={capacity_bytes:,} holds no value: one chunk takes "
                f"{value:,} bytes on disk (its row and a 4 KiB head); give at least that"
            )
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"the disk tier folder {self.path} is a file, not a folder")
        self._measured_at = -float("inf")  # when a write last measured free space
        self.read_only = read_only
        self.touch_reads = touch_reads
        self._files = DiskFiles(
            self.path, self.codec, fsync=fsync, direct=False, read_only=read_only,
            file_mode=file_mode,
        )  # fmt: skip
        self._life = AsyncLifecycle(f"the disk tier {self.path}", opened=True)
        self._health = HealthGate(backoff_s, life=self._life)
        # Refused writes back off on a gate of their own: reads go on meanwhile.
        self._write_gate = HealthGate(backoff_s, life=self._life)
        if not read_only:
            self._files.lock()  # last: a bad option raised above leaves the folder free
        self._counters = TierCounters()
        self._opening = FolderOpening(self._files, direct_io, read_only)
        self._warned_not_regular = False

    # -- life -------------------------------------------------------------------------

    async def open(self) -> ScanResult:
        """Scan the folder and build the index, however long the scan takes (once; later
        calls return the same report). Calls made before it ends wait for it at most
        their timeout, then answer as busy."""
        self._life.check_open()
        await self._ensure_open(timeout=None)
        report = self._opening.report
        assert report is not None
        return report

    async def _ensure_open(self, timeout: float | None = -1.0) -> bool:
        """Whether the index is built; waits for the scan (started on first need, in a
        thread of its own) at most ``timeout`` (the tier's, by default; None: for ever).
        Always a checkpoint; a scan that failed raises its `ConfigError` to each caller."""
        opening = self._opening
        if opening.report is not None:
            await anyio.lowlevel.checkpoint()
            return True
        # Raises the scan's ConfigError, if any, to each caller.
        found = await opening.scanned(self.timeout_s if timeout == -1.0 else timeout)
        if found is None:
            return False
        if opening.report is None:
            victims = self._adopt(*found)
            # Over capacity (it was lowered): delete the oldest now; the next write
            # deletes what is left.
            if victims and not await opening.remove(victims, self.timeout_s):
                self._index.trash.extend(victims)
        return True

    # -- the contract ---------------------------------------------------------------------

    async def _scanned(self, count: int) -> bool:
        """Whether a lookup or read of ``count`` values goes on: some asked for, and the
        folder scanned (else counted busy). Always a checkpoint."""
        if not count:
            await anyio.lowlevel.checkpoint()
            return False
        if not await self._ensure_open():
            self._counters.busy_total += 1  # still scanning the folder
            return False
        return True

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._life.check_open()
        c = self._counters
        c.contains_calls += 1
        if not await self._scanned(len(keys)):
            return c.found([False] * len(keys))
        ok, _ = await self._run(lambda guard: self._files.check_folder())
        if not ok:
            return c.found([False] * len(keys))
        index = self._index
        return c.found([key in index for key in keys])

    async def write(self, items: Sequence[WriteItem]) -> int:
        return await self._write_items(items, None)

    async def write_hinted(self, items: Sequence[WriteItem], hint: Hint) -> int:
        return await self._write_items(items, hint)

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> int:
        self._life.check_open()
        if not await self._scanned(len(keys)) or hint.empty:  # a checkpoint either way
            return 0
        applied = self._index.hint(keys, hint)
        self._counters.hinted_total += applied
        return applied

    async def _write_items(self, items: Sequence[WriteItem], hint: Hint | None) -> int:
        self._life.check_open()
        rows = [(key, payload_row(row, self.row_bytes)) for key, row in items]
        c = self._counters
        c.write_calls += 1
        if not rows:
            await anyio.lowlevel.checkpoint()
            return 0
        try:
            opened = await self._ensure_open()
        except BaseException:
            c.written(0, len(rows), self.row_bytes, cause=Unwritten.CANCELLED)
            raise
        if not opened:
            c.busy_total += 1  # still scanning the folder
            return c.written(0, len(rows), self.row_bytes, cause=Unwritten.BUSY)
        if self.read_only:
            await anyio.lowlevel.checkpoint()
            return c.written(0, len(rows), self.row_bytes, cause=Unwritten.READ_ONLY)
        writing = self._write_gate.admit()
        if writing is None:  # the disk refused writes just before: not due to try again
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()
            return c.written(0, len(rows), self.row_bytes, cause=Unwritten.BACKING_OFF)
        return await self._write(rows, writing, hint)

    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        self._life.check_open()
        views = [(key, writable_row(buffer, self.row_bytes)) for key, buffer in items]
        c = self._counters
        c.read_calls += 1
        if not await self._scanned(len(views)):
            c.read_misses_total += len(views)
            return [False] * len(views)
        index = self._index
        held = [i for i, (key, _) in enumerate(views) if key in index]
        filled = [False] * len(views)
        c.read_misses_total += len(views) - len(held)  # not held: answered from the index
        if not held:
            await anyio.lowlevel.checkpoint()
            return filled
        wanted = [views[i] for i in held]
        keys = [key for key, _ in wanted]
        index.begin_read(keys)
        out = ReadOutcome(len(wanted))
        try:
            await self._run(lambda guard: self._files.read(guard, wanted, out, self.touch_reads))
        finally:
            # A write of a key that landed while it was read made a new file: what the
            # read found wrong with the old one says nothing of it.
            fresh = index.end_read(keys)
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
                index.forget(key)  # its file is deleted: never offered again
        for position in out.vanished:
            c.read_misses_total += 1
            if keys[position] not in fresh:
                index.lose(keys[position])
        for exc in out.errors.values():
            c.read_misses_total += 1
            c.error(f"reading a value: {describe(exc)}")
        if out.not_regular:  # a rejection, as a value that fails a check; its entry stays
            self._not_regular(len(out.not_regular), "read")
            for position in out.not_regular:
                if keys[position] not in fresh:
                    index.forget(keys[position])
        index.touch(good)
        return filled

    # -- writes ---------------------------------------------------------------------------

    async def _write(
        self, rows: list[tuple[OffloadKey, memoryview]], writing: Admission, hint: Hint | None
    ) -> int:
        plans: list[WritePlan] = []  # the one plan, made once a worker thread is ours
        out = WriteOutcome()

        def plan() -> None:
            plans.append(self._index.plan_write(rows, measure=self._measure_due()))

        def work(guard: Guard) -> None:
            chosen = plans[0]
            self._files.write(guard, chosen.victims, chosen.items, out)
            space_refused = (errno_fault(e.errno) is Fault.NO_SPACE for e in out.errors.values())
            if chosen.measure or any(space_refused):
                chosen.space = measure(self._files)

        cause: str = Unwritten.CANCELLED
        try:
            _, cause = await self._run(work, plan=plan)
        finally:
            if not plans:  # no I/O: nothing chosen, nothing evicted
                self._write_gate.release(writing)
                written = self._counters.written(0, len(rows), self.row_bytes, cause=cause)
            else:
                written = self._settle(plans[0], out, writing, cause, hint)
        return written

    def _settle(
        self, plan: WritePlan, out: WriteOutcome, writing: Admission, cause: str, hint: Hint | None
    ) -> int:
        c = self._counters
        index = self._index
        before = index.effective_capacity_bytes
        settled = index.settle(plan, out)
        index.written([plan.items[p][0] for p in out.renamed], hint)
        if hint is not None and not hint.empty:
            c.hinted_total += settled.written
        if out.not_regular:
            self._not_regular(out.not_regular, "written or evicted")
        self._capacity_moved(before)
        refused = self._refusals(plan.items, out, writing, cause, settled.room)
        offered = len(plan.items) - out.blocked
        c.written(settled.written, offered, self.row_bytes, cause=cause, refused=refused)
        for reason, n in (
            (Unwritten.BUSY, plan.busy),
            (Unwritten.NO_ROOM, plan.no_room),
            (Unwritten.NOT_REGULAR, out.blocked),  # a link where the value or its shard belongs
        ):
            if n:  # not written for reasons of their own: counted under them
                c.write_errors_total += n
                by_reason = c.write_errors_by_reason
                by_reason[reason.value] = by_reason.get(reason.value, 0) + n
        return settled.written

    def _refusals(
        self,
        items: list[tuple[OffloadKey, memoryview]],
        out: WriteOutcome,
        writing: Admission,
        cause: str,
        room: bool = False,
    ) -> list[tuple[str, str]]:
        """``(code, message)`` per chunk the disk refused; the write gate learns of them.
        ``room``: the tier evicted to fit its file system (`DiskIndex.refit`), so refusals
        for space alone do not back writes off: the next write goes into the room made."""
        refused: list[tuple[str, str]] = []
        stopped: int | None = None
        space_only = True
        for position, exc in sorted(out.errors.items()):
            code = errno.errorcode.get(exc.errno or 0, "EIO")
            fault = errno_fault(exc.errno)
            if fault.refused:
                refused.append((code, f"{code}: {describe(exc)}"))
                space_only = space_only and fault is Fault.NO_SPACE
                if fault.stops:
                    stopped = position
            else:
                self._counters.error(f"writing a value: {describe(exc)}")
        if stopped is not None and cause == Unwritten.FAILED:
            # The values after a full disk were not tried: refused alike.
            refused += [refused[-1]] * (len(items) - stopped - 1)
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

    def _measure_due(self) -> bool:
        """Whether this write measures free space (once a `space_check_s` at most)."""
        now = time.monotonic()
        if now - self._measured_at < self.space_check_s:
            return False
        self._measured_at = now
        return True
