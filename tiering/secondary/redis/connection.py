"""The tier's own connections to Redis: a socket, a `ReplyReader`, and a caller's buffers.

Everything here blocks and runs in the tier's worker threads. A `Connection`
is one socket the tier opened itself (TCP, or TLS for ``rediss://``), logged
in (``AUTH``, ``SELECT``, ``CLIENT SETNAME``, in one round trip) and speaking
RESP2. It sends commands and a caller's rows, and reads replies through its
`ReplyReader`, which puts a value's payload where a sink says: on a plain
socket the kernel receives it straight into the caller's row.

Buffers: a caller's row is read (sent) or written (received) only under the
call's `Guard`, in non-blocking pieces of at most `PIECE` bytes; the waits for
the socket are outside the guard, bounded by the timeout. Once the call is
abandoned the thread stops before the next piece (`Abandoned`). On TLS there
is no non-blocking path to a caller's row: rows are framed, and values
received, in buffers of the thread, copied under the guard.

Failures close the connection and raise redis-py's exception classes, with
redis-py's messages (see `tiering.secondary.redis.failures`). A connection
is reused only in step: no unread byte, no half-sent command.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from tiering._state import Lifecycle
from tiering.secondary.base import Abandoned, Guard
from tiering.secondary.redis.address import RedisAddress
from tiering.secondary.redis.failures import error_from_reply, errors
from tiering.secondary.redis.resp import (
    NEED_DATA,
    BulkSink,
    ErrorReply,
    ProtocolError,
    Push,
    ReplyReader,
    command,
)

__all__ = ["PIECE", "Abandoned", "Connection", "ConnectionPool", "Guard"]

logger = logging.getLogger(__name__)

#: Most bytes of a caller's row handed to the kernel, or taken from it, at once (under the guard).
PIECE = 1 << 20


class Connection:
    """One socket of the tier's own to one server. Not thread-safe: one call at a time.

    Plain TCP sockets are non-blocking, each wait bounded by ``timeout_s``;
    TLS sockets block, with ``timeout_s`` as their timeout.
    """

    __slots__ = (
        "_poll_in",
        "_poll_out",
        "_read_size",
        "_reader",
        "_sock",
        "address",
        "client_name",
        "connect_timeout_s",
        "timeout_s",
    )

    def __init__(
        self,
        address: RedisAddress,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        read_size: int = 256 << 10,
        client_name: str = "tiering",
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.client_name = client_name
        self._read_size = read_size
        self._reader = ReplyReader(read_size)
        self._sock: socket.socket | None = None
        self._poll_in: Any = None
        self._poll_out: Any = None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def reusable(self) -> bool:
        """Connected and in step: every reply asked for read, and nothing more."""
        return self._sock is not None and self._reader.unread == 0

    def connect(self) -> None:
        """Open the socket and log in; raise redis-py's error (the connection closed) if not."""
        rx = errors().rx
        address = self.address
        try:
            sock = socket.create_connection(
                (address.host, address.port), timeout=self.connect_timeout_s
            )
        except TimeoutError:
            raise rx.TimeoutError("Timeout connecting to server") from None
        except OSError as exc:
            raise rx.ConnectionError(_connect_message(address.name, exc)) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if address.tls:
                sock = address.ssl_context().wrap_socket(sock, server_hostname=address.host)
                sock.settimeout(self.timeout_s)
            else:
                sock.settimeout(0.0)
                self._poll_in = select.poll()
                self._poll_in.register(sock, select.POLLIN)
                self._poll_out = select.poll()
                self._poll_out.register(sock, select.POLLOUT)
        except TimeoutError:
            sock.close()
            raise rx.TimeoutError("Timeout connecting to server") from None
        except OSError as exc:  # ssl.SSLError too: a failed handshake, an untrusted certificate
            sock.close()
            raise rx.ConnectionError(_connect_message(address.name, exc)) from None
        self._sock = sock
        self._reader = ReplyReader(self._read_size)  # nothing left of an earlier socket
        try:
            self._log_in()
        except BaseException:
            self.close()
            raise

    def _log_in(self) -> None:
        address, rx = self.address, errors().rx
        steps: list[tuple[bytes, ...]] = []
        if address.password is not None or address.username is not None:
            password = (address.password or "").encode()
            user = address.username.encode() if address.username is not None else None
            steps.append((b"AUTH", user, password) if user is not None else (b"AUTH", password))
        if address.db:
            steps.append((b"SELECT", b"%d" % address.db))
        steps.append((b"CLIENT", b"SETNAME", self.client_name.encode()))
        self.send(None, b"".join(command(*step) for step in steps))
        replies = [self.reply(None) for _ in steps]
        for step, reply in zip(steps, replies, strict=True):
            if not isinstance(reply, ErrorReply):
                continue
            error = error_from_reply(reply)
            if step[0] == b"CLIENT" and isinstance(error, rx.NoPermissionError):
                continue  # a user that may not name its connection: no matter
            if isinstance(error, rx.ResponseError) and step[0] == b"AUTH":
                error = rx.AuthenticationError(str(error))
            raise error

    def close(self) -> None:
        """Close the socket (idempotent). Unread bytes are dropped with it."""
        sock, self._sock = self._sock, None
        self._poll_in = self._poll_out = None
        if sock is not None:
            with contextlib.suppress(OSError):  # closing never matters
                sock.close()

    def stale(self) -> bool:
        """An idle plain connection the server closed, or that has bytes nobody asked for."""
        if self._sock is None:
            return True
        if self._poll_in is None:
            return self._tls_stale()
        return bool(self._poll_in.poll(0))

    def _tls_stale(self) -> bool:
        """A TLS socket is readable for session tickets too: ask TLS itself, without
        waiting, whether application data or the end of the stream is there."""
        sock = self._sock
        assert sock is not None
        timeout = sock.gettimeout()
        try:
            sock.settimeout(0)
            sock.recv(1)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return False  # nothing to read: sound (a ticket, if any, was taken by TLS)
        except OSError:
            return True
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(timeout)
        return True  # closed by the server (b""), or bytes nobody asked for

    # -- commands ----------------------------------------------------------------

    def command(self, *args: bytes) -> Any:
        """Send one command and read its reply (an `ErrorReply` is returned, not raised)."""
        self.send(None, command(*args))
        return self.reply(None)

    def send(
        self, guard: Guard | None, own: bytes | memoryview, row: memoryview | None = None
    ) -> None:
        """Send ``own`` then ``row`` (if given; plain sockets only), ``row`` under the guard.

        On a plain socket each ``sendmsg`` takes our bytes and a piece of the
        row at once (the kernel's copy is the only one); waiting for room in
        the socket's buffer is outside the guard, within the timeout. Once the
        call is abandoned, no row is read again (the connection, holding a
        partial command, is then closed by whoever released it).
        """
        sock = self._sock
        if sock is None:
            self.connect()
            sock = self._sock
            assert sock is not None
        if self._poll_out is None:
            if row is not None:
                raise ValueError("a TLS connection sends rows framed, not from the caller's buffer")
            try:
                sock.sendall(own)
            except BaseException as exc:
                self._send_failed(exc)
                raise
            return
        ours = memoryview(own)
        size = 0 if row is None else row.nbytes
        mine = theirs = 0  # bytes sent of each
        try:
            while mine < len(ours) or theirs < size:
                parts = [ours[mine:]] if mine < len(ours) else []
                with _held(guard):
                    if row is not None and theirs < size:
                        parts.append(row[theirs : theirs + PIECE])
                    sent = self._sendmsg(sock, parts)
                if sent < 0:
                    if not self._poll_out.poll(self._wait_ms()):
                        raise TimeoutError("timed out")
                    continue
                took = min(sent, len(ours) - mine)
                mine += took
                theirs += sent - took
        except Abandoned:
            raise
        except BaseException as exc:
            self._send_failed(exc)
            raise

    @staticmethod
    def _sendmsg(sock: socket.socket, parts: list[memoryview]) -> int:
        try:
            return sock.sendmsg(parts)
        except BlockingIOError:
            return -1

    def reply(self, guard: Guard | None, sink: BulkSink | None = None) -> Any:
        """The next reply (read past push frames); a bulk string through ``sink`` if given.

        With a ``guard``, the reader moves bytes into a sink's buffer, and the
        socket receives into it, only under the guard's lock. An
        `ErrorReply` is returned; a malformed stream closes the connection
        and raises redis-py's ``InvalidResponse``.
        """
        reader = self._reader
        while True:
            try:
                with _held(guard):
                    reply = reader.reply(sink)
            except ProtocolError as exc:
                self.protocol_error(str(exc))
            if reply is NEED_DATA:
                self._receive(guard)
            elif isinstance(reply, Push):  # the tier subscribes to nothing: a notification
                logger.debug("Redis tier: a push frame from %s: %.200r", self.address.name, reply)
            else:
                return reply

    def protocol_error(self, what: str) -> NoReturn:
        """Close the connection and raise redis-py's protocol error."""
        self.close()
        raise errors().rx.InvalidResponse(f"Protocol Error: {what}")

    # -- receiving ---------------------------------------------------------------

    def _receive(self, guard: Guard | None) -> None:
        """Receive what the reader asks for: at least one byte, or all of a routed payload."""
        sock = self._sock
        if sock is None:
            raise errors().rx.ConnectionError("Connection closed by server.")
        reader = self._reader
        poll = self._poll_in
        while True:
            try:
                view = reader.buffer()
            except ProtocolError as exc:
                self.protocol_error(str(exc))
            if poll is None:  # TLS: blocking, never into a caller's row
                try:
                    got = sock.recv_into(view)
                except BaseException as exc:
                    self._read_failed(exc)
            elif guard is None:
                got = self._recv_nowait(sock, view[:PIECE])
            else:
                with guard.lock:
                    if guard.abandoned:
                        raise Abandoned
                    got = self._recv_nowait(sock, view[:PIECE])
            if got < 0:  # nothing yet: wait for it, outside the guard
                try:
                    ready = poll.poll(self._wait_ms())
                except BaseException as exc:
                    self._read_failed(exc)
                if not ready:
                    self._read_failed(TimeoutError("timed out"))
                continue
            if got == 0:
                self._read_failed(None)
            reader.received(got)
            if not reader.routing:  # the reader has bytes to parse
                return

    def _recv_nowait(self, sock: socket.socket, into: memoryview) -> int:
        try:
            return sock.recv_into(into)
        except BlockingIOError:
            return -1
        except BaseException as exc:
            self._read_failed(exc)

    def _wait_ms(self) -> int:
        return max(1, math.ceil(self.timeout_s * 1000))

    def _read_failed(self, exc: BaseException | None) -> NoReturn:
        """Close the connection and raise redis-py's error for a failed read."""
        rx = errors().rx
        name = self.address.name
        self.close()
        if exc is None:
            raise rx.ConnectionError("Connection closed by server.")
        if isinstance(exc, TimeoutError):
            raise rx.TimeoutError(f"Timeout reading from {name}") from None
        if isinstance(exc, OSError):
            raise rx.ConnectionError(f"Error while reading from {name} : {exc.args}") from None
        raise exc

    def _send_failed(self, exc: BaseException) -> None:
        """Close the connection and raise redis-py's error for a failed send."""
        rx = errors().rx
        self.close()
        if isinstance(exc, TimeoutError):  # socket.timeout is the builtin TimeoutError
            raise rx.TimeoutError("Timeout writing to socket") from None
        if isinstance(exc, OSError):
            if len(exc.args) == 1:
                number, message = "UNKNOWN", exc.args[0]
            else:
                number, message = exc.args[0], exc.args[1]
            raise rx.ConnectionError(
                f"Error {number} while writing to socket. {message}."
            ) from None

    def __repr__(self) -> str:
        state = "connected" if self._sock is not None else "closed"
        return f"<Connection [{state}; {self.address.name}; {self._reader.unread} unread]>"


@contextlib.contextmanager
def _held(guard: Guard | None) -> Iterator[None]:
    """Hold ``guard`` (raise `Abandoned` if the call was abandoned); nothing without one."""
    if guard is None:
        yield
        return
    with guard.lock:
        if guard.abandoned:
            raise Abandoned
        yield


def _connect_message(name: str, exc: OSError) -> str:
    """redis-py's words for a failed connect."""
    if not exc.args:
        return f"Error connecting to {name}."
    if len(exc.args) == 1:
        return f"Error {exc.args[0]} connecting to {name}."
    return f"Error {exc.args[0]} connecting to {name}. {exc.args[1]}."


class ConnectionPool:
    """Idle connections to one server, reused last in, first out. Thread-safe.

    Unbounded, like redis-py's: the tier's thread limiter bounds how many
    calls (so connections) are in use at once.
    """

    def __init__(
        self,
        address: RedisAddress,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        read_size: int,
    ) -> None:
        self.address = address
        self._options: dict[str, Any] = {
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "read_size": read_size,
        }
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._life = Lifecycle("the connection pool", opened=True)
        self.created = 0

    def get(self) -> Connection:
        """An idle connection in step, or a new one (connected: redis-py's error if not)."""
        while True:
            with self._lock:
                if self._life.closed:  # a call that outlived the tier: the store is away
                    raise errors().rx.ConnectionError("the connection pool is closed")
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                break
            if not connection.stale():
                return connection
            connection.close()  # the server closed it while it was idle
        connection = Connection(self.address, **self._options)
        with self._lock:
            self.created += 1
        connection.connect()
        return connection

    def release(self, connection: Connection) -> None:
        """Give ``connection`` back: kept if in step and the pool is open, else closed."""
        with self._lock:
            if connection.reusable and not self._life.closed:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        """Close the idle connections; those in use are closed when released."""
        with self._lock:
            self._life.close_now()
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def __repr__(self) -> str:
        return f"<ConnectionPool [{self.address.name}; {len(self._idle)} idle]>"
