"""The Redis tier's sans-IO RESP reader: bytes in (split anywhere), replies out, values routed.

No sockets: the reader is fed bytes in pieces of random sizes, through
``buffer``/``received`` (as a socket driver does) or ``feed``, and every reply
kind must come out whole and in order, a routed value's payload landing in
the sink's buffer and a dropped one nowhere.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.secondary.redis.resp import (
    MAX_LINE,
    NEED_DATA,
    ROUTED,
    ErrorReply,
    ProtocolError,
    Push,
    ReplyReader,
    command,
)


def read_all(reader: ReplyReader, stream: bytes, seed: int, sinks: Any = None) -> list[Any]:
    """Every reply in ``stream``, received in random pieces through ``buffer``/``received``."""
    rng = random.Random(seed)
    replies: list[Any] = []
    at = 0
    while True:
        sink = sinks(len(replies)) if sinks is not None else None
        reply = reader.reply(sink)
        if reply is not NEED_DATA:
            replies.append(reply)
            continue
        if at == len(stream):
            return replies
        into = reader.buffer()
        n = min(into.nbytes, len(stream) - at, rng.choice((1, 2, 3, 17, 4096, 70_000)))
        into[:n] = stream[at : at + n]
        reader.received(n)
        at += n


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


EVERY_KIND = (
    b"+OK\r\n"
    + b":-12\r\n"
    + bulk(b"abc")
    + b"$0\r\n\r\n"
    + b"$-1\r\n"
    + b"*-1\r\n"
    + b"_\r\n"
    + b"-WRONGTYPE Operation against a key\r\n"
    + b"!14\r\nOOM over limit\r\n"
    + b"*3\r\n$1\r\na\r\n:1\r\n*1\r\n+x\r\n"
    + b">2\r\n+invalidate\r\n#t\r\n"
    + b"%1\r\n+k\r\n,1.5\r\n"
    + b"~1\r\n(12345678901234567890\r\n"
    + b"=7\r\ntxt:abc\r\n"
    + b"|1\r\n+meta\r\n+data\r\n:5\r\n"  # an attribute, then the reply it describes
    + bulk(bytes(range(256)) * 1000)  # larger than the buffer: a bytearray of its own
)
EXPECTED = [
    b"OK",
    -12,
    b"abc",
    b"",
    None,
    None,
    None,
    ErrorReply("WRONGTYPE Operation against a key"),
    ErrorReply("OOM over limit"),
    [b"a", 1, [b"x"]],
    Push([b"invalidate", True]),
    {b"k": 1.5},
    [12345678901234567890],
    b"abc",
    5,
    bytes(range(256)) * 1000,
]


@pytest.mark.parametrize("seed", range(6))
def test_every_reply_kind_split_anywhere(seed: int) -> None:
    reader = ReplyReader(1024)  # raised to its floor (2 lines' worth); the big bulk is larger
    replies = read_all(reader, EVERY_KIND, seed)
    assert replies == EXPECTED
    assert type(replies[10]) is Push
    assert replies[7].code == "WRONGTYPE"
    assert reader.unread == 0


def test_feed_takes_plain_bytes() -> None:
    reader = ReplyReader()
    reader.feed(b"+PONG\r\n:3\r")
    assert reader.reply() == b"PONG"
    assert reader.reply() is NEED_DATA
    reader.feed(b"\n")
    assert reader.reply() == 3
    assert reader.reply() is NEED_DATA


def test_error_codes() -> None:
    assert ErrorReply("OOM command not allowed").code == "OOM"
    assert ErrorReply("MOVED 12 127.0.0.1:7000").code == "MOVED"
    assert ErrorReply("ERR unknown command").code == "ERR"
    assert ErrorReply("something in lower case").code == "ERR"
    assert ErrorReply("").code == "ERR"


class Sink:
    """Routes a value of ``size`` bytes (after ``head`` bytes) into ``into``; drops others."""

    def __init__(self, size: int, head: int, into: bytearray) -> None:
        self.size, self.wanted, self.into = size, head, into
        self.heads: list[bytes] = []

    def head(self, size: int) -> int:
        return min(size, self.wanted)

    def route(self, head: memoryview, size: int) -> memoryview | None:
        self.heads.append(bytes(head))
        return memoryview(self.into) if size == self.size else None


@pytest.mark.parametrize("seed", range(6))
def test_a_routed_value_lands_in_the_sinks_buffer_and_a_dropped_one_nowhere(seed: int) -> None:
    rng = random.Random(seed)
    value = rng.randbytes(300_000)
    other = rng.randbytes(5000)
    stream = bulk(value) + b"$-1\r\n" + bulk(other) + b"-ERR no\r\n" + bulk(value)
    rows = [bytearray(300_000 - 40) for _ in range(5)]
    sinks = [Sink(300_000, 40, row) for row in rows]
    replies = read_all(ReplyReader(4096), stream, seed, sinks=lambda i: sinks[i % 5])
    assert replies == [ROUTED, None, ROUTED, ErrorReply("ERR no"), ROUTED]
    assert bytes(rows[0]) == value[40:]
    assert sinks[0].heads == [value[:40]]
    assert sinks[2].heads == [other[:40]]
    assert not any(rows[2])  # not its size: dropped, nowhere
    assert bytes(rows[4]) == value[40:]


def test_a_routed_payload_is_received_straight_into_the_sinks_buffer() -> None:
    # Once the head is taken and nothing is buffered, `buffer` *is* the destination.
    reader = ReplyReader()
    row = bytearray(10_000)
    payload = random.Random(1).randbytes(10_000)
    reader.feed(b"$10004\r\nHEAD")
    assert reader.reply(Sink(10_004, 4, row)) is NEED_DATA
    into = reader.buffer()
    assert into.obj is row
    assert into.nbytes == 10_000
    into[:] = payload
    reader.received(10_000)
    assert reader.reply() is NEED_DATA  # the CRLF is still due
    reader.feed(b"\r\n")
    assert reader.reply() is ROUTED
    assert bytes(row) == payload


def test_a_sink_sees_replies_that_are_no_bulk_strings_unrouted() -> None:
    reader = ReplyReader()
    reader.feed(b":1\r\n_\r\n-ERR x\r\n")
    sink = Sink(10, 2, bytearray(8))
    assert [reader.reply(sink) for _ in range(3)] == [1, None, ErrorReply("ERR x")]
    assert sink.heads == []


@pytest.mark.parametrize(
    "stream",
    [
        b"?what\r\n",
        b"$abc\r\n",
        b"$-7\r\n",
        b"$3\r\nabcXY",
        b":12x\r\n",
        b"#maybe\r\n",
        b"*-2\r\n",
        b"$%d\r\n" % (513 << 20),
    ],
)
def test_bytes_that_are_no_reply_are_a_protocol_error(stream: bytes) -> None:
    reader = ReplyReader()
    reader.feed(stream)
    with pytest.raises(ProtocolError):
        reader.reply()


def test_a_routed_value_not_followed_by_crlf_is_a_protocol_error() -> None:
    reader = ReplyReader()
    reader.feed(b"$6\r\nabcdefXY")
    with pytest.raises(ProtocolError, match="CRLF"):
        reader.reply(Sink(6, 2, bytearray(4)))


def test_a_line_of_over_64_kib_is_a_protocol_error() -> None:
    reader = ReplyReader()
    reader.feed(b"+" + b"x" * (MAX_LINE + 10))
    with pytest.raises(ProtocolError, match="over"):
        reader.reply()


def test_an_aggregate_larger_than_the_buffer_is_a_protocol_error() -> None:
    reader = ReplyReader(2 * MAX_LINE)
    stream = b"*1000\r\n" + bulk(b"x" * 1000) * 1000
    with pytest.raises(ProtocolError, match="a reply of over"):
        read_all(reader, stream, seed=0)


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert command(b"GET", b"k") == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
    assert command(b"SET", b"", b"\r\n") == b"*3\r\n$3\r\nSET\r\n$0\r\n\r\n$2\r\n\r\n\r\n"


# -- any replies, any splits ---------------------------------------------------------

_scalars = st.one_of(
    st.binary(max_size=300).map(lambda b: (bulk(b), b)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: (b":%d\r\n" % i, i)),
    st.just((b"$-1\r\n", None)),
    st.just((b"_\r\n", None)),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40).map(
        lambda t: (b"-%s\r\n" % t.encode(), ErrorReply(t))
    ),
    st.from_regex(rb"\A[A-Za-z0-9 ]{0,40}\Z").map(lambda b: (b"+%s\r\n" % b, b)),
)
_replies = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5).map(
        lambda items: (
            b"*%d\r\n" % len(items) + b"".join(raw for raw, _ in items),
            [value for _, value in items],
        )
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_replies, max_size=20), st.integers(0, 2**32))
def test_any_replies_split_anywhere_come_out_whole_and_in_order(
    replies: list[tuple[bytes, Any]], seed: int
) -> None:
    stream = b"".join(raw for raw, _ in replies)
    assert read_all(ReplyReader(256), stream, seed) == [value for _, value in replies]
