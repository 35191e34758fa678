"""`DiskShell`: the async shell of a `DiskTier`, apart from its contract and its writes.

What every call of the tier goes through, on the event loop: admission by its
health (`HealthGate`: up, down, backing off), the worker thread of its file work
(`tiering.secondary._threads.ThreadCalls`: bounded, timed out, busy), the folder
made again when it went away, the index filled from a scan, and what it shows
(``statistics()``, ``repr``). `tiering.secondary.disk.tier.DiskTier` builds the
parts and adds the contract; its design note says why each is so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec

from tiering._closing import AsyncLifecycle
from tiering._state import ResourceState
from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.secondary._threads import CallOutcome, ThreadCalls, ThreadedTier
from tiering.secondary.base import (
    Guard,
    SecondaryStatistics,
    SecondaryTier,
    TierCounters,
    describe,
)
from tiering.secondary.disk.files import DiskFiles
from tiering.secondary.disk.index import DiskIndex
from tiering.secondary.disk.layout import DirectoryGone, ScanResult, head_bytes
from tiering.secondary.disk.opening import FolderOpening
from tiering.secondary.health import Admission, HealthGate, TierState
from tiering.secondary.refusals import Unwritten

__all__ = ["DiskShell"]

logger = logging.getLogger("tiering.secondary.disk")


class DiskShell(ThreadedTier, SecondaryTier):
    """The parts of a `DiskTier` every call uses (built by `DiskTier.__init__`)."""

    path: Path
    read_only: bool
    _calls: ThreadCalls
    _index: DiskIndex
    _files: DiskFiles
    _opening: FolderOpening
    _life: AsyncLifecycle
    _health: HealthGate
    _write_gate: HealthGate  # refused writes back off on a gate of their own
    _counters: TierCounters
    _measured_at: float  # when a write last measured free space
    _warned_not_regular: bool

    # -- what it shows --------------------------------------------------------------------

    @property
    def state(self) -> TierState | ResourceState:
        """Up or down; ``closed`` once closing."""
        return self._health.state

    @property
    def capacity_bytes(self) -> int:
        """The configured capacity (`effective_capacity_bytes`: what it holds at most now)."""
        return self._index.capacity_bytes

    @property
    def effective_capacity_bytes(self) -> int:
        """What the tier holds at most now: less than configured where its file system
        holds less (see the design note)."""
        return self._index.effective_capacity_bytes

    @property
    def direct_io(self) -> bool:
        """Whether values move with ``O_DIRECT`` (known once open)."""
        return self._opening.direct_io

    @property
    def open_report(self) -> ScanResult | None:
        """What the last scan found (None until open)."""
        return self._opening.report

    @property
    def _sizes(self) -> dict[OffloadKey, int]:  # white box, for tests: the index's sizes
        return self._index.sizes

    @property
    def _used(self) -> int:  # white box, for tests: the index's bytes used
        return self._index.used

    @_used.setter
    def _used(self, value: int) -> None:
        self._index.used = value

    def _adopt(self, report: ScanResult, space: tuple[int, int] | None) -> list[OffloadKey]:
        """Index what a scan found (oldest first), then trim to capacity; the victims,
        whose files the caller deletes (none for a read-only tier)."""
        before = self._index.effective_capacity_bytes
        if space is not None:
            self._measured_at = time.monotonic()
        victims = self._index.adopt(report.values, space)
        self._opening.report = report
        self._capacity_moved(before)
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
        reason = Unwritten.NOT_REGULAR.value
        c.rejected_by_reason[reason] = c.rejected_by_reason.get(reason, 0) + n
        c.last_rejection = f"{reason}: {n} {where}"
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
        if not await self._life.begin_aclose():
            return
        try:
            with anyio.CancelScope(shield=True):
                if self._calls.in_flight:
                    with anyio.move_on_after(self.timeout_s):
                        await self._calls.wait_idle()
                # The scan deletes half-written files: not once the folder is free for another.
                await self._opening.wait_scan(self.timeout_s)
        finally:
            try:
                self._files.unlock()
                self._files.close_folder()
            finally:
                self._life.end_close()  # a later aclose never waits for a close that failed

    def discard(self) -> None:
        """Release the folder now, for a tier that was built and will never be used."""
        self._life.close_now()
        self._files.unlock()
        self._files.close_folder()

    def statistics(self) -> SecondaryStatistics:
        down = self._write_gate.state is TierState.DOWN
        writes = (TierState.BACKING_OFF if down else TierState.UP).value
        snapshot = self._counters.snapshot(self.name, self.state.value, writes)
        index = self._index
        return msgspec.structs.replace(
            snapshot,
            capacity_bytes=index.capacity_bytes,
            effective_capacity_bytes=index.effective_capacity_bytes,
            used_bytes=index.used,
            chunks=len(index),
            evictions_total=index.evictions,
            lost_total=index.lost,
        )

    def _capacity_moved(self, before: int) -> None:
        """One line when the effective capacity left or came back to the configured one."""
        now, configured = self._index.effective_capacity_bytes, self._index.capacity_bytes
        if now < configured <= before:
            logger.warning(
                "disk tier %s: its file system holds %s bytes of values, less than the "
                "configured %s: holding at most that (evicting) until space frees up",
                self.path,
                f"{now:,}",
                f"{configured:,}",
            )
        elif before < configured <= now:
            logger.warning(
                "disk tier %s: space freed up, back to its configured capacity (%s bytes)",
                self.path,
                f"{now:,}",
            )

    def _value_bytes(self, key: OffloadKey) -> int:
        return self.row_bytes + head_bytes(self.codec, key)

    def _removed(self, keys: Sequence[OffloadKey]) -> None:
        if self.on_removed is not None and keys:
            try:
                self.on_removed(keys)
            except Exception:  # an announcement never fails the tier
                logger.exception("disk tier %s: announcing removed values failed", self.path)

    # -- the async shell ------------------------------------------------------------------

    async def _run(
        self, work: Callable[[Guard], None], *, plan: Callable[[], None] | None = None
    ) -> tuple[bool, str]:
        """Run ``work(guard)`` in a worker thread within the timeout, unless the tier is
        down; ``plan()`` runs on the loop first, once a thread is ours (never for a call
        answered without I/O). Returns whether the work ran to its end, and why not (an
        `Unwritten` cause). Counts every outcome."""
        c = self._counters
        admission = self._health.admit()
        if admission is None:
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()  # answered without I/O, but still a checkpoint
            return False, Unwritten.DOWN
        guard = Guard()
        try:
            called = await self._calls.call(work, guard, start=plan)
        except BaseException:  # cancelled from outside: give the buffers back, then go
            guard.abandon()
            self._health.release(admission)
            raise
        if called.outcome is CallOutcome.BUSY:  # every worker busy for the whole timeout
            guard.abandon()
            self._health.release(admission)  # overload, no fault
            c.busy_total += 1
            return False, Unwritten.BUSY
        if called.outcome is CallOutcome.TIMED_OUT:
            guard.abandon()
            c.timeouts_total += 1
            self._failed(admission, f"TimeoutError: no answer within {self.timeout_s} s")
            return False, Unwritten.TIMEOUT
        failure = called.error
        if failure is not None:
            self._failed(admission, describe(failure))
            if isinstance(failure, DirectoryGone) and admission is Admission.PROBE:
                await self._recover()
            return False, Unwritten.FAILED
        c.round_trips_total += 1
        if self._health.succeeded(admission):
            c.reconnects_total += 1
            logger.warning("disk tier %s answers again", self.path)
        return True, Unwritten.FAILED

    async def _recover(self) -> None:
        """The folder is gone (or another): make it again and index what it holds; the
        values the index named and the new folder lacks are lost (announced as removed).
        The next call finds the tier up."""
        index = self._index
        before = list(index.sizes)
        try:
            with anyio.move_on_after(self.timeout_s):
                report, space = await self._opening.reopen()
                index.trash.extend(self._adopt(report, space))
                lost = [key for key in before if key not in index]
                index.lost += len(lost)
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
            f"<DiskTier [{self.state.value}; {self.path}; {len(self._index)} values, "
            f"{self._index.used:,}/{self._capacity_text()} bytes; {c.hits_total} hits, "
            f"{c.misses_total} misses, {c.reads_total} read, {c.writes_total} written, "
            f"{c.rejected_total} rejected, {c.errors_total} errors]>"
        )
