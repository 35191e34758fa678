"""KV cache events from a TieringEngine: when they are built, what they say, where they go."""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest

from tiering import ConfigError, OffloadingConfig, OffloadingGroupConfig, make_offload_key
from tiering.engine import TieringEngine
from tiering.errors import EventSchemaError
from tiering.events import (
    BlockRemoved,
    BlockStored,
    ChunkBlocks,
    EventSubscription,
    KVEventsConfig,
    SequencedBatch,
    ZmqSubscriber,
)
from tiering.scheduler import JobOutcome
from tiering.specs import GPULoadStoreSpec

from .test_engine import CHUNK_BYTES, config, kv_caches, mock

pytestmark = pytest.mark.anyio

TOKENS_PER_CHUNK = 16  # config(): 16 tokens a block, one block a chunk


def events_config(**extra: object) -> object:
    return msgspec.structs.replace(config(**extra), enable_kv_cache_events=True)


def key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"))


def wire_hash(i: int) -> int:
    return i  # the low 8 bytes of the key's hash, big-endian


async def next_events(subscription: EventSubscription) -> list[object]:
    with anyio.fail_after(10):
        item = await subscription.__anext__()
    assert isinstance(item, SequencedBatch)
    return list(item.batch.events)


async def store(engine: TieringEngine, ids: Sequence[int], blocks: Sequence[int]) -> JobOutcome:
    handle = await engine.submit_store([key(i) for i in ids], GPULoadStoreSpec(list(blocks)))
    return (await handle).outcome


async def test_without_events_nothing_is_built(anyio_backend: str) -> None:
    async with TieringEngine(config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES) as engine:
        assert await store(engine, [1, 2], [0, 1]) is JobOutcome.SUCCEEDED
        stats = engine.statistics()
        assert stats.events is None
        assert stats.manager.events_pending == 0
        assert engine.manager.take_events() == []
        assert engine.event_endpoints is None
        with pytest.raises(ConfigError, match="enable_kv_cache_events"):
            engine.subscribe()


async def test_stores_evictions_and_resets_become_wire_events(anyio_backend: str) -> None:
    engine = TieringEngine(events_config(), kv_caches(), cpu_bytes=2 * CHUNK_BYTES, backend="mock")
    async with engine:
        subscription = engine.subscribe()
        assert await store(engine, [1, 2], [0, 1]) is JobOutcome.SUCCEEDED
        # vLLM's description of offloaded chunks: one event each, block_size 0, no tokens.
        assert await next_events(subscription) == [plain(1), plain(2)]
        # A failed store announces nothing; its slot comes back.
        backend = mock(engine)
        backend.close_gate()
        try:
            handle = await engine.submit_store([key(3)], GPULoadStoreSpec([2]))
            (removed,) = await next_events(subscription)  # room was made for it
            assert isinstance(removed, BlockRemoved)
            assert removed.block_hashes == [wire_hash(2)]  # a request's tail goes first
            backend._fail = set(backend.held)
        finally:
            backend.open_gate()
        assert (await handle).outcome is JobOutcome.FAILED
        assert await store(engine, [4], [3]) is JobOutcome.SUCCEEDED
        (stored_4,) = await next_events(subscription)
        assert isinstance(stored_4, BlockStored)
        assert stored_4.block_hashes == [wire_hash(4)]
        engine.reset()
        # What the CPU tier held leaves the CPU tier; no AllBlocksCleared (it has no medium,
        # and a router would drop the GPU's blocks with it).
        assert await next_events(subscription) == [
            BlockRemoved(block_hashes=[wire_hash(1), wire_hash(4)], medium="CPU", group_idx=0)
        ]
        stats = engine.statistics().events
        assert stats is not None
        assert (stats.batches_total, stats.events_total) == (4, 5)
        assert stats.sinks[0].name == "subscribers"
        assert stats.sinks[0].dropped_total == 0


def plain(i: int) -> BlockStored:
    """Chunk ``i`` stored, as vLLM's offloading connector describes one by default."""
    return BlockStored(
        block_hashes=[wire_hash(i)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )


SELF_DESCRIBING = {"self_describing_kv_events": True}


async def test_self_describing_stores_and_a_reset_after_them(anyio_backend: str) -> None:
    engine = TieringEngine(
        events_config(**SELF_DESCRIBING), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock"
    )
    async with engine:
        subscription = engine.subscribe()
        assert await store(engine, [1, 2], [0, 1]) is JobOutcome.SUCCEEDED
        assert await store(engine, [3], [2]) is JobOutcome.SUCCEEDED
        stores = await next_events(subscription) + await next_events(subscription)
        assert stores == [
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=[],
                block_size=TOKENS_PER_CHUNK,
                lora_id=None,
                medium="CPU",
                lora_name=None,
                group_idx=0,
            )
            for hashes in ([wire_hash(1), wire_hash(2)], [wire_hash(3)])
        ]
        engine.reset()
        (removed,) = await next_events(subscription)
        assert removed == BlockRemoved(
            block_hashes=[wire_hash(1), wire_hash(2), wire_hash(3)], medium="CPU", group_idx=0
        )
        engine.reset()  # an empty tier: nothing to say
        assert await store(engine, [5], [0]) is JobOutcome.SUCCEEDED
        assert [type(e) for e in await next_events(subscription)] == [BlockStored]


async def test_descriptions_are_ignored_unless_self_describing(anyio_backend: str) -> None:
    engine = TieringEngine(events_config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock")
    async with engine:
        subscription = engine.subscribe()
        blocks = [ChunkBlocks(block_hashes=[101], block_size=16, token_ids=list(range(16)))]
        handle = await engine.submit_store([key(1)], GPULoadStoreSpec([0]), blocks=blocks)
        assert (await handle).success
        assert await next_events(subscription) == [plain(1)]
        assert engine._events is not None
        assert engine._events.described_jobs == 0
        with pytest.raises(ConfigError, match="one ChunkBlocks"):  # still checked
            await engine.submit_store([key(3)], GPULoadStoreSpec([2]), blocks=[])


async def test_callers_can_describe_the_blocks_of_each_chunk(anyio_backend: str) -> None:
    engine = TieringEngine(
        events_config(**SELF_DESCRIBING), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock"
    )
    async with engine:
        subscription = engine.subscribe()
        tokens = list(range(32))
        blocks = [
            ChunkBlocks(block_hashes=[101], block_size=16, token_ids=tokens[:16]),
            ChunkBlocks(
                block_hashes=[102], block_size=16, token_ids=tokens[16:], parent_block_hash=101
            ),
        ]
        handle = await engine.submit_store(
            [key(1), key(2)], GPULoadStoreSpec([0, 1]), blocks=blocks
        )
        assert (await handle).success
        (stored,) = await next_events(subscription)
        assert isinstance(stored, BlockStored)
        assert (stored.block_hashes, stored.token_ids, stored.block_size) == (
            [101, 102],
            tokens,
            16,
        )
        # A description that does not fit is refused before anything is queued.
        with pytest.raises(ConfigError, match="one ChunkBlocks"):
            await engine.submit_store([key(3)], GPULoadStoreSpec([2]), blocks=[])
        with pytest.raises(ConfigError, match="ChunkBlocks or None"):
            engine.submit_store_nowait([key(3)], GPULoadStoreSpec([2]), blocks=[b"x"])  # type: ignore[list-item]
        assert engine.lookup([key(3)]).missing == 1
        with pytest.raises(EventSchemaError, match="2\\*\\*64"):
            ChunkBlocks(block_hashes=[1 << 64], block_size=16)


async def test_a_description_goes_with_its_own_store(anyio_backend: str) -> None:
    """A described store that fails leaves nothing behind for a later store of the key."""
    engine = TieringEngine(
        events_config(**SELF_DESCRIBING), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock"
    )
    async with engine:
        subscription = engine.subscribe()
        backend = mock(engine)
        backend.close_gate()
        try:
            handle = await engine.submit_store(
                [key(7)],
                GPULoadStoreSpec([0]),
                blocks=[ChunkBlocks(block_hashes=[777], block_size=16)],
            )
            backend._fail = set(backend.held)
        finally:
            backend.open_gate()
        assert (await handle).outcome is JobOutcome.FAILED
        backend._fail = None
        assert await store(engine, [7], [1]) is JobOutcome.SUCCEEDED
        (stored,) = await next_events(subscription)
        assert isinstance(stored, BlockStored)
        assert (stored.block_hashes, stored.token_ids) == ([wire_hash(7)], [])


async def test_each_group_announces_its_own_block_size(anyio_backend: str) -> None:
    cfg = msgspec.structs.replace(
        events_config(**SELF_DESCRIBING),
        groups=(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=("k",)),
            OffloadingGroupConfig(tokens_per_block=64, layer_names=("v",)),
        ),
    )
    engine = TieringEngine(cfg, kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock")
    async with engine:
        subscription = engine.subscribe()
        keys = [make_offload_key(b"a" * 8, 0), make_offload_key(b"b" * 8, 1)]
        handle = await engine.submit_store(keys, GPULoadStoreSpec([0, 1], [1, 1], [0, 0]))
        assert (await handle).success
        events = await next_events(subscription)
        assert [(e.group_idx, e.block_size) for e in events] == [(0, 16), (1, 64)]


def test_events_settings_need_events_on() -> None:
    with pytest.raises(ConfigError, match="enable_kv_cache_events"):
        TieringEngine(config(), kv_caches(), cpu_bytes=CHUNK_BYTES, events=KVEventsConfig())


async def test_a_slow_subscriber_loses_its_oldest_batches_and_never_slows_the_engine(
    anyio_backend: str,
) -> None:
    engine = TieringEngine(events_config(), kv_caches(), cpu_bytes=64 * CHUNK_BYTES)
    async with engine:
        slow = engine.subscribe(max_batches=2)
        fast = engine.subscribe()
        for i in range(5):  # five turns of the loop, five batches
            assert await store(engine, [i], [i]) is JobOutcome.SUCCEEDED
            await next_events(fast)
        stats = engine.statistics().events
        assert stats is not None
        assert stats.batches_total == 5
        assert stats.sinks[0].dropped_total == 3
        with anyio.fail_after(10):
            gap = await slow.__anext__()
            assert not isinstance(gap, SequencedBatch)
            last = [await slow.__anext__(), await slow.__anext__()]
        assert [item.seq for item in last if isinstance(item, SequencedBatch)] == [3, 4]


async def test_subscriptions_end_when_the_engine_closes(anyio_backend: str) -> None:
    engine = TieringEngine(events_config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES)
    async with engine:
        subscription = engine.subscribe()
        assert await store(engine, [1], [0]) is JobOutcome.SUCCEEDED
    seen = []
    with anyio.fail_after(10):
        async for item in subscription:
            seen.append(item)
    assert len(seen) == 1


async def test_events_reach_a_zmq_subscriber_and_late_joiners_replay(
    anyio_backend: str, tmp_path: Path
) -> None:
    settings = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay"
    )
    engine = TieringEngine(events_config(), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, events=settings)
    async with engine:
        assert engine.event_endpoints == (settings.endpoint, settings.replay_endpoint)
        for i in range(3):
            assert await store(engine, [i], [i]) is JobOutcome.SUCCEEDED
        async with ZmqSubscriber(
            settings.endpoint, settings.replay_endpoint, start_seq=0
        ) as subscriber:
            got = []
            with anyio.fail_after(10):
                async for item in subscriber:
                    assert isinstance(item, SequencedBatch)
                    got.append(item)
                    if len(got) == 3:
                        break
        assert [item.seq for item in got] == [0, 1, 2]
        assert [item.batch.events[0].block_hashes for item in got] == [[0], [1], [2]]
        published = engine.statistics().events
        assert published is not None
        assert [(s.name, s.published_total) for s in published.sinks] == [
            ("subscribers", 0),
            ("zmq", 3),
        ]
    assert not [t for t in threading.enumerate() if "zmq" in t.name.lower()]


def test_importing_the_engine_does_not_import_pyzmq() -> None:
    import subprocess
    import sys

    code = "import tiering.engine, sys; print('zmq' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_restoring_present_keys_leaves_no_job_behind(anyio_backend: str) -> None:
    """A store whose keys are all present holds nothing: no job in the manager, no
    description in the event emitter (a leak of one entry per such store, once)."""
    engine = TieringEngine(
        events_config(**SELF_DESCRIBING), kv_caches(), cpu_bytes=4 * CHUNK_BYTES, backend="mock"
    )
    async with engine:
        assert await store(engine, [1, 2], [0, 1]) is JobOutcome.SUCCEEDED
        blocks = [ChunkBlocks(block_hashes=[i], block_size=16) for i in (1, 2)]
        for _ in range(200):
            handle = await engine.submit_store(
                [key(1), key(2)], GPULoadStoreSpec([0, 1]), blocks=blocks
            )
            assert (await handle).outcome is JobOutcome.SUCCEEDED
        assert engine._events is not None
        assert engine._events.described_jobs == 0
        assert engine.manager._store_jobs == {}
        stats = engine.statistics().manager
        assert (stats.open_store_jobs, stats.open_load_jobs, stats.writing) == (0, 0, 0)


async def test_the_config_data_parallel_index_moves_the_ports_and_ranks_the_batches(
    anyio_backend: str,
) -> None:
    cfg = events_config()
    assert isinstance(cfg, OffloadingConfig)
    rank = 2
    cfg = msgspec.structs.replace(
        cfg,
        parallel=msgspec.structs.replace(
            cfg.parallel, data_parallel_index=rank, data_parallel_size=rank + 1
        ),
    )
    with socket.socket() as a, socket.socket() as b:  # two free loopback ports
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        pub_port, replay_port = a.getsockname()[1], b.getsockname()[1]
    settings = KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{pub_port - rank}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port - rank}",
    )
    engine = TieringEngine(cfg, kv_caches(), cpu_bytes=4 * CHUNK_BYTES, events=settings)
    async with engine:
        assert engine.event_endpoints == (
            f"tcp://127.0.0.1:{pub_port}",
            f"tcp://127.0.0.1:{replay_port}",
        )
        subscription = engine.subscribe()
        assert await store(engine, [1], [0]) is JobOutcome.SUCCEEDED
        with anyio.fail_after(10):
            item = await subscription.__anext__()
        assert isinstance(item, SequencedBatch)
        assert item.batch.data_parallel_rank == rank
        # A late subscriber on the moved replay port gets the same batch, ranked.
        async with ZmqSubscriber(
            f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", start_seq=0
        ) as subscriber:
            with anyio.fail_after(10):
                replayed = await subscriber.__anext__()
        assert isinstance(replayed, SequencedBatch)
        assert replayed.batch == item.batch
