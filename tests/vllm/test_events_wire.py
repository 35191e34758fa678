"""tiering's own KV events against vLLM 0.33's code: the codec both ways, how an offloaded
chunk is described, how a rank moves the ports, and the replay ROUTER's frames.

Re-record the replay golden (tests/events/golden/replay/) from vLLM's own publisher with
`RECORD` (run from the repository's root).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec
from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
)
from vllm.v1.kv_offload.base import (
    Locality,
    OffloadingEvent,
    OffloadingKVEventsConfig,
)
from vllm.v1.kv_offload.base import Medium as VllmMedium
from vllm.v1.kv_offload.base import make_offload_key as vllm_offload_key

from tiering._types import Medium, make_offload_key
from tiering.cpu.manager import ChunksRemoved, ChunksStored
from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSchemaError,
    EventTranslator,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tiering.events.config import offset_endpoint

try:
    from ..events.replay_client import ask_replay, free_ports
except ImportError:  # run as a script (to re-record the golden): no parent package
    sys.path.insert(0, str(Path(__file__).parents[1] / "events"))
    from replay_client import ask_replay, free_ports

GOLDEN = Path(__file__).parents[1] / "events" / "golden" / "replay" / "frames.msgpack"
RECORD = (
    "PYTHONPATH=.vllm-env/site VLLM_TARGET_DEVICE=cpu .venv/bin/python "
    "tests/vllm/test_events_wire.py"
)
TS = 1757500000.5

VLLM_TYPES: dict[type, type] = {
    BlockStored: vllm_events.BlockStored,
    BlockRemoved: vllm_events.BlockRemoved,
    AllBlocksCleared: vllm_events.AllBlocksCleared,
}


def every_field(lookahead: list[list[int]] | None) -> BlockStored:
    return BlockStored(
        block_hashes=[0xFFFFFFFFFFFFFFFF, bytes(range(32))],
        parent_block_hash=7,
        token_ids=[1, 2, 3, 65536],
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("salt", 1), None],
        group_idx=1,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=4096,
        locality="REMOTE",
        ownership="tier-2",
        session_id="s-1",
        lookahead_token_ids=lookahead,
    )


EVENTS: dict[str, KVEvent] = {
    "stored, every field": every_field([[9, 10], [11, 12]]),
    "stored, no lookahead": every_field(None),
    "stored, empty lookahead lists": every_field([[], []]),
    "stored, required fields only": BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium=None,
        lora_name=None,
    ),
    "removed, every field": BlockRemoved(
        block_hashes=[1, b"\x02" * 32], medium="CPU", group_idx=2, locality="LOCAL", ownership="o"
    ),
    "removed, required fields only": BlockRemoved(block_hashes=[5], medium=None),
    "cleared": AllBlocksCleared(),
}


def as_vllm(event: KVEvent) -> Any:
    """The same event built with vLLM's own classes."""
    return VLLM_TYPES[type(event)](**msgspec.structs.asdict(event))


VLLM_DECODER = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
VLLM_ENCODER = msgspec.msgpack.Encoder()


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_each_event_decodes_both_ways(name: str) -> None:
    event = EVENTS[name]
    mine = KVEventBatch(ts=TS, events=[event], data_parallel_rank=1)
    theirs = vllm_events.KVEventBatch(ts=TS, events=[as_vllm(event)], data_parallel_rank=1)
    assert VLLM_ENCODER.encode(theirs) == encode_batch(mine)
    assert VLLM_DECODER.decode(encode_batch(mine)) == theirs  # vLLM reads tiering's
    assert decode_batch(VLLM_ENCODER.encode(theirs)) == mine  # tiering reads vLLM's


@pytest.mark.parametrize("rank", [None, 0, 3])
def test_a_batch_of_every_event_decodes_both_ways(rank: int | None) -> None:
    events = [EVENTS[name] for name in sorted(EVENTS)]
    mine = KVEventBatch(ts=TS, events=events, data_parallel_rank=rank)
    theirs = vllm_events.KVEventBatch(
        ts=TS, events=[as_vllm(e) for e in events], data_parallel_rank=rank
    )
    assert VLLM_ENCODER.encode(theirs) == encode_batch(mine)
    assert VLLM_DECODER.decode(encode_batch(mine)) == theirs
    assert decode_batch(VLLM_ENCODER.encode(theirs)) == mine


def test_the_lookahead_field_is_one_token_list_per_block() -> None:
    """vLLM 0.33 sends one list per block; a flat list (the old field) is refused by both."""
    event = fields(EVENTS["stored, required fields only"])
    good = msgspec.msgpack.encode([TS, [{**event, "lookahead_token_ids": [[1, 2]]}], None])
    assert VLLM_DECODER.decode(good).events[0].lookahead_token_ids == [[1, 2]]
    assert decode_batch(good).events[0] == msgspec.structs.replace(
        EVENTS["stored, required fields only"], lookahead_token_ids=[[1, 2]]
    )
    flat = msgspec.msgpack.encode([TS, [{**event, "lookahead_token_ids": [1, 2]}], None])
    with pytest.raises(msgspec.ValidationError):
        VLLM_DECODER.decode(flat)
    with pytest.raises(EventSchemaError):
        decode_batch(flat)


# -- how an offloaded chunk is described ----------------------------------------------


def keys_of(*specs: tuple[int, int]) -> tuple[list[bytes], list[Any]]:
    """The same keys, as tiering and vLLM make them: (hash id, group) each."""
    digests = [(i * 0x0101010101).to_bytes(32, "big") for i, _ in specs]
    mine = [make_offload_key(d, g) for d, (_, g) in zip(digests, specs, strict=True)]
    theirs = [vllm_offload_key(d, g) for d, (_, g) in zip(digests, specs, strict=True)]
    assert mine == theirs
    return mine, theirs


def vllm_describes(events: list[OffloadingEvent], self_describing: bool = False) -> list[Any]:
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=self_describing
        )
    )
    return list(tracker.take_events(events))


def fields(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


@pytest.mark.parametrize("locality", [None, "REMOTE"])
def test_by_default_a_store_is_described_as_vllms_offloading_connector_does(
    locality: str | None,
) -> None:
    mine, theirs = keys_of((1, 0), (2, 0), (3, 1), (4, 0))
    vllm_locality = None if locality is None else Locality(locality)
    translator = EventTranslator(tokens_per_chunk=64, locality=locality)
    medium = Medium.CPU if locality is None else Medium.STORAGE
    vllm_medium = VllmMedium.CPU if locality is None else VllmMedium.STORAGE
    ours = translator.translate(
        [ChunksStored(keys=tuple(mine), medium=medium), ChunksRemoved(keys=tuple(mine))]
    )
    expected = vllm_describes(
        [
            OffloadingEvent(keys=theirs, medium=vllm_medium, removed=False, locality=vllm_locality),
            OffloadingEvent(
                keys=theirs, medium=VllmMedium.CPU, removed=True, locality=vllm_locality
            ),
        ]
    )
    assert len(ours) == len(expected) == 6  # four stores, one removal per group
    for got, want in zip(ours, expected, strict=True):
        assert fields(got) == fields(want)  # field by field
    batch = KVEventBatch(ts=TS, events=ours, data_parallel_rank=0)
    theirs_batch = vllm_events.KVEventBatch(ts=TS, events=expected, data_parallel_rank=0)
    assert encode_batch(batch) == VLLM_ENCODER.encode(theirs_batch)  # and byte for byte


def test_vllm_reads_the_self_describing_key_as_tiering_does() -> None:
    from tiering.events.emitter import SELF_DESCRIBING_KEY

    assert SELF_DESCRIBING_KEY == "self_describing_kv_events"
    source = Path(sys.modules["vllm.v1.kv_offload.base"].__file__ or "").read_text()
    assert f'self.extra_config.get("{SELF_DESCRIBING_KEY}", False)' in source


# -- data-parallel ranks ------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint", ["tcp://*:5557", "tcp://127.0.0.1:6000", "tcp://[::1]:7000", "inproc://kv"]
)
@pytest.mark.parametrize("rank", [0, 1, 7])
def test_ports_move_by_rank_as_in_vllm(endpoint: str, rank: int) -> None:
    moved = vllm_events.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)
    assert offset_endpoint("endpoint", endpoint, rank) == moved


# -- the replay ROUTER's frames (golden recorded from vLLM) -------------------------------

TOPIC = "kv-events"
RANK = 1
REQUESTS = (0, 2, 99)  # from the first batch, from the third, past the end


def golden_batches() -> list[KVEventBatch]:
    """What is published: unranked batches (the publisher stamps its rank) and a ranked one."""
    return [
        KVEventBatch(ts=TS, events=[EVENTS["stored, every field"]]),
        KVEventBatch(ts=TS + 1, events=[EVENTS["removed, every field"], AllBlocksCleared()]),
        KVEventBatch(
            ts=TS + 2, events=[EVENTS["stored, required fields only"]], data_parallel_rank=5
        ),
        KVEventBatch(ts=TS + 3, events=[EVENTS["removed, required fields only"]]),
    ]


def record_vllm() -> dict[str, Any]:
    """Drive vLLM's own ZmqEventPublisher on loopback and record its replay answers."""
    pub_port, replay_port = free_ports(2)
    publisher = vllm_events.ZmqEventPublisher(
        data_parallel_rank=RANK,
        endpoint=f"tcp://127.0.0.1:{pub_port - RANK}",  # vLLM moves both ports by the rank
        replay_endpoint=f"tcp://127.0.0.1:{replay_port - RANK}",
        topic=TOPIC,
    )
    try:
        batches = golden_batches()
        for batch in batches:
            publisher.publish(VLLM_DECODER.decode(encode_batch(batch)))
        replay = f"tcp://127.0.0.1:{replay_port}"
        deadline = time.monotonic() + 10
        while len(ask_replay(replay, 0)) < len(batches) + 1:  # until all are buffered
            assert time.monotonic() < deadline, "vLLM's publisher never sent them all"
        return {
            "topic": TOPIC,
            "data_parallel_rank": RANK,
            "batches": [encode_batch(b) for b in batches],
            "requests": [{"start_seq": s, "reply": ask_replay(replay, s)} for s in REQUESTS],
        }
    finally:
        publisher.shutdown()


def test_the_replay_golden_is_what_vllms_publisher_answers() -> None:
    recorded = record_vllm()
    assert msgspec.msgpack.decode(GOLDEN.read_bytes()) == recorded, (
        f"vLLM's replay answers differ from the golden: re-record with `{RECORD}`"
    )


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_bytes(msgspec.msgpack.encode(record_vllm()))
    print(f"wrote {GOLDEN}")
