"""The worker-thread side of the Redis tier: redis-py's connections, streamed pipelines.

Everything here blocks and runs in a worker thread (`RedisTier` calls it
through ``anyio.to_thread``); nothing here touches the event loop or the
tier's counters. A call's work fills an `Answer` that the async side reads.

Pipelines, streamed, one round trip per node: a call's commands go out as one
pipeline per node (of at most ``max_batch`` keys): every node is sent its
commands before any reply is read, so a call is one round trip on a
standalone server and one per node on a cluster (the slot map of redis-py's
cluster client routes each key; keys carry a hash tag, so a chunk's keys
share a slot). The wire drives redis-py's connections itself, instead of its
``Pipeline``, to stream: a write checksums each value's row just before
sending it, then sends the RESP frame in one ``sendmsg`` (its own bytes, then
the row straight from the caller's buffer: the kernel's copy is the only one;
on TLS the frame is built in a buffer the thread reuses), so the server takes
one value while the next is checksummed. A read parses the replies itself
(`_Replies`, where redis-py's pure-Python parser would hold no read-ahead):
each value's header is checked as it arrives, its payload received straight
into the caller's row (the kernel's copy is the only one) and checksummed
there, while the next is in flight; TLS and other parsers go through
redis-py's parser, the value then copied once into the row. A ``MOVED`` or
``ASK`` reply (the cluster is resharding) is a miss, counted, and the slot map
is refreshed before the next call.

Buffers: each row is checksummed, encoded, sent, received or decoded under
the call's `Guard` (a row is handed to the kernel, or filled from it, in
non-blocking pieces under it, the waits on the socket being outside it); once
the async side has
abandoned the call (timeout, cancellation), the thread stops before the next
piece and never touches a caller's buffer again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import threading
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

from tiering._types import OffloadKey
from tiering.errors import ConfigError, ResourceClosedError
from tiering.secondary.base import describe
from tiering.secondary.codec import ChunkCodec, Verdict

__all__ = ["Abandoned", "Answer", "Guard", "RedisWire", "Row", "Work"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "invalid username-password", "invalid password")

_LOCAL = threading.local()


def _frame_buffer(size: int) -> memoryview:
    """A buffer of at least ``size`` bytes, this thread's own, reused from call to call."""
    buffer: bytearray | None = getattr(_LOCAL, "frame", None)
    if buffer is None or len(buffer) < size:
        buffer = _LOCAL.frame = bytearray(size)
    return memoryview(buffer)


#: Most bytes of a caller's row handed to the kernel in one call (under the guard's lock).
_PIECE = 1 << 20


def _read_buffer(size: int) -> bytearray:
    """A buffer of ``size`` bytes or more, this thread's own, reused from call to call."""
    buffer: bytearray | None = getattr(_LOCAL, "read", None)
    if buffer is None or len(buffer) < size:
        buffer = _LOCAL.read = bytearray(size)
    return buffer


def _plain_socket(connection: Any) -> socket.socket | None:
    """The connection's TCP socket (connected), or ``None`` where it is not a plain one (TLS)."""
    if connection._sock is None:
        connection.connect()
    sock = connection._sock
    if type(sock) is not socket.socket or sock.gettimeout() == 0:
        return None  # an SSLSocket (rediss://) or a non-blocking one: the framed path
    return sock


class _NonBlocking:
    """A plain socket made non-blocking for a call's I/O, its waits bounded by its timeout.

    `close` puts the timeout back (unless a failure closed the socket).
    """

    __slots__ = ("_connection", "_guard", "_poller", "_sock", "_timeout")

    def __init__(self, connection: Any, sock: socket.socket, guard: Guard, events: int) -> None:
        self._connection = connection
        self._sock = sock
        self._guard = guard
        self._timeout = sock.gettimeout()
        self._poller = select.poll()
        self._poller.register(sock, events)
        sock.settimeout(0.0)

    def _ready(self) -> bool:
        """Wait until the socket is ready; ``False`` when the socket's timeout ran out first."""
        timeout = self._timeout
        return bool(self._poller.poll(-1 if timeout is None else max(1, math.ceil(timeout * 1000))))

    def close(self) -> None:
        if self._sock.fileno() != -1:
            self._sock.settimeout(self._timeout)


class _Stream(_NonBlocking):
    """Sends RESP frames on a plain socket: our own bytes and callers' rows, in one syscall each.

    The socket is non-blocking while the stream is open (its timeout is put
    back by `close`). Each frame (our bytes, then a caller's row straight from
    its buffer: the kernel's copy is the only one) is handed to the kernel by
    one ``sendmsg`` where it fits, in pieces of at most `_PIECE` bytes of the
    row, each under the guard's lock (a bounded memory copy); waiting for room
    in the socket's buffer is done outside the lock, within the socket's
    timeout. Once the call is abandoned, no row is read again (the connection,
    holding a partial command, is then closed by `RedisWire.exchange`). A
    failed send closes the connection and raises redis-py's error, as
    redis-py does.
    """

    __slots__ = ()

    def __init__(self, connection: Any, sock: socket.socket, guard: Guard) -> None:
        super().__init__(connection, sock, guard, select.POLLOUT)

    def send(self, own: bytes, row: memoryview | None = None) -> None:
        """Send ``own`` then ``row`` (if given), reading ``row`` only under the guard."""
        sock, guard = self._sock, self._guard
        ours = memoryview(own)
        size = 0 if row is None else row.nbytes
        mine = theirs = 0  # bytes sent of each
        try:
            while mine < len(ours) or theirs < size:
                with guard.lock:
                    if guard.abandoned:
                        raise Abandoned
                    parts = [ours[mine:]] if mine < len(ours) else []
                    if row is not None and theirs < size:
                        parts.append(row[theirs : theirs + _PIECE])
                    try:
                        sent = sock.sendmsg(parts)
                    except BlockingIOError:
                        sent = -1
                if sent < 0:
                    if not self._ready():
                        raise TimeoutError("timed out")
                    continue
                took = min(sent, len(ours) - mine)
                mine += took
                theirs += sent - took
        except Abandoned:
            raise
        except BaseException as exc:
            _send_failed(self._connection, exc)
            raise


class _Replies(_NonBlocking):
    """Reads a pipeline's RESP replies from a plain socket: values straight into callers' rows.

    redis-py's parser reads a value through a buffer, a ``BytesIO`` and a
    ``bytes`` of its own (three copies) before the tier checks it and copies
    it once more into the caller's row. Here, a value of the expected size
    has its header read and checked first (`ChunkCodec.check_head`), then its
    payload is received straight into the caller's row, in pieces of at most
    `_PIECE` bytes, each under the guard's lock, and checksummed there while
    it is in cache. Anything else (a miss, a refusal, a value of another size)
    is read whole and given to the call as redis-py would give it.

    The socket is non-blocking while this reads (`close` puts its timeout
    back); each wait for data lasts at most the socket's timeout. A failed
    read closes the connection and raises redis-py's error, as redis-py does.
    Only used where redis-py's parser holds no unread byte (`usable`), and
    it reads exactly the replies asked for, so the connection is left as
    redis-py expects it.
    """

    __slots__ = ("_buffer", "_end", "_raw", "_start")

    def __init__(self, connection: Any, sock: socket.socket, guard: Guard, size: int) -> None:
        super().__init__(connection, sock, guard, select.POLLIN)
        # Room for any value's header (a key is at most 64 KiB) and any reply line.
        self._raw = _read_buffer(max(size, 2 * _MAX_LINE))
        self._buffer = memoryview(self._raw)
        self._start = self._end = 0  # the unread bytes: _buffer[_start:_end]

    @staticmethod
    def usable(connection: Any) -> bool:
        """Whether ``connection`` uses redis-py's pure-Python parser, with nothing read ahead."""
        parser = getattr(connection, "_parser", None)
        buffer = getattr(parser, "_buffer", None)
        unread = getattr(buffer, "unread_bytes", None)
        return unread is not None and type(parser).__name__ in _PARSERS and unread() == 0

    def close(self) -> None:
        """Put the socket's timeout back (unless a failure closed it).

        Bytes read past the last reply asked for would be lost to redis-py's
        parser: the connection is closed then, never reused out of step.
        """
        super().close()
        if self._sock.fileno() != -1 and self._end > self._start:
            self._connection.disconnect()

    def reply(self, codec: ChunkCodec, key: OffloadKey, out: memoryview) -> Any:
        """The next reply to a GET of chunk ``key``: a `Verdict` once checked into ``out``.

        Otherwise what redis-py's parser returns: ``None`` (no such key), the
        value's ``bytes`` (when not of the size a value of ``key`` has), or
        the refusal's exception (a ``ResponseError``; a ``ConnectionError``
        reply is raised).
        """
        line = self._line()
        while line[:1] == b">":  # RESP3 push data between replies: redis-py's to handle
            self._push(line)
            line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                size = int(rest)
            except ValueError:
                size = -2
            if size < -1:
                self._protocol_error(f"{line[:64]!r} in reply to GET")
            if size == -1:
                return None
            if size != codec.value_bytes(key):
                value = bytearray(size)
                self._into(memoryview(value), None)
                self._crlf()
                return bytes(value)
            head_bytes = codec.header_bytes(key)
            checked = codec.check_head(key, self._take(head_bytes), size)
            if isinstance(checked, Verdict):
                self._skip(size - head_bytes)
            else:
                self._into(out, self._guard)
                with self._guard.lock:
                    if self._guard.abandoned:
                        raise Abandoned
                    checked = codec.check_payload(*checked, out)
            self._crlf()
            return checked
        if kind == b"_":  # RESP3's null
            return None
        if kind == b"!":  # RESP3's blob error
            rest = self._blob(rest, line)
        if kind in (b"-", b"!"):
            error = self._connection._parser.parse_error(rest.decode("utf-8", errors="replace"))
            if not isinstance(error, _errors().refused):
                self._connection.disconnect()
                raise error
            return error
        self._protocol_error(f"{line[:64]!r} in reply to GET")

    def _push(self, line: bytes) -> None:
        """Read a push frame (a server notification) and hand it to redis-py, as it would."""
        try:
            frame = [self._element() for _ in range(int(line[1:]))]
        except ValueError:
            self._protocol_error(f"{line[:64]!r} in a push frame")
        try:
            self._connection._parser.handle_push_response(frame)
        except Exception:  # redis-py's handler: say so, the replies go on
            logger.exception("Redis tier: handling a push notification failed")

    def _element(self) -> Any:
        """One element of a push frame, as redis-py's RESP3 parser gives it (not decoded)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"=", b"!"):
            return None if rest == b"-1" else self._blob(rest, line)
        if kind == b"+":
            return rest
        if kind == b"-":
            return self._connection._parser.parse_error(rest.decode("utf-8", errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b",":
            return float(rest)
        if kind == b"#":
            return rest == b"t"
        if kind == b"_":
            return None
        if kind in (b"*", b">", b"~"):
            return [self._element() for _ in range(int(rest))]
        if kind == b"%":
            pairs = [(self._element(), self._element()) for _ in range(int(rest))]
            return dict(pairs)
        self._protocol_error(f"{line[:64]!r} in a push frame")

    def _blob(self, size: bytes, line: bytes) -> bytes:
        """The bytes of a length-prefixed reply whose first line was ``line``."""
        if not size.isdigit() or int(size) > _MAX_LINE:
            self._protocol_error(f"{line[:64]!r} in reply to GET")
        blob = bytes(self._take(int(size)))
        self._crlf()
        return blob

    def _line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            at = self._raw.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._raw[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start >= _MAX_LINE:
                self._protocol_error("a reply line of over 64 KiB")
            self._fill()

    def _protocol_error(self, what: str) -> NoReturn:
        from redis import exceptions as rx

        self._connection.disconnect()
        raise rx.InvalidResponse(f"Protocol Error: {what}")

    def _take(self, n: int) -> memoryview:
        """The next ``n`` bytes (at most the buffer's size), valid until the next read."""
        while self._end - self._start < n:
            self._fill()
        view = self._buffer[self._start : self._start + n]
        self._start += n
        return view

    def _skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step

    def _crlf(self) -> None:
        if bytes(self._take(2)) != b"\r\n":
            self._protocol_error("a value not followed by CRLF")

    def _into(self, out: memoryview, guard: Guard | None) -> None:
        """Fill ``out``: first from what is buffered, then from the socket straight into it.

        With a ``guard``, ``out`` is written only under its lock, in pieces.
        """
        lock = contextlib.nullcontext() if guard is None else guard.lock
        size, done = out.nbytes, 0
        while done < size:
            with lock:
                if guard is not None and guard.abandoned:
                    raise Abandoned
                got = min(size - done, self._end - self._start)
                if got:
                    out[done : done + got] = self._buffer[self._start : self._start + got]
                    self._start += got
                else:
                    got = self._recv(out[done : done + _PIECE])
            if got < 0:
                self._wait()
            else:
                done += got

    def _fill(self) -> None:
        """Read more into the buffer (moving what is unread to its front first)."""
        if self._start:
            unread = self._end - self._start
            self._buffer[:unread] = self._buffer[self._start : self._end]
            self._start, self._end = 0, unread
        while True:
            got = self._recv(self._buffer[self._end :])
            if got >= 0:
                self._end += got
                return
            self._wait()

    def _recv(self, into: memoryview) -> int:
        """Bytes received into ``into`` (-1: none yet). The server closing is an error."""
        try:
            got = self._sock.recv_into(into)
        except BlockingIOError:
            return -1
        except BaseException as exc:
            _read_failed(self._connection, exc)
            raise
        if got == 0 and into.nbytes:
            _read_failed(self._connection, None)
        return got

    def _wait(self) -> None:
        try:
            ready = self._ready()
        except BaseException as exc:
            _read_failed(self._connection, exc)
            raise
        if not ready:
            _read_failed(self._connection, TimeoutError("timed out"))


#: The longest reply line `_Replies` reads (a GET's replies have short lines).
_MAX_LINE = 64 << 10

#: redis-py's pure-Python parsers (RESP2, and RESP3: redis-py 8's default), whose
#: read-ahead `_Replies` can see.
_PARSERS = frozenset({"_RESP2Parser", "_RESP3Parser"})


def _read_failed(connection: Any, exc: BaseException | None) -> None:
    """Close the connection and raise redis-py's error for a failed read, as redis-py does."""
    from redis import exceptions as rx

    host = connection._host_error()
    connection.disconnect()
    if exc is None:
        raise rx.ConnectionError(f"Connection closed by server {host}.")
    if isinstance(exc, TimeoutError):
        raise rx.TimeoutError(f"Timeout reading from {host}") from None
    if isinstance(exc, OSError):
        raise rx.ConnectionError(f"Error while reading from {host} : {exc.args}") from None


def _send_failed(connection: Any, exc: BaseException) -> None:
    """Close the connection and raise redis-py's error for a failed send, as redis-py does."""
    from redis import exceptions as rx

    if isinstance(exc, TimeoutError):  # socket.timeout is the builtin TimeoutError
        connection.disconnect()
        raise rx.TimeoutError("Timeout writing to socket") from None
    if isinstance(exc, OSError):
        connection.disconnect()
        if len(exc.args) == 1:
            number, message = "UNKNOWN", exc.args[0]
        else:
            number, message = exc.args[0], exc.args[1]
        raise rx.ConnectionError(f"Error {number} while writing to socket. {message}.") from None


def _send_framed(
    connection: Any,
    guard: Guard,
    codec: ChunkCodec,
    key: OffloadKey,
    payload: Any,
    head: bytes,
    tail: bytes,
) -> None:
    """Send one value framed in a buffer this thread reuses (TLS: no raw socket to send on).

    The value is written into the frame in the same pass that checksums the row.
    """
    size = codec.value_bytes(key)
    frame = _frame_buffer(len(head) + size + len(tail))
    frame[: len(head)] = head
    with guard.lock:
        if guard.abandoned:
            raise Abandoned
        end = len(head) + codec.encode_into(key, payload, frame[len(head) :])
    frame[end : end + len(tail)] = tail
    connection.send_packed_command([frame[: end + len(tail)]], check_health=False)


class Guard:
    """Who may touch the caller's buffers: the worker thread, until the call is abandoned."""

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False

    def abandon(self) -> None:
        with self.lock:  # waits for at most one row being encoded or decoded
            self.abandoned = True


class Abandoned(Exception):
    """The call was abandoned (timed out or cancelled): stop, touch no buffer."""


#: One chunk of a call: its key, its remote key, and its row (``None`` for ``contains``).
Row = tuple[OffloadKey, bytes, Any]


class Answer(Generic[T]):
    """What a worker thread did: a value per row (``None``: no answer), errors, trips."""

    __slots__ = ("errors", "refused", "round_trips", "timed_out", "unavailable", "values")

    def __init__(self, rows: int) -> None:
        self.values: list[T | None] = [None] * rows
        self.round_trips = 0
        #: What made the call fail (the store could not answer it as a whole).
        self.errors: list[str] = []
        #: ``(reason, message)`` per command the server refused (``OOM``, ``READONLY``, ...).
        self.refused: list[tuple[str, str]] = []
        #: Why the store could not be reached, if it could not (the rest is unanswered).
        self.unavailable: str | None = None
        #: Whether that was a socket timing out.
        self.timed_out = False


#: Reads a connection's replies to ``positions``, handing each to ``receive(position, reply)``.
Replies = Callable[[Any, list[int], Callable[[int, Any], None]], None]


def _each_reply(connection: Any, positions: list[int], receive: Callable[[int, Any], None]) -> None:
    """redis-py's parser reads each reply (a refusal is given as its exception)."""
    refused = _errors().refused
    for position in positions:
        try:
            reply = connection.read_response()
        except refused as exc:
            reply = exc
        receive(position, reply)


#: What a call does in its thread: ``work(client, guard, answer, rows, batch)``.
Work = Callable[[Any, Guard, "Answer[T]", list[Row], list[int]], None]


class RedisWire:
    """The blocking I/O of one `RedisTier`: its redis-py client and its calls. Thread-safe."""

    def __init__(
        self,
        url: str,
        shown_url: str,
        codec: ChunkCodec,
        *,
        cluster: bool | None,
        timeout_s: float,
        connect_timeout_s: float,
        socket_read_size: int,
        max_batch: int,
        ttl_s: float | None,
    ) -> None:
        self._url = url
        self.url = shown_url
        self.codec = codec
        #: Whether the server is a Redis Cluster (``None`` until the first connection tells).
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.socket_read_size = socket_read_size
        self.max_batch = max_batch
        self.ttl_s = ttl_s
        self._client: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._refresh_slots = False  # set when the cluster's slot map is stale

    def client(self) -> Any:
        """The redis-py client, built (and the server kind detected) on first use."""
        with self._lock:
            if self._closed:
                raise ResourceClosedError(f"the Redis tier at {self.url} is closed")
            if self._client is None:
                self._client = self._build_client()
            return self._client

    def close(self) -> None:
        """Close the client's connections; idempotent. Calls after this fail as closed."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def ping(self) -> None:
        """Connect and PING; raise `ConfigError` naming what is wrong."""
        errors = _errors()
        try:
            self.client().ping()
        except (*errors.any, *errors.unavailable) as exc:
            raise _config_error(self.url, exc, errors) from None

    def run(
        self,
        work: Callable[[Any, Guard, Answer[T], list[Row], list[int]], None],
        guard: Guard,
        rows: list[Row],
    ) -> Answer[T]:
        errors = _errors()
        answer: Answer[T] = Answer(len(rows))
        try:
            client = self.client()
            if self.cluster and self._refresh_slots:
                self._refresh_slots = False
                client.nodes_manager.initialize()
            for start in range(0, len(rows), self.max_batch):
                batch = list(range(start, min(len(rows), start + self.max_batch)))
                work(client, guard, answer, rows, batch)
        except Abandoned:
            pass  # nobody waits for this answer any more
        except errors.unavailable as exc:
            answer.unavailable = describe(exc)
            answer.timed_out = isinstance(exc, errors.timeout)
            self._refresh_slots = True
        except errors.any as exc:
            answer.errors.append(describe(exc))
        except ResourceClosedError:
            answer.unavailable = "ResourceClosedError: the tier was closed"
        return answer

    def exchange(
        self,
        client: Any,
        answer: Answer[Any],
        rows: list[Row],
        batch: list[int],
        send: Callable[[Any, list[int]], None],
        receive: Callable[[int, Any], None],
        replies: Replies | None = None,
    ) -> None:
        """One round trip per node: send each node its commands, then read every answer.

        ``send(connection, positions)`` writes the commands of ``rows[positions]``;
        ``receive(position, reply)`` takes each reply (a refusal is a
        ``ResponseError`` instance) in order, as ``replies(connection,
        positions, receive)`` reads them (redis-py's parser, one by one, unless
        given). A connection whose replies were not all read is closed, never
        reused.
        """
        routes = self.route(client, rows, batch)
        taken: list[tuple[Any, Any]] = []
        read = 0
        try:
            for pool, positions in routes:
                connection = pool.get_connection()
                taken.append((pool, connection))
                send(connection, positions)
            answer.round_trips += len(routes)
            for (_, connection), (_, positions) in zip(taken, routes, strict=True):
                (replies or _each_reply)(connection, positions, receive)
                read += 1
        finally:
            for i, (pool, connection) in enumerate(taken):
                if i >= read:
                    connection.disconnect()
                pool.release(connection)

    def route(self, client: Any, rows: list[Row], batch: list[int]) -> list[tuple[Any, list[int]]]:
        """(connection pool, positions) per node that holds ``rows[batch]``."""
        if not self.cluster:
            return [(client.connection_pool, batch)]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for position in batch:
            node = client.get_node_from_key(rows[position][1])
            group = groups.get(node.name)
            if group is None:
                pool = client.get_redis_connection(node).connection_pool
                group = groups[node.name] = (pool, [])
            group[1].append(position)
        return list(groups.values())

    def accepted(self, answer: Answer[Any], reply: Any) -> bool:
        """False (and the refusal counted) when ``reply`` is the server refusing a command."""
        if not isinstance(reply, BaseException):
            return True
        if isinstance(reply, _errors().unavailable):
            raise reply  # CLUSTERDOWN and the like: the store as a whole is away
        answer.refused.append((refusal_reason(reply), describe(reply)))
        if isinstance(reply, _errors().moved):
            self._refresh_slots = True  # the slot map is stale: refresh it on the next call
        return False

    def contains(
        self, client: Any, guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]
    ) -> None:
        def send(connection: Any, positions: list[int]) -> None:
            commands = [("EXISTS", rows[p][1]) for p in positions]
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)

        def receive(position: int, reply: Any) -> None:
            answer.values[position] = self.accepted(answer, reply) and reply == 1

        self.exchange(client, answer, rows, batch, send, receive)

    def write(
        self, client: Any, guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]
    ) -> None:
        argc, expiry = 3, b""
        if self.ttl_s is not None:
            ms = b"%d" % max(1, round(self.ttl_s * 1000))
            argc, expiry = 5, b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)

        def frame(key: OffloadKey, remote: bytes) -> tuple[bytes, bytes]:
            """A SET frame's bytes before and after the value."""
            size = self.codec.value_bytes(key)
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(remote), remote, size)
            return head, b"\r\n" + expiry

        def send(connection: Any, positions: list[int]) -> None:
            # Streamed: each value is sent before the next is checksummed, so the
            # server takes one while this thread checksums the next.
            sock = _plain_socket(connection)
            if sock is None:  # TLS: each frame built in a buffer, then sent
                for p in positions:
                    key, remote, payload = rows[p]
                    head, tail = frame(key, remote)
                    _send_framed(connection, guard, self.codec, key, payload, head, tail)
                return
            # Each RESP frame (SET key value [PX ms]) goes out in one sendmsg: our
            # bytes (the last frame's tail, this one's head and the value's
            # header with its checksum), then the caller's row from its buffer.
            stream = _Stream(connection, sock, guard)
            try:
                pending = b""  # our own bytes not sent yet: the last frame's tail
                for p in positions:
                    key, remote, payload = rows[p]
                    head, tail = frame(key, remote)
                    with guard.lock:
                        if guard.abandoned:
                            raise Abandoned
                        header = self.codec.encode_header(key, payload)
                    stream.send(pending + head + header, payload)
                    pending = tail
                stream.send(pending)
            finally:
                stream.close()

        def receive(position: int, reply: Any) -> None:
            answer.values[position] = self.accepted(answer, reply) and reply == b"OK"

        self.exchange(client, answer, rows, batch, send, receive)

    def read(
        self,
        client: Any,
        guard: Guard,
        answer: Answer[Verdict],
        rows: list[Row],
        batch: list[int],
    ) -> None:
        def send(connection: Any, positions: list[int]) -> None:
            commands = [("GET", rows[p][1]) for p in positions]
            connection.send_packed_command(connection.pack_commands(commands), check_health=False)

        def receive(position: int, reply: Any) -> None:
            # Each value is checked and copied as it arrives, while the next is in flight.
            if isinstance(reply, BaseException) and str(reply).startswith("WRONGTYPE"):
                answer.values[position] = Verdict.BAD_MAGIC  # not a string: not ours
            elif self.accepted(answer, reply) and reply is not None:
                key, _, out = rows[position]
                with guard.lock:
                    if guard.abandoned:
                        raise Abandoned
                    answer.values[position] = self.codec.decode_into(key, reply, out)

        def replies(
            connection: Any, positions: list[int], receive: Callable[[int, Any], None]
        ) -> None:
            sock = _plain_socket(connection)
            if sock is None or not _Replies.usable(connection):
                _each_reply(connection, positions, receive)
                return
            reader = _Replies(connection, sock, guard, self.socket_read_size)
            try:
                for position in positions:
                    key, _, out = rows[position]
                    reply = reader.reply(self.codec, key, out)
                    if isinstance(reply, Verdict):
                        answer.values[position] = reply
                    else:
                        receive(position, reply)
            finally:
                reader.close()

        self.exchange(client, answer, rows, batch, send, receive, replies)

    def _build_client(self) -> Any:
        import redis
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_read_size": self.socket_read_size,
            "retry": Retry(NoBackoff(), 0),
            "client_name": "tiering",
        }
        if not self.cluster:
            client = redis.Redis.from_url(self._url, **options)
            if self.cluster is False:
                return client
            try:
                enabled = bool(client.info("cluster").get("cluster_enabled"))
            except redis.exceptions.NoPermissionError:
                enabled = False  # a user that may not run INFO: take it as standalone
            except BaseException:
                client.close()
                raise
            if not enabled:
                self.cluster = False
                return client
            client.close()
            self.cluster = True
        return redis.cluster.RedisCluster.from_url(self._url, **options)


class _RedisErrors:
    """redis-py's exception classes, sorted by what they mean for the tier."""

    def __init__(self) -> None:
        from redis import exceptions as rx

        #: The store is away: the tier goes down.
        self.unavailable: tuple[type[BaseException], ...] = (
            rx.ConnectionError,
            rx.TimeoutError,
            rx.ClusterError,
            rx.ClusterDownError,
            rx.SlotNotCoveredError,
            rx.InvalidResponse,
            rx.RedisClusterException,  # cannot build or refresh the cluster's slot map
            OSError,
        )
        #: ... because a socket timed out.
        self.timeout: tuple[type[BaseException], ...] = (rx.TimeoutError, TimeoutError)
        #: Anything redis-py raises on purpose.
        self.any: tuple[type[BaseException], ...] = (rx.RedisError,)
        #: The server refused one command (its reply is an error).
        self.refused: tuple[type[BaseException], ...] = (rx.ResponseError,)
        #: ... because the cluster's slot map changed.
        self.moved: tuple[type[BaseException], ...] = (rx.AskError, rx.TryAgainError)
        self.auth: tuple[type[BaseException], ...] = (rx.AuthenticationError,)
        self.permission: tuple[type[BaseException], ...] = (rx.NoPermissionError,)


_ERRORS: _RedisErrors | None = None
_CODES: dict[type[BaseException], str] | None = None


def refusal_reason(exc: BaseException) -> str:
    """The server's error code of a refusal: ``OOM``, ``READONLY``, ``WRONGTYPE``, ``ERR``...

    redis-py strips the code off the message of the errors it maps to a class
    of their own (``OOM`` becomes `OutOfMemoryError`), so those are mapped back.
    """
    global _CODES
    if _CODES is None:
        from redis._parsers.base import BaseParser

        _CODES = {
            cls: code for code, cls in BaseParser.EXCEPTION_CLASSES.items() if isinstance(cls, type)
        }
    code = _CODES.get(type(exc))
    if code is not None:
        return code
    first = str(exc).split(" ", 1)[0]
    if first.isalpha() and first.isupper():
        return first  # a code redis-py does not know keeps its message whole
    return "ERR" if type(exc).__name__ == "ResponseError" else type(exc).__name__


def _errors() -> _RedisErrors:
    global _ERRORS
    if _ERRORS is None:
        _ERRORS = _RedisErrors()
    return _ERRORS


#: What a plain-TCP client reads from a server that expects a TLS handshake.
_CLOSED_WORDS = ("Connection closed by server", "Connection reset by peer")


def _config_error(url: str, exc: BaseException, errors: _RedisErrors) -> ConfigError:
    text = describe(exc)
    if isinstance(exc, errors.auth) or any(w in str(exc) for w in _AUTH_WORDS):
        return ConfigError(
            f"cannot open the Redis tier at {url}: the server refused the user name or "
            f"password ({text})"
        )
    if isinstance(exc, errors.permission):
        return ConfigError(
            f"cannot open the Redis tier at {url}: the user may not run the commands the tier "
            f"needs: PING, EXISTS, GET, SET, INFO ({text})"
        )
    hint = ""
    if url.startswith("rediss://") and (isinstance(exc, errors.timeout) or "SSL" in text):
        hint = (
            "; the TLS handshake did not complete: if the server speaks plain TCP on this "
            "port, use redis:// instead of rediss://"
        )
    elif url.startswith("redis://") and any(w in text for w in _CLOSED_WORDS):
        hint = "; if the server speaks TLS on this port, use rediss:// instead of redis://"
    return ConfigError(f"cannot reach the Redis tier at {url}: {text}{hint}")
