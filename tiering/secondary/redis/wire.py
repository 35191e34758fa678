"""The worker-thread side of the Redis tier: its calls, one round trip per node, values streamed.

Everything here blocks and runs in a worker thread (`RedisTier` calls it
through ``anyio.to_thread``); nothing here touches the event loop or the
tier's counters. A call's work fills an `Answer` that the async side reads.

Pipelines, streamed, one round trip per node: a call's commands go out as one
pipeline per node (of at most ``max_batch`` keys): every node is sent its
commands before any reply is read, so a call is one round trip on a
standalone server and one per node on a cluster (the slot map of redis-py's
cluster client routes each key; keys carry a hash tag, so a chunk's keys
share a slot). The connections are the tier's own (`Connection`): a write
checksums each value's row just before sending it, then sends the RESP frame
in one ``sendmsg`` (its own bytes, then the row straight from the caller's
buffer: the kernel's copy is the only one; on TLS the frame is built in a
buffer the thread reuses), so the server takes one value while the next is
checksummed. A read checks each value's header as it arrives (`_ChunkSink`),
then its payload is received straight into the caller's row and checksummed
there, while the next is in flight (on TLS it is received into a buffer of the
thread and copied into the row in the same pass as its checksum). A ``MOVED``
or ``ASK`` reply (the cluster is resharding) is a miss, counted, and the slot
map is refreshed before the next call.

Nodes, one at a time: on a cluster, a node that cannot be reached takes only
its own slots down, the other nodes being served as before
(`tiering.secondary.redis.cluster`).

What redis-py still does, and why: the cluster's slot map (``RedisCluster``:
discovery, ``MOVED`` refreshes), the exception classes the tier's errors are
reported in, and `RedisWire.client` for benchmarks and diagnostics. It reads
no reply of the tier's and owns none of its sockets: nothing here depends on
redis-py's private parts, nor on whether ``hiredis`` is installed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tiering._state import Lifecycle
from tiering._types import OffloadKey
from tiering.errors import ResourceClosedError
from tiering.secondary.base import describe
from tiering.secondary.codec import ChunkCodec, Verdict
from tiering.secondary.health import Admission, NodeGates
from tiering.secondary.redis.address import RedisAddress
from tiering.secondary.redis.answer import Answer, Node, Row, Work
from tiering.secondary.redis.cluster import ClusterNodes
from tiering.secondary.redis.connection import Abandoned, Connection, ConnectionPool, Guard
from tiering.secondary.redis.failures import config_error, error_from_reply, errors
from tiering.secondary.redis.options import RedisOptions
from tiering.secondary.redis.resp import ROUTED, ErrorReply, command
from tiering.secondary.refusals import Fault, server_fault

logger = logging.getLogger(__name__)

__all__ = ["Abandoned", "Answer", "Guard", "RedisWire", "Row", "Work"]

T = TypeVar("T")

_LOCAL = threading.local()


def _thread_buffer(name: str, size: int) -> memoryview:
    """A buffer of at least ``size`` bytes, this thread's own, reused from call to call."""
    buffer: bytearray | None = getattr(_LOCAL, name, None)
    if buffer is None or len(buffer) < size:
        buffer = bytearray(size)
        setattr(_LOCAL, name, buffer)
    return memoryview(buffer)


#: Sends the commands of some rows on a connection: ``send(connection, positions)``.
Send = Callable[[Connection, list[int]], None]
#: Reads the reply to one row's command: ``receive(connection, position)``.
Receive = Callable[[Connection, int], None]


class _ChunkSink:
    """Where a GET's value goes: its header checked first, then its payload into the row."""

    __slots__ = ("_check", "codec", "direct", "key", "out", "verdict")

    def __init__(self, codec: ChunkCodec, key: OffloadKey, out: memoryview, direct: bool) -> None:
        self.codec, self.key, self.out, self.direct = codec, key, out, direct
        self.verdict: Verdict | None = None
        self._check: Any = None

    def head(self, size: int) -> int:
        return min(size, self.codec.header_bytes(self.key))

    def route(self, head: memoryview, size: int) -> memoryview | None:
        checked = self.codec.check_head(self.key, head, size)
        if isinstance(checked, Verdict):
            self.verdict = checked
            return None  # dropped unread: nothing foreign reaches the row
        self._check = checked
        if self.direct:
            return self.out
        size = self.out.nbytes  # this thread's buffer may be longer (another tier's rows)
        return _thread_buffer("value", size)[:size]

    def finish(self) -> Verdict:
        """The verdict once the value is in (call under the guard)."""
        if self._check is None:
            assert self.verdict is not None
            return self.verdict
        kind, expected = self._check
        if self.direct:
            return self.codec.check_payload(kind, expected, self.out)
        received = _thread_buffer("value", self.out.nbytes)[: self.out.nbytes]
        return self.codec.check_payload(kind, expected, received, self.out)  # and copied


class RedisWire:
    """The blocking I/O of one `RedisTier`: its connections and its calls. Thread-safe."""

    def __init__(
        self,
        address: RedisAddress,
        url: str,
        shown_url: str,
        codec: ChunkCodec,
        options: RedisOptions,
        *,
        cluster: bool | None,
    ) -> None:
        self.address = address
        self._url = url  # for redis-py (the cluster's slot map, `client`)
        self.url = shown_url
        self.codec = codec
        self.options = options
        #: Whether the server is a Redis Cluster (``None`` until the first connection tells).
        self.cluster = cluster
        self._life = Lifecycle(f"the Redis tier at {shown_url}", opened=True)
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()  # one thread finds out what the server is
        self._pools: dict[tuple[str, int], ConnectionPool] = {}
        self._client: Any = None  # redis-py's client of `client`
        self._ready = False
        self.cluster_nodes = ClusterNodes(shown_url, options.timeout_s, options.backoff_s)

    @property
    def nodes(self) -> NodeGates[Node]:
        """The health of each cluster node (only those that failed are tracked)."""
        return self.cluster_nodes.gates

    @nodes.setter
    def nodes(self, gates: NodeGates[Node]) -> None:
        self.cluster_nodes.gates = gates

    # -- setting up ----------------------------------------------------------------

    def _pool(self, address: RedisAddress) -> ConnectionPool:
        with self._lock:
            self._life.check_open()
            pool = self._pools.get((address.host, address.port))
            if pool is None:
                pool = self._pools[address.host, address.port] = ConnectionPool(
                    address,
                    timeout_s=self.options.timeout_s,
                    connect_timeout_s=self.options.connect_s,
                    read_size=self.options.socket_read_size,
                )
            return pool

    def _setup(self) -> None:
        """Know whether the server is a cluster (``INFO cluster``) and, if so, its slot map."""
        if self._ready:
            return
        with self._setup_lock:
            if self._ready:
                return
            if self.cluster is None:
                self.cluster = self._cluster_enabled()
            if self.cluster:
                slot_map = self._redis_py_client()
                with self._lock:
                    if self._life.closed:
                        slot_map.close()
                    self._life.check_open()
                    self.cluster_nodes.attach(slot_map)
            self._ready = True

    def _info(self, address: RedisAddress, *command: bytes) -> bytes | None:
        """The text ``command`` (an INFO) answers at ``address``; None when the user may
        not run it. Any other error reply is raised as redis-py's exception."""
        pool = self._pool(address)
        connection = pool.get()
        try:
            reply = connection.command(*command)
        finally:
            pool.release(connection)
        if isinstance(reply, ErrorReply):
            error = error_from_reply(reply)
            if isinstance(error, errors().permission):
                return None
            raise error
        if not isinstance(reply, bytes | bytearray):
            name = b" ".join(command).decode()
            raise errors().rx.InvalidResponse(f"Protocol Error: {reply!r} in reply to {name}")
        return bytes(reply)

    def _cluster_enabled(self) -> bool:
        reply = self._info(self.address, b"INFO", b"cluster")
        if reply is None:
            return False  # a user that may not run INFO: take it as standalone
        return any(line.strip() == b"cluster_enabled:1" for line in reply.splitlines())

    def _redis_py_client(self) -> Any:
        import redis
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options: dict[str, Any] = {
            "socket_timeout": self.options.timeout_s,
            "socket_connect_timeout": self.options.connect_s,
            "retry": Retry(NoBackoff(), 0),
            "client_name": "tiering",
        }
        if self.cluster:
            # A cluster that serves only some slots (``cluster-require-full-coverage
            # no``, a master lost without a replica) is still a cluster to use.
            return redis.cluster.RedisCluster.from_url(
                self._url, require_full_coverage=False, **options
            )
        return redis.Redis.from_url(self._url, **options)

    def client(self) -> Any:
        """A redis-py client of the tier's server, with its settings (connects on first use).

        On a cluster, the client whose slot map routes the tier's keys. For
        benchmarks and diagnostics: the tier's calls do not go through it.
        """
        self._setup()
        if self.cluster:
            return self.cluster_nodes.slot_map
        with self._lock:
            self._life.check_open()
            if self._client is None:
                self._client = self._redis_py_client()
            return self._client

    def close(self) -> None:
        """Close every connection; idempotent. Calls after this fail as closed."""
        with self._lock:
            self._life.close_now()
            pools, self._pools = list(self._pools.values()), {}
            clients = [c for c in (self.cluster_nodes.slot_map, self._client) if c is not None]
        self.nodes.close()
        for pool in pools:
            pool.close()
        for client in clients:
            client.close()

    def ping(self) -> None:
        """Connect and PING; raise `ConfigError` naming what is wrong."""
        e = errors()
        try:
            self._setup()
            pool = self._pool(self.address)
            connection = pool.get()
            try:
                reply = connection.command(b"PING")
            finally:
                pool.release(connection)
            if isinstance(reply, ErrorReply):
                raise error_from_reply(reply)
        except (*e.any, *e.unavailable) as exc:
            raise config_error(self.url, exc, self.address.password) from None

    # -- calls -------------------------------------------------------------------------

    def run(
        self, work: Work[T], guard: Guard, rows: list[Row], answer: Answer[T] | None = None
    ) -> Answer[T]:
        """Do ``work`` on ``rows``, in batches; fill ``answer`` (or a new one) and return it."""
        e = errors()
        if answer is None:
            answer = Answer(len(rows))
        try:
            self._setup()
            if self.cluster:
                self.cluster_nodes.check(answer, self._ping)
            step = self.options.max_batch
            for start in range(0, len(rows), step):
                work(guard, answer, rows, list(range(start, min(len(rows), start + step))))
        except Abandoned:
            pass  # nobody waits for this answer any more
        except e.unavailable as exc:
            answer.unavailable = describe(exc)
            answer.timed_out = isinstance(exc, e.timeout)
            self.cluster_nodes.stale = True
        except e.any as exc:
            answer.errors.append(describe(exc))
        except ResourceClosedError:
            answer.unavailable = "ResourceClosedError: the tier was closed"
        except Exception as exc:  # a bug: counted as a failed call, never raised to the caller
            logger.exception("Redis tier at %s: a call failed unexpectedly", self.url)
            answer.errors.append(describe(exc))
        return answer

    def exchange(
        self, answer: Answer[Any], rows: list[Row], batch: list[int], send: Send, receive: Receive
    ) -> None:
        """One round trip per node: send each node its commands, then read every reply.

        A connection whose replies were not all read (or that read more) is
        closed, never reused. On a cluster, a node that is down is skipped
        (its rows in ``answer.node_down``), and one that fails takes only its
        own rows with it.
        """
        routes: list[tuple[Node | None, ConnectionPool, list[int]]]
        cluster = self.cluster_nodes
        if not self.cluster:
            routes = [(None, self._pool(self.address), batch)]
        else:
            routes = [
                (where, self._pool(self.address.at(*where)), positions)
                for where, positions in cluster.route(rows, batch, answer)
            ]
        e = errors()
        taken: list[tuple[Node | None, Admission, ConnectionPool, Connection, list[int]]] = []
        settled = 0  # connections whose every reply was read, or that failed
        try:
            for node, pool, positions in routes:
                admission = Admission.NORMAL if node is None else self.nodes.admit(node)
                if admission is None:
                    answer.node_down.extend(positions)
                    continue
                answer.stuck = node
                try:
                    connection = pool.get()
                except e.unavailable as exc:
                    if node is None:
                        raise
                    cluster.failed(answer, node, admission, positions, exc)
                    continue
                except BaseException:
                    if node is not None:
                        self.nodes.release(node, admission)
                    raise
                taken.append((node, admission, pool, connection, positions))
                try:
                    send(connection, positions)
                except e.unavailable as exc:
                    if node is None:
                        raise
                    connection.close()
                    taken.pop()
                    pool.release(connection)
                    cluster.failed(answer, node, admission, positions, exc)
            answer.stuck = None
            answer.round_trips += len(taken)
            for node, admission, _, connection, positions in taken:
                answer.stuck = node
                done = 0
                try:
                    for position in positions:
                        receive(connection, position)
                        done += 1
                except e.unavailable as exc:
                    if node is None:
                        raise
                    connection.close()
                    cluster.failed(answer, node, admission, positions[done:], exc)
                else:
                    if node is not None:
                        cluster.answered(answer, node, admission)
                settled += 1
            answer.stuck = None
        finally:
            for i, (unsettled, admitted, pool, connection, _) in enumerate(taken):
                if i >= settled:
                    connection.close()  # replies still due: out of step for good
                    if unsettled is not None:
                        self.nodes.release(unsettled, admitted)
                pool.release(connection)  # kept only if in step (no byte read past the last)

    def _ping(self, node: Node) -> None:
        """Probe one node on a connection of the tier's own; redis-py's error if it fails.

        ``CLUSTER INFO``, not PING: a master started again answers PING at once
        but refuses every command (CLUSTERDOWN) until it has rejoined the
        cluster; brought up on its PING, it would go down again on its first
        keys, every probe (its backoff reset each time) until then.
        """
        reply = self._info(self.address.at(*node), b"CLUSTER", b"INFO")
        # None: a user that may not run CLUSTER INFO; it answered, take it as up.
        if reply is not None and b"cluster_state:ok" not in reply:
            raise errors().rx.ClusterDownError(
                f"node {node[0]}:{node[1]} does not serve its slots yet (cluster_state:fail)"
            )

    def nodes_down(self, *, waiting: bool = False) -> bool:
        """On a cluster: whether every node that holds slots is down (``waiting``: and
        none is due a probe yet). Always False on a standalone server."""
        return bool(self.cluster) and self.cluster_nodes.all_down(waiting=waiting)

    def accepted(self, answer: Answer[Any], connection: Connection, reply: Any) -> bool:
        """False (and the refusal counted) when ``reply`` is the server refusing a command."""
        if not isinstance(reply, ErrorReply):
            return True
        error = error_from_reply(reply)
        fault = server_fault(reply.text)
        if fault is Fault.UNAVAILABLE:  # LOADING, CLUSTERDOWN...: the server cannot answer now
            connection.close()
            raise error
        answer.refused.append((reply.code, describe(error)))
        if fault is Fault.MOVED:
            answer.moved += 1
            self.cluster_nodes.stale = True  # refresh the slot map before the next call
        return False

    def contains(
        self, guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]
    ) -> None:
        send = _keys_sender(guard, rows, b"EXISTS")
        self.exchange(answer, rows, batch, send, self._receiver(guard, answer, 1))

    def _receiver(self, guard: Guard, answer: Answer[bool], expected: object) -> Receive:
        """Reads one row's reply: ``True`` where it is ``expected`` (a refusal counted)."""

        def receive(connection: Connection, position: int) -> None:
            reply = connection.reply(guard)
            answer.values[position] = self.accepted(answer, connection, reply) and reply == expected

        return receive

    def write(self, guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]) -> None:
        """SET each row's value, expiring after the tier's ``ttl_s`` (if any)."""
        self._write(guard, answer, rows, batch, self.options.ttl_s)

    def writer(self, ttl_s: float | None) -> Work[bool]:
        """The work of a write whose values expire after ``ttl_s`` (None: never), the
        tier's ``ttl_s`` aside (a retention hint's: `RedisTier.write_hinted`)."""

        def work(guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]) -> None:
            self._write(guard, answer, rows, batch, ttl_s)

        return work

    def expirer(self, ttl_s: float | None, condition: bytes = b"") -> Work[bool]:
        """The work of setting each row's value to expire after ``ttl_s`` (``PEXPIRE``,
        only where that is later than now, ``condition`` ``GT``, or sooner, ``LT``: Redis
        7.0 or later; a value without a TTL expires never, for both), or never (None:
        ``PERSIST``): ``True`` where the TTL was set (for ``PERSIST``, where the server
        answered: it says 0 both for a value without a TTL and for none at all)."""
        name, args = b"PERSIST", list[bytes]()
        if ttl_s is not None:
            name, args = b"PEXPIRE", [_milliseconds(ttl_s)]
            if condition:
                args.append(condition)

        def work(guard: Guard, answer: Answer[bool], rows: list[Row], batch: list[int]) -> None:
            if ttl_s is None:
                receive = self._answered(guard, answer)
            else:
                receive = self._receiver(guard, answer, 1)
            self.exchange(answer, rows, batch, _keys_sender(guard, rows, name, *args), receive)

        return work

    def _answered(self, guard: Guard, answer: Answer[bool]) -> Receive:
        """Reads one row's reply: ``True`` where the server answered with an integer (a
        refusal counted)."""

        def receive(connection: Connection, position: int) -> None:
            reply = connection.reply(guard)
            answer.values[position] = self.accepted(answer, connection, reply) and isinstance(
                reply, int
            )

        return receive

    def _write(
        self,
        guard: Guard,
        answer: Answer[bool],
        rows: list[Row],
        batch: list[int],
        ttl_s: float | None,
    ) -> None:
        argc, expiry = 3, b""
        if ttl_s is not None:
            ms = _milliseconds(ttl_s)
            argc, expiry = 5, b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        codec = self.codec

        def frame(key: OffloadKey, remote: bytes) -> tuple[bytes, bytes]:
            """A SET frame's bytes before and after the value."""
            size = codec.value_bytes(key)
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(remote), remote, size)
            return head, b"\r\n" + expiry

        def send(connection: Connection, positions: list[int]) -> None:
            # Streamed: each value is sent before the next is checksummed, so the
            # server takes one while this thread checksums the next.
            if connection.address.tls:  # each frame built in a buffer, then sent
                for p in positions:
                    key, remote, payload = rows[p]
                    head, tail = frame(key, remote)
                    out = _thread_buffer("frame", len(head) + codec.value_bytes(key) + len(tail))
                    out[: len(head)] = head
                    with guard.lock:
                        if guard.abandoned:
                            raise Abandoned
                        end = len(head) + codec.encode_into(key, payload, out[len(head) :])
                    out[end : end + len(tail)] = tail
                    connection.send(None, out[: end + len(tail)])
                return
            # Each RESP frame (SET key value [PX ms]) goes out in one sendmsg: our
            # bytes (the last frame's tail, this one's head and the value's
            # header with its checksum), then the caller's row from its buffer.
            pending = b""  # our own bytes not sent yet: the last frame's tail
            for p in positions:
                key, remote, payload = rows[p]
                head, tail = frame(key, remote)
                with guard.lock:
                    if guard.abandoned:
                        raise Abandoned
                    header = codec.encode_header(key, payload)
                connection.send(guard, pending + head + header, payload)
                pending = tail
            connection.send(guard, pending)

        self.exchange(answer, rows, batch, send, self._receiver(guard, answer, b"OK"))

    def read(
        self, guard: Guard, answer: Answer[Verdict], rows: list[Row], batch: list[int]
    ) -> None:
        def receive(connection: Connection, position: int) -> None:
            # Each value is checked and received as it arrives, while the next is in flight.
            key, _, out = rows[position]
            sink = _ChunkSink(self.codec, key, out, direct=not connection.address.tls)
            reply = connection.reply(guard, sink)
            if reply is ROUTED:
                with guard.lock:
                    if guard.abandoned:
                        raise Abandoned
                    answer.values[position] = sink.finish()
            elif isinstance(reply, ErrorReply) and reply.code == "WRONGTYPE":
                answer.values[position] = Verdict.BAD_MAGIC  # not a string: not ours
            elif reply is not None and self.accepted(answer, connection, reply):
                connection.protocol_error(f"{reply!r:.64} in reply to GET")

        self.exchange(answer, rows, batch, _keys_sender(guard, rows, b"GET"), receive)

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "standalone" if self.cluster is False else "?"
        return f"<RedisWire [{self.url}; {kind}; {len(self._pools)} pools]>"


def _milliseconds(seconds: float) -> bytes:
    """``seconds`` as a ``PX`` or ``PEXPIRE`` argument: whole milliseconds, at least 1."""
    return b"%d" % max(1, round(seconds * 1000))


def _keys_sender(guard: Guard, rows: list[Row], name: bytes, *args: bytes) -> Send:
    """Sends command ``name`` (``EXISTS``, ``GET``, ``PEXPIRE``) of each row's remote key,
    then ``args``, in one write."""

    def send(connection: Connection, positions: list[int]) -> None:
        connection.send(guard, b"".join(command(name, rows[p][1], *args) for p in positions))

    return send
