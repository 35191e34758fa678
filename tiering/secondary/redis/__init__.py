"""A shared secondary tier on Redis (or Valkey), standalone or Redis Cluster.

Needs the ``redis`` extra (redis-py). redis-py is imported when a `RedisTier`
first connects, never on ``import tiering``.

Threading model, and why: the tier's calls run as blocking I/O on sockets of
its own, in worker threads (``anyio.to_thread.run_sync``, at most
``max_concurrency`` at once), not on an asyncio client.

- It works on asyncio *and* trio, like the rest of the engine; redis-py's
  asyncio client is asyncio-only.
- The per-chunk CPU work (receiving a multi-megabyte reply into the caller's
  row, the header and the checksum of every value) runs in the worker
  thread, off the event loop; the socket calls release the GIL. On an
  asyncio client all of it would run on the loop, stalling every other
  request for a millisecond or more per chunk.
- Throughput: ``bench/remote.py`` measures the tier against raw pipelined
  SET/GET on redis-py's client, and the asyncio client beside them.

The layers below, each its own module: `tiering.secondary.redis.address`
(the URL, checked when the tier is built), `tiering.secondary.redis.resp`
(RESP, sans-IO: the reply reader that puts a value's payload where it is told),
`tiering.secondary.redis.connection` (the tier's sockets, TCP or TLS, and their
pools), `tiering.secondary.redis.wire` (a call as one round trip per node, and
what it answered) and `tiering.secondary.redis.failures` (redis-py's exception
classes, sorted by what they mean). Why the tier reads replies itself: a value
is received straight into the caller's row, where redis-py's parsers and
hiredis copy it once to three times first (``bench/remote.py``: the tier,
checking and checksumming every value, reads at about 2.1 times redis-py's
Python parser and 0.9 of hiredis reading bare rows unchecked; hiredis with a
copy into the row reached 0.7). redis-py keeps what it does well and the tier
need not redo: the cluster's slot map and its refreshes, and the exception
classes errors are reported in.

Timeouts, faults and buffers: every socket operation has ``timeout_s``, and
every call as a whole is abandoned after ``timeout_s`` (the worker thread may
run on until its socket times out, but it never touches the caller's buffers
after the call returned: each row is encoded or decoded under a per-call lock
that the abandoning side takes). A connection error, a timeout or a cluster
that is down takes the tier *down* (see `tiering.secondary.health`): calls
then miss, writes are dropped and counted, without any I/O, until a probe
finds the server again; retries back off exponentially. Connections are
never retried behind the tier's back, so that only this schedule applies. An
error the server answers for one command (out of memory, read-only, a key of
the wrong type) is counted by its code and does not take the tier down; but a
refused write takes the tier's *writes* down on a gate of their own, with the
same backoff: a Redis full under ``noeviction`` is not sent every
write-through only to refuse it, while lookups and reads go on.

On a Redis Cluster, a node that cannot be reached takes only its own slots
down, with the same backoff per node (see `tiering.secondary.redis.wire`):
its keys miss and its writes are dropped and counted (``node down``), the
other nodes' keys are served, and the tier is *down* only when every node
that holds slots is. A replica promoted in its place, or the node's return,
is found by its next probe. A standalone server is one gate, as above.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from tiering._types import OffloadKey
from tiering.errors import ConfigError, ResourceClosedError
from tiering.secondary.auth import AuthKey
from tiering.secondary.base import (
    UNWRITTEN_BACKING_OFF,
    UNWRITTEN_BUSY,
    UNWRITTEN_CANCELLED,
    UNWRITTEN_DOWN,
    UNWRITTEN_FAILED,
    UNWRITTEN_NODE_DOWN,
    UNWRITTEN_TIMEOUT,
    Locality,
    ReadItem,
    SecondaryStatistics,
    SecondaryTier,
    TierCounters,
    WriteItem,
)
from tiering.secondary.checksum import Checksum
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, writable_row
from tiering.secondary.health import Admission, HealthGate, TierState
from tiering.secondary.redis.address import URL_ENV, parse_url, redact_url, resolve_url
from tiering.secondary.redis.wire import Answer, Guard, RedisWire, Row, Work

__all__ = ["RedisTier", "redact_url"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RedisTier(SecondaryTier):
    """A `SecondaryTier` on a Redis server or cluster. Works on asyncio and trio.

    ``url``: ``redis://[user[:password]@]host[:port][/db]`` or ``rediss://``
    (TLS; the ``ssl_*`` query options of redis-py's URLs apply, see
    `tiering.secondary.redis.address`), with an optional
    ``cluster=yes|no|auto`` query option. ``cluster``: ``None`` detects it
    (``INFO cluster`` on connecting). ``ttl_s``: expire written values (``SET
    ... PX``); capacity and eviction are otherwise the server's (``maxmemory``
    and an LRU policy). ``timeout_s`` bounds every call and every socket
    operation; ``connect_timeout_s`` (default: ``timeout_s``) each connect.
    A call's keys go in pipelines of at most ``max_batch`` keys (one round trip each).
    ``backoff_s`` is ``(first, longest)`` retry delay while the server is away
    (on a cluster: each node that is away, its keys missing meanwhile).
    At most ``max_concurrency`` calls run at once, each in a worker thread;
    others wait for a thread within their timeout (one that waits it all out
    is counted in ``busy_total`` and answered as misses; the tier stays up).
    ``checksum`` is what values are written with (`Checksum` or its name):
    ``xxh3``, or ``ml64`` while engines of a version before XXH3, which
    reject it, still read the same store (a rolling upgrade); values of
    every kind are read. ``auth_key`` (an `AuthKey`, the same for every
    engine of the store): values are written with a tag under it and only
    values with a valid one are read (`tiering.secondary.codec`).

    Constructing does no I/O; the first call connects. `open` connects now
    and reports a wrong URL, credentials or server as `ConfigError`.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        namespace: RemoteNamespace,
        *,
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        connect_timeout_s: float | None = None,
        cluster: bool | None = None,
        max_batch: int = 1024,
        max_concurrency: int = 8,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        socket_read_size: int = 256 << 10,
        locality: Locality = Locality.REMOTE,
        checksum: Checksum | str = Checksum.XXH3,
        auth_key: AuthKey | None = None,
    ) -> None:
        for label, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if value is not None and not value > 0:
                raise ConfigError(f"{label} must be a positive number of seconds, got {value!r}")
        if ttl_s is not None and not ttl_s >= 0.001:
            raise ConfigError(f"ttl_s must be None or at least 0.001 seconds, got {ttl_s!r}")
        for label, number in (
            ("max_batch", max_batch),
            ("max_concurrency", max_concurrency),
            ("socket_read_size", socket_read_size),
        ):
            if not isinstance(number, int) or number < 1:
                raise ConfigError(f"{label} must be a positive integer, got {number!r}")
        address, plain_url, cluster = parse_url(url, cluster)
        #: The server's URL without its password: safe to log and show.
        self.url = redact_url(url)
        self.codec = ChunkCodec(namespace, _checksum(checksum), auth_key)
        self.locality = locality
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self.max_batch = max_batch
        self.max_concurrency = max_concurrency
        self._health = HealthGate(backoff_s)
        # Writes the server refuses (OOM under noeviction, READONLY, MISCONF)
        # back off on a gate of their own: reads and lookups go on meanwhile.
        self._write_gate = HealthGate(backoff_s)
        self._counters = TierCounters()
        self._slots: anyio.CapacityLimiter | None = None  # calls in worker threads
        self._threads: anyio.CapacityLimiter | None = None  # our own, not anyio's default
        self._closed = False
        self._wire = RedisWire(
            address,
            plain_url,
            self.url,
            self.codec,
            cluster=cluster,
            timeout_s=timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            socket_read_size=socket_read_size,
            max_batch=max_batch,
            ttl_s=ttl_s,
            backoff_s=backoff_s,
        )

    @classmethod
    def from_env(
        cls,
        namespace: RemoteNamespace,
        *,
        url_env: str = URL_ENV,
        password_file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> RedisTier:
        """A tier whose URL is in the environment variable ``url_env`` (`URL_ENV` by
        default), its password there or in the first line of ``password_file``: no
        secret in a server's argv or in a config it logs (see `resolve_url`)."""
        url = resolve_url(url_env=url_env, password_file=password_file)
        return cls(url, namespace, **options)

    @classmethod
    async def open(cls, url: str, namespace: RemoteNamespace, **options: Any) -> RedisTier:
        """A tier connected and answering PING; `ConfigError` (one line, no password) if not."""
        tier = cls(url, namespace, **options)
        try:
            await tier.connect()
        except BaseException:
            await tier.aclose()
            raise
        return tier

    @property
    def cluster(self) -> bool | None:
        """Whether the server is a Redis Cluster (``None`` until the first connection tells)."""
        return self._wire.cluster

    @property
    def state(self) -> TierState:
        """``down`` when the server is, or on a cluster when every node that holds slots is."""
        if self._closed:
            return TierState.CLOSED
        return TierState.DOWN if self._wire.nodes_down() else self._health.state

    async def connect(self) -> None:
        """Connect now (detecting a cluster) and PING; raise `ConfigError` naming what is wrong."""
        self._check_open()
        with anyio.move_on_after(self.timeout_s + self.connect_timeout_s) as scope:
            await anyio.to_thread.run_sync(
                self._wire.ping, abandon_on_cancel=True, limiter=self._limiters()[1]
            )
        if scope.cancelled_caught:
            raise ConfigError(
                f"cannot reach the Redis tier at {self.url}: no answer within {self.timeout_s} s"
            )

    def sync_client(self) -> Any:
        """A redis-py client of the tier's server (blocking: connects on first use).

        On a cluster, the client whose slot map routes the tier's keys. For
        benchmarks and diagnostics (the tier's own calls do not go through
        it); do not write under the tier's keys.
        """
        self._check_open()
        return self._wire.client()

    # -- the contract -----------------------------------------------------------

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._check_open()
        c = self._counters
        c.contains_calls += 1
        if not keys:
            await anyio.lowlevel.checkpoint()
            return []
        rows = [(k, self.codec.remote_key(k), None) for k in keys]
        answer, _ = await self._run(self._wire.contains, rows)
        found = [bool(v) for v in answer.values] if answer is not None else [False] * len(keys)
        return c.found(found)

    async def write(self, items: Sequence[WriteItem]) -> int:
        self._check_open()
        rows = [(k, self.codec.remote_key(k), _row(p, self.row_bytes)) for k, p in items]
        c = self._counters
        c.write_calls += 1
        if not rows:
            await anyio.lowlevel.checkpoint()
            return 0
        try:
            answer, cause = await self._run(self._wire.write, rows, write=True)
        except BaseException:  # cancelled: none of them written, and each counted so
            c.written(0, len(rows), self.row_bytes, cause=UNWRITTEN_CANCELLED)
            raise
        if answer is None:
            return c.written(0, len(rows), self.row_bytes, cause=cause)
        written = sum(1 for v in answer.values if v)
        down = len(answer.node_down)  # on a cluster node that is down: none written
        if down:
            c.written(0, down, self.row_bytes, cause=UNWRITTEN_NODE_DOWN)
        return c.written(
            written, len(rows) - down, self.row_bytes, cause=cause, refused=answer.refused
        )

    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        self._check_open()
        rows = [(k, self.codec.remote_key(k), writable_row(b, self.row_bytes)) for k, b in items]
        c = self._counters
        c.read_calls += 1
        if not rows:
            await anyio.lowlevel.checkpoint()
            return []
        answer, _ = await self._run(self._wire.read, rows)
        verdicts = answer.values if answer is not None else [None] * len(rows)
        return [
            c.read(key, verdict, self.row_bytes)
            for (key, _, _), verdict in zip(rows, verdicts, strict=True)
        ]

    def statistics(self) -> SecondaryStatistics:
        writes = "backing off" if self._write_gate.state is TierState.DOWN else "up"
        return self._counters.snapshot(self.name, self.state.value, writes)

    async def aclose(self) -> None:
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        self._closed = True
        self._health.close()
        self._write_gate.close()
        with anyio.move_on_after(self.timeout_s):
            await anyio.to_thread.run_sync(self._wire.close, abandon_on_cancel=True)

    # -- the async shell --------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ResourceClosedError(f"{self!r} is closed")

    def _limiters(self) -> tuple[anyio.CapacityLimiter, anyio.CapacityLimiter]:
        if self._slots is None or self._threads is None:
            self._slots = anyio.CapacityLimiter(self.max_concurrency)
            self._threads = anyio.CapacityLimiter(self.max_concurrency)
        return self._slots, self._threads

    async def _run(
        self,
        work: Work[T],
        rows: list[Row],
        *,
        write: bool = False,
    ) -> tuple[Answer[T] | None, str]:
        """Run ``work`` in a worker thread within the timeout, unless the tier is down.

        Returns the answer (``None``: nothing was answered) and, for what was
        left unanswered, why (an ``UNWRITTEN_*`` cause). A ``write`` also
        passes the write gate, which refused writes take down.
        """
        c = self._counters
        admission = self._health.admit()
        if admission is not None and self._wire.nodes_down(waiting=True):
            self._health.release(admission)  # every node of the cluster is down, none due
            admission = None
        if admission is None:
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()  # answered without I/O, but still a checkpoint
            return None, UNWRITTEN_DOWN
        writing = self._write_gate.admit() if write else None
        if write and writing is None:
            self._health.release(admission)
            c.unavailable_total += 1
            await anyio.lowlevel.checkpoint()
            return None, UNWRITTEN_BACKING_OFF
        guard = Guard()
        answer: Answer[T] | None = None
        box: Answer[T] = Answer(len(rows))  # what the thread fills, seen here if it times out
        slots, threads = self._limiters()
        started = False
        try:
            with anyio.move_on_after(self.timeout_s):
                async with slots:
                    started = True
                    answer = await anyio.to_thread.run_sync(
                        self._wire.run,
                        work,
                        guard,
                        rows,
                        box,
                        abandon_on_cancel=True,
                        limiter=threads,
                    )
        except BaseException:  # cancelled from outside: give the buffers back, then go
            guard.abandon()
            self._health.release(admission)
            if writing is not None:
                self._write_gate.release(writing)
            raise
        if answer is None or answer.unavailable is not None or answer.errors:
            if writing is not None:  # says nothing about whether writes are accepted
                self._write_gate.release(writing)
        elif writing is not None:
            self._writes_answered(writing, answer.refused, answer.moved)
        if answer is None and not started:
            # Every worker thread stayed busy for the whole timeout: the tier is
            # overloaded, which says nothing about the server. Not a fault.
            self._health.release(admission)
            c.busy_total += 1
            return None, UNWRITTEN_BUSY
        if answer is None:
            guard.abandon()
            c.timeouts_total += 1
            message = f"TimeoutError: no answer within {self.timeout_s} s"
            # Read ``stuck`` first: the thread records a node's failure before it
            # moves on, so a node that timed out in this call is seen either way.
            stuck = box.stuck
            slow = [text for text, timed_out in list(box.node_failures) if timed_out]
            if stuck is None and not box.node_failures:
                self._failed(admission, message)
            elif slow:  # a node timed out in this call, and took the call's time with it
                self._health.release(admission)
                c.error(f"{message} ({slow[0]})")
            else:  # stuck is not None: one node of a cluster kept the call waiting
                self._health.release(admission)
                if stuck is not None:
                    self._wire.node_timed_out(stuck)
                    message = f"{message} (node {stuck[0]}:{stuck[1]})"
                c.error(message)
            return None, UNWRITTEN_TIMEOUT
        c.round_trips_total += answer.round_trips
        for error in answer.errors:
            c.error(error)
        for message, timed_out in answer.node_failures:  # one node of a cluster
            c.error(message)
            c.timeouts_total += timed_out
        c.reconnects_total += answer.nodes_back
        if not write:  # a write's refusals are counted with its chunks
            for reason, message in answer.refused:
                c.refused(reason, message)
        if answer.unavailable is not None:
            c.timeouts_total += answer.timed_out
            self._failed(admission, answer.unavailable)
        elif self._health.succeeded(admission):
            c.reconnects_total += 1
        return answer, UNWRITTEN_TIMEOUT if answer.timed_out else UNWRITTEN_FAILED

    def _writes_answered(
        self, admission: Admission, refused: Sequence[tuple[str, str]], moved: int
    ) -> None:
        """The server answered a write: refusals take the write gate down (back off).

        A slot that moved (a cluster resharding, or a standalone client on a
        cluster node; ``moved`` of the ``refused``) is not the server refusing
        writes: it does not count.
        """
        if len(refused) == moved:
            if self._write_gate.succeeded(admission):
                logger.warning("Redis tier at %s accepts writes again", self.url)
            return
        if self._write_gate.failed(admission):
            reason, message = refused[0]
            logger.warning(
                "Redis tier at %s refused %d writes (%s: %s); writes back off, reads go on",
                self.url,
                len(refused) - moved,
                reason,
                message,
            )

    def _failed(self, admission: Admission, message: str) -> None:
        self._counters.error(message)
        self._health.failed(admission)

    def __repr__(self) -> str:
        c = self._counters
        kind = " cluster" if self._wire.cluster else ""
        down = len(self._wire.nodes.down()) if self._wire.cluster else 0
        kind += f", {down} node{'s' if down != 1 else ''} down" if down else ""
        return (
            f"<RedisTier [{self.state.value}; {self.url}{kind}; {c.hits_total} hits, "
            f"{c.misses_total} misses, {c.reads_total} read, {c.writes_total} written, "
            f"{c.write_errors_total} dropped, {c.rejected_total} rejected, "
            f"{c.errors_total} errors]>"
        )


def _checksum(value: Checksum | str) -> Checksum:
    if isinstance(value, Checksum):
        return value
    name = value.upper() if isinstance(value, str) else None
    if name not in Checksum.__members__:
        names = ", ".join(k.lower() for k in Checksum.__members__)
        raise ConfigError(f"checksum must be one of {names}, got {value!r}")
    return Checksum[name]


def _row(payload: Any, row_bytes: int) -> memoryview:
    view = memoryview(payload)
    if view.nbytes != row_bytes or not view.c_contiguous:
        from tiering.errors import SpecError

        raise SpecError(
            f"a chunk payload must be one contiguous row of {row_bytes} bytes, "
            f"got {view.nbytes} bytes{'' if view.c_contiguous else ', not contiguous'}"
        )
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
