"""The Redis tier's own reader of GET replies and writer of SET frames, on socket pairs.

`_Replies` receives a value's payload straight into the caller's row. These
tests give it replies split at random points (so every buffer boundary is
crossed), every reply kind a GET may get, and broken streams: a bad reply is a
protocol error that closes the connection, a silent or closed peer is redis-py's
timeout or connection error, and an abandoned call never touches a row.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("redis")

from redis import exceptions as rx
from redis._parsers.resp3 import _RESP3Parser

from tiering._types import make_offload_key
from tiering.secondary import ChunkCodec, RemoteNamespace, Verdict
from tiering.secondary.redis.wire import Abandoned, Guard, _Replies, _Stream

ROW = 40_000  # not a multiple of any buffer or piece size
NS = RemoteNamespace(model="m", dtype="bfloat16", row_bytes=ROW, blocks_per_chunk=2)
CODEC = ChunkCodec(NS)


class FakeConnection:
    """What `_Replies` uses of a redis-py connection: its parser's errors, and disconnect."""

    def __init__(self) -> None:
        self._parser = _RESP3Parser(socket_read_size=65536)
        self.disconnects = 0

    def disconnect(self) -> None:
        self.disconnects += 1

    def _host_error(self) -> str:
        return "127.0.0.1:7"


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, peer = socket.socketpair()
    ours.settimeout(2.0)
    yield ours, peer
    ours.close()
    peer.close()


def feed(peer: socket.socket, data: bytes, seed: int = 0, close: bool = False) -> threading.Thread:
    """Send ``data`` from a thread in pieces of random sizes (then close the peer, if asked)."""

    def run() -> None:
        rng = random.Random(seed)
        at = 0
        while at < len(data):
            step = rng.choice((1, 2, 3, 17, 4096, 9000, 70_000))
            peer.sendall(data[at : at + step])
            at += step
        if close:
            peer.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def rows(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, ROW, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_every_reply_kind_split_anywhere(pair: Any, seed: int) -> None:
    ours, peer = pair
    keys = [make_offload_key(bytes([i]) * 16, i) for i in range(9)]
    good = rows(3)
    corrupt = bytearray(CODEC.encode(keys[6], good[2]))
    corrupt[-1] ^= 0x80
    stream = (
        bulk(CODEC.encode(keys[0], good[0]))
        + b"$-1\r\n"  # RESP2's null
        + b"_\r\n"  # RESP3's null
        + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
        + b"!20\r\nWRONGTYPE blob error\r\n"
        + bulk(b"abc")  # not a value's size: given whole, as redis-py would
        + bulk(bytes(corrupt))
        + bulk(CODEC.encode(keys[0], good[1]))  # a valid value of another key
        + bulk(CODEC.encode(keys[8], good[1]))
    )
    feed(peer, stream, seed)
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    outs = [np.zeros(ROW, dtype=np.uint8) for _ in keys]
    got = [reader.reply(CODEC, k, memoryview(o)) for k, o in zip(keys, outs, strict=True)]
    reader.close()
    assert got[0] is Verdict.OK
    assert np.array_equal(outs[0], good[0])
    assert got[1:3] == [None, None]
    assert type(got[3]) is rx.ResponseError
    assert str(got[3]).startswith("WRONGTYPE Operation")
    assert type(got[4]) is rx.ResponseError
    assert str(got[4]) == "WRONGTYPE blob error"
    assert got[5] == b"abc"
    assert got[6] is Verdict.BAD_CHECKSUM
    assert got[7] is Verdict.WRONG_KEY
    assert not outs[7].any()  # untouched: the header is checked first
    assert got[8] is Verdict.OK
    assert np.array_equal(outs[8], good[1])
    assert connection.disconnects == 0
    assert ours.gettimeout() == 2.0  # put back


@pytest.mark.parametrize(
    "stream",
    [b"+OK\r\n", b":1\r\n", b"*1\r\n$1\r\na\r\n", b"$abc\r\n", b"$-7\r\n", b"$3\r\nabcXY"],
)
def test_a_reply_no_get_gives_is_a_protocol_error_that_closes_the_connection(
    pair: Any, stream: bytes
) -> None:
    ours, peer = pair
    feed(peer, stream)
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    with pytest.raises(rx.InvalidResponse, match="Protocol Error"):
        reader.reply(CODEC, make_offload_key(b"k" * 16), memoryview(bytearray(ROW)))
    assert connection.disconnects == 1


def test_a_connection_error_reply_is_raised_and_closes_the_connection(pair: Any) -> None:
    ours, peer = pair
    feed(peer, b"-LOADING Redis is loading the dataset in memory\r\n")
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    with pytest.raises(rx.BusyLoadingError):
        reader.reply(CODEC, make_offload_key(b"k" * 16), memoryview(bytearray(ROW)))
    assert connection.disconnects == 1


def test_a_peer_closing_mid_value_is_a_connection_error(pair: Any) -> None:
    ours, peer = pair
    key = make_offload_key(b"k" * 16)
    value = bulk(CODEC.encode(key, rows(1)[0]))
    feed(peer, value[: len(value) // 2], close=True)
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    with pytest.raises(rx.ConnectionError, match=r"Connection closed by server 127\.0\.0\.1:7"):
        reader.reply(CODEC, key, memoryview(bytearray(ROW)))
    assert connection.disconnects == 1


def test_a_silent_peer_times_out_within_the_socket_timeout(pair: Any) -> None:
    ours, peer = pair
    ours.settimeout(0.2)
    key = make_offload_key(b"k" * 16)
    value = bulk(CODEC.encode(key, rows(1)[0]))
    feed(peer, value[:1000])  # a header, then nothing
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    with pytest.raises(rx.TimeoutError, match=r"Timeout reading from 127\.0\.0\.1:7"):
        reader.reply(CODEC, key, memoryview(bytearray(ROW)))
    assert connection.disconnects == 1


def test_bytes_past_the_last_reply_close_the_connection(pair: Any) -> None:
    ours, peer = pair
    feed(peer, b"$-1\r\n+unasked\r\n").join()
    connection = FakeConnection()
    reader = _Replies(connection, ours, Guard(), 4096)
    assert reader.reply(CODEC, make_offload_key(b"k" * 16), memoryview(bytearray(ROW))) is None
    reader.close()
    assert connection.disconnects == 1


def test_an_abandoned_call_never_writes_the_row(pair: Any) -> None:
    ours, peer = pair
    key = make_offload_key(b"k" * 16)
    feed(peer, bulk(CODEC.encode(key, rows(1)[0]))).join()
    guard = Guard()
    guard.abandon()
    out = np.zeros(ROW, dtype=np.uint8)
    reader = _Replies(FakeConnection(), ours, guard, 4096)
    with pytest.raises(Abandoned):
        reader.reply(CODEC, key, memoryview(out))
    assert not out.any()


def test_push_frames_between_replies_go_to_redis_pys_handler(pair: Any) -> None:
    # RESP3 servers may push notifications (maintenance, invalidation) at any
    # point: redis-py hands them to its handlers and reads on, and so does this.
    ours, peer = pair
    keys = [make_offload_key(bytes([i]) * 16, i) for i in range(2)]
    good = rows(2)
    push = b">4\r\n$9\r\nMIGRATING\r\n:7\r\n%1\r\n+a\r\n#t\r\n*2\r\n,1.5\r\n_\r\n"
    stream = (
        push
        + bulk(CODEC.encode(keys[0], good[0]))
        + push
        + push
        + bulk(CODEC.encode(keys[1], good[1]))
    )
    feed(peer, stream, seed=3)
    connection = FakeConnection()
    pushed: list[Any] = []
    connection._parser.handle_push_response = pushed.append  # type: ignore[method-assign]
    reader = _Replies(connection, ours, Guard(), 4096)
    outs = [np.zeros(ROW, dtype=np.uint8) for _ in keys]
    got = [reader.reply(CODEC, k, memoryview(o)) for k, o in zip(keys, outs, strict=True)]
    reader.close()
    assert got == [Verdict.OK, Verdict.OK]
    assert all(np.array_equal(o, g) for o, g in zip(outs, good, strict=True))
    assert pushed == [[b"MIGRATING", 7, {b"a": True}, [1.5, None]]] * 3
    assert connection.disconnects == 0


def test_a_push_handler_that_fails_is_logged_and_the_replies_go_on(pair: Any, caplog: Any) -> None:
    ours, peer = pair
    feed(peer, b">1\r\n+invalidate\r\n$-1\r\n")
    connection = FakeConnection()

    def broken(frame: Any) -> None:
        raise RuntimeError("handler bug")

    connection._parser.handle_push_response = broken  # type: ignore[method-assign]
    reader = _Replies(connection, ours, Guard(), 4096)
    assert reader.reply(CODEC, make_offload_key(b"k" * 16), memoryview(bytearray(ROW))) is None
    assert "push notification" in caplog.text
    assert connection.disconnects == 0


class FlakySocket:
    """A socket whose sendmsg takes a random part of what it is given, or nothing (EAGAIN)."""

    def __init__(self, real: socket.socket, rng: random.Random) -> None:
        self.real, self.rng = real, rng
        self.sent = bytearray()

    def gettimeout(self) -> float | None:
        return self.real.gettimeout()

    def settimeout(self, value: float | None) -> None:
        self.real.settimeout(value)

    def fileno(self) -> int:
        return self.real.fileno()

    def sendmsg(self, parts: list[memoryview]) -> int:
        roll = self.rng.random()
        if roll < 0.2:
            raise BlockingIOError
        data = b"".join(bytes(p) for p in parts)
        taken = self.rng.randint(1, len(data)) if roll < 0.8 else len(data)
        self.sent += data[:taken]
        return taken


@pytest.mark.parametrize("seed", range(3))
def test_frames_go_out_whole_and_in_order_whatever_sendmsg_takes(pair: Any, seed: int) -> None:
    ours, _ = pair
    rng = random.Random(seed)
    connection = FakeConnection()
    for _ in range(60):
        flaky = FlakySocket(ours, rng)
        stream = _Stream(connection, flaky, Guard())  # type: ignore[arg-type]
        expected = bytearray()
        for _ in range(rng.randint(1, 5)):
            own = rng.randbytes(rng.randint(0, 50))
            size = rng.choice([0, 1, 10, 3000, (1 << 20) + 7])
            row = memoryview(rng.randbytes(size)) if rng.random() < 0.8 else None
            stream.send(own, row)
            expected += own + (b"" if row is None else bytes(row))
        stream.close()
        assert flaky.sent == expected
        assert ours.gettimeout() == 2.0
    assert connection.disconnects == 0
