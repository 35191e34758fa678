"""EventTranslator: the manager's chunk events as wire events."""

from __future__ import annotations

import pytest

from tiering import CPUOffloadingManager, make_offload_key
from tiering._types import Medium, OffloadKey
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


def plain(h: int | bytes, group: int = 0, **fields: object) -> BlockStored:
    """A store as vLLM's offloading connector describes a chunk by default."""
    return stored([h], group, block_size=0, **fields)


def run_manager(translator: EventTranslator) -> tuple[list[object], list[int | bytes]]:
    """Stores 1, 2 then 3 in a tier of two chunks, then a reset: the wire events, the evicted."""
    manager = CPUOffloadingManager(num_chunks=2, enable_events=True)
    evicted: list[int | bytes] = []
    for keys in ([key(1), key(2)], [key(3)]):
        out = manager.prepare_store(keys)
        assert out is not None
        manager.complete_store(out.keys_to_store)
        evicted += [key_wire_hash(k, HashFormat.INT) for k in out.evicted_keys]
    manager.reset()
    assert len(evicted) == 1
    return list(translator.translate(manager.take_events())), evicted


def test_by_default_a_manager_run_is_described_as_vllm_does() -> None:
    """One plain BlockStored per chunk; a reset retracts the CPU tier's chunks, and only them."""
    events, evicted = run_manager(EventTranslator(tokens_per_chunk=64))
    (kept,) = {1, 2} - set(evicted)
    assert events == [
        plain(1),
        plain(2),
        BlockRemoved(block_hashes=evicted, medium="CPU", group_idx=0),
        plain(3),
        BlockRemoved(block_hashes=[kept, 3], medium="CPU", group_idx=0),  # the reset
    ]
    assert not any(isinstance(e, AllBlocksCleared) for e in events)


def test_self_describing_a_manager_run_groups_chunks_and_a_reset_removes_them() -> None:
    translator = EventTranslator(tokens_per_chunk=64, self_describing=True)
    events, evicted = run_manager(translator)
    (kept,) = {1, 2} - set(evicted)
    assert events == [
        stored([1, 2]),
        BlockRemoved(block_hashes=evicted, medium="CPU", group_idx=0),
        stored([3]),
        BlockRemoved(block_hashes=[kept, 3], medium="CPU", group_idx=0),
    ]


def test_a_reset_removes_per_group_with_the_tiers_medium() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    cleared = AllChunksCleared(medium=Medium.STORAGE, keys=(key(1), key(2, group=1), key(3)))
    assert translator.translate([cleared]) == [
        BlockRemoved(block_hashes=[1, 3], medium="STORAGE", group_idx=0),
        BlockRemoved(block_hashes=[2], medium="STORAGE", group_idx=1),
    ]
    assert translator.translate([AllChunksCleared()]) == []  # an empty tier held nothing


def test_by_default_every_chunk_is_its_own_store_and_block_info_is_ignored() -> None:
    translator = EventTranslator(tokens_per_chunk=64)
    assert not translator.self_describing
    event = ChunksStored(keys=(key(1), key(2), key(3, group=1)))
    blocks = {key(1): ChunkBlocks(block_hashes=[11, 12], block_size=2, token_ids=[1, 2, 3, 4])}
    assert translator.translate([event], blocks) == [plain(1), plain(2), plain(3, group=1)]
    assert translator.translate([ChunksRemoved(keys=(key(1),))]) == [
        BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0)
    ]
    assert "vLLM's plain stores" in repr(translator)


def test_chunks_are_grouped_per_run_of_one_kv_cache_group() -> None:
    translator = EventTranslator(tokens_per_chunk=64, self_describing=True)
    event = ChunksStored(keys=(key(1), key(2), key(3, group=1), key(4)))
    assert translator.translate([event]) == [stored([1, 2]), stored([3], group=1), stored([4])]
    # Removals come one per group, as vLLM groups them, even where the groups interleave.
    removed = ChunksRemoved(keys=(key(1), key(3, group=1), key(4, group=1), key(2)))
    assert translator.translate([removed]) == [
        BlockRemoved(block_hashes=[1, 2], medium="CPU", group_idx=0),
        BlockRemoved(block_hashes=[3, 4], medium="CPU", group_idx=1),
    ]


def test_hash_format_and_locality_pass_through() -> None:
    translator = EventTranslator(tokens_per_chunk=64, hash_format="bytes", locality="REMOTE")
    assert translator.hash_format is HashFormat.BYTES
    digest = (5).to_bytes(32, "big")
    assert translator.translate([ChunksStored(keys=(key(5),))]) == [
        plain(digest, locality="REMOTE")
    ]
    assert translator.translate([ChunksRemoved(keys=(key(5),))]) == [
        BlockRemoved(block_hashes=[digest], medium="CPU", group_idx=0, locality="REMOTE")
    ]
    assert key_wire_hash(key(5), HashFormat.INT) == 5


def test_block_info_chains_chunks_and_removals_retract_exactly_it() -> None:
    translator = EventTranslator(tokens_per_chunk=64, self_describing=True)
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
    assert translator.translate([AllChunksCleared(keys=(c,))]) == [
        BlockRemoved(block_hashes=[21], medium="CPU", group_idx=0)  # what c announced
    ]
    assert "0 chunks with block info" in repr(translator)
    assert translator.translate([ChunksRemoved(keys=(c,))]) == [
        BlockRemoved(block_hashes=[3], medium="CPU", group_idx=0)
    ]


def test_chains_break_where_the_blocks_do_not_continue() -> None:
    translator = EventTranslator(tokens_per_chunk=64, self_describing=True)
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
    assert translator.batch([AllChunksCleared()]) is None
    removed = ChunksRemoved(keys=(key(1),))
    assert translator.batch([removed], ts=2.5, data_parallel_rank=1) == KVEventBatch(
        ts=2.5,
        events=[BlockRemoved(block_hashes=[1], medium="CPU", group_idx=0)],
        data_parallel_rank=1,
    )
    made = translator.batch([removed])
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
    with pytest.raises(ConfigError, match="self_describing must be True or False, got 'yes'"):
        EventTranslator(tokens_per_chunk=16, self_describing="yes")  # type: ignore[arg-type]


def test_a_numpy_integer_never_reaches_the_wire() -> None:
    """What goes on the wire is a Python int: a numpy integer is refused or converted,
    never kept to fail the batch's encoding at publish time."""
    import numpy as np

    from tiering.events.schema import decode_batch, encode_batch

    with pytest.raises(EventSchemaError, match="block_size must be an int"):
        ChunkBlocks(block_hashes=[1], block_size=np.int64(16))  # type: ignore[arg-type]
    try:
        translator = EventTranslator(np.int64(32), self_describing=True)  # type: ignore[arg-type]
    except ConfigError:
        return  # refused: as good as converted
    batch = translator.batch([ChunksStored(keys=(key(1),))], ts=1.0)
    assert batch is not None
    (event,) = decode_batch(encode_batch(batch)).events
    assert isinstance(event, BlockStored)
    assert event.block_size == 32
