"""`ThreadCalls`: the one threaded-call helper of the disk and Redis tiers."""

from __future__ import annotations

import threading

import anyio
import pytest

from tiering.errors import ConfigError
from tiering.secondary._threads import CallOutcome, ThreadCalls

pytestmark = pytest.mark.anyio


class Hang:
    """A blocking call that waits until released, counting the threads inside it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.inside = self.most = self.entered = 0

    def __call__(self, value: int = 0) -> int:
        with self.lock:
            self.inside += 1
            self.entered += 1
            self.most = max(self.most, self.inside)
        try:
            self.release.wait(30)
        finally:
            with self.lock:
                self.inside -= 1
        return value


async def test_done_returns_the_value() -> None:
    calls = ThreadCalls(2, 5.0)
    called = await calls.call(lambda a, b: a + b, 2, 3)
    assert called.outcome is CallOutcome.DONE
    assert called.ok
    assert called.value == 5
    assert called.error is None
    assert calls.in_flight == 0


async def test_start_runs_on_the_loop_before_the_thread() -> None:
    calls = ThreadCalls(1, 5.0)
    seen: list[str] = []
    await calls.call(lambda: seen.append("thread"), start=lambda: seen.append("start"))
    assert seen == ["start", "thread"]


async def test_a_captured_error_is_returned() -> None:
    calls = ThreadCalls(1, 5.0)

    def fails() -> None:
        raise FileNotFoundError("gone")

    called = await calls.call(fails)
    assert called.outcome is CallOutcome.DONE
    assert not called.ok
    assert isinstance(called.error, FileNotFoundError)


async def test_other_errors_propagate() -> None:
    calls = ThreadCalls(1, 5.0, capture=(OSError,))

    def bug() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        await calls.call(bug)
    # Its place came back: the next call runs.
    assert (await calls.call(lambda: 1)).value == 1
    assert calls.in_flight == 0


async def test_a_hung_call_times_out_and_its_thread_keeps_its_place() -> None:
    hang = Hang()
    calls = ThreadCalls(1, 0.05)
    try:
        called = await calls.call(hang)
        assert called.outcome is CallOutcome.TIMED_OUT
        # The hung thread still holds the only place: the next call is busy, and
        # ``start`` (where a caller decides its I/O) never runs for it.
        started: list[bool] = []
        called = await calls.call(lambda: 1, start=lambda: started.append(True))
        assert called.outcome is CallOutcome.BUSY
        assert not started
    finally:
        hang.release.set()
    # Once the hung thread ends, its place is free again.
    with anyio.fail_after(5):
        while (called := await calls.call(lambda: 2)).outcome is not CallOutcome.DONE:
            pass
    assert called.value == 2


async def test_the_thread_bound_holds_while_hung_threads_run() -> None:
    hang = Hang()
    calls = ThreadCalls(3, 0.05)
    try:
        outcomes = []
        for _ in range(10):
            outcomes.append((await calls.call(hang)).outcome)
        assert outcomes[:3] == [CallOutcome.TIMED_OUT] * 3
        assert set(outcomes[3:]) == {CallOutcome.BUSY}
        assert hang.entered == 3
        assert hang.most <= 3
    finally:
        hang.release.set()


async def test_concurrent_calls_never_exceed_the_bound() -> None:
    hang = Hang()
    calls = ThreadCalls(2, 5.0)
    results: list[int | None] = []

    async def one(i: int) -> None:
        results.append((await calls.call(hang, i)).value)

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(one, i)
        with anyio.fail_after(5):
            while hang.inside < 2:
                await anyio.sleep(0.001)
        assert hang.most == 2
        hang.release.set()
    assert sorted(r for r in results if r is not None) == list(range(6))
    assert hang.most == 2
    assert calls.in_flight == 0


async def test_a_cancelled_waiter_gives_its_place_back() -> None:
    hang = Hang()
    calls = ThreadCalls(1, 5.0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(calls.call, hang)  # holds the only place
            with anyio.fail_after(5):
                while hang.inside < 1:
                    await anyio.sleep(0.001)
            ran: list[bool] = []

            async def waiter() -> None:
                await calls.call(lambda: ran.append(True))

            with anyio.CancelScope() as scope:  # waits for a place, then is cancelled
                tg.start_soon(waiter)
                await anyio.sleep(0.02)
                scope.cancel()
            tg.cancel_scope.cancel()  # and the one in its thread gives up too
        assert calls.in_flight == 0
    finally:
        hang.release.set()
    # The abandoned hung thread gives its place back when it ends; nothing leaked.
    with anyio.fail_after(5):
        while (called := await calls.call(lambda: 3)).outcome is not CallOutcome.DONE:
            pass
    assert called.value == 3


async def test_a_call_cancelled_while_its_thread_runs_leaves_the_place_to_that_thread() -> None:
    hang = Hang()
    calls = ThreadCalls(1, 5.0)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(calls.call, hang)
            with anyio.fail_after(5):
                while hang.inside < 1:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()  # the caller gives up (anyio's limiter token goes back)
        assert calls.in_flight == 0
        # The thread still runs: it keeps its place, and no second thread starts.
        calls.timeout_s = 0.05
        assert (await calls.call(lambda: 1)).outcome is CallOutcome.BUSY
        assert hang.entered == 1
    finally:
        hang.release.set()
    calls.timeout_s = 5.0
    with anyio.fail_after(5):
        while (called := await calls.call(lambda: 2)).outcome is not CallOutcome.DONE:
            pass
    assert called.value == 2


async def test_cancelled_before_the_thread_began_frees_the_place_at_once() -> None:
    calls = ThreadCalls(1, 5.0)
    with anyio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(anyio.get_cancelled_exc_class()):
            await calls.call(lambda: None)
    assert calls.in_flight == 0
    assert (await calls.call(lambda: 4)).value == 4


async def test_wait_idle_returns_once_calls_end() -> None:
    hang = Hang()
    calls = ThreadCalls(2, 5.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(calls.call, hang)
        with anyio.fail_after(5):
            while hang.inside < 1:
                await anyio.sleep(0.001)
        assert calls.in_flight == 1
        hang.release.set()
        with anyio.fail_after(5):
            await calls.wait_idle()
        assert calls.in_flight == 0
    await calls.wait_idle()  # idle: a checkpoint only


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_concurrency must be a positive integer"):
        ThreadCalls(0, 1.0)
    with pytest.raises(ConfigError, match="max_concurrency"):
        ThreadCalls(True, 1.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ThreadCalls(1, 0)
