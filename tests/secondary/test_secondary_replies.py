"""The Redis tier's own connections and GET replies, against a scripted loopback server.

A `ScriptedServer` accepts one connection, answers its login, then sends the
bytes a test gives it in pieces of random sizes (so every buffer boundary is
crossed), and records what the client sent. Every reply kind a GET may get,
and broken streams: a bad reply is a protocol error that closes the
connection, a silent or closed peer is redis-py's timeout or connection error,
and an abandoned call never touches a row.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("redis")

from redis import exceptions as rx

from tiering._types import make_offload_key
from tiering.secondary import ChunkCodec, RemoteNamespace, Verdict
from tiering.secondary.redis.address import RedisAddress
from tiering.secondary.redis.connection import Abandoned, Connection, ConnectionPool, Guard
from tiering.secondary.redis.options import RedisOptions
from tiering.secondary.redis.resp import command
from tiering.secondary.redis.wire import RedisWire

ROW = 40_000  # not a multiple of any buffer or piece size
NS = RemoteNamespace(model="m", dtype="bfloat16", row_bytes=ROW, blocks_per_chunk=2)
CODEC = ChunkCodec(NS)
LOGIN = command(b"CLIENT", b"SETNAME", b"tiering")


class ScriptedServer:
    """One connection: answers the login, sends ``script`` in random pieces, records the rest."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = bytearray()
        self._thread: threading.Thread | None = None

    def serve(self, script: bytes, *, seed: int = 0, close: bool = False) -> None:
        def run() -> None:
            peer, _ = self.listener.accept()
            with peer, contextlib.suppress(ConnectionError):  # the client may close first
                login = b""
                while len(login) < len(LOGIN):
                    login += peer.recv(len(LOGIN) - len(login))
                assert login == LOGIN
                peer.sendall(b"+OK\r\n")
                rng = random.Random(seed)
                at = 0
                while at < len(script):
                    step = rng.choice((1, 2, 3, 17, 4096, 9000, 70_000))
                    peer.sendall(script[at : at + step])
                    at += step
                if close:
                    peer.shutdown(socket.SHUT_WR)
                while chunk := peer.recv(1 << 20):  # until the client closes
                    self.received += chunk

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(30)

    def close(self) -> None:
        self.listener.close()

    @property
    def address(self) -> RedisAddress:
        return RedisAddress(host="127.0.0.1", port=self.port)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


def connect(server: ScriptedServer, timeout_s: float = 10.0) -> Connection:
    connection = Connection(server.address, timeout_s=timeout_s, connect_timeout_s=10.0)
    connection.connect()
    return connection


def wire(server: ScriptedServer, timeout_s: float = 10.0) -> RedisWire:
    return RedisWire(
        server.address,
        f"redis://127.0.0.1:{server.port}/0",
        f"redis://127.0.0.1:{server.port}/0",
        CODEC,
        RedisOptions(timeout_s=timeout_s, connect_timeout_s=10.0, socket_read_size=4096),
        cluster=False,
    )


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def rows(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, ROW, dtype=np.uint8) for _ in range(n)]


def read(server: ScriptedServer, keys: list[Any], guard: Guard | None = None) -> Any:
    """The tier's read of ``keys`` against the script: (answer, rows read into)."""
    outs = [np.zeros(ROW, dtype=np.uint8) for _ in keys]
    batch = [(k, CODEC.remote_key(k), memoryview(o)) for k, o in zip(keys, outs, strict=True)]
    link = wire(server)
    try:
        answer = link.run(link.read, guard or Guard(), batch)
    finally:
        link.close()
    return answer, outs


@pytest.mark.parametrize("seed", range(4))
def test_every_reply_kind_split_anywhere(server: ScriptedServer, seed: int) -> None:
    keys = [make_offload_key(bytes([i]) * 16, i) for i in range(9)]
    good = rows(3)
    corrupt = bytearray(CODEC.encode(keys[6], good[2]))
    corrupt[-1] ^= 0x80
    server.serve(
        bulk(CODEC.encode(keys[0], good[0]))
        + b"$-1\r\n"  # RESP2's null
        + b"_\r\n"  # RESP3's null
        + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        + b"!19\r\nREADONLY blob error\r\n"
        + bulk(b"abc")  # not a value: dropped unread
        + bulk(bytes(corrupt))
        + bulk(CODEC.encode(keys[0], good[1]))  # a valid value of another key
        + bulk(CODEC.encode(keys[8], good[1])),
        seed=seed,
    )
    answer, outs = read(server, keys)
    assert answer.values[0] is Verdict.OK
    assert np.array_equal(outs[0], good[0])
    assert answer.values[1:3] == [None, None]
    assert answer.values[3] is Verdict.BAD_MAGIC  # not a string: not ours
    assert answer.values[4] is None  # a refusal: a miss, counted
    assert answer.refused == [("READONLY", "ReadOnlyError: blob error")]
    assert answer.values[5] is Verdict.BAD_MAGIC
    assert not outs[5].any()
    assert answer.values[6] is Verdict.BAD_CHECKSUM
    assert answer.values[7] is Verdict.WRONG_KEY
    assert not outs[7].any()  # untouched: the header is checked first
    assert answer.values[8] is Verdict.OK
    assert np.array_equal(outs[8], good[1])
    assert (answer.errors, answer.unavailable) == ([], None)
    server.join()
    expected = b"".join(command(b"GET", CODEC.remote_key(k)) for k in keys)
    assert bytes(server.received) == expected  # one pipeline, nothing else


@pytest.mark.parametrize(
    "stream",
    [b"+OK\r\n", b":1\r\n", b"*1\r\n$1\r\na\r\n", b"$abc\r\n", b"$-7\r\n", b"$3\r\nabcXY"],
)
def test_a_reply_no_get_gives_is_a_protocol_error_that_closes_the_connection(
    server: ScriptedServer, stream: bytes
) -> None:
    server.serve(stream)
    answer, _ = read(server, [make_offload_key(b"k" * 16)])
    assert answer.unavailable is not None
    assert answer.unavailable.startswith("InvalidResponse: Protocol Error")
    server.join()  # the server saw the connection closed


def test_a_loading_server_is_away_and_the_connection_is_closed(server: ScriptedServer) -> None:
    server.serve(b"-LOADING Redis is loading the dataset in memory\r\n")
    answer, _ = read(server, [make_offload_key(b"k" * 16)])
    assert answer.unavailable == "BusyLoadingError: Redis is loading the dataset in memory"
    server.join()


def test_a_peer_closing_mid_value_is_a_connection_error(server: ScriptedServer) -> None:
    key = make_offload_key(b"k" * 16)
    value = bulk(CODEC.encode(key, rows(1)[0]))
    server.serve(value[: len(value) // 2], close=True)
    connection = connect(server)
    connection.send(None, command(b"GET", CODEC.remote_key(key)))
    with pytest.raises(rx.ConnectionError, match=r"Connection closed by server"):
        connection.reply(Guard())
    assert not connection.connected


def test_a_silent_peer_times_out_within_the_socket_timeout(server: ScriptedServer) -> None:
    key = make_offload_key(b"k" * 16)
    value = bulk(CODEC.encode(key, rows(1)[0]))
    server.serve(value[:1000])  # a header, then nothing
    connection = connect(server, timeout_s=0.2)
    with pytest.raises(rx.TimeoutError, match=rf"Timeout reading from 127\.0\.0\.1:{server.port}"):
        connection.reply(Guard())
    assert not connection.connected


def test_bytes_past_the_last_reply_close_the_connection(server: ScriptedServer) -> None:
    server.serve(b"$-1\r\n+unasked\r\n")
    pool = ConnectionPool(server.address, timeout_s=10.0, connect_timeout_s=10.0, read_size=4096)
    connection = pool.get()
    assert connection.reply(Guard()) is None
    while connection.reusable:  # the unasked reply arrives with the first, or after it
        if connection.reply(Guard()) == b"unasked":
            break
    assert not connection.reusable
    pool.release(connection)
    assert not connection.connected  # never reused out of step
    pool.close()


def test_an_abandoned_call_never_writes_the_row(server: ScriptedServer) -> None:
    key = make_offload_key(b"k" * 16)
    server.serve(bulk(CODEC.encode(key, rows(1)[0])))
    guard = Guard()
    guard.abandon()
    answer, outs = read(server, [key], guard)
    assert answer.values == [None]
    assert not outs[0].any()


def test_an_abandoned_read_stops_between_pieces(server: ScriptedServer) -> None:
    big = ChunkCodec(RemoteNamespace(model="m", dtype="b", row_bytes=4 << 20, blocks_per_chunk=1))
    key = make_offload_key(b"k" * 16)
    payload = np.random.default_rng(1).integers(1, 256, 4 << 20, dtype=np.uint8)
    server.serve(bulk(big.encode(key, payload)))
    connection = Connection(server.address, timeout_s=10.0, connect_timeout_s=10.0, read_size=1)
    connection.connect()
    guard = Guard()
    out = np.zeros(4 << 20, dtype=np.uint8)

    class Abandoning:
        """Abandons the call the moment the value is routed into the row."""

        def head(self, size: int) -> int:
            return big.header_bytes(key)

        def route(self, head: memoryview, size: int) -> memoryview:
            guard.abandoned = True  # as if the async side gave up now (the lock is held)
            return memoryview(out)

    with pytest.raises(Abandoned):
        connection.reply(guard, Abandoning())
    connection.close()
    # At most what the reader had buffered with the header (its buffer: 128 KiB).
    assert out.any()
    assert not out[128 << 10 :].any()


def test_push_frames_between_replies_are_read_past(server: ScriptedServer) -> None:
    # The tier speaks RESP2 and subscribes to nothing, but a server may push
    # notifications anyway: they are read past, the replies go on.
    keys = [make_offload_key(bytes([i]) * 16, i) for i in range(2)]
    good = rows(2)
    push = b">4\r\n$9\r\nMIGRATING\r\n:7\r\n%1\r\n+a\r\n#t\r\n*2\r\n,1.5\r\n_\r\n"
    server.serve(
        push
        + bulk(CODEC.encode(keys[0], good[0]))
        + push
        + push
        + bulk(CODEC.encode(keys[1], good[1])),
        seed=3,
    )
    answer, outs = read(server, keys)
    assert answer.values == [Verdict.OK, Verdict.OK]
    assert all(np.array_equal(o, g) for o, g in zip(outs, good, strict=True))


def test_the_login_sends_auth_and_select_in_one_round_trip() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    got = bytearray()
    expected = (
        command(b"AUTH", b"engine", b"pw")
        + command(b"SELECT", b"3")
        + command(b"CLIENT", b"SETNAME", b"tiering")
    )

    def run() -> None:
        peer, _ = listener.accept()
        with peer:
            while len(got) < len(expected):
                got.extend(peer.recv(4096))
            peer.sendall(b"+OK\r\n+OK\r\n-NOPERM this user has no permissions to run it\r\n")
            peer.recv(1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    address = RedisAddress(
        host="127.0.0.1", port=listener.getsockname()[1], db=3, username="engine", password="pw"
    )
    connection = Connection(address, timeout_s=10.0, connect_timeout_s=10.0)
    connection.connect()  # NOPERM on CLIENT SETNAME: no matter
    assert bytes(got) == expected
    assert connection.reusable
    connection.close()
    thread.join(30)
    listener.close()


def test_a_refused_login_is_an_authentication_error() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.recv(4096)
            peer.sendall(b"-WRONGPASS invalid username-password pair\r\n+OK\r\n")
            peer.recv(1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    address = RedisAddress(host="127.0.0.1", port=listener.getsockname()[1], password="no")
    connection = Connection(address, timeout_s=10.0, connect_timeout_s=10.0)
    with pytest.raises(rx.AuthenticationError, match="invalid username-password"):
        connection.connect()
    assert not connection.connected
    thread.join(30)
    listener.close()


@pytest.mark.parametrize("seed", range(3))
def test_frames_go_out_whole_and_in_order_whatever_sendmsg_takes(
    server: ScriptedServer, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    real = Connection._sendmsg

    def flaky(sock: socket.socket, parts: list[memoryview]) -> int:
        """Takes a random part of what it is given, or nothing (EAGAIN)."""
        roll = rng.random()
        if roll < 0.2:
            return -1
        data = b"".join(bytes(p) for p in parts)
        taken = rng.randint(1, len(data)) if roll < 0.8 else len(data)
        return real(sock, [memoryview(data[:taken])])

    server.serve(b"")
    connection = connect(server)
    monkeypatch.setattr(Connection, "_sendmsg", staticmethod(flaky))
    expected = bytearray()
    for _ in range(60):
        own = rng.randbytes(rng.randint(0, 50))
        size = rng.choice([0, 1, 10, 3000, (1 << 20) + 7])
        row = memoryview(rng.randbytes(size)) if rng.random() < 0.8 else None
        connection.send(Guard(), own, row)
        expected += own + (b"" if row is None else bytes(row))
    connection.close()
    server.join()
    assert bytes(server.received) == bytes(expected)
