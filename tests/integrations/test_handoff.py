"""`Handoff`: calls handed to an event loop's thread from another, never waiting for it."""

from __future__ import annotations

import concurrent.futures
import threading
from importlib.util import find_spec

import anyio
import anyio.from_thread
import pytest

from tiering.integrations.vllm.handoff import Handoff

BACKENDS = [
    "asyncio",
    pytest.param(
        "trio", marks=pytest.mark.skipif(find_spec("trio") is None, reason="no trio here")
    ),
]


async def echo(value: int) -> int:
    await anyio.lowlevel.checkpoint()
    return value


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_submit_returns_at_once_while_the_loop_is_busy_and_the_call_runs_after(backend):
    with anyio.from_thread.start_blocking_portal(backend) as portal:
        handoff = Handoff()
        portal.start_task(handoff.run)
        busy, release = threading.Event(), threading.Event()
        held: list[bool] = []

        async def hog() -> None:
            busy.set()
            # The loop's thread blocks until the test releases it (a submit that waited for
            # the loop, as a portal's start_task_soon does, would keep it blocked 10 s).
            held.append(release.wait(10))
            await anyio.lowlevel.checkpoint()

        portal.start_task_soon(hog)
        assert busy.wait(5)
        futures = [handoff.submit(echo, i) for i in range(100)]
        none_ran = not any(f.done() for f in futures)  # the loop was blocked throughout
        release.set()
        assert none_ran
        assert [f.result(timeout=5) for f in futures] == list(range(100))
        assert held == [True]  # released by the test, not by its timeout
        portal.call(handoff.close)


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_leaves_no_call_pending_and_a_later_submit_is_cancelled(backend):
    with anyio.from_thread.start_blocking_portal(backend) as portal:
        handoff = Handoff()
        portal.start_task(handoff.run)

        async def blocked() -> int:
            await anyio.sleep(30)
            return 1

        running = handoff.submit(blocked)
        assert handoff.submit(echo, 2).result(timeout=5) == 2
        portal.call(handoff.close)  # cancels the call still running
        with pytest.raises(BaseException) as raised:  # noqa: PT011
            running.result(timeout=5)
        assert "Cancel" in type(raised.value).__name__  # asyncio's or trio's
        late = handoff.submit(echo, 3)
        assert late.cancelled()
        portal.call(handoff.close)  # again: nothing to do


def test_a_call_that_raises_sets_its_future_and_the_handoff_goes_on():
    async def boom() -> None:
        await anyio.lowlevel.checkpoint()
        raise ValueError("boom")

    with anyio.from_thread.start_blocking_portal() as portal:
        handoff = Handoff()
        portal.start_task(handoff.run)
        failed = handoff.submit(boom)
        with pytest.raises(ValueError, match="boom"):
            failed.result(timeout=5)
        assert handoff.submit(echo, 4).result(timeout=5) == 4
        done, _ = concurrent.futures.wait([failed], timeout=0)
        assert done == {failed}
        portal.call(handoff.close)
