"""Rigs for the event tests: loopback endpoints and publishers that are always closed.

Test modules reach these through fixtures, never by importing this file.
"""

from __future__ import annotations

import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tiering.events import KVEventsConfig
from tiering.events.publisher import ZmqEventPublisher

PUBLISHER_THREAD = "tiering-events-publisher"


def publisher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PUBLISHER_THREAD]


@pytest.fixture(params=["tcp", "ipc"])
def endpoints(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A PUB and a replay address to bind: free loopback ports, or sockets in a short temp dir."""
    if request.param == "tcp":
        yield "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
        return
    with tempfile.TemporaryDirectory(prefix="tev-") as tmp:  # ipc paths must stay short
        yield f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"


@pytest.fixture
def make_publisher(
    endpoints: tuple[str, str],
) -> Iterator[Callable[..., ZmqEventPublisher]]:
    """Build publishers on ``endpoints`` (``replay=False`` for none); all closed at the end.

    ``cls`` picks a subclass (a test hook), ``close_timeout`` goes to it, other
    keywords to `KVEventsConfig`.
    """
    built: list[ZmqEventPublisher] = []
    count = 0

    def make(
        replay: bool = True,
        cls: type[ZmqEventPublisher] = ZmqEventPublisher,
        close_timeout: float = 1.0,
        **config: Any,
    ) -> ZmqEventPublisher:
        nonlocal count
        endpoint, replay_endpoint = endpoints
        if endpoint.startswith("ipc://"):  # one address per publisher
            endpoint, replay_endpoint = f"{endpoint}{count}", f"{replay_endpoint}{count}"
        count += 1
        cfg = KVEventsConfig(
            endpoint=endpoint, replay_endpoint=replay_endpoint if replay else None, **config
        )
        publisher = cls(cfg, close_timeout=close_timeout)
        built.append(publisher)
        return publisher

    yield make
    for publisher in built:
        publisher.close()
    assert publisher_threads() == []


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that is bound but never listens: a connect to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
