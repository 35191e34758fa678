"""Whom a ZeroMQ socket has met: its connection events, read without blocking.

ZeroMQ connects in the background and retries for ever, so a PUB socket that
connects to an address nobody binds, or a SUB socket waiting at one nobody
serves, looks exactly like a quiet one. `PeerMonitor` turns the socket's
monitor events (``zmq_socket_monitor``) into the few outcomes a person can act
on: a ZeroMQ peer shook hands, a connect found nothing listening, or a
connection ended before any handshake (the program there does not speak
ZeroMQ, or is the wrong kind of socket).

Design note: the monitor is a PAIR socket that ZeroMQ's I/O thread writes to;
it has no thread of its own. Whoever owns the watched socket reads it (the
publisher's sender thread through its poller, the subscriber's event loop on
demand), and narrows or closes it once it has told what matters, so a socket
retrying every 100 ms does not wake anyone ten times a second for ever.
"""

from __future__ import annotations

import enum
import itertools
import sys

import zmq

__all__ = ["PeerEvent", "PeerMonitor"]

_monitor_ids = itertools.count()


class PeerEvent(enum.Enum):
    """What a monitored socket's connection did."""

    HANDSHAKE = "handshake"  # a ZeroMQ peer completed the handshake
    REFUSED = "refused"  # a connect found nothing accepting there; ZeroMQ retries
    REJECTED = "rejected"  # a connection ended before a ZeroMQ handshake


_EVENTS: dict[int, PeerEvent] = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: PeerEvent.HANDSHAKE,
    zmq.EVENT_CONNECT_RETRIED: PeerEvent.REFUSED,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: PeerEvent.REJECTED,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: PeerEvent.REJECTED,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: PeerEvent.REJECTED,
    # A peer of the wrong socket type (a ROUTER for a PUB) just disconnects.
    zmq.EVENT_DISCONNECTED: PeerEvent.REJECTED,
}
_MASKS: dict[PeerEvent, int] = {
    kind: sum({raw for raw, event in _EVENTS.items() if event is kind}) for kind in PeerEvent
}


class PeerMonitor:
    """The `PeerEvent` s of ``sock`` among ``watch``; read by the thread that owns ``sock``.

    Create it before ``sock`` binds or connects, so that nothing is missed.
    A `DISCONNECTED` after a handshake also reads as `PeerEvent.REJECTED`:
    stop watching for it once a handshake was seen. `close` is idempotent.
    """

    def __init__(self, sock: zmq.Socket[bytes], watch: frozenset[PeerEvent]) -> None:
        self._sock = sock
        self._pair: zmq.Socket[bytes] | None = None
        self.watch(watch)

    @property
    def socket(self) -> zmq.Socket[bytes] | None:
        """The PAIR socket to poll for readability; None once closed."""
        return self._pair

    def watch(self, events: frozenset[PeerEvent]) -> None:
        """Report only ``events`` from now on (what is not read yet is lost)."""
        self.close()
        address = f"inproc://tiering-events-monitor-{next(_monitor_ids)}"
        self._sock.monitor(address, sum(_MASKS[event] for event in events))
        pair: zmq.Socket[bytes] = self._sock.context.socket(zmq.PAIR)
        pair.connect(address)
        self._pair = pair

    def read(self) -> list[PeerEvent]:
        """The events that happened since the last read, oldest first; never waits."""
        got: list[PeerEvent] = []
        pair = self._pair
        while pair is not None:
            try:
                frames = pair.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = _EVENTS.get(int.from_bytes(frames[0][:2], sys.byteorder))
            if event is not None:
                got.append(event)
        return got

    def close(self) -> None:
        """Stop monitoring and close the PAIR socket. Idempotent."""
        pair, self._pair = self._pair, None
        if pair is not None:
            self._sock.disable_monitor()
            pair.close(linger=0)
