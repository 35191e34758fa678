"""The ZMQ publisher of KV event batches: live on a PUB socket, history on a ROUTER socket.

Wire protocol (vLLM's):

- PUB, one message per batch: ``[topic, seq, payload]``; ``seq`` is 8 bytes
  big-endian, 0 for the first batch and one more for each next one;
  ``payload`` is the msgpack `KVEventBatch`.
- ROUTER (optional): a DEALER sends ``[b"", start_seq]`` (8 bytes big-endian)
  and gets ``[b"", topic, seq, payload]`` for every buffered batch with
  ``seq >= start_seq``, in order, then ``[b"", b"", END_SEQ, b""]`` where
  ``END_SEQ`` is -1 as 8 signed big-endian bytes.

Design note: ZeroMQ sockets are not thread-safe and the event loop must never
wait, so one thread owns the sockets. ``publish`` appends the batch to a
bounded deque and, only when that thread is idle, wakes it with one byte on an
inproc PAIR socket; the thread waits in a single ``zmq.Poller`` on that wake
socket and the ROUTER, so it is asleep when there is nothing to do and answers
replay requests even while it is busy sending. The thread encodes each batch
(off the event loop), sends it, and keeps the last ``buffer_steps`` payloads
for replay. Batches are numbered when published, so a batch dropped because
the queue was full (its events counted) still uses its number: subscribers see
the loss as a sequence gap that replay cannot fill. ZeroMQ itself drops
messages for a subscriber past the PUB high-water mark, which no one can count
here; those the subscriber sees as a gap that replay can fill.

Data parallelism (vLLM's rule): the publisher of data-parallel rank ``r``
moves both its endpoints by ``r`` (`offset_endpoint`: a ``tcp://`` port plus
``r``, an ``inproc://`` name with ``_dp<r>``), so each rank has sockets of its
own, and stamps ``r`` on every batch that comes without a rank (one that names
a rank keeps it).

Binding or connecting: the PUB socket binds an endpoint with a ``*`` wildcard
(and ``::``, ``ipc://``, ``inproc://``) and connects to any other, as vLLM
does, unless ``KVEventsConfig.bind`` says which (tiering's default endpoint
binds loopback); `binds` says which. A socket bound on every interface logs one
warning: the stream has no authentication. A connecting PUB socket with no subscriber bound
there loses every batch without an error, and its subscribers, which connect
too, never meet it. So a connecting publisher watches its socket's connection
events (`PeerMonitor`, read by the sender thread's poller: no thread, no cost
per batch) and logs one warning, naming the fix, when the first attempt finds
nothing listening or a program that is not a ZeroMQ subscriber; it stops
watching at the first subscriber's handshake. A program that accepts the TCP
connection but never speaks ZeroMQ is only found out when the handshake times
out, after ZeroMQ's default of 30 s; the connecting PUB socket gives it
`_HANDSHAKE_IVL_MS` (3 s) instead, so the warning comes while a person is
still looking. A ZeroMQ handshake is one exchange of greetings, milliseconds
on any network; and a connection dropped for being slow is simply retried.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import overload

import msgspec
import zmq

from tiering._checks import check_real
from tiering._exports import RESOURCE_STATE, deprecations
from tiering._state import Lifecycle
from tiering.errors import ConfigError
from tiering.events.bus import SinkStatistics
from tiering.events.config import (
    DEFAULT_ENDPOINT,
    KVEventsConfig,
    binds_every_interface,
    offset_endpoint,
    wildcard_of,
)
from tiering.events.monitor import PeerEvent, PeerMonitor
from tiering.events.schema import KVEventBatch
from tiering.events.sockets import SocketEnd, attach

logger = logging.getLogger(__name__)

__all__ = ["END_SEQ", "ZmqEventPublisher", "should_bind"]

#: The sequence frame that ends a replay: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

_REPLAY_CHECK_EVERY = 64  # batches sent between looks at the replay socket while busy
_ZERO_COPY_BYTES = 16384  # payloads at least this large are sent without a copy
#: ``zmq.HANDSHAKE_IVL`` of a connecting PUB socket: how long a peer that accepted the
#: connection has to complete the ZeroMQ handshake before it is taken for another program.
_HANDSHAKE_IVL_MS = 3_000
_wake_ids = itertools.count()


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (``*``), a ``::`` address, ``ipc://`` and ``inproc://``."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class _Seqs(Sequence[int]):
    """The sequence numbers of the replay buffer, as a sorted sequence for `bisect`."""

    def __init__(self, buffer: deque[tuple[int, bytes, bytes]]) -> None:
        self._buffer = buffer

    def __len__(self) -> int:
        return len(self._buffer)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [entry[0] for entry in itertools.islice(self._buffer, *index.indices(len(self)))]
        return self._buffer[index][0]


class ZmqEventPublisher(SocketEnd):
    """Sends KV event batches on ZeroMQ from its own thread; an `EventSink` named ``"zmq"``.

    ``publish`` never blocks and never waits for a subscriber. ``close`` is
    idempotent: it sends what is queued for at most ``close_timeout`` seconds
    (the rest is dropped and counted), gives ZeroMQ the rest of that time to
    deliver, and joins the thread. Sockets bind or connect in the constructor,
    on the config's endpoints moved by ``data_parallel_rank`` (vLLM's rule);
    an endpoint that cannot be used raises `ConfigError`.
    """

    def __init__(
        self,
        config: KVEventsConfig | None = None,
        *,
        data_parallel_rank: int = 0,
        close_timeout: float = 1.0,
    ) -> None:
        self._config = config = KVEventsConfig() if config is None else config
        check_real("close_timeout (seconds)", close_timeout, minimum=0)
        self._close_timeout = close_timeout
        endpoint = offset_endpoint("KVEventsConfig.endpoint", config.endpoint, data_parallel_rank)
        replay_endpoint = config.replay_endpoint
        if replay_endpoint is not None:
            replay_endpoint = offset_endpoint(
                "KVEventsConfig.replay_endpoint", replay_endpoint, data_parallel_rank
            )
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._max_queue = config.max_queue_size
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0  # numbered on publish: a dropped batch leaves a gap
        self._published = 0
        self._dropped_full = 0  # written by the caller of publish()
        self._dropped_thread = 0  # written by the sender thread
        self._replays = 0
        self._life = Lifecycle("the ZMQ publisher", opened=True)  # changed under _lock
        self._lock = threading.Lock()
        self._idle = False
        self._deadline = 0.0

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._binds = should_bind(endpoint) if config.bind is None else config.bind
        self._warned = False
        # Before connecting, so that no connection event is missed.
        self._peers = None if self._binds else PeerMonitor(self._pub, frozenset(PeerEvent))
        self._replay: zmq.Socket[bytes] | None = None
        wake = f"inproc://tiering-events-wake-{next(_wake_ids)}"
        self._wake_rx = ctx.socket(zmq.PAIR)
        self._wake_tx: zmq.Socket[bytes] | None = ctx.socket(zmq.PAIR)
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            if not self._binds:  # before connecting: the setting applies to new connections
                self._pub.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS)
            self._endpoint = self._attach(self._pub, "endpoint", endpoint, bind=self._binds)
            self._replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # A whole replay must fit in the client's pipe, or its tail is dropped.
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 2)
                self._replay_endpoint = self._attach(
                    self._replay, "replay_endpoint", replay_endpoint, bind=True
                )
            self._wake_rx.bind(wake)
            self._wake_tx.connect(wake)
            bound = [self._endpoint] if self._binds else []
            bound += [self._replay_endpoint] if self._replay_endpoint is not None else []
            everywhere = [e for e in bound if binds_every_interface(e)]
            if everywhere:  # one line per publisher, whatever it bound
                logger.warning(
                    "KV cache events: bound %s on every interface; the stream is "
                    "unauthenticated: anyone who reaches the port reads every block hash%s. "
                    "Bind loopback or a private address instead: tiering's default %s, "
                    "tcp://127.0.0.1:* (a free port), or any address with "
                    "KVEventsConfig(bind=True)",
                    " and ".join(everywhere),
                    " and can ask for replays" if self._replay_endpoint in everywhere else "",
                    DEFAULT_ENDPOINT,
                )
        except BaseException:
            if self._peers is not None:
                self._peers.close()
            for sock in (self._pub, self._replay, self._wake_rx, self._wake_tx):
                if sock is not None:
                    sock.close(linger=0)
            raise
        self._thread = threading.Thread(
            target=self._run, name="tiering-events-publisher", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _attach(sock: zmq.Socket[bytes], field: str, endpoint: str, bind: bool = False) -> str:
        """Bind or connect ``sock``; the address it really has (a bound wildcard resolved)."""
        bind = bind or should_bind(endpoint)
        try:
            return attach(sock, endpoint, bind=bind)
        except zmq.ZMQError as exc:
            verb = "bind" if bind else "connect"
            raise ConfigError(f"cannot {verb} KVEventsConfig.{field} {endpoint!r}: {exc}") from exc

    @property
    def config(self) -> KVEventsConfig:
        return self._config

    @property
    def data_parallel_rank(self) -> int:
        """The rank stamped on batches without one; the endpoints are moved by it."""
        return self._rank

    @property
    def replay_endpoint(self) -> str | None:
        """The bound ROUTER address, or None without replay."""
        return self._replay_endpoint

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for sending; when the queue is full, drop it and count its events."""
        self._life.check_open("cannot publish")
        seq = self._next_seq
        self._next_seq = seq + 1
        if len(self._queue) >= self._max_queue:
            self._dropped_full += len(batch.events)
            return
        self._queue.append((seq, batch))
        if self._idle:
            self._idle = False
            self._wake()

    def statistics(self) -> SinkStatistics:
        """Events sent on the PUB socket, and events dropped before it."""
        return SinkStatistics(
            name="zmq",
            published_total=self._published,
            dropped_total=self._dropped_full + self._dropped_thread,
        )

    def close(self) -> None:
        """Send what is queued (for ``close_timeout`` at most), join the thread. Idempotent."""
        with self._lock:
            if self._life.begin_close():
                self._deadline = time.monotonic() + self._close_timeout
        self._wake()
        self._thread.join()
        with self._lock:
            if self._wake_tx is not None:
                self._wake_tx.close(linger=0)
                self._wake_tx = None
            self._life.end_close()

    def _wake(self) -> None:
        with self._lock:
            if self._wake_tx is None:
                return
            # Again: wake-ups already pending, the thread will look at the queue anyway.
            with contextlib.suppress(zmq.Again):
                self._wake_tx.send(b"", zmq.NOBLOCK)

    # --- the sender thread -------------------------------------------------

    def _run(self) -> None:
        queue, life = self._queue, self._life
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        if self._peers is not None and self._peers.socket is not None:
            poller.register(self._peers.socket, zmq.POLLIN)
        try:
            while True:
                for _ in range(min(len(queue), _REPLAY_CHECK_EVERY)):
                    if not life.is_open:
                        break  # closing: `_flush` sends the rest against the deadline
                    self._send(*queue.popleft())
                if not life.is_open:
                    break
                timeout: int | None = 0
                if not queue:
                    # Say we sleep, then look again: a batch queued before the flag
                    # was set is seen here; one queued after it wakes us.
                    self._idle = True
                    if queue or not life.is_open:
                        self._idle = False
                        continue
                    timeout = None
                ready = dict(poller.poll(timeout))
                self._idle = False
                if self._wake_rx in ready:
                    self._drain_wakeups()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays(self._replay)
                if self._peers is not None and self._peers.socket in ready:
                    self._watch_peers(poller, self._peers)
            self._flush()
        finally:
            if self._peers is not None:
                self._peers.close()
            self._pub.close(linger=max(0, int((self._deadline - time.monotonic()) * 1000)))
            if self._replay is not None:
                self._replay.close(linger=0)
            self._wake_rx.close(linger=0)

    def _watch_peers(self, poller: zmq.Poller, peers: PeerMonitor) -> None:
        """Warn once when the connecting PUB socket has no subscriber; stop at the first one."""
        outcome: PeerEvent | None = None
        for event in peers.read():
            if event is PeerEvent.HANDSHAKE:
                outcome = event
                break
            outcome = outcome or event  # the first failure says what is wrong
        if outcome is None:
            return
        poller.unregister(peers.socket)
        if outcome is PeerEvent.HANDSHAKE:
            if self._warned:
                logger.info("KV cache events: a subscriber is connected at %s now", self._endpoint)
            peers.close()
            self._peers = None
            return
        self._warned = True
        logger.warning(self._no_subscriber(outcome))
        peers.watch(frozenset({PeerEvent.HANDSHAKE}))  # to say when one comes; nothing else
        poller.register(peers.socket, zmq.POLLIN)

    def _no_subscriber(self, outcome: PeerEvent) -> str:
        endpoint = self._endpoint
        wild = wildcard_of(endpoint)
        if outcome is PeerEvent.REFUSED:
            found = "nothing accepts connections there"
        else:
            found = "the program there is not a ZeroMQ subscriber (no ZeroMQ handshake)"
        fix = (
            f"bind one side: the publisher with {wild}, or the subscriber with "
            f"`tiering events {wild}`"
            if wild is not None
            else "bind the subscriber there, or give the publisher an endpoint it binds"
        )
        return (
            f"KV cache events: the publisher connects to {endpoint} (an endpoint without '*' "
            f"connects, as in vLLM) and {found}: every batch is lost until a subscriber binds "
            f"that address, and a subscriber that connects to it never receives anything; {fix}"
        )

    def _send(self, seq: int, batch: KVEventBatch) -> None:
        try:
            if batch.data_parallel_rank is None:
                batch = msgspec.structs.replace(batch, data_parallel_rank=self._rank)
            payload = self._encoder.encode(batch)
        except Exception:  # a batch that cannot be encoded: lose it, counted, and go on
            logger.exception("ZMQ publisher: batch %d cannot be encoded; dropped", seq)
            self._dropped_thread += len(batch.events)
            return
        seq_bytes = seq.to_bytes(8, "big")
        self._buffer.append((seq, seq_bytes, payload))
        try:
            self._send_live([self._topic, seq_bytes, payload])
        except zmq.ZMQError:
            self._dropped_thread += len(batch.events)  # still buffered: replay can recover it
        else:
            self._published += len(batch.events)

    def _send_live(self, frames: list[bytes]) -> None:
        """Put one message on the PUB socket (PUB never blocks: past its HWM ZeroMQ drops)."""
        # Zero-copy pays for itself on large payloads only.
        self._pub.send_multipart(frames, copy=len(frames[-1]) < _ZERO_COPY_BYTES)

    def _drain_wakeups(self) -> None:
        try:
            while True:
                self._wake_rx.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        """Answer every waiting replay request with the buffered batches it asks for."""
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                continue  # not a replay request: ignore it
            identity = frames[0]
            start = int.from_bytes(frames[2], "big")
            buffer = self._buffer
            # Not by position: a batch dropped for a full queue kept its number
            # but never entered the buffer, so the buffer's numbers have holes.
            skip = bisect.bisect_left(_Seqs(buffer), start)
            try:
                for _, seq_bytes, payload in itertools.islice(buffer, skip, None):
                    replay.send_multipart([identity, b"", self._topic, seq_bytes, payload])
                replay.send_multipart([identity, b"", b"", END_SEQ, b""])
            except zmq.ZMQError:
                continue  # the client went away; others are unaffected
            self._replays += 1

    def _flush(self) -> None:
        """Closing: send what is queued until the deadline, then drop and count the rest."""
        queue = self._queue
        while queue and time.monotonic() < self._deadline:
            self._send(*queue.popleft())
        while queue:
            self._dropped_thread += len(queue.popleft()[1].events)

    def __repr__(self) -> str:
        dropped = self._dropped_full + self._dropped_thread
        return (
            f"<ZmqEventPublisher [{self._life.state.value}; "
            f"{'binds' if self._binds else 'connects'} "
            f"{self._endpoint}, {len(self._queue)} "
            f"batches queued, {len(self._buffer)} buffered for replay, {self._published} events "
            f"published, {dropped} dropped, {self._replays} replays served]>"
        )


__getattr__ = deprecations(__name__, {"PublisherState": RESOURCE_STATE})
