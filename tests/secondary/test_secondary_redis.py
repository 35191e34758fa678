"""RedisTier on a real standalone server: what it stores, TLS, URLs, TTL, ACL, batches.

What every tier guarantees is tests/secondary/test_secondary_contract.py; here,
what is Redis's own."""

from __future__ import annotations

import sys
import threading
from typing import Any

import anyio
import numpy as np
import pytest

from tiering._types import Medium
from tiering.errors import ConfigError
from tiering.secondary import Locality, RemoteNamespace, SecondaryTier
from tiering.secondary.checksum import Checksum
from tiering.secondary.redis import RedisTier, redact_url

pytestmark = pytest.mark.anyio


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


def test_importing_the_package_does_not_import_redis() -> None:
    import subprocess

    code = "import sys, tiering.secondary; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_it_detects_a_standalone_server_and_stores_one_plain_string_per_chunk(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with await RedisTier.open(redis_server.url, namespace) as tier:
        assert isinstance(tier, SecondaryTier)
        assert tier.cluster is False  # detected
        assert (tier.medium, tier.locality, tier.name) == (Medium.STORAGE, Locality.REMOTE, "redis")
        assert await tier.write(items(keys, rows)) == 2
        # One plain string per chunk, under its hash-tagged key.
        raw = redis_server.client()
        remote = tier.codec.remote_key(keys[0])
        assert raw.strlen(remote) == tier.codec.value_bytes(keys[0])
        assert raw.get(remote) == tier.codec.encode(keys[0], rows[0])
        assert raw.pttl(remote) == -1  # no TTL unless asked
        assert "tiering" in {c["name"] for c in raw.client_list()}  # it names its connections


async def test_rediss_writes_and_reads_byte_for_byte_over_tls(
    redis_tls_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    # TLS has no plain socket to send a caller's row on: each value is framed
    # in a buffer of the worker thread, checksummed on the way.
    keys, rows = chunks.keys(6), chunks.rows(6)
    async with await RedisTier.open(redis_tls_server.tls_url, namespace) as tier:
        assert tier.cluster is False
        assert await tier.write(items(keys[:4], rows[:4])) == 4
        assert await tier.contains(keys) == [True] * 4 + [False] * 2
        buffers = chunks.buffers(6)
        assert await tier.read(items(keys, buffers)) == [True] * 4 + [False] * 2
        for row, buffer in zip(rows[:4], buffers, strict=False):
            assert np.array_equal(row, buffer)
        s = tier.statistics()
        assert (s.errors_total, s.rejected_total, s.state) == (0, 0, "up")
    # The bytes on the server are the tier's values, readable over the plain port too.
    async with await RedisTier.open(redis_tls_server.url, namespace) as plain:
        again = chunks.buffers(4)
        assert await plain.read(items(keys[:4], again)) == [True] * 4
        assert all(np.array_equal(r, b) for r, b in zip(rows[:4], again, strict=True))


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_a_pooled_connection_the_server_closed_is_not_reused(
    redis_tls_server: Any, namespace: RemoteNamespace, chunks: Any, tls: bool
) -> None:
    """The server drops idle clients (its ``timeout``, or CLIENT KILL): the next call
    takes a fresh connection instead of failing on the dead one and going down."""
    keys, rows = chunks.keys(2), chunks.rows(2)
    url = redis_tls_server.tls_url if tls else redis_tls_server.url
    async with await RedisTier.open(url, namespace) as tier:
        assert await tier.write(items(keys, rows)) == 2
        raw = redis_tls_server.client()
        assert raw.client_kill_filter(_type="normal", skipme=True) >= 1  # the tier's, idle
        raw.close()
        assert await tier.contains(keys) == [True, True]
        s = tier.statistics()
        assert (s.state, s.errors_total) == ("up", 0)


def test_a_tls_read_into_a_thread_buffer_longer_than_the_row_fills_the_row() -> None:
    """A worker thread keeps its value buffer from call to call; after a tier of
    longer rows it is longer than this row, and only the row's part is used."""
    from tiering._types import make_offload_key
    from tiering.secondary import ChunkCodec
    from tiering.secondary.codec import Verdict
    from tiering.secondary.redis import wire
    from tiering.secondary.redis.resp import ReplyReader

    outcome: list[object] = []

    def run() -> None:
        wire._thread_buffer("value", 8192)  # an earlier read of an 8 KiB-row tier
        codec = ChunkCodec(
            RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4)
        )
        key = make_offload_key(1)
        row = (np.arange(4096) % 251).astype(np.uint8)
        value = codec.encode(key, memoryview(row))
        reader = ReplyReader()
        reader.feed(b"$%d\r\n" % len(value) + bytes(value) + b"\r\n")
        out = memoryview(bytearray(4096))
        sink = wire._ChunkSink(codec, key, out, direct=False)  # as on a TLS connection
        try:
            reader.reply(sink)
            outcome.append(sink.finish())
            outcome.append(bytes(out) == row.tobytes())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == [Verdict.OK, True]


async def test_rediss_with_an_untrusted_certificate_is_one_clear_config_error(
    redis_tls_server: Any, namespace: RemoteNamespace
) -> None:
    url = f"rediss://127.0.0.1:{redis_tls_server.tls_port}/0"  # the system CAs: not ours
    with pytest.raises(ConfigError, match="cannot reach the Redis tier at rediss://") as info:
        async with await RedisTier.open(url, namespace):
            pass
    assert "\n" not in str(info.value)


async def test_rediss_to_a_plain_server_and_redis_to_a_tls_port_say_which_is_wrong(
    redis_tls_server: Any, namespace: RemoteNamespace
) -> None:
    plain = f"rediss://127.0.0.1:{redis_tls_server.port}/0"
    with pytest.raises(ConfigError, match=r"use redis:// instead of rediss://"):
        await RedisTier.open(plain, namespace, timeout_s=0.5)
    tls = f"redis://127.0.0.1:{redis_tls_server.tls_port}/0"
    with pytest.raises(ConfigError, match=r"use rediss:// instead of redis://"):
        await RedisTier.open(tls, namespace, timeout_s=2.0)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://", "names no host"),
        ("redis://:6380/0", "names no host"),
        ("redis://127.0.0.1:99999", "port out of range or not a number; give a port from 1"),
        ("redis://127.0.0.1:0/0", "port out of range"),
        ("redis://127.0.0.1:abc/0", "not a number"),
        ("redis://[::1", "is not a valid URL"),
        ("redis://u:secret@[::1/0", "is not a valid URL"),
        ("redis://127.0.0.1:6380/abc", "names database 'abc'; a Redis database is a number"),
        ("rediss://u:secret@127.0.0.1:6380/x1", "names database 'x1'"),
    ],
)
def test_a_url_without_a_host_a_port_or_a_database_number_is_refused(
    namespace: RemoteNamespace, url: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        RedisTier(url, namespace)
    assert "secret" not in str(info.value)


async def test_large_batches_are_split_into_pipelines_of_max_batch(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(10), chunks.rows(10)
    async with RedisTier(redis_server.url, namespace, max_batch=4) as tier:
        assert await tier.write(items(keys, rows)) == 10
        buffers = chunks.buffers(10)
        assert await tier.read(items(keys, buffers)) == [True] * 10
        assert all(np.array_equal(r, b) for r, b in zip(rows, buffers, strict=True))
        assert tier.statistics().round_trips_total == 6


async def test_ttl_sets_an_expiry_on_every_value(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(3), chunks.rows(3)
    raw = redis_server.client()
    async with RedisTier(redis_server.url, namespace, ttl_s=60) as tier:
        assert await tier.write(items(keys, rows)) == 3
        for key in keys:
            assert 50_000 < raw.pttl(tier.codec.remote_key(key)) <= 60_000
    async with RedisTier(redis_server.url, namespace, ttl_s=0.001) as tier:
        assert await tier.write(items(keys[:1], rows[:1])) == 1
        # PX 1: expired already (-2), or within its last millisecond.
        assert raw.pttl(tier.codec.remote_key(keys[0])) in (-2, 0, 1)
        raw.delete(tier.codec.remote_key(keys[0]))  # what expiring does, without the wait
        assert await tier.contains(keys[:1]) == [False]  # expired: a miss, not an error
        assert tier.statistics().errors_total == 0


async def test_a_value_that_is_no_string_is_rejected_not_refused(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with RedisTier(redis_server.url, namespace) as tier:
        await tier.write(items(keys, rows))
        raw = redis_server.client()
        raw.delete(tier.codec.remote_key(keys[1]))
        raw.rpush(tier.codec.remote_key(keys[1]), b"a list, not a string")
        buffers = chunks.buffers(2)
        assert await tier.read(items(keys, buffers)) == [True, False]  # WRONGTYPE: not ours
        s = tier.statistics()
        assert (s.rejected_total, s.rejected_by_reason) == (1, {"bad_magic": 1})
        assert (s.refused_total, s.errors_total, s.state) == (0, 0, "up")
        assert not buffers[1].any()


async def test_works_with_an_acl_user_and_the_default_user_password(
    redis_acl_server: Any, acl: dict[str, str], namespace: RemoteNamespace, chunks: Any
) -> None:
    user, password, default = acl["user"], acl["password"], acl["default"]
    keys, rows = chunks.keys(2), chunks.rows(2)
    port = redis_acl_server.port
    for url in (
        f"redis://{user}:{password}@127.0.0.1:{port}/0",
        f"redis://:{default}@127.0.0.1:{port}/0",
    ):
        async with await RedisTier.open(url, namespace) as tier:
            assert await tier.write(items(keys, rows)) == 2
            buffers = chunks.buffers(2)
            assert await tier.read(items(keys, buffers)) == [True, True]
            assert np.array_equal(buffers[0], rows[0])
            assert password not in repr(tier)
            assert default not in tier.url


@pytest.mark.parametrize(
    ("userinfo", "shown"),
    [
        ("engine:wrong-password@", "redis://engine:***@"),
        ("", "redis://127.0.0.1"),
        (":nope@", "redis://:***@"),
    ],
)
async def test_wrong_credentials_are_one_clear_config_error(
    redis_acl_server: Any, namespace: RemoteNamespace, userinfo: str, shown: str
) -> None:
    url = f"redis://{userinfo}127.0.0.1:{redis_acl_server.port}/0"
    with pytest.raises(ConfigError) as caught:
        await RedisTier.open(url, namespace)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"cannot open the Redis tier at {shown}"
        + ("" if shown.endswith("127.0.0.1") else "127.0.0.1")
        + f":{redis_acl_server.port}/0: the server refused the user name or password"
    )
    assert shown in message
    assert "wrong-password" not in message
    assert "nope" not in message


async def test_an_unreachable_server_is_a_config_error_at_open(
    namespace: RemoteNamespace, unused_port: int
) -> None:
    url = f"redis://u:pw@127.0.0.1:{unused_port}/0"
    with anyio.fail_after(30), pytest.raises(ConfigError, match=r"cannot reach the Redis tier at"):
        await RedisTier.open(url, namespace, timeout_s=1.0)


def test_urls_and_options_are_checked(namespace: RemoteNamespace) -> None:
    with pytest.raises(ConfigError, match="redis:// or rediss://"):
        RedisTier("http://127.0.0.1:1/", namespace)
    with pytest.raises(ConfigError, match="yes, no or auto"):
        RedisTier("redis://127.0.0.1:1/?cluster=maybe", namespace)
    with pytest.raises(ConfigError, match="contradicts"):
        RedisTier("redis://127.0.0.1:1/?cluster=no", namespace, cluster=True)
    assert RedisTier("redis://127.0.0.1:1/?cluster=yes", namespace).cluster is True
    assert RedisTier("rediss://127.0.0.1:1/0?cluster=auto", namespace).cluster is None
    for option in ("timeout_s", "connect_timeout_s"):
        with pytest.raises(ConfigError, match=option):
            RedisTier("redis://127.0.0.1:1", namespace, **{option: 0})
    with pytest.raises(ConfigError, match="ttl_s"):
        RedisTier("redis://127.0.0.1:1", namespace, ttl_s=0)
    with pytest.raises(ConfigError, match="max_batch"):
        RedisTier("redis://127.0.0.1:1", namespace, max_batch=0)
    assert (
        redact_url("rediss://user:secret@host:6380/2?password=x&ssl_cert_reqs=none")
        == "rediss://user:***@host:6380/2"
    )
    assert redact_url("redis://:secret@[::1]:7000") == "redis://:***@[::1]:7000"


async def test_reads_land_straight_in_the_rows_not_through_redis_pys_parser(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any, monkeypatch: Any
) -> None:
    # White box: on a plain socket every GET value is routed by the tier's own reader
    # into the caller's row itself (after its header is checked), whether or not
    # hiredis is installed; redis-py reads no reply of the tier's.
    import redis.connection

    from tiering.secondary.redis import wire

    routed: list[bool] = []
    route = wire._ChunkSink.route

    def spy(self: Any, head: memoryview, size: int) -> Any:
        into = route(self, head, size)
        routed.append(into is self.out)
        return into

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("redis-py read a reply of the tier's")

    monkeypatch.setattr(wire._ChunkSink, "route", spy)
    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", refuse)
    keys, rows = chunks.keys(40), chunks.rows(40)
    async with RedisTier(redis_server.url, namespace, max_batch=16) as tier:
        assert await tier.write(items(keys[:30], rows[:30])) == 30
        buffers = chunks.buffers(40)
        assert await tier.read(items(keys, buffers)) == [True] * 30 + [False] * 10
        for buffer, row in zip(buffers[:30], rows[:30], strict=True):
            assert np.array_equal(buffer, row)
        assert routed == [True] * 30  # the misses are null replies: nothing to route
        s = tier.statistics()
        assert (s.round_trips_total, s.errors_total, s.rejected_total) == (5, 0, 0)


async def test_the_checksum_written_can_stay_ml64_for_a_rolling_upgrade(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(2), chunks.rows(2)
    async with RedisTier(redis_server.url, namespace, checksum="ml64") as old:
        assert await old.write(items(keys[:1], rows[:1])) == 1
    async with RedisTier(redis_server.url, namespace) as new:
        assert new.codec.checksum is Checksum.XXH3
        assert await new.write(items(keys[1:], rows[1:])) == 1
        raw = redis_server.client()
        kinds = [raw.get(new.codec.remote_key(k))[5] for k in keys]
        assert kinds == [Checksum.ML64, Checksum.XXH3]
        buffers = chunks.buffers(2)
        assert await new.read(items(keys, buffers)) == [True, True]  # every kind is read
        assert all(np.array_equal(b, r) for b, r in zip(buffers, rows, strict=True))
    with pytest.raises(ConfigError, match=r"checksum must be one of crc32, ml64, xxh3, got 'md5'"):
        RedisTier(redis_server.url, namespace, checksum="md5")


async def test_an_abandoned_call_touches_no_buffer(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    # White box: the worker thread of a call that timed out or was cancelled finds
    # the call's guard abandoned before each row, and stops without copying it.
    from tiering.secondary.redis.wire import Guard

    keys, rows = chunks.keys(3), chunks.rows(3)
    async with RedisTier(redis_server.url, namespace) as tier:
        assert await tier.write(items(keys, rows)) == 3
        wire = tier._wire
        buffers = chunks.buffers(3)
        read_rows = [
            (k, tier.codec.remote_key(k), memoryview(b)) for k, b in zip(keys, buffers, strict=True)
        ]
        guard = Guard()
        guard.abandon()
        answer = await anyio.to_thread.run_sync(wire.run, wire.read, guard, read_rows)
        assert answer.values == [None] * 3
        assert not any(b.any() for b in buffers)
        write_rows = [
            (k, tier.codec.remote_key(k), memoryview(r)) for k, r in zip(keys, rows, strict=True)
        ]
        answer = await anyio.to_thread.run_sync(wire.run, wire.write, guard, write_rows)
        assert answer.values == [None] * 3
        assert await tier.read(items(keys, buffers)) == [True] * 3  # the pool is still sound
