"""tiering's replay ROUTER answers byte for byte as vLLM 0.33's does (frames recorded from
vLLM's own publisher: golden/replay/README.md says how, and how to re-record them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from tiering.events import KVEventsConfig, decode_batch
from tiering.events.publisher import END_SEQ, ZmqEventPublisher

from .replay_client import ask_replay

GOLDEN = Path(__file__).parent / "golden" / "replay" / "frames.msgpack"


def test_the_replay_router_answers_as_vllms_recorded_frames() -> None:
    golden: dict[str, Any] = msgspec.msgpack.decode(GOLDEN.read_bytes())
    assert golden["requests"], "an empty golden proves nothing"
    publisher = ZmqEventPublisher(
        KVEventsConfig(
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            topic=golden["topic"],
        ),
        data_parallel_rank=golden["data_parallel_rank"],
    )
    try:
        batches = [decode_batch(payload) for payload in golden["batches"]]
        for batch in batches:
            publisher.publish(batch)
        replay = publisher.replay_endpoint
        assert replay is not None
        deadline = time.monotonic() + 10
        while len(ask_replay(replay, 0)) < len(batches) + 1:  # until every batch is sent
            assert time.monotonic() < deadline, "the publisher never sent them all"
        for request in golden["requests"]:
            assert ask_replay(replay, request["start_seq"]) == request["reply"], request[
                "start_seq"
            ]
    finally:
        publisher.close()


def test_the_golden_pins_topic_rank_stamping_and_the_end_marker() -> None:
    """What the recorded frames say, read without the publisher: so a golden re-recorded
    from a different vLLM shows what changed."""
    golden: dict[str, Any] = msgspec.msgpack.decode(GOLDEN.read_bytes())
    topic, rank = golden["topic"].encode(), golden["data_parallel_rank"]
    for request in golden["requests"]:
        *messages, end = request["reply"]
        assert end == [b"", b"", END_SEQ, b""]
        seqs = [int.from_bytes(m[2], "big") for m in messages]
        assert seqs == list(range(request["start_seq"], len(golden["batches"])))
        for message, seq in zip(messages, seqs, strict=True):
            assert message[:2] == [b"", topic]
            sent = decode_batch(golden["batches"][seq])
            replayed = decode_batch(message[3])
            assert replayed.events == sent.events
            expected_rank = rank if sent.data_parallel_rank is None else sent.data_parallel_rank
            assert replayed.data_parallel_rank == expected_rank
