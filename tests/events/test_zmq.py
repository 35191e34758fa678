"""ZmqEventPublisher and ZmqSubscriber over real sockets: loopback tcp and ipc, asyncio and trio."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import anyio
import pytest
import zmq

from tiering._state import ResourceState
from tiering.errors import ConfigError, ResourceClosedError
from tiering.events import (
    BlockRemoved,
    EventBus,
    EventItem,
    Gap,
    KVEventBatch,
    KVEventsConfig,
    SequencedBatch,
    ZmqSubscriber,
)
from tiering.events.publisher import END_SEQ, ZmqEventPublisher, should_bind

pytestmark = pytest.mark.anyio

MakePublisher = Callable[..., ZmqEventPublisher]


def batch(i: int, n: int = 1) -> KVEventBatch:
    """Batch ``i``: ``n`` removals whose hashes name the batch."""
    events = [
        BlockRemoved(block_hashes=[i * 1000 + j], medium="CPU", group_idx=0) for j in range(n)
    ]
    return KVEventBatch(ts=float(i), events=list(events), data_parallel_rank=0)


def raw_replay(endpoint: str | None, start: int) -> list[int]:
    """The sequence numbers a DEALER gets for a replay request from ``start``."""
    assert endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return got
            got.append(int.from_bytes(frames[2], "big"))
    finally:
        dealer.close(linger=0)


async def take(subscriber: ZmqSubscriber, n: int) -> list[EventItem]:
    return [await anext(subscriber) for _ in range(n)]


def seqs(items: list[EventItem]) -> list[int]:
    assert all(isinstance(item, SequencedBatch) for item in items), items
    return [item.seq for item in items if isinstance(item, SequencedBatch)]


async def go_live(publisher: ZmqEventPublisher, subscriber: ZmqSubscriber) -> int:
    """Publish probes until the SUB socket has received one and every probe was read.

    PUB/SUB drops what is sent before the subscription reaches the publisher;
    past this point nothing is. Returns the next sequence number to publish.
    """
    seq = 0
    while True:
        publisher.publish(batch(seq))
        seq += 1
        with anyio.move_on_after(0.05):  # cancelling a step must leave the client consistent
            while True:
                item = await anext(subscriber)
                last = isinstance(item, SequencedBatch) and item.seq == seq - 1
                if last and subscriber.statistics().received_total:
                    return seq


async def read_through(subscriber: ZmqSubscriber, seq: int) -> None:
    """Read until batch ``seq`` (gaps allowed): it has been sent."""
    while True:
        item = await anext(subscriber)
        if isinstance(item, SequencedBatch) and item.seq >= seq:
            return


class LossyPublisher(ZmqEventPublisher):
    """Loses the live message of every sequence number in ``lose``; replay still has it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.lose: set[int] = set()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _send_live(self, frames: list[bytes]) -> None:
        if int.from_bytes(frames[1], "big") not in self.lose:
            super()._send_live(frames)


class StalledPublisher(ZmqEventPublisher):
    """Its first send waits for ``release``, so the queue behind it fills up."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _send_live(self, frames: list[bytes]) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(10)
        super()._send_live(frames)


class SlowPublisher(ZmqEventPublisher):
    """A network that takes 20 ms per message."""

    def _send_live(self, frames: list[bytes]) -> None:
        time.sleep(0.02)
        super()._send_live(frames)


async def test_every_batch_arrives_in_order(make_publisher: MakePublisher) -> None:
    publisher = make_publisher()
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=0.05
    ) as subscriber:
        for i in range(50):
            publisher.publish(batch(i, n=3))
        with anyio.fail_after(10):
            items = await take(subscriber, 50)
    assert seqs(items) == list(range(50))
    assert [item.batch for item in items if isinstance(item, SequencedBatch)] == [
        batch(i, n=3) for i in range(50)
    ]
    assert subscriber.statistics().gaps_total == 0
    publisher.close()  # its counts are final once its thread has ended
    assert publisher.statistics().published_total == 150


async def test_a_late_joiner_recovers_earlier_batches_by_replay(
    make_publisher: MakePublisher,
) -> None:
    publisher = make_publisher()
    endpoints = (publisher.endpoint, publisher.replay_endpoint)
    async with ZmqSubscriber(*endpoints, start_seq=0, idle_replay=0.05) as first:
        for i in range(20):
            publisher.publish(batch(i))
        with anyio.fail_after(10):
            await read_through(first, 19)  # all 20 have been sent
            async with ZmqSubscriber(*endpoints, start_seq=0, idle_replay=0.05) as late:
                early = await take(late, 20)
                for i in range(20, 30):
                    publisher.publish(batch(i))
                rest = await take(late, 10)
            async with ZmqSubscriber(*endpoints, start_seq=25) as midway:
                tail = await take(midway, 5)
    assert seqs(early + rest) == list(range(30))
    stats = late.statistics()
    assert stats.replayed_total >= 20
    assert stats.gaps_total == 0
    assert seqs(tail) == [25, 26, 27, 28, 29]


async def test_a_dropped_range_is_detected_and_filled(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(cls=LossyPublisher)
    assert isinstance(publisher, LossyPublisher)
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=None
    ) as subscriber:
        with anyio.fail_after(10):
            seq = await go_live(publisher, subscriber)
            before = subscriber.statistics()
            publisher.lose.update(range(seq + 2, seq + 6))
            for i in range(seq, seq + 10):
                publisher.publish(batch(i))
            items = await take(subscriber, 10)
    assert seqs(items) == list(range(seq, seq + 10))
    after = subscriber.statistics()
    assert after.replay_requests_total == before.replay_requests_total + 1
    assert after.replayed_total - before.replayed_total >= 4
    assert after.gaps_total == 0


async def test_without_replay_a_dropped_range_is_a_gap(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(replay=False, cls=LossyPublisher)
    assert isinstance(publisher, LossyPublisher)
    async with ZmqSubscriber(publisher.endpoint) as subscriber:
        with anyio.fail_after(10):
            seq = await go_live(publisher, subscriber)
            publisher.lose.update({seq + 1, seq + 2})
            for i in range(seq, seq + 5):
                publisher.publish(batch(i))
            items = await take(subscriber, 4)
    assert [type(item) for item in items] == [SequencedBatch, Gap, SequencedBatch, SequencedBatch]
    assert items[1] == Gap(seq + 1, seq + 2)
    assert seqs([items[0], *items[2:]]) == [seq, seq + 3, seq + 4]
    assert subscriber.statistics().missing_total == 2


async def test_history_no_longer_buffered_is_reported(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(buffer_steps=5)
    endpoints = (publisher.endpoint, publisher.replay_endpoint)
    async with ZmqSubscriber(*endpoints, start_seq=0, idle_replay=0.05) as first:
        for i in range(20):
            publisher.publish(batch(i))
        with anyio.fail_after(10):
            await read_through(first, 19)
            async with ZmqSubscriber(*endpoints, start_seq=0) as late:
                items = await take(late, 6)
    assert items[0] == Gap(0, 14)
    assert items[0].count == 15
    assert seqs(items[1:]) == [15, 16, 17, 18, 19]
    assert late.statistics().missing_total == 15


async def test_dead_subscribers_do_not_disturb_the_publisher(
    make_publisher: MakePublisher,
) -> None:
    publisher = make_publisher()
    assert publisher.replay_endpoint is not None
    for i in range(10):
        publisher.publish(batch(i))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    # A replay client that asks and vanishes, one that sends garbage, a SUB that leaves.
    for request in ([b"", (0).to_bytes(8, "big")], [b"not", b"a request"]):
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart(request)
        dealer.close(linger=1000)
    gone = ZmqSubscriber(publisher.endpoint, publisher.replay_endpoint, start_seq=0)
    with anyio.fail_after(10):
        await anext(gone)  # mid-replay
    await gone.aclose()
    await gone.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(gone)
    for i in range(10, 30):
        publisher.publish(batch(i))
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=0.05
    ) as healthy:
        with anyio.fail_after(10):
            items = await take(healthy, 30)
    assert seqs(items) == list(range(30))
    assert publisher.statistics().dropped_total == 0
    assert publisher.state is ResourceState.OPEN


async def test_close_flushes_joins_and_is_idempotent(make_publisher: MakePublisher) -> None:
    publisher = make_publisher()
    async with ZmqSubscriber(publisher.endpoint, idle_replay=None) as subscriber:
        with anyio.fail_after(10):
            seq = await go_live(publisher, subscriber)
            for i in range(seq, seq + 100):
                publisher.publish(batch(i))
            publisher.close()  # queued batches are sent before the thread ends
            assert not [t for t in threading.enumerate() if t.name == "tiering-events-publisher"]
            items = await take(subscriber, 100)
    assert seqs(items) == list(range(seq, seq + 100))
    publisher.close()
    assert publisher.state is ResourceState.CLOSED
    assert publisher.statistics().published_total == seq + 100
    with pytest.raises(ResourceClosedError, match="closed"):
        publisher.publish(batch(0))
    assert "closed" in repr(publisher)


async def test_a_full_queue_drops_new_batches_and_counts_them(
    make_publisher: MakePublisher,
) -> None:
    publisher = make_publisher(cls=StalledPublisher, max_queue_size=4)
    assert isinstance(publisher, StalledPublisher)
    publisher.publish(batch(0, n=2))
    assert await anyio.to_thread.run_sync(publisher.entered.wait, 10)
    for i in range(1, 8):
        publisher.publish(batch(i, n=2))  # 1..4 wait in the queue; 5, 6, 7 are dropped
    assert publisher.statistics().dropped_total == 6
    assert "4 batches queued" in repr(publisher)
    publisher.release.set()
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=0.05
    ) as subscriber:
        with anyio.fail_after(10):
            sent = await take(subscriber, 5)  # the queue has drained
            publisher.publish(batch(8, n=2))
            after = await take(subscriber, 2)
    assert seqs(sent) == [0, 1, 2, 3, 4]
    # The dropped batches used their sequence numbers: subscribers see the loss.
    assert after[0] == Gap(5, 7)
    assert seqs(after[1:]) == [8]
    # The replay buffer has a hole where 5..7 were dropped: a replay from past it
    # still finds what follows (it searches by number, not by position).
    assert await anyio.to_thread.run_sync(raw_replay, publisher.replay_endpoint, 8) == [8]
    assert await anyio.to_thread.run_sync(raw_replay, publisher.replay_endpoint, 6) == [8]
    assert await anyio.to_thread.run_sync(raw_replay, publisher.replay_endpoint, 2) == [2, 3, 4, 8]
    publisher.close()
    stats = publisher.statistics()
    assert (stats.name, stats.published_total, stats.dropped_total) == ("zmq", 12, 6)


async def test_a_batch_that_cannot_be_encoded_is_dropped_and_counted(
    make_publisher: MakePublisher,
) -> None:
    publisher = make_publisher()
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=0.05
    ) as subscriber:
        bad = KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[1 << 70], medium="CPU")])
        publisher.publish(bad)  # past 64 bits: msgpack refuses it in the publisher thread
        publisher.publish(batch(1))
        with anyio.fail_after(10):
            got = await take(subscriber, 2)
    assert got[0] == Gap(0, 0)
    assert seqs(got[1:]) == [1]
    publisher.close()
    stats = publisher.statistics()
    assert (stats.published_total, stats.dropped_total) == (1, 1)


async def test_close_gives_up_after_its_timeout(make_publisher: MakePublisher) -> None:
    publisher = make_publisher(cls=SlowPublisher, close_timeout=0.1)
    for i in range(50):
        publisher.publish(batch(i))
    publisher.close()  # 50 sends of 20 ms do not fit in 0.1 s: the rest is dropped
    stats = publisher.statistics()
    assert stats.dropped_total > 0
    assert stats.published_total + stats.dropped_total == 50


async def test_the_bus_feeds_the_publisher_and_closes_it(make_publisher: MakePublisher) -> None:
    publisher = make_publisher()
    async with ZmqSubscriber(
        publisher.endpoint, publisher.replay_endpoint, start_seq=0, idle_replay=0.05
    ) as subscriber:
        async with EventBus(sinks=[publisher]) as bus:
            local = bus.subscribe()
            for i in range(3):
                bus.publish(batch(i, n=2))
            with anyio.fail_after(10):
                remote = await take(subscriber, 3)
        assert publisher.state is ResourceState.CLOSED
        stats = bus.statistics()  # final: the publisher's thread has ended
    assert seqs(remote) == [0, 1, 2]
    assert [s.name for s in stats.sinks] == ["subscribers", "zmq"]
    assert stats.sinks[1].published_total == 6
    assert [item async for item in local] == [SequencedBatch(i, batch(i, n=2)) for i in range(3)]


def test_bind_rule_and_unusable_endpoints() -> None:
    assert should_bind("tcp://*:5557")
    assert should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/x")
    assert should_bind("inproc://x")
    assert not should_bind("tcp://127.0.0.1:5557")
    assert END_SEQ == b"\xff" * 8
    first = ZmqEventPublisher(
        KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    )
    try:
        taken = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint=first.replay_endpoint)
        with pytest.raises(ConfigError, match=r"cannot bind KVEventsConfig\.replay_endpoint"):
            ZmqEventPublisher(taken)
        with pytest.raises(ConfigError, match="close_timeout"):
            ZmqEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), close_timeout=-1)
    finally:
        first.close()
    assert not [t for t in threading.enumerate() if t.name == "tiering-events-publisher"]


async def test_subscriber_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^ZmqSubscriber endpoint must be a ZeroMQ endpoint "):
        ZmqSubscriber("nowhere")
    with pytest.raises(ConfigError, match=r"^ZmqSubscriber replay_endpoint must be a ZeroMQ "):
        ZmqSubscriber("tcp://127.0.0.1:1", "nowhere")
    with pytest.raises(
        ConfigError, match=r"cannot connect to replay endpoint 'tcp://127\.0\.0\.1:"
    ):
        ZmqSubscriber("tcp://127.0.0.1:1", "tcp://127.0.0.1:*")  # zmq's: no connect to a '*'
    with pytest.raises(ConfigError, match=r"cannot resolve host 'no-such-host\.invalid'"):
        ZmqSubscriber("tcp://no-such-host.invalid:1")
    for numeric in ("tcp://[::1]:1", "tcp://127.0.0.1:1", "tcp://localhost:1"):
        await ZmqSubscriber(numeric).aclose()  # resolved at once: accepted
    with pytest.raises(ConfigError, match="start_seq must be None or an integer >= 0, got -1"):
        ZmqSubscriber("tcp://127.0.0.1:1", start_seq=-1)
    with pytest.raises(ConfigError, match="idle_replay"):
        ZmqSubscriber("tcp://127.0.0.1:1", idle_replay=0)
    with pytest.raises(ConfigError, match="replay_timeout"):
        ZmqSubscriber("tcp://127.0.0.1:1", replay_timeout=0)


@pytest.mark.parametrize(
    ("endpoint", "replay_endpoint"),
    [
        # ZeroMQ would bind port 99999 as 34463, and retry a connect to it or to 0 for ever.
        ("tcp://*:99999", None),
        ("tcp://127.0.0.1:99999", None),
        ("tcp://127.0.0.1:0", None),
        ("tcp://:5557", None),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:99999"),
    ],
)
def test_subscriber_refuses_the_tcp_endpoints_the_publisher_refuses(
    endpoint: str, replay_endpoint: str | None
) -> None:
    field, bad = ("replay_endpoint", replay_endpoint) if replay_endpoint else ("endpoint", endpoint)
    with pytest.raises(ConfigError) as publisher_info:
        KVEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
    with pytest.raises(ConfigError) as subscriber_info:
        ZmqSubscriber(endpoint, replay_endpoint)
    rule = "must be tcp://HOST:PORT with a port in 1-65535, or '*' for a free one"
    assert str(subscriber_info.value).startswith(f"ZmqSubscriber {field} {rule}")
    assert str(subscriber_info.value).endswith(f"got {bad!r}")
    # The same check, in the same words, as the publisher's.
    assert str(publisher_info.value) == str(subscriber_info.value).replace(
        f"ZmqSubscriber {field}", f"KVEventsConfig.{field}"
    )


async def test_a_subscriber_entered_when_cancelled_is_closed() -> None:
    """Its sockets are open from the constructor: a cancel at the checkpoint of
    ``__aenter__`` must close them, as no ``__aexit__`` will run."""
    subscriber = ZmqSubscriber("tcp://127.0.0.1:*", "tcp://127.0.0.1:1")
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with subscriber:
            pytest.fail("the body of a cancelled enter ran")
    assert scope.cancelled_caught
    assert subscriber.state is ResourceState.CLOSED
    assert re.match(r"<ZmqSubscriber \[closed; ", repr(subscriber))
    assert subscriber._sub.closed
    assert subscriber._dealer is not None
    assert subscriber._dealer.closed
    assert subscriber._peers is None  # the monitor too
    await subscriber.aclose()  # idempotent
    with pytest.raises(ResourceClosedError):
        async with subscriber:
            pass
