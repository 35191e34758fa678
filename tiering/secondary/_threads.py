"""`ThreadCalls`: blocking calls in worker threads, bounded, timed out (layer 4).

The disk and the Redis tiers do their I/O in blocking calls (file system calls,
sockets) that run in worker threads so that the event loop never waits on a
device. Each call goes the same way, and this is that way, written once::

    admit --(a thread of ours free within the timeout?)--no--> BUSY
      |yes
      start() on the loop, then fn(*args) in the thread
      |--(ends within the timeout)--> DONE: its value, or the error it raised
      '--(does not)-----------------> TIMED_OUT (the thread goes on alone)

Design note: why a semaphore of our own, and not only anyio's limiter.
``anyio.to_thread.run_sync(..., abandon_on_cancel=True)`` gives its
`anyio.CapacityLimiter` token back as soon as the waiting task gives up, while
the thread itself still waits for a hung disk or socket. A limiter alone
therefore bounds *waiting tasks*, not *threads*: every timed-out call would
leave one more thread behind, and a hung device would take as many threads as
calls were made. Here a call holds a place in a `threading.BoundedSemaphore`
(``max_threads`` places) from before its thread starts until that thread ends,
abandoned or not; the place is given back by the thread itself (or by the call,
when it gave up before its thread began, which then does nothing). So at most
``max_threads`` threads do a tier's work at once, counting those a hung device
still holds, and calls made meanwhile answer *busy* instead of piling up
threads. Waiting for a place polls (a few ms apart, only while every place is
held): the place is released by a thread, which cannot set an anyio event.

What the caller keeps: what the outcomes mean for its health (`HealthGate`),
its counters, its buffers (a `Guard` it hands to ``fn`` and abandons on
``TIMED_OUT`` or cancellation). A call cancelled from outside raises as any
checkpoint does, with its place given back (or left to its thread).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from tiering._checks import check_int, check_real

__all__ = ["CallOutcome", "Called", "ThreadCalls", "ThreadedTier"]

T = TypeVar("T")

#: The longest wait between two looks for a free place, in seconds (only under
#: overload: every place held).
_POLL_MAX_S = 0.01


class CallOutcome(enum.Enum):
    """How one call ended."""

    DONE = "done"  # the thread ran ``fn`` to its end (its value, or its error)
    BUSY = "busy"  # no place free within the timeout: nothing ran (overload, no fault)
    TIMED_OUT = "timed out"  # the thread did not end within the timeout (it goes on)


class Called(Generic[T]):
    """What `ThreadCalls.call` returns: the outcome, and for ``DONE`` the value that ``fn``
    returned or the error (one of the ``capture`` types) it raised."""

    __slots__ = ("error", "outcome", "value")

    def __init__(
        self, outcome: CallOutcome, value: T | None = None, error: BaseException | None = None
    ) -> None:
        self.outcome = outcome
        self.value = value
        self.error = error

    @property
    def ok(self) -> bool:
        """Done, without an error."""
        return self.outcome is CallOutcome.DONE and self.error is None

    def __repr__(self) -> str:
        detail = f", error={self.error!r}" if self.error is not None else ""
        return f"<Called {self.outcome.value}{detail}>"


class _Ticket:
    """One call's place among the live threads: given back by its thread when it ends,
    or by the call when it gave up before the thread began."""

    __slots__ = ("live", "lock", "started", "void")

    def __init__(self, live: threading.BoundedSemaphore) -> None:
        self.live = live
        self.lock = threading.Lock()
        self.started = self.void = False

    def start(self) -> bool:
        """In the thread: whether to run (False: the call gave up first)."""
        with self.lock:
            if self.void:
                return False
            self.started = True
            return True

    def abandon(self) -> None:
        """On the loop: the call gives up; the place goes back now if no thread began."""
        with self.lock:
            if not self.started and not self.void:
                self.void = True
                self.live.release()


class ThreadCalls:
    """Blocking calls of one tier in at most ``max_threads`` live threads, each bounded by
    ``timeout_s`` (its wait for a place included).

    ``timeout_s`` may be ``inf`` (no deadline). ``capture``: the exception types a
    call returns as `Called.error` (expected faults of the device, such as
    ``OSError``); any other exception raised by ``fn`` propagates to the caller.
    """

    __slots__ = ("_idle", "_limiter", "_live", "capture", "in_flight", "max_threads", "timeout_s")

    def __init__(
        self,
        max_threads: int,
        timeout_s: float,
        *,
        capture: tuple[type[BaseException], ...] = (OSError,),
    ) -> None:
        check_real("timeout_s", timeout_s, minimum=0.0, inclusive=False, infinite=True)
        self.max_threads = check_int("max_concurrency", max_threads, minimum=1)
        self.timeout_s = timeout_s  # as given: messages show it so ("within 5 s")
        self.capture = capture
        #: Calls between admission and their answer (waiting for a place or a thread).
        self.in_flight = 0
        self._live = threading.BoundedSemaphore(self.max_threads)  # threads doing work
        self._limiter: anyio.CapacityLimiter | None = None  # made on the loop, at first use
        self._idle: anyio.Event | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The anyio limiter of this tier's threads (not anyio's default one), for its other
        thread work (connecting, closing), which the bound on live threads leaves alone."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_threads)
        return self._limiter

    async def call(
        self,
        fn: Callable[..., T],
        *args: object,
        start: Callable[[], None] | None = None,
    ) -> Called[T]:
        """Run ``fn(*args)`` in a worker thread within the timeout. ``start()`` runs on the
        loop once a place is ours, just before the thread is asked for (never for a call
        answered ``BUSY``): where a caller decides what the I/O will be. Always a
        checkpoint."""
        ticket = _Ticket(self._live)
        started = done = False
        result: tuple[T | None, BaseException | None] = (None, None)
        self.in_flight += 1
        try:
            with anyio.move_on_after(self.timeout_s):
                await self._take_place()
                started = True
                if start is not None:
                    start()
                result = await anyio.to_thread.run_sync(
                    self._in_thread, fn, args, ticket, abandon_on_cancel=True,
                    limiter=self.limiter,
                )  # fmt: skip
                done = True
        except BaseException:  # cancelled from outside (or ``fn`` raised): place handled
            if started and not done:
                ticket.abandon()
            raise
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._idle is not None:
                self._idle.set()
        if not started:
            return Called(CallOutcome.BUSY)
        if not done:
            ticket.abandon()
            return Called(CallOutcome.TIMED_OUT)
        value, error = result
        return Called(CallOutcome.DONE, value, error)

    async def wait_idle(self) -> None:
        """Return once no call is in flight (calls that timed out are not: their threads
        may still run). Always a checkpoint; the caller bounds and shields it."""
        if not self.in_flight:
            await anyio.lowlevel.checkpoint()
            return
        if self._idle is None or self._idle.is_set():
            self._idle = anyio.Event()
        await self._idle.wait()

    async def _take_place(self) -> None:
        """Wait until fewer than ``max_threads`` threads live (each gives its place back
        when it ends, abandoned or not)."""
        delay = 0.0005
        while not self._live.acquire(blocking=False):
            await anyio.sleep(delay)  # only under overload: every place held
            delay = min(2 * delay, _POLL_MAX_S)

    def _in_thread(
        self, fn: Callable[..., T], args: tuple[object, ...], ticket: _Ticket
    ) -> tuple[T | None, BaseException | None]:
        """In the worker thread: ``fn(*args)``, a captured error returned, not raised."""
        if not ticket.start():
            return None, None  # the call gave up before this thread began: nothing to do
        try:
            return fn(*args), None
        except self.capture as exc:
            return None, exc
        finally:
            ticket.live.release()  # this thread's place, given back when it really ends

    def __repr__(self) -> str:
        return f"<ThreadCalls [{self.in_flight} calls; at most {self.max_threads} threads]>"


class ThreadedTier:
    """What a tier whose blocking I/O runs through its `ThreadCalls` (``_calls``) shows of
    them: the disk tier's and the Redis tier's one view of the one bound."""

    _calls: ThreadCalls

    @property
    def timeout_s(self) -> float:
        """Seconds each call may take (its wait for a thread included)."""
        return self._calls.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._calls.timeout_s = value

    @property
    def max_concurrency(self) -> int:
        """Threads that may do this tier's I/O at once (hung ones included)."""
        return self._calls.max_threads
