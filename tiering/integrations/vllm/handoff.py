"""`Handoff`: calls handed from a thread to an event loop's thread without waiting.

anyio's ``BlockingPortal.start_task_soon`` waits until the loop's thread has
taken the call (it runs ``start_soon`` there and waits for that): under vLLM's
scheduler thread, with the GIL shared with the loop threads, each wait cost
about 2 ms, once per tier adapter per job (N at tensor-parallel size N).
`Handoff.submit` puts the call on a thread-safe queue and wakes the loop
without waiting (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``);
one long-lived task on the loop (`Handoff.run`, started once in the portal)
takes what was queued and starts each call in its task group.

Each call's outcome is a ``concurrent.futures.Future`` as the portal's is: it
can be waited on from any thread, and cancelled before it started. `close` (on
the loop) stops taking calls: a call submitted after it, or queued and not yet
started, is cancelled, never left pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel

__all__ = ["Handoff"]

_T = TypeVar("_T")
_Call = tuple[Callable[..., Awaitable[Any]], tuple[Any, ...], "concurrent.futures.Future[Any]"]


def _soon_from_thread() -> Callable[[Callable[[], None]], object]:
    """The running loop's way to run a callback on it from another thread, not waiting."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: anyio's only other backend
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


class Handoff:
    """Calls handed to one event loop's thread from others (see the module docstring)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()  # a submit and `close` do not interleave
        self._wake: Callable[[], object] | None = None  # None: not running (yet, or any more)
        self._wakeup = anyio.Event()
        self._scope: anyio.CancelScope | None = None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Start each call handed over, until `close`: on the loop, as long as it runs."""
        soon = _soon_from_thread()
        async with anyio.create_task_group() as tasks:
            self._scope = tasks.cancel_scope
            with self._lock:
                self._wake = lambda: soon(self._set)
            task_status.started()
            while True:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                while True:
                    try:
                        func, args, future = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    tasks.start_soon(_settle, func, args, future)

    def _set(self) -> None:
        self._wakeup.set()  # on the loop

    def submit(
        self, func: Callable[..., Awaitable[_T]], *args: Any
    ) -> concurrent.futures.Future[_T]:
        """Start ``await func(*args)`` on the loop soon; returns at once."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._wake is None:
                future.cancel()
                return future
            self._calls.put((func, args, future))
            self._wake()
        return future

    def close(self) -> None:
        """Stop taking calls (on the loop): those still queued are cancelled, the calls
        running too (wait for them first to let them end). Idempotent."""
        with self._lock:
            self._wake = None
        if self._scope is not None:
            self._scope.cancel()
        while True:
            try:
                _, _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            future.cancel()


async def _settle(
    func: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    future: concurrent.futures.Future[Any],
) -> None:
    if not future.set_running_or_notify_cancel():
        await anyio.lowlevel.checkpoint()
        return
    try:
        result = await func(*args)
    except BaseException as exc:
        future.set_exception(exc)
        if not isinstance(exc, Exception):
            raise  # a cancellation goes on
    else:
        future.set_result(result)
