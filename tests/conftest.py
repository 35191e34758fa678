from __future__ import annotations

import os
import shutil

import pytest


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
