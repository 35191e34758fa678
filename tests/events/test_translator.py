"""EventTranslator: the manager's chunk events as wire events."""

from __future__ import annotations

import pytest

from tiering import CPUOffloadingManager, make_offload_key
from tiering._types import OffloadKey
from tiering.cpu.manager import AllChunksCleared, ChunksRemoved, ChunksStored
from tiering.errors import ConfigError
from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkBlocks,
    EventSchemaError,
    EventTranslator,
    HashFormat,
    KVEventBatch,
    key_wire_hash,
)


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), group)


def stored(hashes: list[int | bytes], group: int = 0, **fields: object) -> BlockStored:
    values: dict[str, object] = {
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 64,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": group,
    }
    values.update(fields)
    return BlockStored(block_hashes=hashes, **values)  # type: ignore[arg-type]


def test_a_manager_run_becomes_stores_removals_and_a_clear() -> None:
    manager = CPUOffloadingManager(num_chunks=2, enable_events=True)
    translator = EventTranslator(tokens_per_chunk=64)
    evicted: list[int | bytes] = []
    for keys in ([key(1), key(2)], [key(3)]):
        out = manager.prepare_store(keys)
        assert out is not None
        manager.complete_store(out.keys_to_store)
        evicted += [key_wire_hash(k, HashFormat.INT) for k in out.evicted_keys]
    manager.reset()
    assert len(evicted) == 1
    assert translator.translate(manager.take_events()) == [
        stored([1, 2]),
        BlockRemoved(block_hashes=evicted, medium="CPU", group_idx=0),
        stored([3]),
        AllBlocksCleared(),
    ]


def test_chunks_are_grouped_per_run_of_one_kv_cache_group() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    event = ChunksStored(keys=(key(1), key(2), key(3, group=1), key(4)))
    assert translator.translate([event]) == [stored([1, 2]), stored([3], group=1), stored([4])]
    removed = ChunksRemoved(keys=(key(1), key(3, group=1), key(4, group=1)))
    assert translator.translate([removed]) == [
        BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0),
        BlockRemoved(block_hashes=[3, 4], medium="CPU", group_idx=1),
    ]


def test_hash_format_and_locality_pass_through() -> None:
    translator = EventTranslator(tokens_per_chunk=64, hash_format="bytes", locality="REMOTE")
    assert translator.hash_format is HashFormat.BYTES
    digest = (5).to_bytes(32, "big")
    assert translator.translate([ChunksStored(keys=(key(5),))]) == [
        stored([digest], locality="REMOTE")
    ]
    assert translator.translate([ChunksRemoved(keys=(key(5),))]) == [
        BlockRemoved(block_hashes=[digest], medium="CPU", group_idx=0, locality="REMOTE")
    ]
    assert key_wire_hash(key(5), HashFormat.INT) == 5


def test_block_info_chains_chunks_and_removals_retract_exactly_it() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    a, b, c, d = key(1), key(2), key(3), key(4)
    blocks = {
        a: ChunkBlocks(block_hashes=[11, 12], block_size=2, token_ids=[1, 2, 3, 4]),
        b: ChunkBlocks(
            block_hashes=[(13).to_bytes(32, "big"), 14],
            block_size=2,
            token_ids=[5, 6, 7, 8],
            parent_block_hash=12,
        ),
        c: ChunkBlocks(block_hashes=[21], block_size=2, token_ids=[9, 9], parent_block_hash=99),
    }
    events = translator.translate([ChunksStored(keys=(a, b, c, d))], blocks)
    assert events == [
        # b follows a: one chain, one event; bytes hashes become wire ints.
        stored([11, 12, 13, 14], block_size=2, token_ids=[1, 2, 3, 4, 5, 6, 7, 8]),
        stored([21], block_size=2, token_ids=[9, 9], parent_block_hash=99),
        stored([4]),  # no block info: one hash per chunk
    ]
    assert "3 chunks with block info" in repr(translator)
    assert translator.translate([ChunksRemoved(keys=(b, d, a))]) == [
        BlockRemoved(block_hashes=[13, 14, 4, 11, 12], medium="CPU", group_idx=0)
    ]
    translator.translate([AllChunksCleared()])
    assert "0 chunks with block info" in repr(translator)
    assert translator.translate([ChunksRemoved(keys=(c,))]) == [
        BlockRemoved(block_hashes=[3], medium="CPU", group_idx=0)
    ]


def test_chains_break_where_the_blocks_do_not_continue() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    a, b, c = key(1), key(2), key(3)
    blocks = {
        a: ChunkBlocks(block_hashes=[1], block_size=4),
        b: ChunkBlocks(block_hashes=[2], block_size=4, parent_block_hash=1, token_ids=[0] * 4),
        c: ChunkBlocks(block_hashes=[3], block_size=4, parent_block_hash=2, token_ids=[0] * 4),
    }
    assert translator.translate([ChunksStored(keys=(a, b, c))], blocks) == [
        stored([1], block_size=4),  # no tokens: not merged with blocks that have some
        stored([2, 3], block_size=4, parent_block_hash=1, token_ids=[0] * 8),
    ]


def test_batches_are_stamped_and_empty_ones_are_none() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    assert translator.batch([]) is None
    assert translator.batch([AllChunksCleared()], ts=2.5, data_parallel_rank=1) == KVEventBatch(
        ts=2.5, events=[AllBlocksCleared()], data_parallel_rank=1
    )
    made = translator.batch([AllChunksCleared()])
    assert made is not None
    assert made.ts > 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_hashes": [], "block_size": 4}, "block_hashes is empty"),
        ({"block_hashes": [1], "block_size": 0}, "block_size must be >= 1"),
        ({"block_hashes": [1], "block_size": True}, "block_size must be an int"),
        ({"block_hashes": [1, 2], "block_size": 2, "token_ids": [1]}, "holds 1 tokens; 2 blocks"),
    ],
)
def test_inconsistent_block_info_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(EventSchemaError, match=message):
        ChunkBlocks(**fields)  # type: ignore[arg-type]


def test_bad_translator_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"tokens_per_chunk must be an integer >= 1 .*, got 0"):
        EventTranslator(tokens_per_chunk=0)
    with pytest.raises(ConfigError, match="tokens_per_chunk must be an integer"):
        EventTranslator(tokens_per_chunk=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="hash_format must be 'int' or 'bytes', got 'hex'"):
        EventTranslator(tokens_per_chunk=16, hash_format="hex")
