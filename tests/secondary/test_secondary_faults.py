"""RedisTier when Redis goes away, hangs or never was: backoff, recovery, overload, a full store.

A store that goes away, hangs or is cancelled on is the contract's
(tests/secondary/test_secondary_contract.py); here, what is Redis's own. No
test waits on a clock: a tier backing off is made due for its retry
(``_health.retry_at``, white box)."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from tiering.secondary import RemoteNamespace
from tiering.secondary.redis import RedisTier

from ..conftest import yields

pytestmark = pytest.mark.anyio


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


async def test_while_down_calls_do_no_io_until_the_retry_time(
    own_redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with RedisTier(own_redis_server.url, namespace, backoff_s=(60.0, 120.0)) as tier:
        assert await tier.contains(keys) == [False, False]
        own_redis_server.kill()
        assert await tier.contains(keys) == [False, False]
        before = tier.statistics()
        assert (before.state, before.errors_total) == ("down", 1)
        own_redis_server.start()  # back, but the tier waits for its retry time
        raw = own_redis_server.client()
        connections = raw.info("stats")["total_connections_received"]
        for _ in range(20):
            assert await tier.contains(keys) == [False, False]
            assert await tier.write(items(keys, rows)) == 0
        # Answered at once: not one connection tried (the test's own INFO aside).
        assert raw.info("stats")["total_connections_received"] == connections
        after = tier.statistics()
        assert after.unavailable_total == before.unavailable_total + 40
        assert after.round_trips_total == before.round_trips_total
        assert after.errors_total == before.errors_total
        assert after.state == "down"


async def test_never_reachable_is_down_not_an_exception(
    namespace: RemoteNamespace, chunks: Any, unused_port: int
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    url = f"redis://127.0.0.1:{unused_port}/0"
    async with RedisTier(url, namespace, timeout_s=1.0, backoff_s=(60.0, 60.0)) as tier:
        with anyio.fail_after(10):
            assert await tier.write(items(keys, rows)) == 0
            assert await tier.contains(keys) == [False, False]
        s = tier.statistics()
        assert (s.state, s.errors_total, s.unavailable_total, s.write_errors_total) == (
            "down",
            1,
            1,
            2,
        )
        assert s.last_error is not None
        assert "Connection refused" in s.last_error
        assert f"{unused_port}" in repr(tier)


async def test_a_write_that_fills_the_socket_of_a_hung_server_times_out_and_recovers(
    own_redis_server: Any, namespace: RemoteNamespace, make_chunks: Any
) -> None:
    # 48 MiB to a stopped server: the socket's buffers fill, the worker waits for
    # room (outside the guard's lock) until the timeout, and the tier goes down.
    # Nothing half-sent is ever read back as a chunk.
    big = RemoteNamespace(
        model=namespace.model,
        dtype=namespace.dtype,
        row_bytes=2 << 20,
        blocks_per_chunk=namespace.blocks_per_chunk,
        namespace=namespace.namespace,
    )
    chunks = make_chunks(big.row_bytes)
    keys, rows = chunks.keys(24), chunks.rows(24)
    tier = RedisTier(own_redis_server.url, big, timeout_s=0.5, backoff_s=(0.02, 0.1))
    async with tier:
        await tier.connect()
        own_redis_server.freeze()
        try:
            with anyio.fail_after(10):
                assert await tier.write(items(keys, rows)) == 0
            s = tier.statistics()
            assert (s.state, s.timeouts_total) == ("down", 1)
        finally:
            own_redis_server.thaw()
        tier._health.retry_at = 0.0  # white box: the retry time has come
        assert await tier.write(items(keys[:1], rows[:1])) == 1
        buffers = chunks.buffers(24)
        found = await tier.read(items(keys, buffers))
        assert found[0]
        for hit, buffer, row in zip(found, buffers, rows, strict=True):
            assert np.array_equal(buffer, row) if hit else not buffer.any()
        assert tier.statistics().rejected_total == 0


async def test_all_threads_busy_until_the_deadline_is_overload_not_an_outage(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys = chunks.keys(2)
    async with RedisTier(redis_server.url, namespace, timeout_s=0.1, max_concurrency=1) as tier:
        places = tier._calls._live  # white box: the one worker thread, held by "another call"
        places.acquire()
        try:
            with anyio.fail_after(10):
                assert await tier.contains(keys) == [False, False]
        finally:
            places.release()
        s = tier.statistics()
        assert (s.busy_total, s.state, s.errors_total, s.timeouts_total) == (1, "up", 0, 0)
        assert s.round_trips_total == 0
        assert await tier.contains(keys) == [False, False]  # and the next call goes through
        assert tier.statistics().round_trips_total == 1


async def test_a_full_redis_refusing_writes_backs_off_its_writes_and_reads_go_on(
    own_redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    """``maxmemory`` with ``noeviction``: SETs are refused (OOM). The refusals are
    counted once each, by reason; writes then back off (no I/O until the retry
    time) while lookups and reads go on; when room is made, writes resume."""
    keys, rows = chunks.keys(40), chunks.rows(40)
    raw = own_redis_server.client()
    async with RedisTier(own_redis_server.url, namespace, backoff_s=(0.05, 0.2)) as tier:
        assert await tier.write(items(keys[:2], rows[:2])) == 2
        used = int(raw.info("memory")["used_memory"])
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", used + 4 * len(rows[0]))  # room for a few more values

        written = await tier.write(items(keys[2:], rows[2:]))
        assert written < 38
        s = tier.statistics()
        refused = 38 - written
        assert (s.refused_total, s.refused_by_reason) == (refused, {"OOM": refused})
        assert s.write_errors_by_reason == {"refused OOM": refused}
        assert s.errors_total == 0  # a refusal is not a failed call, and counted once
        assert (s.state, s.write_state) == ("up", "backing off")
        assert s.last_refusal is not None
        assert "OutOfMemoryError" in s.last_refusal

        # Backing off: the next writes are dropped without I/O, and counted so;
        # each is still a checkpoint (another task gets its turns).
        sets = int(raw.info("commandstats").get("cmdstat_set", {}).get("calls", 0))

        async def dropped() -> None:
            assert await tier.write(items(keys[2:4], rows[2:4])) == 0

        assert await yields(dropped, 10)
        assert int(raw.info("commandstats")["cmdstat_set"]["calls"]) == sets
        s = tier.statistics()
        assert s.write_errors_by_reason["backing off"] == 20
        # Lookups and reads still reach the server.
        buffers = chunks.buffers(2)
        assert await tier.contains(keys[:2]) == [True, True]
        assert await tier.read(items(keys[:2], buffers)) == [True, True]
        assert all(np.array_equal(r, b) for r, b in zip(rows[:2], buffers, strict=True))

        raw.config_set("maxmemory", 0)  # room again: the next probe write finds it
        tier._write_gate.retry_at = 0.0  # the retry time has come (no waiting on a clock)
        assert await tier.write(items(keys[2:4], rows[2:4])) == 2
        assert tier.statistics().write_state == "up"
