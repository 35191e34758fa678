"""A closed engine refuses its sync scheduler-side calls as it refuses every other.

Before: `lookup` of a closed engine answered from the manager's last state
(``ready=3`` from a released pool), and `touch` changed the recency of chunks
whose memory was gone. Now both raise `ResourceClosedError`, before the engine
opens and after it closed, while `statistics()` and `repr` keep working.
"""

from __future__ import annotations

import pytest

from tiering import ResourceClosedError
from tiering.engine import PrefixLookup, TieringEngine

from .test_engine import CHUNK_BYTES, config, keys, kv_caches, spec

pytestmark = pytest.mark.anyio


async def test_lookup_and_touch_of_a_closed_engine_raise(anyio_backend: str) -> None:
    engine = TieringEngine(config(), kv_caches(), cpu_bytes=8 * CHUNK_BYTES, backend="mock")
    with pytest.raises(ResourceClosedError, match="new"):
        engine.lookup(keys(1))
    with pytest.raises(ResourceClosedError, match="new"):
        engine.touch(keys(1))
    async with engine:
        assert (await (await engine.submit_store(keys(1, 2, 3), spec(range(3))))).success
        assert engine.lookup(keys(1, 2, 3)) == PrefixLookup(ready=3, pending=0, missing=0)
        engine.touch(keys(1, 2, 3))
    with pytest.raises(ResourceClosedError, match="closed"):
        engine.lookup(keys(1, 2, 3))
    with pytest.raises(ResourceClosedError, match="closed"):
        engine.touch(keys(1, 2, 3))
    stats = engine.statistics()  # still readable after close
    assert stats.state == "closed"
    assert stats.pool is not None
    assert stats.pool.closed
    assert "closed" in repr(engine)
