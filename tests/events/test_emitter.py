"""KVEventEmitter: a manager's events published as batches, described as the config asks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
import pytest

from tiering import (
    CPUOffloadingManager,
    Medium,
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    make_offload_key,
)
from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChunkBlocks,
    SequencedBatch,
)
from tiering.events.emitter import SELF_DESCRIBING_KEY, KVEventEmitter

pytestmark = pytest.mark.anyio


def config(rank: int = 0, **extra: Any) -> OffloadingConfig:
    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("kv",)),),
        worker_kv_bytes_per_block=64,
        engine_id="emitter",
        extra_config=extra,
        model=OffloadingModelConfig(name="m", dtype="int64"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
    )
    parallel = msgspec.structs.replace(
        cfg.parallel, data_parallel_index=rank, data_parallel_size=rank + 1
    )
    return msgspec.structs.replace(cfg, parallel=parallel)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"))


Rig = Callable[..., Any]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """``rig(config)``: an open emitter over a manager of 8 chunks, and a subscription."""
    opened: list[KVEventEmitter] = []

    def make(cfg: OffloadingConfig) -> tuple[KVEventEmitter, CPUOffloadingManager, Any]:
        emitter = KVEventEmitter(cfg)
        manager = CPUOffloadingManager(8, enable_events=True, on_events=emitter.publish_soon)
        emitter.open(manager)
        opened.append(emitter)
        return emitter, manager, emitter.subscribe()

    yield make
    for emitter in opened:
        await emitter.aclose()


def store(manager: CPUOffloadingManager, ids: list[int], job: object = None) -> None:
    out = manager.prepare_store([key(i) for i in ids], job=job)
    assert out is not None
    manager.complete_store(out.keys_to_store, job=job)


async def next_batch(subscription: Any) -> SequencedBatch:
    with anyio.fail_after(10):
        item = await subscription.__anext__()
    assert isinstance(item, SequencedBatch)
    return item


def plain(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


async def test_a_reset_after_stores_removes_exactly_what_the_cpu_tier_held(rig: Rig) -> None:
    _, manager, subscription = rig(config(rank=1))
    store(manager, [1, 2])
    store(manager, [3])
    stored = await next_batch(subscription)  # both stores landed in one turn
    assert stored.batch.events == [plain(1), plain(2), plain(3)]
    assert stored.batch.data_parallel_rank == 1
    manager.reset()
    reset = await next_batch(subscription)
    assert reset.batch.events == [BlockRemoved(block_hashes=[1, 2, 3], medium="CPU", group_idx=0)]
    assert not any(isinstance(e, AllBlocksCleared) for e in reset.batch.events)
    assert reset.batch.data_parallel_rank == 1


async def test_self_describing_stores_keep_descriptions_and_a_reset_retracts_them(
    rig: Rig,
) -> None:
    emitter, manager, subscription = rig(config(**{SELF_DESCRIBING_KEY: True}))
    assert emitter.self_describing
    out = manager.prepare_store([key(1), key(2)], job="j")
    assert out is not None
    info = ChunkBlocks(block_hashes=[11, 12], block_size=16, token_ids=list(range(32)))
    emitter.describe("j", [key(1), key(2)], [info, None])
    assert emitter.described_jobs == 1
    manager.complete_store(out.keys_to_store, job="j")
    (first, second) = (await next_batch(subscription)).batch.events
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert (first.block_hashes, first.block_size, first.token_ids) == ([11, 12], 16, info.token_ids)
    assert (second.block_hashes, second.block_size) == ([2], 32)  # one block of a chunk
    manager.reset()
    assert (await next_batch(subscription)).batch.events == [
        BlockRemoved(block_hashes=[11, 12, 2], medium="CPU", group_idx=0)
    ]


async def test_by_default_descriptions_are_not_kept(rig: Rig) -> None:
    emitter, manager, subscription = rig(config())
    assert not emitter.self_describing
    out = manager.prepare_store([key(1)], job="j")
    assert out is not None
    emitter.describe("j", [key(1)], [ChunkBlocks(block_hashes=[11], block_size=16)])
    assert emitter.described_jobs == 0
    manager.complete_store(out.keys_to_store, job="j")
    assert (await next_batch(subscription)).batch.events == [plain(1)]


@pytest.mark.parametrize(
    ("value", "self_describing"),
    [
        (True, True),
        (1, True),
        ("1", True),
        ("false", True),
        (False, False),
        (0, False),
        ("", False),
    ],
)
def test_the_key_is_read_as_vllm_reads_it(value: object, self_describing: bool) -> None:
    """vLLM takes ``bool(extra_config.get("self_describing_kv_events", False))``."""
    assert KVEventEmitter(config(**{SELF_DESCRIBING_KEY: value})).self_describing is self_describing
    assert not KVEventEmitter(config()).self_describing


async def test_a_lower_tiers_store_is_described_by_a_landing_still_pending() -> None:
    """The CPU tier's pending events are published first, and what they landed describes
    the lower tier's event, even when both come in one turn."""
    emitter = KVEventEmitter(config(**{SELF_DESCRIBING_KEY: True}), keep_landed=True)
    manager = CPUOffloadingManager(8, enable_events=True, on_events=emitter.publish_soon)
    emitter.open(manager)
    try:
        subscription = emitter.subscribe()
        out = manager.prepare_store([key(1)], job="j")
        assert out is not None
        info = ChunkBlocks(block_hashes=[11, 12], block_size=16)
        emitter.describe("j", [key(1)], [info])
        manager.complete_store(out.keys_to_store, job="j")  # its event is pending
        emitter.publish_stored_below([key(1)], medium=Medium.STORAGE, locality="local")
        events = [e for _ in range(2) for e in (await next_batch(subscription)).batch.events]
        assert [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockStored)] == [
            ("CPU", [11, 12]),
            ("STORAGE", [11, 12]),
        ]
    finally:
        await emitter.aclose()
