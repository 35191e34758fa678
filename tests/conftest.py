from __future__ import annotations

import os
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest


async def turns_during(step: Callable[[], Awaitable[Any]], calls: int) -> int:
    """How many turns a counting task got while ``step()`` was awaited ``calls`` times.

    The test of trio's rule that every ``async`` function of the library is a
    checkpoint: one turn per call on asyncio, at least one per two calls on trio
    (a batch of runnable tasks runs in random order), none without a checkpoint
    (use `yields`).
    """
    turns = 0

    async def count() -> None:
        nonlocal turns
        while True:
            turns += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(count)
        await anyio.lowlevel.checkpoint()  # the counter is running
        before = turns
        for _ in range(calls):
            await step()
        during = turns - before
        tg.cancel_scope.cancel()
    return during


async def yields(step: Callable[[], Awaitable[Any]], calls: int) -> bool:
    """Whether ``step()`` awaited ``calls`` times let another task run (see `turns_during`)."""
    return await turns_during(step, calls) >= calls // 2


def require_binary(name: str, package: str) -> str:
    """The path of a server binary; skips without it, fails in CI (TIERING_REQUIRE_SERVERS).

    ``package`` is the Debian package that ships it, named in the message.
    """
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install {package})"
        if os.environ.get("TIERING_REQUIRE_SERVERS"):
            pytest.fail(f"{message}, and TIERING_REQUIRE_SERVERS is set")
        pytest.skip(message)
    return path


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio."""
    return str(request.param)
