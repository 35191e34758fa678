"""A malformed message on the stream is counted and skipped; the stream goes on.

Before: `tiering events` ended with exit status 2 at the first message that was
not a batch (`EventSchemaError` out of the subscriber). Now the subscriber
skips it, counts it (``malformed_total``) and logs one warning at the first;
the command prints every valid event, then one line with the count, and exits 0.

The publisher is a real ZeroMQ XPUB socket: it sees the subscription arrive,
so nothing is sent before the subscriber listens (no sleep, no lost message).
"""

from __future__ import annotations

import logging
import threading

import msgspec
import pytest
import zmq

from tiering.cli import main
from tiering.events import BlockRemoved, BlockStored, KVEventBatch
from tiering.events.subscriber import ZmqSubscriber

pytestmark = pytest.mark.anyio

TOPIC = b""
STORED = BlockStored(
    block_hashes=[0xDEADBEEF],
    parent_block_hash=None,
    token_ids=[],
    block_size=16,
    lora_id=None,
    medium="CPU",
    lora_name=None,
)
REMOVED = BlockRemoved(block_hashes=[0xFEED], medium="CPU")


def _messages() -> list[list[bytes]]:
    """A valid batch, a garbage payload, msgpack of the wrong shape, a valid batch;
    one sequence number each, so no gap is reported."""
    encode = msgspec.msgpack.encode
    payloads = [
        encode(KVEventBatch(ts=1.0, events=[STORED], data_parallel_rank=0)),
        b"\xc1 this is not msgpack",
        encode({"ts": "yesterday", "events": 7}),
        encode(KVEventBatch(ts=2.0, events=[REMOVED], data_parallel_rank=0)),
    ]
    return [[TOPIC, seq.to_bytes(8, "big"), p] for seq, p in enumerate(payloads)]


class XPublisher:
    """An XPUB socket on a free loopback port that sends ``messages`` once subscribed."""

    def __init__(self, messages: list[list[bytes]]) -> None:
        self.socket = zmq.Context.instance().socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = bytes(self.socket.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self.messages = messages
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            # Bounded: a subscriber that never comes fails the test, never hangs it.
            if not self.socket.poll(30_000, zmq.POLLIN):
                raise TimeoutError("no subscriber came")
            assert self.socket.recv()[:1] == b"\x01"  # a subscription
            for message in self.messages:
                self.socket.send_multipart(message)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def __enter__(self) -> XPublisher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=30)
        self.socket.close()
        assert self.error is None, self.error


async def test_the_subscriber_skips_and_counts_what_is_not_a_batch(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    messages = _messages()
    messages.insert(2, [b"one frame only"])  # not even [topic, seq, payload]
    with XPublisher(messages) as pub, caplog.at_level(logging.WARNING):
        async with ZmqSubscriber(pub.endpoint, idle_replay=None) as subscriber:
            first = await anext(subscriber)
            second = await anext(subscriber)
            stats = subscriber.statistics()
    assert (first.seq, second.seq) == (0, 3)  # type: ignore[union-attr]
    assert first.batch.events == [STORED]  # type: ignore[union-attr]
    assert second.batch.events == [REMOVED]  # type: ignore[union-attr]
    assert (stats.malformed_total, stats.gaps_total) == (3, 0)
    assert "3 malformed" in repr(subscriber)
    warnings = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1  # the first one only
    assert "the stream goes on" in warnings[0].getMessage()


def test_events_prints_every_valid_event_and_how_many_it_skipped(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with XPublisher(_messages()) as pub, caplog.at_level(logging.WARNING):
        code = main(["events", pub.endpoint, "--limit", "2", "--timeout", "30"])
    assert code == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("seq=0 ts=1.000000 BlockStored medium=CPU")
    assert lines[1].startswith("seq=3 ts=2.000000 BlockRemoved medium=CPU")
    assert err.splitlines()[-1] == (
        "tiering events: skipped 2 malformed messages that were not KV event batches"
    )
    assert len([r for r in caplog.records if "malformed" in r.getMessage()]) == 1


async def test_a_malformed_message_with_a_wild_sequence_number_drops_nothing_after_it(
    anyio_backend: str,
) -> None:
    """A payload that does not decode, under a number far ahead (as corrupt as it):
    before, its number was taken, so a gap of 2**63 batches was reported and every
    later batch was dropped as a duplicate; now it is only skipped and counted."""
    messages = _messages()
    messages.insert(1, [TOPIC, (1 << 63).to_bytes(8, "big"), b"\xc1 garbage"])
    with XPublisher(messages) as pub:
        async with ZmqSubscriber(pub.endpoint, idle_replay=None) as subscriber:
            first = await anext(subscriber)
            second = await anext(subscriber)
            stats = subscriber.statistics()
    assert (first.seq, second.seq) == (0, 3)  # type: ignore[union-attr]
    assert second.batch.events == [REMOVED]  # type: ignore[union-attr]
    assert (stats.malformed_total, stats.gaps_total, stats.duplicates_total) == (3, 0, 0)
