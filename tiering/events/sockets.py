"""What the publisher's and the subscriber's ZeroMQ sockets share: binding or connecting one.

`attach` binds a socket or connects it, and says the address it then has;
`SocketEnd` is what `ZmqEventPublisher` and `ZmqSubscriber` show of their main
socket (the PUB or the SUB one): its address, whether it binds, and the
owner's state. Each owner decides whether it binds (the publisher by vLLM's
rule, the subscriber where the endpoint has a ``*``) and words its own errors.
"""

from __future__ import annotations

import zmq

from tiering._state import Lifecycle, ResourceState
from tiering.events.config import is_ipv6

__all__ = ["SocketEnd", "attach"]


def attach(sock: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
    """Bind ``sock`` to ``endpoint`` or connect it there; the address it has (a bound
    wildcard resolved). Raises `zmq.ZMQError` where ZeroMQ refuses."""
    if is_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    if bind:
        sock.bind(endpoint)
        return bytes(sock.getsockopt(zmq.LAST_ENDPOINT)).decode()
    sock.connect(endpoint)
    return endpoint


class SocketEnd:
    """The read-only view of an owner of a main ZeroMQ socket (PUB or SUB)."""

    _life: Lifecycle
    _endpoint: str
    _binds: bool

    @property
    def state(self) -> ResourceState:
        return self._life.state

    @property
    def endpoint(self) -> str:
        """The main socket's address: the bound one (wildcards resolved) or the one
        connected to."""
        return self._endpoint

    @property
    def binds(self) -> bool:
        """Whether the main socket binds `endpoint` (its peers connect to it) or connects to
        it (a peer must bind there)."""
        return self._binds
