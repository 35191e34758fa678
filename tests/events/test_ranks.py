"""Data-parallel ranks: each rank's publisher moves its ports and stamps its rank, as vLLM's.

Over real loopback sockets: the ports are found free first, then handed to the
publisher less the rank, so the ports it must end up on are the free ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from tiering.errors import ConfigError
from tiering.events import BlockRemoved, KVEventBatch, KVEventsConfig, decode_batch
from tiering.events.config import offset_endpoint
from tiering.events.publisher import ZmqEventPublisher

from .replay_client import ask_replay, free_ports

RANK = 3


def removal(i: int, rank: int | None) -> KVEventBatch:
    events = [BlockRemoved(block_hashes=[i], medium="CPU", group_idx=0)]
    return KVEventBatch(ts=float(i), events=list(events), data_parallel_rank=rank)


@pytest.fixture
def sub_socket() -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    yield sock
    sock.close(linger=0)


def go_live(publisher: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish unranked probes until ``sub`` receives one (the subscription has reached the
    publisher, and every probe before it was sent and buffered); how many were published."""
    seq = 0
    while True:
        publisher.publish(removal(seq, None))
        seq += 1
        if sub.poll(50):
            return seq


def test_a_ranked_publisher_moves_both_ports_and_stamps_batches(
    sub_socket: zmq.Socket[bytes],
) -> None:
    pub_port, replay_port = free_ports(2)
    sub_socket.bind(f"tcp://127.0.0.1:{pub_port}")  # the publisher connects (no wildcard)
    config = KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{pub_port - RANK}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port - RANK}",
    )
    publisher = ZmqEventPublisher(config, data_parallel_rank=RANK)
    try:
        assert publisher.data_parallel_rank == RANK
        assert publisher.endpoint == f"tcp://127.0.0.1:{pub_port}"
        assert publisher.replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
        seq = go_live(publisher, sub_socket)
        publisher.publish(removal(100, None))  # unranked: gets the publisher's rank
        publisher.publish(removal(101, 7))  # ranked: keeps its own
        live = []
        while len(live) < 2:
            assert sub_socket.poll(10_000), "the live batches never came"
            _, seq_bytes, payload = sub_socket.recv_multipart()
            if int.from_bytes(seq_bytes, "big") >= seq:
                live.append(decode_batch(payload))
        assert live == [removal(100, RANK), removal(101, 7)]
        # The replay port is moved too, and replays the stamped payloads.
        frames = ask_replay(publisher.replay_endpoint, 0)
        batches = [decode_batch(f[3]) for f in frames[:-1]]
        assert [b.data_parallel_rank for b in batches] == [RANK] * seq + [RANK, 7]
        assert batches[-2:] == live
    finally:
        publisher.close()


def test_rank_zero_keeps_the_endpoints_and_stamps_zero(sub_socket: zmq.Socket[bytes]) -> None:
    publisher = ZmqEventPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    )
    try:
        assert publisher.data_parallel_rank == 0
        sub_socket.connect(publisher.endpoint)
        seq = go_live(publisher, sub_socket)
        assert publisher.replay_endpoint is not None
        frames = ask_replay(publisher.replay_endpoint, 0)
        got = [decode_batch(f[3]) for f in frames[:-1]]
        assert got == [removal(i, 0) for i in range(seq)]  # vLLM stamps 0 too
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("endpoint", "rank", "moved"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://127.0.0.1:5557", 1, "tcp://127.0.0.1:5558"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("tcp://127.0.0.1:*", 4, "tcp://127.0.0.1:*"),  # the system picks a port
        ("inproc://events", 2, "inproc://events_dp2"),
        ("ipc:///tmp/events", 0, "ipc:///tmp/events"),
        ("tcp://*:65535", 0, "tcp://*:65535"),
    ],
)
def test_offset_endpoint(endpoint: str, rank: int, moved: str) -> None:
    assert offset_endpoint("where", endpoint, rank) == moved


@pytest.mark.parametrize(
    ("endpoint", "rank", "message"),
    [
        ("ipc:///tmp/events", 1, r"where 'ipc:///tmp/events' cannot be moved for data-parallel "),
        ("tcp://*:65535", 1, r"would be port 65536, past 65535; give a port <= 65534"),
        ("tcp://*:5557", -1, r"rank must be >= 0, got -1"),
        ("tcp://*:5557", True, r"rank must be an integer >= 0, got True"),
    ],
)
def test_endpoints_that_cannot_be_moved_are_config_errors(
    endpoint: str, rank: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        offset_endpoint("where", endpoint, rank)


def test_a_publisher_refuses_a_rank_its_endpoints_cannot_take() -> None:
    config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="ipc:///tmp/tev-r")
    with pytest.raises(ConfigError, match=r"^KVEventsConfig\.replay_endpoint 'ipc:///tmp/tev-r'"):
        ZmqEventPublisher(config, data_parallel_rank=1)
    with pytest.raises(ConfigError, match=r"^the data-parallel rank must be >= 0, got -2$"):
        ZmqEventPublisher(KVEventsConfig(endpoint="inproc://x"), data_parallel_rank=-2)
