"""`AsyncLifecycle`: `tiering._state.Lifecycle` for objects closed by an ``async`` call.

The one addition is the wait: a second ``aclose`` while the first is still
closing returns only once the object is ``CLOSED``; a later one is a checkpoint.
Every path of `begin_aclose` is a checkpoint (trio's rule), and the path that
hands the close to its caller is one that no cancellation interrupts, so a
cancelled task still closes what it owns::

    async def aclose(self) -> None:
        if not await self._life.begin_aclose():
            return
        try:
            ...  # stop what runs, release what is held
        finally:
            self._life.end_close()
"""

from __future__ import annotations

import anyio
import anyio.lowlevel

from tiering._state import Lifecycle, ResourceState

__all__ = ["AsyncLifecycle"]


class AsyncLifecycle(Lifecycle):
    """A `Lifecycle` whose close can be awaited (`begin_aclose`, `wait_closed`)."""

    __slots__ = ("_closed_event",)

    def __init__(self, what: str, *, opened: bool = False) -> None:
        super().__init__(what, opened=opened)
        self._closed_event: anyio.Event | None = None  # made by the first waiter

    async def begin_aclose(self) -> bool:
        """True for the one caller that must now close the object; a caller after it
        waits until it is ``CLOSED`` and gets False. Always a checkpoint."""
        if self.begin_close():
            await anyio.lowlevel.cancel_shielded_checkpoint()
            return True
        await self.wait_closed()
        return False

    async def wait_closed(self) -> None:
        """Return once the object is ``CLOSED`` (a checkpoint even when it is)."""
        if self.state is ResourceState.CLOSED:
            await anyio.lowlevel.checkpoint()
            return
        if self._closed_event is None:
            event = anyio.Event()
            self._closed_event = event
            self.when_closed(event.set)
        await self._closed_event.wait()
