"""The wire schema: golden payloads, an independent reading of their shape, hashes, codec.

The golden files pin the bytes this package sends. Regenerate them only on
purpose (a deliberate, compatible schema change), never from a test run:

    .venv/bin/python tests/events/test_schema.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from tiering._types import make_offload_key
from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSchemaError,
    HashFormat,
    KVEventBatch,
    decode_batch,
    encode_batch,
    key_wire_hash,
    wire_hash,
)

GOLDEN = Path(__file__).parent / "golden"
TS = 1757500000.25
TOP = 0xFFFFFFFFFFFFFFFF
# Tokens across every msgpack integer width a large vocabulary reaches.
TOKENS = [0, 1, 127, 128, 255, 256, 65535, 65536, 128000, 128255, 42, 2, 9, 10, 11, 12]

# The fields of vLLM's events in wire order; those after the first seven have defaults.
STORED_FIELDS = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]


def chunks_stored(*hashes: int) -> BlockStored:
    """A store as this engine sends one: one hash per chunk, no tokens, no parent."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=256,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


CASES: dict[str, KVEventBatch] = {
    "stored_chunks.msgpack": KVEventBatch(
        ts=TS, events=[chunks_stored(0, 0xDEADBEEF12345678, TOP)], data_parallel_rank=0
    ),
    "stored_every_field.msgpack": KVEventBatch(
        ts=TS,
        events=[
            BlockStored(
                block_hashes=[bytes(range(32))],
                parent_block_hash=bytes(range(100, 132)),
                token_ids=TOKENS,
                block_size=16,
                lora_id=3,
                medium="CPU",
                lora_name="adapter",
                extra_keys=[("salt-1", 7)],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=4096,
                locality="REMOTE",
                ownership="owner",
                session_id="session-9",
                lookahead_token_ids=[[5, 6]],  # one list per block
            )
        ],
        data_parallel_rank=2,
    ),
    "removed.msgpack": KVEventBatch(
        ts=TS,
        events=[BlockRemoved(block_hashes=[TOP, 7], medium="CPU", group_idx=0, locality="REMOTE")],
        data_parallel_rank=0,
    ),
    "cleared_unranked.msgpack": KVEventBatch(ts=TS, events=[AllBlocksCleared()]),
    "mixed.msgpack": KVEventBatch(
        ts=TS,
        events=[
            chunks_stored(21, 22),
            BlockRemoved(block_hashes=[21], medium="CPU", group_idx=0),
            AllBlocksCleared(),
            chunks_stored(23),
        ],
        data_parallel_rank=0,
    ),
}


def write_golden() -> None:
    """Rewrite every golden file from `CASES` (run this file as a script)."""
    GOLDEN.mkdir(exist_ok=True)
    for name, batch in CASES.items():
        (GOLDEN / name).write_bytes(encode_batch(batch))
        print(f"wrote {GOLDEN / name}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_bytes_encode_and_decode(name: str) -> None:
    golden = (GOLDEN / name).read_bytes()
    assert encode_batch(CASES[name]) == golden
    assert decode_batch(golden) == CASES[name]


def test_every_golden_file_has_a_case() -> None:
    assert sorted(p.name for p in GOLDEN.glob("*.msgpack")) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_shape_read_without_the_schema(name: str) -> None:
    """Read the bytes as plain msgpack: an array envelope, events as maps, defaults omitted."""
    raw = (GOLDEN / name).read_bytes()
    assert raw[0] == 0x93  # fixarray of 3: ts, events, data_parallel_rank
    envelope: Any = msgspec.msgpack.decode(raw)
    assert isinstance(envelope, list)
    ts, events, rank = envelope
    batch = CASES[name]
    assert (ts, rank) == (batch.ts, batch.data_parallel_rank)  # an absent rank is a nil
    assert len(events) == len(batch.events)
    for event, record in zip(events, batch.events, strict=True):
        assert isinstance(event, dict)
        keys = list(event)
        assert keys[0] == "type"
        assert event["type"] == type(record).__name__
        if isinstance(record, BlockStored):
            fields, required = STORED_FIELDS, 7
        elif isinstance(record, BlockRemoved):
            fields, required = REMOVED_FIELDS, 2
        else:
            fields, required = [], 0
        present = [f for f in fields[required:] if getattr(record, f) is not None]
        assert keys[1:] == fields[:required] + present
        for key in keys[1:]:
            value = getattr(record, key)
            expected = [list(v) for v in value] if key == "extra_keys" else value
            assert event[key] == expected


def test_uint64_hashes_use_the_full_unsigned_width() -> None:
    raw = (GOLDEN / "stored_chunks.msgpack").read_bytes()
    assert b"\xcf" + b"\xff" * 8 in raw  # uint64, not a signed or float form
    assert b"\xcf\xde\xad\xbe\xef\x12\x34\x56\x78" in raw


def test_field_order_matches_vllm() -> None:
    assert [f.name for f in msgspec.structs.fields(BlockStored)] == STORED_FIELDS
    assert [f.name for f in msgspec.structs.fields(BlockRemoved)] == REMOVED_FIELDS
    assert msgspec.structs.fields(AllBlocksCleared) == ()
    assert [f.name for f in msgspec.structs.fields(KVEventBatch)] == [
        "ts",
        "events",
        "data_parallel_rank",
    ]


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's declarations, options as it sets them (mutable, positional), for a cross-check."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


VLLM_TYPES: dict[type, type] = {
    BlockStored: VllmBlockStored,
    BlockRemoved: VllmBlockRemoved,
    AllBlocksCleared: VllmAllBlocksCleared,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_declarations_encode_the_same_bytes(name: str) -> None:
    batch = CASES[name]
    events = [VLLM_TYPES[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
    replica = VllmEventBatch(batch.ts, events, batch.data_parallel_rank)
    assert msgspec.msgpack.encode(replica) == (GOLDEN / name).read_bytes()


def test_wire_hashes() -> None:
    digest = bytes(range(32))
    key = make_offload_key(digest, group_idx=3)
    assert wire_hash(digest, HashFormat.INT) == int.from_bytes(bytes(range(24, 32)), "big")
    assert key_wire_hash(key, HashFormat.INT) == 0x18191A1B1C1D1E1F
    assert key_wire_hash(key, HashFormat.BYTES) == digest
    assert wire_hash(b"\xff" * 8, HashFormat.INT) == TOP
    assert wire_hash(b"\x01\x02", HashFormat.INT) == 0x0102
    assert wire_hash(12345, HashFormat.BYTES) == 12345  # ints are already in wire form


def test_a_payload_that_is_not_a_batch_is_a_schema_error() -> None:
    with pytest.raises(EventSchemaError, match="3 bytes is not a KVEventBatch"):
        decode_batch(b"\x93\x01\x02")
    with pytest.raises(EventSchemaError, match="not a KVEventBatch"):
        decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Unknown"}], None]))


if __name__ == "__main__":
    write_golden()
