"""The `SecondaryTier` contract (tiering/secondary/base.py), one suite run on every tier.

Each tier comes with a `Rig`: the tier under test, and the store behind it
played by hand (values put under the tier's keys; the store taken away,
hung, made to refuse writes, brought back). A rig never waits on a clock: a
tier that backs off is made due for its retry instead.

To add a tier: write its rig fixture below and add its name to `TIERS`.
"""

from __future__ import annotations

import abc
import errno
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from tiering._types import OffloadKey
from tiering.errors import ResourceClosedError, SpecError
from tiering.secondary import ChunkCodec, MemoryTier, RemoteNamespace, SecondaryTier, Verdict
from tiering.secondary.checksum import Checksum

from ..conftest import turns_during as _turns_during

pytestmark = pytest.mark.anyio

#: Every tier the contract runs on: a rig fixture named ``<name>_rig`` each.
TIERS = ["memory", "redis", "disk"]


class Rig(abc.ABC):
    """A tier under test and the store behind it."""

    tier: SecondaryTier
    #: The code a refused write is counted under (``OOM``: a full Redis; ``ENOSPC``: a full disk).
    refusal_code = "OOM"

    async def ready(self) -> None:  # noqa: B027 - most tiers need nothing here
        """Called once the tier is entered, before the test."""

    @abc.abstractmethod
    def put_raw(self, key: OffloadKey, value: bytes) -> None:
        """Store ``value`` as it is under the tier's remote key of ``key``."""

    @abc.abstractmethod
    async def go_down(self) -> None:
        """The store can no longer be reached."""

    @abc.abstractmethod
    async def come_back(self) -> None:
        """The store answers again, and the tier is due to try it."""

    @abc.abstractmethod
    def hang(self) -> None:
        """The store holds every request unanswered."""

    @abc.abstractmethod
    def unhang(self) -> None:
        """The store answers again (what it held, then the rest); the tier is due to try it."""

    @abc.abstractmethod
    def refuse_writes(self) -> None:
        """The store refuses writes with ``OOM`` (full); reads go on."""

    @abc.abstractmethod
    def accept_writes(self) -> None:
        """The store takes writes again; the tier is due to try it."""


class MemoryRig(Rig):
    def __init__(self, namespace: RemoteNamespace) -> None:
        self.tier: MemoryTier = MemoryTier(namespace, timeout_s=0.25)

    def put_raw(self, key: OffloadKey, value: bytes) -> None:
        self.tier.store[self.tier.codec.remote_key(key)] = value

    async def go_down(self) -> None:
        self.tier.set_available(False)

    async def come_back(self) -> None:
        self.tier.set_available(True)

    def hang(self) -> None:
        self.tier.pause()

    def unhang(self) -> None:
        self.tier.resume()

    def refuse_writes(self) -> None:
        self.tier.refuse_writes("OOM")

    def accept_writes(self) -> None:
        self.tier.refuse_writes(None)


class RedisRig(Rig):
    """A `RedisTier` on a server of the test's own, to kill, freeze and fill."""

    def __init__(self, server: Any, namespace: RemoteNamespace) -> None:
        from tiering.secondary.redis import RedisTier

        self.server = server
        # Backoff far beyond any test: only `_due` makes the tier try the store again.
        self.tier: RedisTier = RedisTier(
            server.url, namespace, timeout_s=0.5, backoff_s=(60.0, 60.0)
        )
        self.raw = server.client()

    def _due(self) -> None:
        self.tier._health.retry_at = 0.0  # white box: the retry time has come
        self.tier._write_gate.retry_at = 0.0

    def put_raw(self, key: OffloadKey, value: bytes) -> None:
        self.raw.set(self.tier.codec.remote_key(key), value)

    async def go_down(self) -> None:
        self.server.kill()

    async def come_back(self) -> None:
        self.server.start()  # the same port; empty (no persistence)
        self.raw = self.server.client()
        self._due()

    def hang(self) -> None:
        self.server.freeze()

    def unhang(self) -> None:
        self.server.thaw()
        self._due()

    def refuse_writes(self) -> None:
        self.raw.config_set("maxmemory-policy", "noeviction")
        self.raw.config_set("maxmemory", 1)  # below what the server uses: every SET is OOM

    def accept_writes(self) -> None:
        self.raw.config_set("maxmemory", 0)
        self._due()


class _FullDisk:
    """The `os` calls of a disk tier, with a disk that is full: every write is ENOSPC."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def pwritev(self, *args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class DiskRig(Rig):
    """A `DiskTier` in a folder of the test's own, to take away, freeze and fill."""

    refusal_code = "ENOSPC"

    async def ready(self) -> None:
        await self.tier.open()  # the scan, before values are put behind the tier's back

    def __init__(self, root: Path, namespace: RemoteNamespace) -> None:
        from tiering.secondary.disk import DiskTier

        self.root = root
        self.away = root.with_name(root.name + "-away")
        # Backoff far beyond any test: only `_due` makes the tier try the disk again.
        self.tier: DiskTier = DiskTier(
            root, 64 << 20, namespace, timeout_s=0.25, backoff_s=(60.0, 60.0)
        )

    def _due(self) -> None:
        self.tier._health.retry_at = 0.0  # white box: the retry time has come
        self.tier._write_gate.retry_at = 0.0

    def put_raw(self, key: OffloadKey, value: bytes) -> None:
        from tiering.secondary.disk.files import file_bytes

        tier = self.tier
        path = tier._files.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = file_bytes(tier.codec, key, value)
        path.write_bytes(data)
        # White box: the index learns of it as an open would (without its checks).
        tier._sizes[key] = len(data)
        tier._used += len(data)
        tier.policy.insert([key])

    async def go_down(self) -> None:
        self.root.rename(self.away)

    async def come_back(self) -> None:
        self.away.rename(self.root)
        self._due()

    def hang(self) -> None:
        self.tier._files.answering.clear()

    def unhang(self) -> None:
        self.tier._files.answering.set()
        self._due()

    def refuse_writes(self) -> None:
        self.tier._files.os = _FullDisk()

    def accept_writes(self) -> None:
        self.tier._files.os = os
        self._due()


@pytest.fixture
def disk_rig(tmp_path: Path, namespace: RemoteNamespace) -> DiskRig:
    return DiskRig(tmp_path / "disk", namespace)


@pytest.fixture
def memory_rig(namespace: RemoteNamespace) -> MemoryRig:
    return MemoryRig(namespace)


@pytest.fixture
def redis_rig(own_redis_server: Any, namespace: RemoteNamespace) -> RedisRig:
    return RedisRig(own_redis_server, namespace)


@pytest.fixture(params=TIERS)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    made: Rig = request.getfixturevalue(f"{request.param}_rig")
    async with made.tier:
        await made.ready()
        yield made


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


CALLS = 10


async def turns_during(step: Callable[[], Awaitable[Any]]) -> int:
    """How many turns a counting task got while ``step()`` was awaited `CALLS` times."""
    return await _turns_during(step, CALLS)


# -- what is written is read back, one round trip a call -------------------------------


async def test_written_chunks_read_back_byte_for_byte_one_round_trip_a_call(
    rig: Rig, chunks: Any
) -> None:
    tier, row_bytes = rig.tier, rig.tier.row_bytes
    keys, rows = chunks.keys(12), chunks.rows(12)
    assert await tier.contains(keys) == [False] * 12
    assert await tier.write(items(keys[:8], rows[:8])) == 8
    assert await tier.contains(keys) == [True] * 8 + [False] * 4
    buffers = chunks.buffers(12)
    assert await tier.read(items(keys, buffers)) == [True] * 8 + [False] * 4
    assert all(np.array_equal(r, b) for r, b in zip(rows, buffers[:8], strict=False))
    assert not any(b.any() for b in buffers[8:])  # a miss writes nothing
    s = tier.statistics()
    assert s.round_trips_total == 4  # one per call: batched
    assert (s.contains_calls, s.hits_total, s.misses_total) == (2, 8, 16)
    assert (s.read_calls, s.reads_total, s.read_misses_total) == (1, 8, 4)
    assert (s.read_bytes_total, s.rejected_total) == (8 * row_bytes, 0)
    assert (s.write_calls, s.writes_total, s.write_bytes_total) == (1, 8, 8 * row_bytes)
    assert (s.write_errors_total, s.write_errors_by_reason) == (0, {})
    assert (s.errors_total, s.refused_total, s.state, s.last_error) == (0, 0, "up", None)
    # Empty calls answer at once, with no round trip.
    assert await tier.contains([]) == []
    assert await tier.write([]) == 0
    assert await tier.read([]) == []
    assert tier.statistics().round_trips_total == 4
    assert f"{s.writes_total} written" in repr(tier)


async def test_a_chunk_written_again_is_overwritten(rig: Rig, chunks: Any) -> None:
    keys, rows = chunks.keys(1), chunks.rows(2)
    assert await rig.tier.write(items(keys, rows[:1])) == 1
    assert await rig.tier.write(items(keys, rows[1:])) == 1
    buffers = chunks.buffers(1)
    assert await rig.tier.read(items(keys, buffers)) == [True]
    assert np.array_equal(buffers[0], rows[1])


async def test_statistics_are_snapshots_and_cost_no_io(rig: Rig, chunks: Any) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    await rig.tier.write(items(keys, rows))
    rig.refuse_writes()
    await rig.tier.write(items(keys, rows))
    first = rig.tier.statistics()
    assert rig.tier.statistics() == first  # no I/O, nothing counted
    assert await rig.tier.contains(keys) == [True, True]
    assert first.refused_by_reason == {rig.refusal_code: 2}
    assert first.contains_calls == 0  # a snapshot: later calls do not change it


# -- expected outcomes are return values -----------------------------------------------


async def test_a_store_that_goes_away_is_misses_and_dropped_writes_then_it_comes_back(
    rig: Rig, chunks: Any
) -> None:
    tier = rig.tier
    keys, rows = chunks.keys(4), chunks.rows(4)
    assert await tier.write(items(keys, rows)) == 4
    trips = tier.statistics().round_trips_total
    await rig.go_down()
    assert await tier.contains(keys) == [False] * 4
    assert await tier.write(items(keys, rows)) == 0
    buffers = chunks.buffers(4)
    assert await tier.read(items(keys, buffers)) == [False] * 4
    assert not any(b.any() for b in buffers)
    s = tier.statistics()
    assert s.state == "down"
    assert (s.misses_total, s.read_misses_total, s.write_errors_total) == (4, 4, 4)
    assert set(s.write_errors_by_reason) <= {"down", "failed"}
    assert s.errors_total + s.unavailable_total == 3  # each call answered once, one way
    assert s.round_trips_total == trips  # nothing reached the store while it was away

    await rig.come_back()
    assert await tier.write(items(keys, rows)) == 4  # the store answers: up again
    s = tier.statistics()
    assert (s.state, s.reconnects_total) == ("up", 1)
    assert await tier.read(items(keys, buffers)) == [True] * 4
    assert all(np.array_equal(r, b) for r, b in zip(rows, buffers, strict=True))


async def test_misuse_raises_and_nothing_else_does(rig: Rig, chunks: Any) -> None:
    tier, row_bytes = rig.tier, rig.tier.row_bytes
    key = chunks.keys(1)[0]
    with pytest.raises(SpecError, match="writable"):
        await tier.read([(key, memoryview(bytes(row_bytes)))])
    with pytest.raises(SpecError, match="row"):
        await tier.read([(key, memoryview(bytearray(row_bytes - 1)))])
    with pytest.raises(SpecError, match="row"):
        await tier.write([(key, b"short")])
    with pytest.raises(SpecError, match="contiguous"):
        await tier.read([(key, memoryview(np.zeros(2 * row_bytes, np.uint8))[::2])])
    s = tier.statistics()
    assert (s.read_calls, s.write_calls, s.round_trips_total) == (0, 0, 0)  # refused first
    await tier.aclose()
    await tier.aclose()  # idempotent
    assert tier.statistics().state == "closed"
    for call in (
        lambda: tier.contains([key]),
        lambda: tier.write([(key, memoryview(np.zeros(row_bytes, np.uint8)))]),
        lambda: tier.read([(key, memoryview(np.zeros(row_bytes, np.uint8)))]),
    ):
        with pytest.raises(ResourceClosedError):
            await call()


# -- nothing waits forever; buffers are the caller's again ------------------------------


async def test_a_hung_store_times_out_and_the_buffers_stay_the_callers(
    rig: Rig, chunks: Any
) -> None:
    tier = rig.tier
    keys, rows = chunks.keys(3), chunks.rows(3)
    assert await tier.write(items(keys, rows)) == 3
    buffers = chunks.buffers(3)
    rig.hang()
    try:
        with anyio.fail_after(30):  # a safety net far above the tier's timeout
            assert await tier.read(items(keys, buffers)) == [False] * 3
            assert await tier.contains(keys) == [False] * 3
            assert await tier.write(items(keys, rows)) == 0
        s = tier.statistics()
        assert s.state == "down"
        assert s.timeouts_total >= 1
        assert s.timeouts_total <= s.errors_total
        assert s.last_error is not None
        assert s.last_error.startswith("TimeoutError: ")
        assert not any(b.any() for b in buffers)
    finally:
        rig.unhang()
    # What the store held is answered now; none of it may land in the buffers.
    fresh = chunks.buffers(3)
    assert await tier.read(items(keys, fresh)) == [True] * 3
    assert all(np.array_equal(r, b) for r, b in zip(rows, fresh, strict=True))
    assert not any(b.any() for b in buffers)
    assert tier.statistics().state == "up"


async def test_a_call_cancelled_while_the_store_hangs_gives_the_buffers_back(
    rig: Rig, chunks: Any
) -> None:
    tier = rig.tier
    keys, rows = chunks.keys(2), chunks.rows(2)
    assert await tier.write(items(keys, rows)) == 2
    buffers = chunks.buffers(2)
    payloads = chunks.rows(2)
    sent = [p.copy() for p in payloads]
    written: list[int] = []
    rig.hang()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tier.read, items(keys, buffers))
            tg.start_soon(lambda: _append(written, tier.write(items(keys, payloads))))
            await anyio.wait_all_tasks_blocked()  # both wait for the store
            tg.cancel_scope.cancel()
        assert written == []
        assert not any(b.any() for b in buffers)
        s = tier.statistics()
        assert (s.state, s.errors_total, s.timeouts_total) == ("up", 0, 0)  # not a fault
        assert s.write_errors_by_reason == {"cancelled": 2}
        for payload in payloads:
            payload[:] = 0  # the caller's again: reused at once
    finally:
        rig.unhang()
    fresh = chunks.buffers(2)
    assert await tier.read(items(keys, fresh)) == [True, True]
    for buffer, old, new in zip(fresh, rows, sent, strict=True):
        # The old rows, or (if the cancelled write had reached the store) the new ones
        # whole: never the zeros written into the payloads after the cancellation.
        assert np.array_equal(buffer, old) or np.array_equal(buffer, new)
    assert not any(b.any() for b in buffers)


async def _append(out: list[int], call: Awaitable[int]) -> None:
    out.append(await call)


# -- values are self-checking -------------------------------------------------------------


async def test_values_that_fail_a_check_are_never_loaded(
    rig: Rig, chunks: Any, namespace: RemoteNamespace
) -> None:
    tier = rig.tier
    codec = tier.codec
    keys, rows = chunks.keys(9), chunks.rows(9)
    foreign = ChunkCodec(
        RemoteNamespace(
            model=namespace.model,
            dtype="float8_e4m3",  # same size, other bytes: another engine's
            row_bytes=namespace.row_bytes,
            blocks_per_chunk=namespace.blocks_per_chunk,
            namespace=namespace.namespace,
        )
    )
    good = codec.encode(keys[6], rows[6])
    corrupted = bytearray(codec.encode(keys[5], rows[5]))
    corrupted[-7] ^= 0x01
    rig.put_raw(keys[0], foreign.encode(keys[0], rows[0]))
    rig.put_raw(keys[1], codec.encode(keys[8], rows[1]))  # a valid value, another chunk's
    rig.put_raw(keys[2], codec.encode(keys[2], rows[2])[:-10])  # truncated
    rig.put_raw(keys[3], codec.encode(keys[3], rows[3]) + b"x")  # padded
    rig.put_raw(keys[4], b"not a chunk at all")
    rig.put_raw(keys[5], bytes(corrupted))
    rig.put_raw(keys[6], good)  # the control: a sound value
    rig.put_raw(keys[7], ChunkCodec(namespace, Checksum.ML64).encode(keys[7], rows[7]))
    rig.put_raw(keys[8], b"")
    assert await tier.contains(keys) == [True] * 9  # existence is only a hint
    buffers = chunks.buffers(9)
    filled = await tier.read(items(keys, buffers))
    assert filled == [False] * 6 + [True, True, False]
    assert np.array_equal(buffers[6], rows[6])
    assert np.array_equal(buffers[7], rows[7])  # every checksum kind is read
    for i in (0, 1, 2, 3, 4, 8):  # failed a check of the header: not one byte copied
        assert not buffers[i].any()
    # (a corrupted payload may have landed before its checksum failed: False all the same)
    s = tier.statistics()
    assert (s.rejected_total, s.reads_total, s.read_misses_total) == (7, 2, 0)
    assert s.rejected_by_reason == {
        Verdict.FOREIGN_NAMESPACE.value: 1,
        Verdict.WRONG_KEY.value: 1,
        Verdict.BAD_LENGTH.value: 2,
        Verdict.BAD_MAGIC.value: 2,
        Verdict.BAD_CHECKSUM.value: 1,
    }
    assert (s.errors_total, s.state) == (0, "up")  # a bad value is not a fault
    assert s.last_rejection == f"bad_magic for key {bytes(keys[8]).hex()}"


# -- counts add up --------------------------------------------------------------------------


async def test_refused_writes_are_counted_once_by_code_and_the_tier_stays_up(
    rig: Rig, chunks: Any
) -> None:
    tier = rig.tier
    keys, rows = chunks.keys(5), chunks.rows(5)
    assert await tier.write(items(keys[:2], rows[:2])) == 2
    rig.refuse_writes()
    assert await tier.write(items(keys[2:], rows[2:])) == 0
    s = tier.statistics()
    code = rig.refusal_code
    assert (s.refused_total, s.refused_by_reason) == (3, {code: 3})
    assert s.write_errors_by_reason == {f"refused {code}": 3}
    assert (s.errors_total, s.state) == (0, "up")  # a refusal is no failed call
    assert s.last_refusal is not None
    # Lookups and reads go on.
    buffers = chunks.buffers(2)
    assert await tier.contains(keys[:2]) == [True, True]
    assert await tier.read(items(keys[:2], buffers)) == [True, True]
    rig.accept_writes()
    assert await tier.write(items(keys[2:], rows[2:])) == 3
    s = tier.statistics()
    assert (s.writes_total, s.write_errors_total, s.refused_total) == (5, 3, 3)


async def test_every_chunk_not_written_is_counted_once_by_reason(rig: Rig, chunks: Any) -> None:
    tier = rig.tier
    keys, rows = chunks.keys(3), chunks.rows(3)
    offered = written = 0

    async def write(n: int) -> None:
        nonlocal offered, written
        offered += n
        written += await tier.write(items(keys[:n], rows[:n]))

    await write(3)
    rig.refuse_writes()
    await write(2)
    rig.accept_writes()
    with anyio.CancelScope() as scope:  # the caller gives up
        scope.cancel()
        await write(3)
    rig.hang()
    try:
        await write(1)  # times out
    finally:
        rig.unhang()
    await write(2)  # answered again
    await rig.go_down()
    await write(3)
    await write(1)
    s = tier.statistics()
    assert written == s.writes_total == 5
    assert s.write_errors_total == offered - written == sum(s.write_errors_by_reason.values())
    by_reason = dict(s.write_errors_by_reason)
    assert by_reason.pop(f"refused {rig.refusal_code}") == 2
    assert by_reason.pop("cancelled") == 3
    assert by_reason.pop("timeout") == 1
    assert set(by_reason) <= {"down", "failed"}
    assert sum(by_reason.values()) == 4
    assert s.refused_total == 2  # refusals once: not also errors
    assert s.errors_total == s.timeouts_total + ("failed" in by_reason)  # failed calls only


# -- every call is a checkpoint ---------------------------------------------------------------


async def test_every_call_is_a_checkpoint_up_down_and_closed(rig: Rig, chunks: Any) -> None:
    tier = rig.tier
    keys, rows, buffers = chunks.keys(2), chunks.rows(2), chunks.buffers(2)
    steps: list[Callable[[], Awaitable[Any]]] = [
        lambda: tier.contains([]),
        lambda: tier.write([]),
        lambda: tier.read([]),
        lambda: tier.contains(keys),
        lambda: tier.write(items(keys, rows)),
        lambda: tier.read(items(keys, buffers)),
    ]
    for step in steps:
        assert await turns_during(step) >= CALLS // 2
    await rig.go_down()
    await tier.contains(keys)  # now it knows
    for step in steps:
        assert await turns_during(step) >= CALLS // 2
    assert await turns_during(tier.aclose) >= CALLS // 2  # closing, then closed again
