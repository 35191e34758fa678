"""print_events, the body of ``tiering events``: human lines and JSON lines."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import anyio
import pytest

from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SequencedBatch,
    ZmqSubscriber,
    print_events,
)
from tiering.events.publisher import ZmqEventPublisher
from tiering.events.tool import format_event, silence_message

pytestmark = pytest.mark.anyio

STORED = BlockStored(
    block_hashes=[0xDEADBEEF, 2],
    parent_block_hash=b"\x01\x02",
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=None,
    medium="CPU",
    lora_name=None,
    extra_keys=[(b"\xff", "salt")],
    group_idx=0,
    locality="REMOTE",
)
REMOVED = BlockRemoved(block_hashes=[b"\xab\xcd"], medium="CPU", group_idx=1)


def test_human_lines() -> None:
    item = SequencedBatch(7, KVEventBatch(ts=1.5, events=[STORED, REMOVED, AllBlocksCleared()]))
    assert [format_event(item, e, json_lines=False) for e in item.batch.events] == [
        "seq=7 ts=1.500000 BlockStored medium=CPU group=0 hashes=2 first=0x00000000deadbeef "
        "block_size=2 tokens=4 parent=0102 locality=REMOTE",
        "seq=7 ts=1.500000 BlockRemoved medium=CPU group=1 hashes=1 first=abcd",
        "seq=7 ts=1.500000 AllBlocksCleared",
    ]


def test_json_lines_carry_every_field_with_bytes_as_hex() -> None:
    item = SequencedBatch(7, KVEventBatch(ts=1.5, events=[STORED], data_parallel_rank=0))
    record = json.loads(format_event(item, STORED, json_lines=True))
    assert record == {
        "seq": 7,
        "ts": 1.5,
        "data_parallel_rank": 0,
        "type": "BlockStored",
        "block_hashes": [0xDEADBEEF, 2],
        "parent_block_hash": "0102",
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [["ff", "salt"]],
        "group_idx": 0,
        "kv_cache_spec_kind": None,
        "kv_cache_spec_sliding_window": None,
        "locality": "REMOTE",
        "ownership": None,
        "session_id": None,
        "lookahead_token_ids": None,
    }


@pytest.mark.parametrize("json_lines", [False, True])
async def test_print_events_replays_history_then_stops_at_the_limit(
    make_publisher: Callable[..., ZmqEventPublisher], json_lines: bool
) -> None:
    publisher = make_publisher(buffer_steps=2)
    endpoints = (publisher.endpoint, publisher.replay_endpoint)
    out = io.StringIO()
    with anyio.fail_after(10):
        async with ZmqSubscriber(*endpoints, start_seq=0, idle_replay=0.05) as witness:
            for i in range(4):
                publisher.publish(KVEventBatch(ts=float(i), events=[REMOVED, AllBlocksCleared()]))
            async for item in witness:  # until batch 3 has been sent
                if isinstance(item, SequencedBatch) and item.seq == 3:
                    break
        printed = await print_events(
            publisher.endpoint, publisher.replay_endpoint, json_lines, out, limit=3
        )
    assert printed == 3
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # the lost history, then three events
    if json_lines:
        records = [json.loads(line) for line in lines]
        assert records[0] == {"type": "Gap", "first_seq": 0, "last_seq": 1}
        assert [(r["seq"], r["type"]) for r in records[1:]] == [
            (2, "BlockRemoved"),
            (2, "AllBlocksCleared"),
            (3, "BlockRemoved"),
        ]
    else:
        assert lines[0] == "seq=0..1 Gap lost=2"
        assert lines[1].startswith("seq=2 ts=2.000000 BlockRemoved medium=CPU group=1")
        assert lines[3].startswith("seq=3 ")
    assert await print_events(publisher.endpoint, None, json_lines, out, limit=0) == 0


async def test_print_events_gives_up_at_an_endpoint_nobody_serves(refused_port: int) -> None:
    endpoint = f"tcp://127.0.0.1:{refused_port}"
    out, status = io.StringIO(), io.StringIO()
    with pytest.raises(TimeoutError, match=f"no KV cache events at {endpoint} in 0.1 s: no pub"):
        await print_events(endpoint, None, False, out, first_timeout=0.1, status=status)
    assert status.getvalue().startswith(f"tiering events: connecting to {endpoint}; waiting")
    assert out.getvalue() == ""


async def test_print_events_without_a_first_timeout_waits_on(refused_port: int) -> None:
    status = io.StringIO()
    with anyio.move_on_after(0.1) as scope:  # only a cancellation ends it
        await print_events(
            f"tcp://127.0.0.1:{refused_port}", None, False, io.StringIO(), status=status
        )
    assert scope.cancelled_caught
    assert status.getvalue().endswith(", no time limit\n")


async def test_a_quiet_publisher_is_told_apart_from_none(
    make_publisher: Callable[..., ZmqEventPublisher],
) -> None:
    publisher = make_publisher(replay=False)
    with anyio.fail_after(10):
        async with ZmqSubscriber(publisher.endpoint) as subscriber:
            assert not subscriber.binds
            while True:  # until the subscription is through: then it has met the publisher
                publisher.publish(KVEventBatch(ts=0.0, events=[REMOVED]))
                with anyio.move_on_after(0.05):
                    await anext(subscriber)
                    break
            message = silence_message(subscriber, 3)
    assert message == (
        f"no KV cache events at {publisher.endpoint} in 3 s: a publisher is connected but sent "
        "nothing (an engine publishes only when its cache changes); --timeout 0 waits for ever"
    )
