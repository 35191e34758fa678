"""RESP, sans-IO: commands out as bytes, bytes in as replies. No sockets, no threads.

Design note: the tier reads multi-megabyte values, and the one copy it can
afford is the kernel's, from the socket straight into the caller's row. A
reader that takes ``bytes`` and gives back ``bytes`` (redis-py's parsers,
hiredis) cannot do that: the value is copied out of its buffers at least
once more before the tier can check it and copy it into the row. So
`ReplyReader` is fed the way `asyncio.BufferedProtocol` is: the driver asks
it where the next bytes should go (`ReplyReader.buffer`), receives into that
view, and says how many landed (`ReplyReader.received`). That is the reader's
own buffer, except while a bulk string is being *routed*: a `BulkSink` given
to `ReplyReader.reply` sees the value's size and its first bytes, and names
where the rest goes (the caller's row, checked first) or that it is to be
dropped. `ReplyReader.feed` takes plain bytes, for tests and for drivers that
have only bytes.

The reader knows RESP2 and RESP3 replies (the tier speaks RESP2, so a server
sends it no push frames; one that does is read past). Aggregates (arrays,
maps, pushes) must fit in the buffer; a top-level bulk string may be of any
size up to `MAX_BULK`. Anything malformed is a `ProtocolError`: the stream is
then out of step for good and the connection must be closed.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

__all__ = [
    "MAX_BULK",
    "MAX_LINE",
    "NEED_DATA",
    "ROUTED",
    "BulkSink",
    "ErrorReply",
    "ProtocolError",
    "Push",
    "ReplyReader",
    "command",
]

#: The longest reply line the reader takes (the replies the tier reads have short lines).
MAX_LINE: Final = 64 << 10
#: The largest bulk string the reader takes (Redis's own ``proto-max-bulk-len``).
MAX_BULK: Final = 512 << 20
#: Aggregates nest at most this deep.
_MAX_DEPTH: Final = 32


class _Marker:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: `ReplyReader.reply` needs more bytes before it can give the next reply.
NEED_DATA: Final = _Marker("NEED_DATA")
#: `ReplyReader.reply` routed a bulk string through its `BulkSink`, all of it.
ROUTED: Final = _Marker("ROUTED")


class ProtocolError(Exception):
    """The bytes are not a RESP reply stream: close the connection."""


class ErrorReply:
    """An error reply (``-CODE message`` or RESP3's blob error). ``code``: its first word."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    @property
    def code(self) -> str:
        """The error's code: ``OOM``, ``WRONGTYPE``, ``MOVED``...; ``ERR`` when it names none."""
        first = self.text.split(" ", 1)[0]
        return first if first.isalpha() and first.isupper() else "ERR"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ErrorReply) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"ErrorReply({self.text!r})"


class Push(list[Any]):
    """A RESP3 push frame (a notification the server sends unasked)."""


class BulkSink(Protocol):
    """Where a bulk string reply goes, decided from its size and its first bytes."""

    def head(self, size: int) -> int:
        """How many first bytes of a bulk string of ``size`` bytes `route` needs (<= size)."""

    def route(self, head: memoryview, size: int) -> memoryview | None:
        """Where the rest (``size - len(head)`` bytes) goes: a writable view that long,
        or ``None`` to drop it. ``head`` is valid during the call only."""


def command(*args: bytes) -> bytes:
    """A command as RESP bytes: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


class _Incomplete(Exception):
    """Internal: the buffered bytes end inside the reply being parsed."""


_INCOMPLETE = _Incomplete()


class ReplyReader:
    """Reads RESP replies from bytes it is given; routes bulk strings where a sink says.

    Not thread-safe; one per connection. ``size`` is the buffer's size: the
    most a driver receives at once, and the largest aggregate reply.
    """

    __slots__ = (
        "_dest",
        "_dest_at",
        "_end",
        "_handed",
        "_left",
        "_raw",
        "_size",
        "_start",
        "_view",
        "_whole",
    )

    def __init__(self, size: int = 256 << 10) -> None:
        self._size = max(size, 2 * MAX_LINE)
        self._raw = bytearray(self._size)
        self._view = memoryview(self._raw)
        self._start = self._end = 0  # the unread bytes: _raw[_start:_end]
        # A bulk string being routed: _left bytes of it still to come (then its
        # CRLF), into _dest[_dest_at:] or, with no _dest, dropped.
        self._left = -1
        self._dest: memoryview | None = None
        self._dest_at = 0
        self._handed = False  # whether buffer() last gave out _dest
        self._whole: _Whole | None = None  # the routed value is a reply of its own

    # -- bytes in -------------------------------------------------------------------

    def buffer(self) -> memoryview:
        """Where the next bytes received should go: a writable view, never empty.

        Receive into it (any number of bytes up to its length), then call
        `received`. While a routed value's payload is due and nothing is
        buffered, this is the sink's destination itself.
        """
        if self._left > 0 and self._dest is not None and self._start == self._end:
            self._handed = True
            return self._dest[self._dest_at : self._dest_at + self._left]
        self._handed = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._size - self._end < self._size // 4:
            # Little room left at the end: move what is unread to the front.
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        if self._end == self._size:
            raise ProtocolError(f"a reply of over {self._size} bytes")
        return self._view[self._end :]

    def received(self, n: int) -> None:
        """``n`` bytes landed in the view `buffer` returned last."""
        if n < 0:
            raise ValueError(f"received a negative count: {n}")
        if self._handed:
            self._handed = False
            self._dest_at += n
            self._left -= n
        else:
            self._end += n

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Take ``data`` (a copy): for tests, and for drivers that only have bytes.

        Feeds past a routed payload only as far as the reader can hold: call
        `reply` between feeds of more than the buffer's size.
        """
        view = memoryview(data).cast("B")
        while view.nbytes:
            into = self.buffer()
            n = min(into.nbytes, view.nbytes)
            into[:n] = view[:n]
            self.received(n)
            view = view[n:]

    @property
    def routing(self) -> bool:
        """Whether `buffer` is a sink's destination now (a routed payload is due)."""
        return self._left > 0 and self._dest is not None and self._start == self._end

    @property
    def unread(self) -> int:
        """Bytes received and not yet part of a reply given out."""
        return self._end - self._start

    # -- replies out ------------------------------------------------------------------

    def reply(self, sink: BulkSink | None = None) -> Any:
        """The next reply, `NEED_DATA` until it is all in, or `ROUTED`.

        Replies: ``bytes`` (simple and bulk strings; a large bulk string as a
        ``bytearray``), ``int``, ``float``, ``bool``, ``None`` (any null),
        `ErrorReply`, ``list``, ``dict``, `Push`. With a ``sink``, a bulk
        string reply is routed through it instead (`ROUTED` once its bytes
        have landed or been dropped); other replies come back as usual.
        Raises `ProtocolError` on bytes that are no reply.
        """
        if self._left >= 0:
            return self._finish_routed()
        if self._start == self._end:
            return NEED_DATA
        kind = self._raw[self._start]
        if kind != 0x24:  # not a bulk string ("$"): parsed whole, from the buffer
            try:
                value, at = self._parse(self._start, 0)
            except _Incomplete:
                return NEED_DATA
            self._start = at
            return value
        line = self._line_at(self._start)
        if line is None:
            return NEED_DATA
        size, at = self._bulk_size(line)
        if size < 0:
            self._start = at
            return None
        if sink is None:
            if at + size + 2 <= self._end:  # all here: a slice of the buffer
                value = bytes(self._view[at : at + size])
                self._start = at + size
                self._crlf()
                return value
            sink = _Whole()
        head = sink.head(size)
        if not 0 <= head <= size:
            raise ValueError(f"a sink asked for {head} head bytes of a {size}-byte value")
        if head > self._size - (at - self._start):
            raise ValueError(f"a sink asked for {head} head bytes; the buffer holds {self._size}")
        if at + head > self._end:
            return NEED_DATA  # the line is parsed again with the head
        self._start = at + head
        self._dest = sink.route(self._view[at : at + head], size)
        if self._dest is not None and self._dest.nbytes != size - head:
            raise ValueError(
                f"a sink gave {self._dest.nbytes} bytes for the {size - head} left of a value"
            )
        self._dest_at = 0
        self._left = size - head
        self._whole = sink if isinstance(sink, _Whole) else None
        return self._finish_routed()

    def _finish_routed(self) -> Any:
        """Move buffered bytes of the routed value to its destination; ROUTED when done
        (or the value itself, when it was routed into a bytearray of its own)."""
        if self._left > 0:
            got = min(self._left, self._end - self._start)
            if got:
                if self._dest is not None:
                    at = self._dest_at
                    self._dest[at : at + got] = self._view[self._start : self._start + got]
                    self._dest_at += got
                self._start += got
                self._left -= got
            if self._left:
                return NEED_DATA
        if self._end - self._start < 2:
            return NEED_DATA
        self._crlf()
        self._left = -1
        self._dest = None
        whole, self._whole = self._whole, None
        return ROUTED if whole is None else whole.value

    def _crlf(self) -> None:
        if self._raw[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("a bulk string not followed by CRLF")
        self._start += 2

    # -- parsing (from the buffer; _Incomplete when it ends too soon) -----------------

    def _line_at(self, at: int) -> bytes | None:
        end = self._raw.find(b"\r\n", at, min(self._end, at + MAX_LINE + 2))
        if end < 0:
            if self._end - at > MAX_LINE:
                raise ProtocolError(f"a reply line of over {MAX_LINE} bytes")
            return None
        return bytes(self._view[at:end])

    def _bulk_size(self, line: bytes) -> tuple[int, int]:
        """A bulk string's size from its line (-1: null) and where its bytes start."""
        try:
            size = int(line[1:])
        except ValueError:
            size = -2
        if size < -1 or size > MAX_BULK:
            raise ProtocolError(f"{line[:64]!r} is no bulk string")
        return size, self._start + len(line) + 2

    def _parse(self, at: int, depth: int) -> tuple[Any, int]:
        """The reply starting at ``at`` and where it ends; all of it must be buffered."""
        end = self._raw.find(b"\r\n", at, min(self._end, at + MAX_LINE + 2))
        if end < 0:
            if self._end - at > MAX_LINE:
                raise ProtocolError(f"a reply line of over {MAX_LINE} bytes")
            raise _INCOMPLETE
        kind, rest, after = self._raw[at], bytes(self._view[at + 1 : end]), end + 2
        if kind == 0x2B:  # +simple string
            return rest, after
        if kind == 0x2D:  # -error
            return ErrorReply(rest.decode("utf-8", errors="replace")), after
        if kind in (0x3A, 0x28):  # :integer, (big number
            return self._number(int, rest, kind), after
        if kind == 0x5F:  # _ RESP3 null
            return None, after
        if kind == 0x2C:  # ,double
            return self._number(float, rest, kind), after
        if kind == 0x23:  # #boolean
            if rest not in (b"t", b"f"):
                raise ProtocolError(f"{rest[:64]!r} is no boolean")
            return rest == b"t", after
        if kind in (0x24, 0x3D, 0x21):  # $bulk, =verbatim, !blob error
            size = self._number(int, rest, kind)
            if size == -1:
                return None, after
            if size < 0 or size > MAX_BULK:
                raise ProtocolError(f"{rest[:64]!r} is no length")
            if after + size + 2 > self._end:
                raise _INCOMPLETE
            if self._raw[after + size : after + size + 2] != b"\r\n":
                raise ProtocolError("a bulk string not followed by CRLF")
            blob = bytes(self._view[after : after + size])
            if kind == 0x3D:  # verbatim: "txt:" then the text
                blob = blob[4:]
            elif kind == 0x21:
                return ErrorReply(blob.decode("utf-8", errors="replace")), after + size + 2
            return blob, after + size + 2
        if kind in (0x2A, 0x7E, 0x3E, 0x25, 0x7C):  # *array ~set >push %map |attribute
            if depth >= _MAX_DEPTH:
                raise ProtocolError(f"replies nested over {_MAX_DEPTH} deep")
            count = self._number(int, rest, kind)
            if count == -1 and kind == 0x2A:
                return None, after
            if count < 0:
                raise ProtocolError(f"{rest[:64]!r} is no count")
            pairs = kind in (0x25, 0x7C)
            items = []
            for _ in range(count * 2 if pairs else count):
                item, after = self._parse(after, depth + 1)
                items.append(item)
            if kind == 0x7C:  # attributes describe the reply that follows: skip them
                return self._parse(after, depth)
            if pairs:
                return dict(zip(items[::2], items[1::2], strict=True)), after
            return (Push(items) if kind == 0x3E else items), after
        raise ProtocolError(f"{bytes(self._view[at:end])[:64]!r} is no RESP reply")

    @staticmethod
    def _number(cast: type[Any], text: bytes, kind: int) -> Any:
        try:
            return cast(text)
        except ValueError:
            raise ProtocolError(f"{chr(kind)}{text[:64]!r} is no number") from None

    def __repr__(self) -> str:
        routed = f", {self._left} bytes to route" if self._left >= 0 else ""
        return f"<ReplyReader [{self.unread} unread of {self._size}{routed}]>"


class _Whole:
    """The sink of a bulk string too large for the buffer: one bytearray of its own."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = bytearray()

    def head(self, size: int) -> int:
        return 0

    def route(self, head: memoryview, size: int) -> memoryview:
        self.value = bytearray(size)
        return memoryview(self.value)
