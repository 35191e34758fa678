"""RedisTier on a real three-master Redis Cluster: slots, nodes, one round trip per node."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest

from tiering.secondary import RemoteNamespace
from tiering.secondary.redis import RedisTier

pytestmark = pytest.mark.anyio


def items(keys: list[Any], arrays: list[np.ndarray]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Command batches sent, by server port: the tier's ``Connection.send`` calls."""
    from tiering.secondary.redis.connection import Connection

    counts: Counter[int] = Counter()
    lock = threading.Lock()
    original = Connection.send

    def counting(self: Any, guard: Any, own: Any, row: Any = None) -> None:
        with lock:
            counts[int(self.address.port)] += 1
        original(self, guard, own, row)

    monkeypatch.setattr(Connection, "send", counting)
    return counts


async def test_chunks_spread_over_every_node_and_read_back_byte_for_byte(
    redis_cluster: Any, namespace: RemoteNamespace, chunks: Any, sends: Counter[int]
) -> None:
    keys, rows = chunks.keys(30), chunks.rows(30)
    async with await RedisTier.open(redis_cluster.url, namespace) as tier:
        assert tier.cluster is True  # detected from INFO
        client = tier.sync_client()
        owners = {client.get_node_from_key(tier.codec.remote_key(k)).port for k in keys}
        assert owners == redis_cluster.ports  # all three masters (but once in 10**4 runs)

        assert await tier.write(items(keys, rows)) == 30
        assert tier.statistics().round_trips_total == 3

        sends.clear()
        assert await tier.contains(keys + chunks.keys(3)) == [True] * 30 + [False] * 3
        assert sends == dict.fromkeys(redis_cluster.ports, 1)  # one batch per node

        sends.clear()
        buffers = chunks.buffers(30)
        assert await tier.read(items(keys, buffers)) == [True] * 30
        assert sends == dict.fromkeys(redis_cluster.ports, 1)
        assert all(np.array_equal(r, b) for r, b in zip(rows, buffers, strict=True))

        s = tier.statistics()
        assert s.round_trips_total == 9
        assert (s.errors_total, s.rejected_total, s.state) == (0, 0, "up")


async def test_a_chunk_lands_on_the_node_its_hash_tag_names(
    redis_cluster: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(6), chunks.rows(6)
    async with RedisTier(redis_cluster.url + "?cluster=yes", namespace) as tier:
        assert await tier.write(items(keys, rows)) == 6
        client = tier.sync_client()
        for key in keys:
            remote = tier.codec.remote_key(key)
            node = client.get_node_from_key(remote)
            assert client.keyslot(remote) == client.keyslot(tier.codec.remote_key(key, b":meta"))
            direct = next(n for n in redis_cluster.nodes if n.port == node.port).client()
            assert direct.strlen(remote) == tier.codec.value_bytes(key)


async def test_a_standalone_client_on_a_cluster_node_counts_moved_as_refusals(
    redis_cluster: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    keys, rows = chunks.keys(30), chunks.rows(30)  # on every node but once in 10**5 runs
    async with RedisTier(redis_cluster.url, namespace, cluster=False) as tier:
        written = await tier.write(items(keys, rows))
        assert 0 < written < 30  # only the first node's own slots take the writes
        s = tier.statistics()
        assert s.write_errors_total == 30 - written
        assert s.write_errors_by_reason == {"refused MOVED": 30 - written}
        assert (s.refused_total, s.refused_by_reason) == (30 - written, {"MOVED": 30 - written})
        assert s.errors_total == 0  # each chunk counted once: refused, not also an error
        assert s.last_refusal is not None
        assert s.last_refusal.startswith("MovedError: ")
        assert s.state == "up"  # a refusal is not an outage
        assert s.write_state == "up"  # nor a slot move a reason to stop writing
