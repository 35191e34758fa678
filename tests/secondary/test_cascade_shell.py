"""`SecondaryCascade`, the engine's async shell over `tiering.cpu.flows.Flows`: its limits
as the constructor checks take them, over a MemoryTier and a bare CPU tier."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from tiering._types import make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.secondary import CascadeLimits, MemoryTier, RemoteNamespace
from tiering.secondary.cascade import SecondaryCascade

pytestmark = pytest.mark.anyio

ROW = 16
NAMESPACE = RemoteNamespace(model="m", dtype="float16", row_bytes=ROW, blocks_per_chunk=1)


async def test_a_numpy_integer_queue_bound_is_taken_as_an_int(anyio_backend: str) -> None:
    # The constructor checks take numpy's integers (tiering._checks); the queue is made
    # with the int, not handed to anyio as numpy's (which refuses it when the cascade starts).
    limits = CascadeLimits(cascade_queue=np.int64(2), cascade_chunks=np.int64(2))
    assert type(limits.cascade_queue) is int
    assert limits == CascadeLimits(cascade_queue=2, cascade_chunks=2)
    manager = CPUOffloadingManager(4, "lru")
    rows = bytearray(4 * ROW)
    cascade = SecondaryCascade(
        MemoryTier(NAMESPACE),
        manager,
        lambda chunk: memoryview(rows)[chunk * ROW : (chunk + 1) * ROW],
        row_bytes=ROW,
        limits=limits,
    )
    keys = (make_offload_key(b"a"), make_offload_key(b"b"))
    out = manager.prepare_store(keys)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    async with anyio.create_task_group() as task_group:
        cascade.start(task_group)
        cascade.stored(keys)
        with anyio.fail_after(10):
            await cascade.wait_idle()
        await cascade.aclose()
    stats = cascade.statistics()
    assert (stats.cascade_written, stats.cascade_pinned, stats.cascade_max_pinned) == (2, 0, 2)
