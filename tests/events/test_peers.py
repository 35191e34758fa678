"""Which side binds, and saying so when nobody is at the other end of the ZeroMQ stream.

A publisher given a concrete host connects (vLLM's rule), and so does a
subscriber: two connecting sides never meet and nothing fails. These tests use
a loopback port held by a plain socket that never listens, so that every
connect to it is refused at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator

import anyio
import pytest
import zmq

from tiering.events import BlockRemoved, KVEventBatch, KVEventsConfig, ZmqSubscriber
from tiering.events import publisher as publisher_module
from tiering.events.publisher import ZmqEventPublisher

pytestmark = pytest.mark.anyio

BATCH = KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0)])


class Records(logging.Handler):
    """The records of the publisher's logger; `wait` for the next one of a level."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self._changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def wait(self, level: int) -> str:
        with self._changed:
            found = self._changed.wait_for(lambda: self.at(level), timeout=10)
        assert found, f"no {logging.getLevelName(level)} record"
        return self.at(level)[0]

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("tiering.events.publisher")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture
def closing_server() -> Iterator[int]:
    """A port where a program that does not speak ZeroMQ accepts and hangs up at once."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    server.close()
    thread.join(10)
    assert not thread.is_alive()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port where a program that does not speak ZeroMQ accepts and then says nothing."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            accepted.append(conn)  # held open, silent

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    server.close()
    thread.join(10)
    assert not thread.is_alive()
    for conn in accepted:
        conn.close()


def publisher(endpoint: str) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(endpoint=endpoint), close_timeout=0)


async def receive_one(pub: ZmqEventPublisher, subscriber: ZmqSubscriber) -> None:
    """Publish until ``subscriber`` has a batch (PUB/SUB drops what precedes the subscription)."""
    while True:
        pub.publish(BATCH)
        with anyio.move_on_after(0.05):
            await anext(subscriber)
            return


def test_the_publisher_says_whether_it_binds(refused_port: int) -> None:
    bound = publisher("tcp://127.0.0.1:*")
    connecting = publisher(f"tcp://127.0.0.1:{refused_port}")
    try:
        assert bound.binds
        assert not connecting.binds
        assert "binds tcp://127.0.0.1:" in repr(bound)
        assert f"connects tcp://127.0.0.1:{refused_port}" in repr(connecting)
    finally:
        bound.close()
        connecting.close()


def test_a_publisher_that_connects_to_nothing_warns_once_with_the_fix(
    records: Records, refused_port: int
) -> None:
    pub = publisher(f"tcp://127.0.0.1:{refused_port}")
    try:
        message = records.wait(logging.WARNING)
    finally:
        pub.close()
    assert f"connects to tcp://127.0.0.1:{refused_port}" in message
    assert "nothing accepts connections there" in message
    assert f"tcp://*:{refused_port}" in message  # the fix: bind one side
    assert f"`tiering events tcp://*:{refused_port}`" in message
    assert len(records.at(logging.WARNING)) == 1


def test_a_publisher_connected_to_another_program_warns(
    records: Records, closing_server: int
) -> None:
    pub = publisher(f"tcp://127.0.0.1:{closing_server}")
    try:
        message = records.wait(logging.WARNING)
    finally:
        pub.close()
    assert "is not a ZeroMQ subscriber" in message


def test_a_publisher_connected_to_a_silent_program_warns_once_its_handshake_times_out(
    records: Records, silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeroMQ's own handshake timeout is 30 s; the publisher's is a few seconds."""
    assert publisher_module._HANDSHAKE_IVL_MS == 3_000
    monkeypatch.setattr(publisher_module, "_HANDSHAKE_IVL_MS", 50)  # the test's, shortened
    pub = publisher(f"tcp://127.0.0.1:{silent_server}")
    try:
        message = records.wait(logging.WARNING)  # well before ZeroMQ's default would tell
    finally:
        pub.close()
    assert f"connects to tcp://127.0.0.1:{silent_server}" in message
    assert "is not a ZeroMQ subscriber (no ZeroMQ handshake)" in message
    assert len(records.at(logging.WARNING)) == 1


def test_only_a_connecting_publisher_shortens_the_handshake(refused_port: int) -> None:
    bound = publisher("tcp://127.0.0.1:*")
    connecting = publisher(f"tcp://127.0.0.1:{refused_port}")
    try:
        assert bound._pub.getsockopt(zmq.HANDSHAKE_IVL) == 30_000  # ZeroMQ's default
        assert connecting._pub.getsockopt(zmq.HANDSHAKE_IVL) == 3_000
    finally:
        bound.close()
        connecting.close()


async def test_a_publisher_that_connects_meets_a_subscriber_that_binds(records: Records) -> None:
    """The fix the warning names: the subscriber binds (``*``), the publisher connects to it."""
    with anyio.fail_after(10):
        async with ZmqSubscriber("tcp://127.0.0.1:*") as subscriber:
            assert subscriber.binds
            assert subscriber.endpoint.startswith("tcp://127.0.0.1:")
            assert not subscriber.endpoint.endswith(":*")  # the port it really has
            pub = publisher(subscriber.endpoint)
            try:
                assert not pub.binds
                await receive_one(pub, subscriber)
                assert subscriber.has_publisher
            finally:
                pub.close()
    assert records.records == []  # its first connect found the subscriber: nothing to say


async def test_the_warned_publisher_says_when_a_subscriber_comes(records: Records) -> None:
    holder = socket.socket()  # refuses connects until it steps aside
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    pub = publisher(f"tcp://127.0.0.1:{port}")
    try:
        records.wait(logging.WARNING)
        holder.close()
        with anyio.fail_after(10):
            async with ZmqSubscriber(f"tcp://*:{port}"):  # the fix the warning names
                message = records.wait(logging.INFO)
    finally:
        holder.close()
        pub.close()
    assert message == f"KV cache events: a subscriber is connected at tcp://127.0.0.1:{port} now"
    assert len(records.at(logging.WARNING)) == 1


async def test_a_subscriber_knows_whether_it_met_a_publisher(refused_port: int) -> None:
    async with ZmqSubscriber(f"tcp://127.0.0.1:{refused_port}") as lonely:
        assert not lonely.binds
        assert not lonely.has_publisher
    pub = publisher("tcp://127.0.0.1:*")
    try:
        with anyio.fail_after(10):
            async with ZmqSubscriber(pub.endpoint) as subscriber:
                await receive_one(pub, subscriber)
                assert subscriber.has_publisher
                assert subscriber.has_publisher  # and stays so
    finally:
        pub.close()
