"""Retention hints through the engine's API: the CPU tier, a real DiskTier and a real Redis
honour them (retained chunks outlive a flood, released ones go first, Redis TTLs set
by the rule of `tiering.secondary.redis.tier`), a tier that does not honour them counts
them ignored, a bad hint is refused before anything changes, `engine.hint` is a
checkpoint."""

from __future__ import annotations

import json
import logging
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tiering.engine import TieringEngine
from tiering.errors import ResourceClosedError
from tiering.hints import Hint, HintError
from tiering.secondary import MemoryTier, RemoteNamespace, SecondaryTier
from tiering.secondary.disk import DiskTier
from tiering.secondary.redis import RedisTier
from tiering.transfer.mock import MockBackend

from .conftest import yields
from .secondary import conftest as secondary
from .secondary.conftest import RedisClusterRig, RedisServer
from .test_engine import CHUNK_BYTES, config, keys, kv_caches, spec
from .test_examples import PROMPT
from .test_examples import servers as _servers

pytestmark = pytest.mark.anyio

redis_server = secondary.redis_server
redis_cluster = secondary.redis_cluster
servers = _servers  # examples/server.py in processes of its own, stopped by pid

RETAIN = Hint(retain_s=600.0)
RELEASE = Hint(release=True)
VALUE = CHUNK_BYTES + 4096  # a value on the disk tier: its row and a 4 KiB head


Tier = Callable[[RemoteNamespace], SecondaryTier]


def engine_over(
    chunks: int,
    tier: Tier | Sequence[Tier] | None = None,
    *,
    policy: str = "lru",
    **options: Any,
) -> TieringEngine:
    return TieringEngine(
        config(),
        kv_caches(),
        cpu_bytes=chunks * CHUNK_BYTES,
        policy=policy,
        secondary=tier,
        remote_namespace=uuid.uuid4().hex,  # this test's own keys in a shared Redis
        **options,
    )


async def run_request(
    engine: TieringEngine,
    ids: Sequence[int],
    *,
    hint: Hint | None = None,
    store_hint: Hint | None = None,
) -> None:
    """One request: its chunks stored (with ``store_hint``), then its use (with ``hint``)."""
    ks = keys(*ids)
    handle = await engine.submit_store(ks, spec(range(len(ks))), hint=store_hint)
    assert (await handle).success
    engine.touch(ks, hint)
    if engine.tiers:
        with anyio.fail_after(10):
            await engine.wait_written_through()


async def flood(engine: TieringEngine, first: int, requests: int, size: int = 2) -> None:
    for r in range(requests):
        await run_request(engine, range(first + r * size, first + (r + 1) * size))


def held(engine: TieringEngine, *ids: int) -> list[bool]:
    return [engine.manager.holds(k, ready=True) for k in keys(*ids)]


# -- the CPU tier -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "dslru"])
@pytest.mark.parametrize("how", ["touch", "store", "none"])
async def test_a_retained_prefix_outlives_a_flood_that_evicts_it_without_the_hint(
    anyio_backend: str, policy: str, how: str
) -> None:
    async with engine_over(20, policy=policy) as engine:  # retention: 4 chunks at most
        await run_request(
            engine,
            [1, 2],
            hint=RETAIN if how == "touch" else None,
            store_hint=RETAIN if how == "store" else None,
        )
        await flood(engine, 100, 30)  # 60 chunks, each used once
        assert held(engine, 1, 2) == ([False, False] if how == "none" else [True, True])
        stats = engine.manager.hints.statistics()
        assert stats.retained == (0 if how == "none" else 2)


@pytest.mark.parametrize("released", [True, False])
async def test_a_released_prefix_goes_first(anyio_backend: str, released: bool) -> None:
    async with engine_over(20) as engine:
        for i in range(1, 21):
            await run_request(engine, [i])
        if released:
            await engine.hint(keys(15), RELEASE)
        await run_request(engine, [21])  # one victim
        assert held(engine, 1, 15) == ([True, False] if released else [False, True])


async def test_a_hint_with_a_release_at_touch_frees_that_request_first(anyio_backend: str) -> None:
    async with engine_over(8) as engine:
        for i in range(1, 9):
            await run_request(engine, [i], hint=RELEASE if i == 5 else None)
        await run_request(engine, [9])
        assert held(engine, 1, 5) == [True, False]


# -- the disk tier ----------------------------------------------------------------------


def disk_engine(
    folder: Path, values: int = 10, policy: str = "lru", **options: Any
) -> TieringEngine:
    """A CPU tier larger than the disk tier below it (``values`` values, retention at
    most a fifth of them)."""
    return engine_over(
        64, lambda ns: DiskTier(folder, values * VALUE, ns, policy=policy), **options
    )


async def on_disk(engine: TieringEngine, *ids: int) -> list[bool]:
    return await engine.tiers[0].contains(keys(*ids))


@pytest.mark.parametrize("policy", ["lru", "dslru"])
@pytest.mark.parametrize("how", ["store", "hint", "none"])
async def test_the_disk_tier_spares_values_written_or_hinted_retained(
    anyio_backend: str, tmp_path: Path, how: str, policy: str
) -> None:
    async with disk_engine(tmp_path / "disk", policy=policy) as engine:
        await run_request(engine, [1, 2], store_hint=RETAIN if how == "store" else None)
        if how == "hint":
            await engine.hint(keys(1, 2), RETAIN)
        await flood(engine, 100, 10, size=3)  # 30 values through a disk of 10
        assert await on_disk(engine, 1, 2) == ([False, False] if how == "none" else [True, True])
        tier = engine.statistics().tiers[0]
        assert tier.hints_sent == (0 if how == "none" else 2)
        assert tier.tier.hinted_total == (0 if how == "none" else 2)
        assert tier.tier.evictions_total >= 22


async def test_the_disk_tier_evicts_released_values_first(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with disk_engine(tmp_path / "disk") as engine:
        for i in range(1, 11):
            await run_request(engine, [i])
        assert await on_disk(engine, 1, 10) == [True, True]  # full
        await engine.hint(keys(6, 7), RELEASE)
        await run_request(engine, [11, 12])
        assert await on_disk(engine, 1, 2, 6, 7, 11, 12) == [True, True, False, False, True, True]


async def test_a_disk_value_read_back_is_no_longer_released(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with disk_engine(tmp_path / "disk") as engine:
        for i in range(1, 11):
            await run_request(engine, [i])
        await engine.hint(keys(6), RELEASE)
        engine.reset()  # the CPU tier forgets: 6 comes back from the disk
        assert (await engine.promote(keys(6))).promoted == 1
        await run_request(engine, [11])
        assert await on_disk(engine, 1, 6, 11) == [False, True, True]  # the oldest went


@pytest.mark.parametrize("again", [None, RELEASE])
async def test_a_failed_stores_hint_never_reaches_a_later_store_of_its_keys(
    anyio_backend: str, tmp_path: Path, again: Hint | None
) -> None:
    fail = {"next": True}

    def scripted(job: object) -> bool:
        failing, fail["next"] = fail["next"], False
        return failing

    async with disk_engine(
        tmp_path / "disk", backend="mock", backend_options={"fail": scripted}
    ) as engine:
        failed = await (await engine.submit_store(keys(1, 2), spec([0, 1]), hint=RETAIN))
        assert not failed.success
        await run_request(engine, [1, 2], store_hint=again)  # its own hint, or none
        stats = engine.statistics().tiers[0]
        assert stats.hints_sent == stats.tier.hinted_total == (0 if again is None else 2)
        assert await on_disk(engine, 1, 2) == [True, True]


async def test_a_store_without_a_hint_leaves_the_hint_of_the_store_writing_its_keys(
    anyio_backend: str, tmp_path: Path
) -> None:
    async with disk_engine(tmp_path / "disk", backend="mock") as engine:
        backend = engine.backend
        assert isinstance(backend, MockBackend)
        backend.close_gate()
        first = await engine.submit_store(keys(1, 2), spec([0, 1]), hint=RETAIN)
        second = await engine.submit_store(keys(1, 2, 3), spec([2, 3, 4]))  # writes 3 only
        backend.open_gate()
        assert (await first).success
        assert (await second).success
        with anyio.fail_after(10):
            await engine.wait_written_through()
        stats = engine.statistics().tiers[0]
        assert (stats.hints_sent, stats.tier.hinted_total, stats.cascade_written) == (2, 2, 3)


# -- Redis --------------------------------------------------------------------------------


def redis_engine(server: RedisServer | RedisClusterRig, **options: float) -> TieringEngine:
    return engine_over(32, lambda ns: RedisTier(server.url, ns, **options))


def pttl(server: RedisServer, engine: TieringEngine, key_id: int) -> int:
    """The milliseconds the value of chunk ``key_id`` has left (-1: no TTL, -2: none)."""
    remote = engine.tiers[0].codec.remote_key(keys(key_id)[0])
    return int(server.client().pttl(remote))


async def test_redis_values_get_their_ttl_from_hints(
    anyio_backend: str, redis_server: RedisServer
) -> None:
    async with redis_engine(redis_server, ttl_s=100, release_ttl_s=30) as engine:
        await run_request(engine, [1, 2], store_hint=Hint(retain_s=1000.0))  # SET ... PX
        await run_request(engine, [3])
        assert 900_000 < pttl(redis_server, engine, 1) <= 1_000_000  # max(ttl_s, retain_s)
        assert 90_000 < pttl(redis_server, engine, 3) <= 100_000  # the tier's ttl_s
        await run_request(engine, [4], store_hint=Hint(retain_s=10.0))
        assert 90_000 < pttl(redis_server, engine, 4) <= 100_000  # never below ttl_s
        await engine.hint(keys(1, 99), RELEASE)  # PEXPIRE; 99 is not there
        assert 0 < pttl(redis_server, engine, 1) <= 30_000
        assert pttl(redis_server, engine, 99) == -2
        await engine.hint(keys(3), Hint(retain_s=500.0))
        assert 400_000 < pttl(redis_server, engine, 3) <= 500_000
        await run_request(engine, [5], store_hint=RELEASE)
        assert 0 < pttl(redis_server, engine, 5) <= 30_000
        tier = engine.statistics().tiers[0]
        assert tier.hints_sent == 2 + 1 + 2 + 1 + 1  # chunks handed a hint, in 5 calls
        assert tier.tier.hinted_total == 2 + 1 + 1 + 1 + 1  # 99 was not there


async def test_redis_values_without_a_ttl_do_not_expire_but_for_a_release(
    anyio_backend: str, redis_server: RedisServer
) -> None:
    async with redis_engine(redis_server, release_ttl_s=60) as engine:  # no ttl_s
        await run_request(engine, [1], store_hint=RETAIN)
        assert pttl(redis_server, engine, 1) == -1
        await engine.hint(keys(1), RELEASE)
        assert 0 < pttl(redis_server, engine, 1) <= 60_000
        await engine.hint(keys(1), RETAIN)  # PERSIST: the release is lifted
        assert pttl(redis_server, engine, 1) == -1
        assert engine.statistics().tiers[0].tier.hinted_total == 3


@pytest.mark.parametrize("ttl_s", [None, 100])
async def test_a_release_changes_no_redis_ttl_unless_the_tier_has_release_ttl_s(
    anyio_backend: str, redis_server: RedisServer, ttl_s: float | None
) -> None:
    """A namespace is every engine's: one conversation's end never expires a shared value."""
    options = {} if ttl_s is None else {"ttl_s": ttl_s}
    async with redis_engine(redis_server, **options) as engine:
        await run_request(engine, [1])
        await run_request(engine, [2], store_hint=RELEASE)
        await engine.hint(keys(1), RELEASE)
        for key_id in (1, 2):
            left = pttl(redis_server, engine, key_id)
            assert left == -1 if ttl_s is None else 90_000 < left <= 100_000
        tier = engine.statistics().tiers[0]
        assert (tier.hints_sent, tier.hints_ignored, tier.tier.hinted_total) == (2, 0, 0)


async def test_a_redis_ttl_is_raised_by_a_retention_and_lowered_by_a_release_never_the_other_way(
    anyio_backend: str, redis_server: RedisServer
) -> None:
    async with redis_engine(redis_server, ttl_s=100, release_ttl_s=30) as engine:
        await run_request(engine, [1], store_hint=Hint(retain_s=1000.0))
        await engine.hint(keys(1), Hint(retain_s=10.0))  # a shorter retention: cuts nothing
        assert 900_000 < pttl(redis_server, engine, 1) <= 1_000_000
        await run_request(engine, [2])
        remote = engine.tiers[0].codec.remote_key(keys(2)[0])
        assert redis_server.client().pexpire(remote, 5_000)
        await engine.hint(keys(2), RELEASE)  # a release never lengthens a TTL
        assert 0 < pttl(redis_server, engine, 2) <= 5_000
        assert engine.statistics().tiers[0].tier.hinted_total == 1  # the first write alone


async def test_redis_cluster_values_get_their_ttl_from_hints_on_every_node(
    anyio_backend: str, redis_cluster: RedisClusterRig
) -> None:
    async with redis_engine(redis_cluster, ttl_s=100, release_ttl_s=30) as engine:
        tier = engine.tiers[0]
        assert isinstance(tier, RedisTier)
        ids = range(1, 13)  # their keys' slots spread over the three masters
        await run_request(engine, ids, store_hint=Hint(retain_s=1000.0))
        client = tier.sync_client()
        remote = [tier.codec.remote_key(k) for k in keys(*ids)]
        assert tier.cluster
        assert len({client.get_node_from_key(k).name for k in remote}) == 3
        assert all(900_000 < client.pttl(k) <= 1_000_000 for k in remote)
        await engine.hint(keys(*ids), RELEASE)  # one round trip per node
        assert all(0 < client.pttl(k) <= 30_000 for k in remote)
        assert tier.statistics().hinted_total == 2 * len(ids)


# -- what a tier that does not honour hints does, bad hints, checkpoints --------------------


async def test_a_tier_that_does_not_honour_hints_counts_them_ignored(anyio_backend: str) -> None:
    async with engine_over(16, lambda ns: MemoryTier(ns)) as engine:
        await run_request(engine, [1, 2], store_hint=RETAIN)
        await engine.hint(keys(1, 2, 3), RELEASE)
        tier = engine.statistics().tiers[0]
        assert (tier.hints_sent, tier.hints_ignored, tier.cascade_written) == (0, 5, 2)
        assert tier.tier.hinted_total == 0


async def test_a_tier_that_does_not_honour_hints_says_so_once_in_the_log(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    chain: list[Tier] = [
        lambda ns: MemoryTier(ns, label="near"),
        lambda ns: MemoryTier(ns, label="far"),
    ]
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.cascade"):
        async with engine_over(16, chain) as engine:
            await run_request(engine, [1, 2, 3], store_hint=RETAIN)
            await engine.hint(keys(1, 2), RELEASE)
            await run_request(engine, [4], store_hint=RELEASE)
            ignored = [tier.hints_ignored for tier in engine.statistics().tiers]
    assert ignored == [6, 6]
    said = [r.getMessage() for r in caplog.records if r.name == "tiering.secondary.cascade"]
    assert sorted(said) == [  # once per tier, at its first dropped hint (the store's 3 chunks)
        f"secondary tier memory ({label}) does not honour retention hints; 3 chunks' hints "
        "ignored (counted in its statistics)"
        for label in ("far", "near")
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


BAD = [
    (Hint(retain_s=-1.0), r"> 0.0 - at `\$.retain_s`.*; a hint is a JSON object of retain_s"),
    (Hint(retain_s=5.0, release=True), "retain_s or release, not both"),
    (Hint(priority=1000), r"<= 100 - at `\$.priority`.*an integer from -100 to 100"),
    ({"retain_s": 5.0}, "must be a tiering.hints.Hint or None"),
]


@pytest.mark.parametrize(("bad", "says"), BAD)
async def test_a_bad_hint_is_refused_with_one_message_before_anything_changes(
    anyio_backend: str, bad: object, says: str
) -> None:
    async with engine_over(16, lambda ns: MemoryTier(ns)) as engine:
        await run_request(engine, [1])
        before = engine.manager.statistics()
        refusals = [
            lambda: engine.touch(keys(1), bad),  # type: ignore[arg-type]
            lambda: engine.submit_store_nowait(keys(2), spec([0]), hint=bad),  # type: ignore[arg-type]
        ]
        for refused in refusals:
            with pytest.raises(HintError, match=says) as caught:
                refused()
            assert "\n" not in str(caught.value)
        with pytest.raises(HintError, match=says):
            await engine.submit_store(keys(3), spec([0]), hint=bad)  # type: ignore[arg-type]
        with pytest.raises(HintError, match=says):
            await engine.hint(keys(1), bad)  # type: ignore[arg-type]
        assert held(engine, 1, 2, 3) == [True, False, False]
        assert engine.manager.statistics() == before
        assert engine.manager.hints.statistics().hinted_keys_total == 0
        stores = engine.scheduler.statistics().stores
        assert (stores.queued, stores.succeeded, stores.no_room) == (0, 1, 0)
        tier = engine.statistics().tiers[0]
        assert (tier.hints_sent, tier.hints_ignored) == (0, 0)


async def test_hints_on_a_closed_engine_are_refused_and_a_bad_one_first(
    anyio_backend: str,
) -> None:
    engine = engine_over(16, lambda ns: MemoryTier(ns))
    async with engine:
        await run_request(engine, [1])
    with pytest.raises(ResourceClosedError):
        await engine.hint(keys(1), RELEASE)
    with pytest.raises(ResourceClosedError):
        engine.touch(keys(1), RETAIN)
    with pytest.raises(ResourceClosedError):
        engine.submit_store_nowait(keys(2), spec([0]), hint=RETAIN)
    with pytest.raises(HintError):  # what is wrong with the call comes first
        await engine.hint(keys(1), Hint(priority=1000))
    assert engine.manager.hints.statistics().hinted_keys_total == 0


@pytest.mark.parametrize("below", ["none", "memory", "disk", "redis"])
async def test_engine_hint_is_a_checkpoint(
    anyio_backend: str, tmp_path: Path, below: str, request: pytest.FixtureRequest
) -> None:
    tiers: dict[str, Callable[[RemoteNamespace], SecondaryTier] | None] = {
        "none": None,
        "memory": lambda ns: MemoryTier(ns),
        "disk": lambda ns: DiskTier(tmp_path / "disk", 4 * VALUE, ns),
    }
    if below == "redis":
        url = request.getfixturevalue("redis_server").url
        tiers["redis"] = lambda ns: RedisTier(url, ns, ttl_s=60)
    async with engine_over(8, tiers[below]) as engine:
        await run_request(engine, [1, 2])
        for hint in (RETAIN, RELEASE, Hint(priority=3), None):
            assert await yields(lambda h=hint: engine.hint(keys(1, 2), h), 40)  # type: ignore[misc]
        assert await yields(lambda: engine.hint([], RETAIN), 40)


# -- examples/server.py: a request header carries the hint ---------------------------------


def test_the_server_example_takes_a_hint_header_and_refuses_a_bad_one(servers: Any) -> None:
    server = servers()

    def generate(header: str) -> tuple[int, dict[str, Any]]:
        query = urllib.parse.urlencode({"prompt": PROMPT})
        status, body = server.get(f"/generate?{query}", headers={"X-Tiering-Hint": header})
        return status, json.loads(body)

    assert generate('{"retain_s": 600, "priority": 5}') == (200, {
        "blocks": 8, "cpu_hits": 0, "disk_hits": 0, "computed": 8, "loaded": False,
        "stored": True, "verified": None,
    })  # fmt: skip
    status, answer = generate('{"release": true}')
    assert (status, answer["cpu_hits"], answer["verified"]) == (200, 8, True)
    assert generate('{"release": true, "retain_s": 5}') == (400, {
        "error": "the X-Tiering-Hint header: a hint holds retain_s or release, not both "
        "(got retain_s=5 and release=true)"
    })  # fmt: skip
    status, answer = generate('{"retain_s": "soon"}')
    assert (status, answer["error"][:27]) == (400, "the X-Tiering-Hint header: ")
    status, answer = generate('{"retain')
    assert status == 400
    assert answer["error"].startswith("the X-Tiering-Hint header is not JSON (")
    assert server.stop() == "stopped: 8 chunks written through to the disk tier\n"
