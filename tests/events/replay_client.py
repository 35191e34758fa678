"""A replay client for the event tests: free loopback ports, and one DEALER's replay request.

Shared by tests/events/ and tests/vllm/test_events_wire.py (which also imports it as a
plain module when run as a script to re-record the replay golden). Its end marker is
tiering's ``END_SEQ``, the same bytes as vLLM's ``ZmqEventPublisher.END_SEQ``.
"""

from __future__ import annotations

import socket

import zmq

from tiering.events.publisher import END_SEQ


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports nothing listens on (held together while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def ask_replay(endpoint: str, start: int) -> list[list[bytes]]:
    """The messages a DEALER receives for one replay request from ``start``, end marker last."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[list[bytes]] = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            got.append(dealer.recv_multipart())
            if got[-1][2] == END_SEQ:
                return got
    finally:
        dealer.close(linger=0)
