"""The ZMQ subscriber client: live batches in order, gaps filled from the replay socket.

``async for item in ZmqSubscriber(endpoint, replay_endpoint):`` yields a
`SequencedBatch` for every batch, in sequence order and without duplicates,
and a `Gap` where batches were lost for good. It runs on asyncio and trio.

Design note: the sockets are never touched from another thread. The client
waits on each socket's ZeroMQ file descriptor with `anyio.wait_readable` and
then reads without blocking. That descriptor is edge-triggered, so the client
only waits after a read found nothing *and* the socket's ``EVENTS`` says
nothing is pending; nothing spins and nothing polls on a timer.

Gaps: when a live batch arrives with a sequence number past the next one
expected, the client asks the replay socket for everything from the expected
one, yields the replayed batches, and keeps the live one until the replay ends
(``END_SEQ``); a replayed or live batch it already yielded is skipped. A range
the replay no longer holds, no replay socket, or a replay that does not answer
within ``replay_timeout`` seconds is reported as a `Gap`. A message that is not
a batch (wrong frames, a payload that does not decode as a `KVEventBatch`) is
skipped and counted (``malformed_total``; the first one logs one warning): one
bad message never ends the stream, and its sequence number, where it is the
one expected, is taken, so it is not reported again as a gap (a number further
ahead is not trusted: no gap is reported for it, no later batch dropped).
With ``start_seq`` the client first replays from that number, so a late
joiner sees the history still buffered, then goes live. Batches lost at the end of a burst have no
later batch to reveal them, so after ``idle_replay`` seconds without a live
batch the client also asks the replay socket for anything newer (one small
request per interval while the stream is quiet). Iteration survives cancellation: a replay in
progress resumes on the next step. A publisher restart (the sequence starting
again from 0) is not detected: its batches look like duplicates.

The SUB socket connects to its endpoint, unless the endpoint has a ``*``
wildcard (``tcp://*:5557``): then it binds it, for a publisher that connects
(one given a concrete host, by vLLM's rule); bound on every interface, it logs
one warning (anyone who reaches the port can publish into it). `has_publisher`
says whether a publisher has been met at all, from the socket's connection
events: a quiet stream and an endpoint nobody serves look the same otherwise.
"""

from __future__ import annotations

import logging
import socket
from collections import deque

import anyio
import anyio.lowlevel
import msgspec
import zmq
from anyio.abc import AsyncResource

from tiering._checks import check_real, is_int
from tiering._exports import RESOURCE_STATE, deprecations
from tiering._state import Lifecycle
from tiering.errors import ConfigError, EventSchemaError
from tiering.events.config import (
    DEFAULT_ENDPOINT,
    binds_every_interface,
    check_endpoint,
    check_replay_endpoint,
)
from tiering.events.monitor import PeerEvent, PeerMonitor
from tiering.events.publisher import END_SEQ
from tiering.events.schema import EventItem, Gap, SequencedBatch, decode_batch
from tiering.events.sockets import SocketEnd, attach

logger = logging.getLogger(__name__)

__all__ = ["SubscriberStatistics", "ZmqSubscriber"]

#: What a replay endpoint on the events endpoint's address should be instead.
_OWN_REPLAY_ADDRESS = (
    "the publisher's replay socket (ROUTER) has an address of its own: give the one its "
    "replay endpoint binds (another port)"
)


class SubscriberStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a subscriber has received (batches, not events) since it was created."""

    received_total: int  # live messages read from the SUB socket
    replayed_total: int  # batches yielded from replay answers
    duplicates_total: int  # live or replayed batches skipped: already yielded
    gaps_total: int  # Gap items yielded
    missing_total: int  # batches those gaps cover
    replay_requests_total: int
    malformed_total: int = 0  # live or replayed messages skipped: not a batch


def _check_host(endpoint: str, what: str) -> None:
    """Resolve the host of a ``tcp://`` endpoint now, or raise `ConfigError` naming it.

    ZeroMQ resolves a connect's host in the background and retries forever,
    so an unknown host would look like a publisher that is merely quiet.
    """
    if not endpoint.startswith("tcp://"):
        return
    address = endpoint[len("tcp://") :].rpartition(";")[2]  # after an optional source
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 address is bracketed
    if not host or host == "*":
        return  # zmq's own check says what is wrong with the address
    try:
        socket.getaddrinfo(host, port or None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"cannot {what} {endpoint!r}: cannot resolve host {host!r} ({exc})"
        ) from None


class ZmqSubscriber(SocketEnd, AsyncResource):
    """A client of `ZmqEventPublisher`: a SUB socket and, optionally, a DEALER for replay.

    The SUB socket binds an ``endpoint`` with a ``*`` wildcard (for a publisher
    that connects) and connects to any other; the DEALER always connects.

    ``start_seq=None`` starts with the first live batch; ``start_seq=n``
    yields batch ``n`` onwards (from replay when it is already past).
    ``replay_timeout`` bounds the wait for each replay answer, ``idle_replay``
    the quiet time before asking for batches that may have been lost (None:
    never); ``hwm`` bounds the messages ZeroMQ buffers for this client. Use it
    as an async context manager, or call `aclose`; entering it cancelled closes
    it. An endpoint that cannot work (``tcp://`` without a host, a port outside
    1-65535 or ``*``, a host that does not resolve) raises `ConfigError`.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = None,
        replay_timeout: float = 5.0,
        idle_replay: float | None = 1.0,
        hwm: int = 100_000,
    ) -> None:
        if start_seq is not None and (not is_int(start_seq) or start_seq < 0):
            raise ConfigError(f"start_seq must be None or an integer >= 0, got {start_seq!r}")
        check_real(
            "replay_timeout (seconds)", replay_timeout, minimum=0, inclusive=False, infinite=True
        )
        if idle_replay is not None:
            check_real(
                "idle_replay (seconds, or None)",
                idle_replay,
                minimum=0,
                inclusive=False,
                infinite=True,
            )
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._replay_timeout = replay_timeout
        self._idle_replay = idle_replay
        check_endpoint("ZmqSubscriber endpoint", endpoint)
        _check_host(endpoint, "subscribe to endpoint")
        if replay_endpoint is not None:
            check_replay_endpoint(
                "ZmqSubscriber replay_endpoint", replay_endpoint, endpoint, _OWN_REPLAY_ADDRESS
            )
            _check_host(replay_endpoint, "connect to replay endpoint")
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer: zmq.Socket[bytes] | None = None
        self._binds = "*" in endpoint
        # Before binding or connecting, so that no handshake is missed.
        self._peers: PeerMonitor | None = PeerMonitor(self._sub, frozenset({PeerEvent.HANDSHAKE}))
        self._met = False
        try:
            self._sub.setsockopt(zmq.RCVHWM, hwm)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            self._endpoint = attach(self._sub, endpoint, bind=self._binds)
            if self._binds and binds_every_interface(endpoint):
                logger.warning(
                    "KV cache events: bound %s on every interface; the stream is "
                    "unauthenticated: anyone who reaches the port can publish events here. "
                    "Bind loopback instead (tcp://127.0.0.1:*), or let the publisher bind "
                    "(tiering's default %s) and connect to it",
                    self._endpoint,
                    DEFAULT_ENDPOINT,
                )
        except zmq.ZMQError as exc:
            self._close_sub()
            verb = "bind" if self._binds else "subscribe to"
            raise ConfigError(f"cannot {verb} endpoint {endpoint!r}: {exc}") from exc
        if replay_endpoint is not None:
            try:
                self._dealer = self._new_dealer(replay_endpoint)
            except ConfigError:
                self._close_sub()
                raise
        self._life = Lifecycle("the ZMQ subscriber", opened=True)
        self._expected: int | None = start_seq  # the next seq to yield
        self._pending: deque[EventItem] = deque()
        self._replaying = False
        self._held: tuple[int, bytes] | None = None  # the live batch that revealed a gap
        # The first replay to ask for: a late joiner's history.
        self._replay_from = start_seq if replay_endpoint is not None else None
        self._received = 0
        self._replayed = 0
        self._duplicates = 0
        self._gaps = 0
        self._missing = 0
        self._requests = 0
        self._malformed = 0

    def _new_dealer(self, endpoint: str) -> zmq.Socket[bytes]:
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.RCVHWM, 0)  # a replay answer is bounded by the publisher's buffer
            attach(dealer, endpoint, bind=False)
        except zmq.ZMQError as exc:
            dealer.close(linger=0)
            raise ConfigError(f"cannot connect to replay endpoint {endpoint!r}: {exc}") from exc
        return dealer

    def _close_sub(self) -> None:
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        self._sub.close(linger=0)

    @property
    def has_publisher(self) -> bool:
        """Whether a ZeroMQ peer has completed a handshake with the SUB socket (so far).

        False at an endpoint nobody serves, and while the connection is being
        made; once True it stays True. Never waits.
        """
        peers = self._peers
        if not self._met and peers is not None and PeerEvent.HANDSHAKE in peers.read():
            self._met = True
            peers.close()  # nothing more to learn
            self._peers = None
        return self._met

    def statistics(self) -> SubscriberStatistics:
        return SubscriberStatistics(
            received_total=self._received,
            replayed_total=self._replayed,
            duplicates_total=self._duplicates,
            gaps_total=self._gaps,
            missing_total=self._missing,
            replay_requests_total=self._requests,
            malformed_total=self._malformed,
        )

    def __aiter__(self) -> ZmqSubscriber:
        return self

    async def __anext__(self) -> EventItem:
        if self._pending:  # a checkpoint even with events at hand (trio's rule)
            await anyio.lowlevel.checkpoint()
        while not self._pending:
            if self._life.closed:
                raise StopAsyncIteration
            try:
                if self._replay_from is not None:
                    start, self._replay_from = self._replay_from, None
                    self._request_replay(start)
                elif self._replaying:
                    await self._step_replay()
                else:
                    frames = await self._recv_live()
                    if frames is not None:
                        self._on_live(frames)
            except anyio.ClosedResourceError:
                raise StopAsyncIteration from None  # closed by another task while waiting
        return self._pending.popleft()

    async def _recv(self, sock: zmq.Socket[bytes]) -> list[bytes]:
        """The next message on ``sock``, waiting without a thread and without spinning."""
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if sock.poll(0, zmq.POLLIN):  # reads ZMQ_EVENTS, which re-arms the descriptor
                continue
            await anyio.wait_readable(sock)

    async def _recv_live(self) -> list[bytes] | None:
        """The next live message; None after starting an idle replay instead."""
        expected = self._expected
        if self._dealer is None or self._idle_replay is None or expected is None:
            return await self._recv(self._sub)
        with anyio.move_on_after(self._idle_replay):
            return await self._recv(self._sub)
        self._request_replay(expected)
        return None

    def _skip(self, why: str) -> None:
        """Count a message that is not a batch; the first one is logged (one line)."""
        self._malformed += 1
        if self._malformed == 1:
            logger.warning(
                "KV cache events: skipped a malformed message (%s); the stream goes on, and "
                "later ones are only counted (malformed_total)",
                why,
            )

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._skip(
                f"expected [topic, seq (8 bytes), payload] from {self._endpoint!r}, "
                f"got {len(frames)} frames"
            )
            return
        self._received += 1
        seq = int.from_bytes(frames[1], "big")
        expected = self._expected
        if expected is not None and seq > expected and self._dealer is not None:
            self._held = (seq, frames[2])  # yielded once the replay has filled the gap
            self._request_replay(expected)
        else:
            self._accept(seq, frames[2])

    def _accept(self, seq: int, payload: bytes) -> bool:
        """Queue batch ``seq`` unless yielded already; first a `Gap` for batches lost before it."""
        expected = self._expected
        if expected is not None and seq < expected:
            self._duplicates += 1
            return False
        try:
            batch = decode_batch(payload)
        except EventSchemaError as exc:
            # Skipped, not retried. Its number is taken only where it is the one expected
            # (no false gap for it): a message this corrupt may carry any number, and one
            # far ahead would report a gap of it and drop every later batch as a duplicate.
            if expected is not None and seq == expected:
                self._expected = seq + 1
            self._skip(f"batch {seq} from {self._endpoint!r}: {exc}")
            return False
        if expected is not None and seq > expected:
            self._report_gap(expected, seq - 1)
        self._expected = seq + 1
        self._pending.append(SequencedBatch(seq, batch))
        return True

    def _report_gap(self, first: int, last: int) -> None:
        self._pending.append(Gap(first, last))
        self._gaps += 1
        self._missing += last - first + 1

    def _request_replay(self, start: int) -> None:
        assert self._dealer is not None
        self._dealer.send_multipart([b"", start.to_bytes(8, "big")])
        self._requests += 1
        self._replaying = True

    async def _step_replay(self) -> None:
        """Read one replay answer; at its end (or timeout) release the held live batch."""
        dealer = self._dealer
        assert dealer is not None
        assert self._replay_endpoint is not None
        frames: list[bytes] | None = None
        with anyio.move_on_after(self._replay_timeout):
            frames = await self._recv(dealer)
        if frames is None:
            # No answer in time: forget this request (a late answer must not be
            # mistaken for the next one's) and report what it should have brought.
            dealer.close(linger=0)
            self._dealer = self._new_dealer(self._replay_endpoint)
            self._end_replay()
            return
        if len(frames) != 4 or frames[0] or len(frames[2]) != 8:
            self._skip(
                f"expected [b'', topic, seq (8 bytes), payload] from replay endpoint "
                f"{self._replay_endpoint!r}, got {len(frames)} frames"
            )
            return
        if frames[2] == END_SEQ:
            self._end_replay()
        elif self._accept(int.from_bytes(frames[2], "big"), frames[3]):
            self._replayed += 1

    def _end_replay(self) -> None:
        self._replaying = False
        held, self._held = self._held, None
        if held is not None:
            self._accept(*held)

    async def aclose(self) -> None:
        """Close the sockets and end iteration. Idempotent; always a checkpoint."""
        self._close_now()
        await anyio.lowlevel.checkpoint()  # closed whatever the cancellation

    def _close_now(self) -> None:
        if not self._life.close_now():
            return
        self._pending.clear()
        if self._peers is not None:
            self._peers.close()
            self._peers = None
        for sock in (self._sub, self._dealer):
            if sock is not None:
                anyio.notify_closing(sock)
                sock.close(linger=0)

    async def __aenter__(self) -> ZmqSubscriber:
        self._life.check_open()
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:  # cancelled: the sockets opened in __init__ must not leak
            self._close_now()
            raise
        return self

    def __repr__(self) -> str:
        return (
            f"<ZmqSubscriber [{self._life.state.value}; {self._endpoint}, "
            f"next seq {self._expected}, "
            f"{self._received} received, {self._replayed} replayed, {self._gaps} gaps, "
            f"{self._malformed} malformed]>"
        )


__getattr__ = deprecations(__name__, {"SubscriberState": RESOURCE_STATE})
