"""A Redis Cluster that loses one master loses only that master's slots.

Real clusters, a master killed by its pid (SIGKILL, as a crash): the keys of
the other masters are still hits, read byte for byte, and written; the lost
master's keys miss and their writes are counted ``node down``; a replica
promoted in its place, or the master's return, is served again. And
`NodeGates`, the per-node core, on a clock of the test's own.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from tiering.secondary import RemoteNamespace
from tiering.secondary.health import Admission, NodeGates
from tiering.secondary.redis import RedisTier


def items(keys: list[Any], arrays: list[Any]) -> list[tuple[Any, memoryview]]:
    return [(k, memoryview(a)) for k, a in zip(keys, arrays, strict=True)]


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Connection attempts of the tier's own sockets, by server port."""
    from tiering.secondary.redis.connection import Connection

    counts: Counter[int] = Counter()
    original = Connection.connect

    def counting(self: Any) -> None:
        counts[int(self.address.port)] += 1
        original(self)

    monkeypatch.setattr(Connection, "connect", counting)
    return counts


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Sends on the tier's own sockets (commands, PINGs), by server port."""
    from tiering.secondary.redis.connection import Connection

    counts: Counter[int] = Counter()
    original = Connection.send

    def counting(self: Any, guard: Any, own: Any, row: Any = None) -> None:
        counts[int(self.address.port)] += 1
        original(self, guard, own, row)

    monkeypatch.setattr(Connection, "send", counting)
    return counts


def owners(tier: RedisTier, keys: list[Any]) -> list[int]:
    """The port of the master whose slot each key is in (the tier's slot map)."""
    client = tier.sync_client()
    return [int(client.get_node_from_key(tier.codec.remote_key(k)).port) for k in keys]


async def poll(check: Callable[[], Any], what: str, timeout_s: float = 20.0) -> None:
    """Call ``check`` (sync or async) until it is true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        await anyio.sleep(0.05)


@contextlib.contextmanager
def restarted_after(rig: Any) -> Iterator[None]:
    """Start again the rig's servers killed in the block (for the next test), and wait for them."""
    try:
        yield
    finally:
        dead = [node for node in rig.nodes if node.proc.poll() is not None]
        for node in dead:
            node.start()
        if dead:
            rig.wait_ok(rig.nodes)


def cluster_nodes(node: Any) -> list[list[str]]:
    """CLUSTER NODES of one server, one field list per node."""
    text = node.client().execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return [line.split() for line in text.splitlines() if line.strip()]


# -- NodeGates: the per-node core ------------------------------------------------


def test_one_node_down_leaves_the_others_up_and_probes_on_the_backoff_schedule() -> None:
    clock = Clock()
    gates: NodeGates[str] = NodeGates((1.0, 4.0), jitter=0.0, clock=clock)
    assert gates.admit("a") is Admission.NORMAL
    assert gates.failed("a", Admission.NORMAL) is True
    assert gates.admit("a") is None  # down, not due
    assert gates.admit("b") is Admission.NORMAL  # another node: untouched
    assert gates.down() == ["a"]
    assert not gates.all_down(["a", "b"])
    assert gates.all_down(["a"])
    assert gates.all_down(["a"], waiting=True)
    assert gates.take_due() == []

    clock.now += 1.0
    assert not gates.all_down(["a"], waiting=True)  # due a probe
    assert gates.take_due() == [("a", Admission.PROBE)]
    assert gates.take_due() == []
    assert gates.admit("a") is None
    assert gates.failed("a", Admission.PROBE) is False  # still down: 2 s to the next
    clock.now += 1.5
    assert gates.take_due() == []
    clock.now += 0.5
    assert gates.take_due() == [("a", Admission.PROBE)]
    assert gates.succeeded("a", Admission.PROBE) is True
    assert gates.down() == []
    assert gates.admit("a") is Admission.NORMAL

    assert gates.failed("c", Admission.NORMAL)
    assert gates.retain({"a", "b"}) == ["c"]  # "c" holds no slots any more: forgotten
    assert gates.admit("c") is Admission.NORMAL
    gates.close()
    assert gates.admit("b") is None


# -- a real cluster loses a master --------------------------------------------------

anyio_test = pytest.mark.anyio


@anyio_test
async def test_a_killed_master_loses_only_its_slots_then_its_return_is_served(
    redis_partial_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
    connects: Counter[int],
) -> None:
    rig = redis_partial_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys, rows = chunks.keys(120), chunks.rows(120)
    clock = Clock()
    async with await RedisTier.open(rig.url, namespace) as tier:
        tier._wire.nodes = NodeGates(clock=clock)  # probes when the test says
        assert tier.cluster is True
        assert await tier.write(items(keys, rows)) == 120
        ports = owners(tier, keys)
        assert set(ports) == rig.ports  # all three masters (but once in 10**20 runs)
        victim = rig.nodes[1]
        live = [p != victim.port for p in ports]
        fresh, fresh_rows = chunks.keys(90), chunks.rows(90)
        fresh_live = [p != victim.port for p in owners(tier, fresh)]
        before = tier.statistics()

        with restarted_after(rig):
            victim.kill()
            connects.clear()
            # The first call finds the master gone (connection refused): only its keys miss.
            assert await tier.contains(keys) == live
            tried = connects[victim.port]
            assert tried <= 1  # a new connection (refused), or none: the idle one failed
            buffers = chunks.buffers(120)
            assert await tier.read(items(keys, buffers)) == live
            for row, buffer, up in zip(rows, buffers, live, strict=True):
                assert np.array_equal(row, buffer) if up else not buffer.any()

            # New writes: the live masters take theirs, the lost master's are counted.
            written = await tier.write(items(fresh, fresh_rows))
            assert written == sum(fresh_live) > 0
            s = tier.statistics()
            assert s.write_errors_by_reason == {"node down": 90 - written}
            assert s.hits_total - before.hits_total == sum(live)
            assert s.reads_total - before.reads_total == sum(live)
            assert (s.rejected_total, s.refused_total, s.state) == (0, 0, "up")
            assert s.errors_total == 1  # the one failure that took the node down
            buffers = chunks.buffers(90)
            assert await tier.read(items(fresh, buffers)) == fresh_live
            for row, buffer, up in zip(fresh_rows, buffers, fresh_live, strict=True):
                assert np.array_equal(row, buffer) if up else not buffer.any()
            # ... and none of those calls tried the lost master again before its probe.
            assert connects[victim.port] == tried

            # Its probe is due: one try (refused), and the calls go on.
            clock.now += 1.0
            assert await tier.contains(keys) == live
            assert connects[victim.port] == tried + 1
            assert tier.statistics().state == "up"

            # The master comes back (its slots, none of its values): the next probe finds it.
            victim.start()
            rig.wait_ok(rig.nodes)
            clock.now += 60.0
            assert await tier.write(items(fresh, fresh_rows)) == 90
            buffers = chunks.buffers(90)
            assert await tier.read(items(fresh, buffers)) == [True] * 90
            assert all(np.array_equal(r, b) for r, b in zip(fresh_rows, buffers, strict=True))
            s = tier.statistics()
            assert (s.rejected_total, s.state, s.reconnects_total) == (0, "up", 1)


@anyio_test
async def test_a_frozen_master_keeps_the_other_slots_waiting_once_per_probe(
    redis_partial_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
    sends: Counter[int],
) -> None:
    rig = redis_partial_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys, rows = chunks.keys(90), chunks.rows(90)
    clock = Clock()
    async with await RedisTier.open(rig.url, namespace, timeout_s=0.5) as tier:
        tier._wire.nodes = NodeGates(clock=clock)
        assert await tier.write(items(keys, rows)) == 90
        ports = owners(tier, keys)
        assert set(ports) == rig.ports
        victim = rig.nodes[2]
        live = [p != victim.port for p in ports]
        misses = [False] * 90
        victim.freeze()  # SIGSTOP: connections stay open, nothing is answered
        try:
            # The first call waits on it once: it times out as a whole (or, on a
            # loaded machine, the node's socket times out first and the rest is served).
            assert await tier.contains(keys) in (misses, live)
            s = tier.statistics()
            assert (s.timeouts_total, s.state) == (1, "up")
            sends.clear()
            for _ in range(3):  # then no call waits on it, nor sends it anything
                assert await tier.contains(keys) == live
            buffers = chunks.buffers(90)
            assert await tier.read(items(keys, buffers)) == live
            for row, buffer, up in zip(rows, buffers, live, strict=True):
                assert np.array_equal(row, buffer) if up else not buffer.any()
            assert sends[victim.port] == 0
            # Its probe: one PING, one wait; the calls after it are served again.
            clock.now += 1.0
            assert await tier.contains(keys) in (misses, live)
            assert sends[victim.port] == 1
            assert await tier.contains(keys) == live
            s = tier.statistics()
            assert (s.rejected_total, s.state) == (0, "up")
        finally:
            victim.thaw()
        rig.wait_ok(rig.nodes)

        async def served() -> bool:
            # Its next probe finds it, once the abandoned thread of the last
            # probe (still refreshing the slot map, its probe held) is done.
            clock.now += 60.0
            return await tier.contains(keys) == [True] * 90

        await poll(served, "the thawed master's keys", timeout_s=10.0)


@anyio_test
async def test_every_master_lost_takes_the_tier_down_without_io(
    redis_partial_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
    connects: Counter[int],
) -> None:
    rig = redis_partial_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys = chunks.keys(60)
    async with await RedisTier.open(rig.url, namespace) as tier:
        tier._wire.nodes = NodeGates(clock=Clock())  # no probe comes due
        assert set(owners(tier, keys)) == rig.ports
        with restarted_after(rig):
            for node in rig.nodes:
                node.kill()
            assert await tier.contains(keys) == [False] * 60
            s = tier.statistics()
            assert (s.state, s.errors_total) == ("down", 3)  # each master, once
            tried = sum(connects.values())
            assert await tier.write(items(keys, chunks.rows(60))) == 0
            s = tier.statistics()
            assert s.write_errors_by_reason == {"down": 60}  # answered at once, as today's
            assert s.unavailable_total == 1
            assert sum(connects.values()) == tried


@anyio_test
async def test_a_replica_promoted_in_place_of_a_killed_master_is_served(
    redis_replicated_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
) -> None:
    rig = redis_replicated_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys, rows = chunks.keys(120), chunks.rows(120)
    async with await RedisTier.open(rig.url, namespace) as tier:
        assert await tier.write(items(keys, rows)) == 120
        ports = owners(tier, keys)
        victim = next(n for n in rig.nodes if n.port == ports[0])
        others = [n for n in rig.nodes if n is not victim]
        on_victim = [k for k, p in zip(keys, ports, strict=True) if p == victim.port]
        fresh, fresh_rows = chunks.keys(200), chunks.rows(200)
        mine = [i for i, p in enumerate(owners(tier, fresh)) if p == victim.port][:20]
        wanted = [fresh[i] for i in mine]
        wanted_rows = [fresh_rows[i] for i in mine]
        assert len(wanted) == 20  # (but once in 10**30 runs)

        with restarted_after(rig):  # the old master comes back as a replica of the new one
            victim.kill()
            # Until the replica takes over, the other masters' keys hit, the lost one's miss.
            live = [p != victim.port for p in ports]
            assert await tier.contains(keys) == live
            assert tier.statistics().state == "up"

            def failed_over() -> bool:
                if not rig.ok(others):
                    return False
                nodes = cluster_nodes(others[0])
                victim_fields = next(
                    f for f in nodes if f[1].startswith(f"127.0.0.1:{victim.port}@")
                )
                return "fail" in victim_fields[2] and not any(
                    f[3] == victim_fields[0] for f in nodes
                )

            await poll(failed_over, "the replica's promotion")
            # Within a few seconds (its probes' backoff), the tier sends them to the new master.

            async def served() -> bool:
                return await tier.write(items(wanted, wanted_rows)) == len(wanted)

            await poll(served, "writes to the promoted replica's slots", timeout_s=10.0)
            assert victim.port not in owners(tier, wanted)
            buffers = chunks.buffers(len(wanted))
            assert await tier.read(items(wanted, buffers)) == [True] * len(wanted)
            assert all(np.array_equal(r, b) for r, b in zip(wanted_rows, buffers, strict=True))
            # What the lost master held is read from its replica or missed: never corrupt.
            buffers = chunks.buffers(len(on_victim))
            mask = await tier.read(items(on_victim, buffers))
            for key, up, buffer in zip(on_victim, mask, buffers, strict=True):
                row = rows[keys.index(key)]
                assert np.array_equal(row, buffer) if up else not buffer.any()
            s = tier.statistics()
            assert (s.rejected_total, s.state) == (0, "up")


@pytest.fixture
def late_after_timeout(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, str], None]:
    """Make one node's socket time out at once, then keep the call busy past its deadline.

    ``late(port, where)``: the node on ``port`` times out (its send, as a socket
    would), then the call's thread is slow ``where``: ``"after"`` the round trip
    (waiting on no node), or ``"live"`` reading another node's replies.
    """
    import redis.exceptions

    from tiering.secondary.redis.connection import Connection
    from tiering.secondary.redis.wire import RedisWire

    def late(port: int, where: str) -> None:
        send, reply, exchange = Connection.send, Connection.reply, RedisWire.exchange
        state = {"failed": False, "slept": False}

        def slow() -> None:
            if state["failed"] and not state["slept"]:
                state["slept"] = True
                time.sleep(1.0)  # past the call's deadline (0.3 s)

        def timing_out(self: Any, guard: Any, own: Any, row: Any = None) -> None:
            if int(self.address.port) == port and not state["failed"]:
                state["failed"] = True
                self.close()
                raise redis.exceptions.TimeoutError(f"Timeout writing to 127.0.0.1:{port}")
            send(self, guard, own, row)

        def slow_reply(self: Any, guard: Any, sink: Any = None) -> Any:
            if where == "live" and int(self.address.port) != port:
                slow()
            return reply(self, guard, sink)

        def slow_exchange(self: Any, *args: Any) -> None:
            exchange(self, *args)
            if where == "after":
                slow()

        monkeypatch.setattr(Connection, "send", timing_out)
        monkeypatch.setattr(Connection, "reply", slow_reply)
        monkeypatch.setattr(RedisWire, "exchange", slow_exchange)

    return late


@anyio_test
@pytest.mark.parametrize("where", ["after", "live"])
async def test_a_call_that_outlives_one_nodes_timeout_blames_only_that_node(
    redis_partial_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
    late_after_timeout: Callable[[int, str], None],
    where: str,
) -> None:
    # A node's socket times out (as a frozen master's does, within the call's
    # timeout too) and the call's deadline passes while the thread is past that
    # node: the tier must not go down as a whole, nor take a live node down.
    rig = redis_partial_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys, rows = chunks.keys(90), chunks.rows(90)
    async with await RedisTier.open(rig.url, namespace, timeout_s=0.3) as tier:
        tier._wire.nodes = NodeGates(clock=Clock())  # no probe comes due
        assert await tier.write(items(keys, rows)) == 90
        ports = owners(tier, keys)
        assert set(ports) == rig.ports
        victim = rig.nodes[0]
        live = [p != victim.port for p in ports]
        late_after_timeout(victim.port, where)
        assert await tier.contains(keys) == [False] * 90  # the call timed out as a whole
        s = tier.statistics()
        assert (s.timeouts_total, s.state) == (1, "up")
        assert tier._wire.nodes.down() == [("127.0.0.1", victim.port)]
        assert await tier.contains(keys) == live  # the other nodes are served


@anyio_test
async def test_a_returning_master_is_up_only_once_it_serves_its_slots(
    redis_partial_cluster: Any,
    namespace: RemoteNamespace,
    make_chunks: Callable[[int], Any],
) -> None:
    # A master started again answers PING at once, but refuses every command
    # (CLUSTERDOWN) until it has rejoined the cluster (about two node timeouts):
    # its probe must not bring it up before that, to go down again on its keys.
    rig = redis_partial_cluster
    chunks = make_chunks(namespace.row_bytes)
    keys = chunks.keys(90)
    clock = Clock()
    async with await RedisTier.open(rig.url, namespace) as tier:
        tier._wire.nodes = NodeGates(clock=clock)
        assert await tier.write(items(keys, chunks.rows(90))) == 90
        ports = owners(tier, keys)
        victim = rig.nodes[1]
        live = [p != victim.port for p in ports]
        with restarted_after(rig):
            victim.kill()
            assert await tier.contains(keys) == live
            victim.start()  # answers PING, says cluster_state:fail
            info = victim.client().execute_command("CLUSTER", "INFO").decode()
            assert "cluster_state:fail" in info
            clock.now += 1.0
            assert await tier.contains(keys) == live  # its probe: not back yet
            s = tier.statistics()
            assert (s.reconnects_total, s.errors_total) == (0, 2)  # the kill, the probe
            assert tier._wire.nodes.down() == [("127.0.0.1", victim.port)]
            rig.wait_ok(rig.nodes)
            clock.now += 60.0
            assert await tier.write(items(keys, chunks.rows(90))) == 90  # its probe: back
            assert await tier.contains(keys) == [True] * 90
            assert tier.statistics().reconnects_total == 1
