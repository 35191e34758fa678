"""`RedisTier`: the contract of a secondary tier, on a Redis server or cluster.

The async shell of the tier: it checks and counts on the event loop, and
hands each call's I/O to a worker thread (`tiering.secondary.redis.wire`)
through `ThreadCalls`, the one threaded-call helper of the lower tiers.

Threading model, and why: the tier's calls run as blocking I/O on sockets of
its own, in worker threads, not on an asyncio client.

- It works on asyncio *and* trio, like the rest of the engine; redis-py's
  asyncio client is asyncio-only.
- The per-chunk CPU work (receiving a multi-megabyte reply into the caller's
  row, the header and the checksum of every value) runs in the worker
  thread, off the event loop; the socket calls release the GIL. On an
  asyncio client all of it would run on the loop, stalling every other
  request for a millisecond or more per chunk.

Timeouts, faults and buffers: every socket operation has ``timeout_s``, and
every call as a whole is abandoned after ``timeout_s`` (the worker thread may
run on until its socket times out, but it never touches the caller's buffers
after the call returned: each row is encoded or decoded under the call's
`Guard`, which the abandoning side takes; and it holds one of the tier's
``max_concurrency`` threads until it ends). A connection error, a timeout or
a cluster that is down takes the tier *down* (see `tiering.secondary.health`):
calls then miss, writes are dropped and counted, without any I/O, until a
probe finds the server again; retries back off exponentially. Connections
are never retried behind the tier's back, so that only this schedule applies.
An error the server answers for one command (out of memory, read-only, a key
of the wrong type) is counted by its code and does not take the tier down
(`tiering.secondary.refusals`); but a refused write takes the tier's
*writes* down on a gate of their own, with the same backoff: a Redis full
under ``noeviction`` is not sent every write-through only to refuse it,
while lookups and reads go on.

On a Redis Cluster, a node that cannot be reached takes only its own slots
down, with the same backoff per node (`tiering.secondary.redis.cluster`): its
keys miss and its writes are dropped and counted (``node down``), the other
nodes' keys are served, and the tier is *down* only when every node that
holds slots is. A replica promoted in its place, or the node's return, is
found by its next probe. A standalone server is one gate, as above.

Retention hints (`tiering.hints`) set TTLs; Redis evicts by its own policy,
so a TTL is what the tier can say. The rule, at write (``SET ... PX``) and for
values already written (``PEXPIRE``, one round trip per node):

- a retention keeps a value at least ``retain_s``: written with the tier's
  ``ttl_s``, it expires after ``max(ttl_s, retain_s)`` (a write sets a TTL
  anew, as every write does); a hint on values already written raises their
  TTL to that, never lowers one (``PEXPIRE ... GT``, Redis 7.0 or later: an
  older server refuses it, counted), so a shorter retention never cuts a
  longer one; without ``ttl_s`` values never expire, and a retention only
  lifts a release's TTL (``PERSIST``);
- a release changes nothing unless the tier has ``release_ttl_s`` (None by
  default): the values of a namespace are every engine's that shares it, a
  release is one conversation's, and a read does not lift a TTL, so one
  conversation's end would expire a prefix the others share (a system prompt)
  for all of them. Set ``release_ttl_s`` where a release speaks for every
  engine (one engine's namespace): released values then expire after it (or
  the tier's ``ttl_s`` if shorter), a TTL only ever lowered by it
  (``PEXPIRE ... LT``);
- a priority changes nothing here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from tiering._closing import AsyncLifecycle
from tiering._extras import require
from tiering._state import ResourceState
from tiering._types import OffloadKey
from tiering.errors import ConfigError
from tiering.hints import Hint
from tiering.secondary._threads import CallOutcome, ThreadCalls, ThreadedTier
from tiering.secondary.base import (
    ReadItem,
    SecondaryStatistics,
    SecondaryTier,
    TierCounters,
    WriteItem,
)
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, payload_row, writable_row
from tiering.secondary.health import Admission, HealthGate, TierState
from tiering.secondary.redis.address import URL_ENV, parse_url, redact_url, resolve_url
from tiering.secondary.redis.answer import Answer, Row, Work
from tiering.secondary.redis.failures import what_to_check
from tiering.secondary.redis.options import RedisOptions, decode_options
from tiering.secondary.redis.wire import Guard, RedisWire
from tiering.secondary.refusals import Unwritten

__all__ = ["RedisTier"]

logger = logging.getLogger("tiering.secondary.redis")

T = TypeVar("T")


class RedisTier(ThreadedTier, SecondaryTier):
    """A `SecondaryTier` on a Redis server or cluster. Works on asyncio and trio.

    ``url``: ``redis://[user[:password]@]host[:port][/db]`` or ``rediss://``
    (TLS; the ``ssl_*`` query options of redis-py's URLs apply, see
    `tiering.secondary.redis.address`), with an optional
    ``cluster=yes|no|auto`` query option. The keyword ``options``
    (`RedisOptions`, each checked, an unknown one refused):

    - ``cluster``: ``None`` detects it (``INFO cluster`` on connecting).
    - ``ttl_s``: expire written values (``SET ... PX``); capacity and eviction
      are otherwise the server's (``maxmemory`` and an LRU policy).
    - ``release_ttl_s``: how soon a value released by a hint expires (None: a
      release changes nothing; see the module's note on hints).
    - ``timeout_s`` bounds every call and every socket operation;
      ``connect_timeout_s`` (default: ``timeout_s``) each connect.
    - ``max_batch``: a call's keys go in pipelines of at most this many keys
      (one round trip each).
    - ``backoff_s``: ``(first, longest)`` retry delay while the server is away
      (on a cluster: each node that is away, its keys missing meanwhile).
    - ``max_concurrency``: at most this many calls run at once, each in a
      worker thread, counting threads that a hung socket still holds; others
      wait for a thread within their timeout (one that waits it all out is
      counted in ``busy_total`` and answered as misses; the tier stays up).
    - ``socket_read_size``: the most bytes one receive takes.
    - ``locality``: what KV events say of the chunks it holds (``REMOTE``).
    - ``checksum``: what values are written with (`Checksum` or its name):
      ``xxh3``, or ``ml64`` while engines of a version before XXH3, which
      reject it, still read the same store (a rolling upgrade); values of
      every kind are read.
    - ``auth_key`` (an `AuthKey`, the same for every engine of the store):
      values are written with a tag under it and only values with a valid one
      are read (`tiering.secondary.codec`).

    Constructing does no I/O (redis-py missing is a `ConfigError` naming the
    ``redis`` extra); the first call connects. `open` connects now and reports a
    wrong URL, credentials or server as `ConfigError`.
    """

    name = "redis"
    honours_hints = True

    def __init__(self, url: str, namespace: RemoteNamespace, **options: Any) -> None:
        require("redis", "redis", "the Redis tier")  # now, not at its first call
        settings = decode_options(options)
        address, plain_url, cluster = parse_url(url, settings.cluster)
        #: The server's URL without its password: safe to log and show.
        self.url = redact_url(url)
        #: Its options, decoded (``max_batch``, ``ttl_s``... : `RedisOptions`).
        self.options: RedisOptions = settings
        self.codec = ChunkCodec(namespace, settings.checksum_kind, settings.auth_key)
        self.locality = settings.locality
        self._life = AsyncLifecycle(f"the Redis tier at {self.url}", opened=True)
        self._health = HealthGate(settings.backoff_s, life=self._life)
        # Writes the server refuses (OOM under noeviction, READONLY, MISCONF)
        # back off on a gate of their own: reads and lookups go on meanwhile.
        self._write_gate = HealthGate(settings.backoff_s, life=self._life)
        self._counters = TierCounters()
        self._calls = ThreadCalls(settings.max_concurrency, settings.timeout_s, capture=())
        self._wire = RedisWire(address, plain_url, self.url, self.codec, settings, cluster=cluster)

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
    def state(self) -> TierState | ResourceState:
        """``closed`` once closing; ``down`` when the server is, or on a cluster when every
        node that holds slots is; else ``up``."""
        if self._life.closed:
            return ResourceState.CLOSED
        return TierState.DOWN if self._wire.nodes_down() else self._health.state

    async def connect(self, *, warn: bool = False) -> None:
        """Connect now (detecting a cluster) and PING; raise `ConfigError` naming what is wrong.

        A failure takes the tier down (calls then miss until a probe finds the
        server); ``warn`` also logs that, as a failed call would, for a caller
        that goes on without the server (an engine's start) rather than report it.
        """
        self._life.check_open()
        admission = self._health.admit()  # the tier's health learns what the ping found
        try:
            with anyio.move_on_after(self.timeout_s + self.options.connect_s) as scope:
                await anyio.to_thread.run_sync(
                    self._wire.ping, abandon_on_cancel=True, limiter=self._calls.limiter
                )
            if scope.cancelled_caught:
                raise ConfigError(
                    f"cannot reach the Redis tier at {self.url}: no answer within "
                    f"{self.timeout_s} s"
                )
        except ConfigError as exc:
            if admission is not None:
                # The line names the tier and its URL already: the reason alone.
                reason = str(exc).removeprefix(f"cannot reach the Redis tier at {self.url}: ")
                self._failed(admission, reason, warn=warn)
            raise
        except BaseException:
            if admission is not None:
                self._health.release(admission)
            raise
        if admission is not None:
            self._up_again(admission)

    def sync_client(self) -> Any:
        """A redis-py client of the tier's server (blocking: connects on first use).

        On a cluster, the client whose slot map routes the tier's keys. For
        benchmarks and diagnostics (the tier's own calls do not go through
        it); do not write under the tier's keys.
        """
        self._life.check_open()
        return self._wire.client()

    # -- the contract -----------------------------------------------------------

    async def contains(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self._life.check_open()
        c = self._counters
        c.contains_calls += 1
        rows = [(k, self.codec.remote_key(k), None) for k in keys]
        answer, _ = await self._run(self._wire.contains, rows)
        found = [bool(v) for v in answer.values] if answer is not None else [False] * len(keys)
        return c.found(found)

    async def write(self, items: Sequence[WriteItem]) -> int:
        return await self._write(items, self._wire.write)

    async def write_hinted(self, items: Sequence[WriteItem], hint: Hint) -> int:
        """`write`, each value expiring as ``hint`` says (see the module's note)."""
        expiry = self._hint_expiry(hint)
        if expiry is None:
            return await self.write(items)
        written = await self._write(items, self._wire.writer(expiry[0]))
        self._counters.hinted_total += written
        return written

    async def hint(self, keys: Sequence[OffloadKey], hint: Hint) -> int:
        """Set the TTL of those of ``keys`` the server holds as ``hint`` says (``PEXPIRE``,
        or ``PERSIST`` for a retention on a tier without ``ttl_s``): one round trip per
        node; how many TTLs it set. Failures and refusals are counted as any call's."""
        self._life.check_open()
        expiry = self._hint_expiry(hint)
        if expiry is None:
            await anyio.lowlevel.checkpoint()
            return 0
        ttl_s, condition = expiry
        rows = [(k, self.codec.remote_key(k), None) for k in keys]
        answer, _ = await self._run(self._wire.expirer(ttl_s, condition), rows)
        applied = sum(1 for v in answer.values if v) if answer is not None else 0
        self._counters.hinted_total += applied
        return applied

    def _hint_expiry(self, hint: Hint) -> tuple[float | None, bytes] | None:
        """The TTL values get from ``hint`` (None: never expire) and the condition a
        ``PEXPIRE`` of values already written sets it on; None: the hint changes
        nothing here (see the module's note)."""
        ttl_s, release_s = self.options.ttl_s, self.options.release_ttl_s
        if hint.release:
            if release_s is None:
                return None
            return (release_s if ttl_s is None else min(ttl_s, release_s)), b"LT"
        if hint.retain_s is None:
            return None
        return (None if ttl_s is None else max(ttl_s, hint.retain_s)), b"GT"

    async def _write(self, items: Sequence[WriteItem], work: Work[bool]) -> int:
        self._life.check_open()
        rows = [(k, self.codec.remote_key(k), payload_row(p, self.row_bytes)) for k, p in items]
        c = self._counters
        c.write_calls += 1
        with c.cancelled_writes(len(rows), self.row_bytes):
            answer, cause = await self._run(work, rows, write=True)
        if answer is None:
            return c.written(0, len(rows), self.row_bytes, cause=cause)
        written = sum(1 for v in answer.values if v)
        down = len(answer.node_down)  # on a cluster node that is down: none written
        if down:
            c.written(0, down, self.row_bytes, cause=Unwritten.NODE_DOWN)
        return c.written(
            written, len(rows) - down, self.row_bytes, cause=cause, refused=answer.refused
        )

    async def read(self, items: Sequence[ReadItem]) -> list[bool]:
        self._life.check_open()
        rows = [(k, self.codec.remote_key(k), writable_row(b, self.row_bytes)) for k, b in items]
        c = self._counters
        c.read_calls += 1
        answer, _ = await self._run(self._wire.read, rows)
        verdicts = answer.values if answer is not None else [None] * len(rows)
        return [
            c.read(key, verdict, self.row_bytes)
            for (key, _, _), verdict in zip(rows, verdicts, strict=True)
        ]

    def statistics(self) -> SecondaryStatistics:
        writes = TierState.BACKING_OFF if self._write_gate.state is TierState.DOWN else TierState.UP
        return self._counters.snapshot(self.name, self.state.value, writes.value)

    async def aclose(self) -> None:
        if not await self._life.begin_aclose():
            return
        try:
            with anyio.move_on_after(self.timeout_s):
                await anyio.to_thread.run_sync(self._wire.close, abandon_on_cancel=True)
        finally:
            self._life.end_close()

    # -- the async shell --------------------------------------------------------

    async def _run(
        self,
        work: Work[T],
        rows: list[Row],
        *,
        write: bool = False,
    ) -> tuple[Answer[T] | None, Unwritten]:
        """Run ``work`` in a worker thread within the timeout, unless the tier is down.

        Returns the answer (``None``: nothing was answered) and, for what was
        left unanswered, why. A ``write`` also passes the write gate, which
        refused writes take down. No rows: no I/O (still a checkpoint).
        """
        admission = self._admit(write, bool(rows))
        if not isinstance(admission, tuple):
            await anyio.lowlevel.checkpoint()  # answered without I/O, but still a checkpoint
            return None, admission
        admitted, writing = admission
        guard = Guard()
        box: Answer[T] = Answer(len(rows))  # what the thread fills, seen here if it times out
        try:
            called = await self._calls.call(self._wire.run, work, guard, rows, box)
        except BaseException:  # cancelled from outside: give the buffers back, then go
            guard.abandon()
            self._health.release(admitted)
            if writing is not None:
                self._write_gate.release(writing)
            raise
        answer = called.value if called.outcome is CallOutcome.DONE else None
        if writing is not None:
            self._writes_answered(writing, answer)
        if called.outcome is CallOutcome.BUSY:
            # Every worker thread stayed busy for the whole timeout: the tier is
            # overloaded, which says nothing about the server. Not a fault.
            self._health.release(admitted)
            self._counters.busy_total += 1
            return None, Unwritten.BUSY
        if answer is None:
            guard.abandon()
            self._timed_out(admitted, box)
            return None, Unwritten.TIMEOUT
        return answer, self._answered(admitted, answer, write)

    def _admit(self, write: bool, rows: bool) -> tuple[Admission, Admission | None] | Unwritten:
        """The call's admissions (the tier's, and the write gate's for a write), or why
        it is answered without I/O (``rows`` false: nothing to ask, nothing counted)."""
        if not rows:
            return Unwritten.FAILED  # no I/O and nothing counted: no chunk is left unwritten
        admission = self._health.admit()
        if admission is not None and self._wire.nodes_down(waiting=True):
            self._health.release(admission)  # every node of the cluster is down, none due
            admission = None
        if admission is None:
            self._counters.unavailable_total += 1
            return Unwritten.DOWN
        writing = self._write_gate.admit() if write else None
        if write and writing is None:
            self._health.release(admission)
            self._counters.unavailable_total += 1
            return Unwritten.BACKING_OFF
        return admission, writing

    def _timed_out(self, admission: Admission, box: Answer[Any]) -> None:
        """The call ran out of time: who is to blame, the store or one node of a cluster."""
        c = self._counters
        c.timeouts_total += 1
        message = f"TimeoutError: no answer within {self.timeout_s} s"
        # Read ``stuck`` first: the thread records a node's failure before it
        # moves on, so a node that timed out in this call is seen either way.
        stuck = box.stuck
        slow = [text for text, timed_out in list(box.node_failures) if timed_out]
        if stuck is None and not box.node_failures:
            self._failed(admission, message)
            return
        self._health.release(admission)
        if slow:  # a node timed out in this call, and took the call's time with it
            c.error(f"{message} ({slow[0]})")
        else:  # stuck is not None: one node of a cluster kept the call waiting
            if stuck is not None:
                self._wire.cluster_nodes.timed_out(stuck)
                message = f"{message} (node {stuck[0]}:{stuck[1]})"
            c.error(message)

    def _answered(self, admission: Admission, answer: Answer[Any], write: bool) -> Unwritten:
        """Count what the thread answered; why the rest (if any) was left unanswered."""
        c = self._counters
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
        else:
            self._up_again(admission)
        return Unwritten.TIMEOUT if answer.timed_out else Unwritten.FAILED

    def _writes_answered(self, admission: Admission, answer: Answer[Any] | None) -> None:
        """The write gate learns what the server said: refusals take it down (back off).

        A call unanswered, or failed, says nothing about whether writes are
        accepted. A slot that moved (a cluster resharding, or a standalone
        client on a cluster node; ``moved`` of the ``refused``) is not the
        server refusing writes: it does not count.
        """
        if answer is None or answer.unavailable is not None or answer.errors:
            self._write_gate.release(admission)
            return
        refused, moved = answer.refused, answer.moved
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

    def _failed(self, admission: Admission, message: str, *, warn: bool = True) -> None:
        """A call could not reach the server: counted; one line when that took the tier
        down (the server is probed again with backoff, no line per call meanwhile)."""
        self._counters.error(message)
        if self._health.failed(admission) and warn:
            check = what_to_check(self.url, message)
            logger.warning(
                "Redis tier at %s is down: %s%s. Until it answers, its lookups miss and "
                "its writes are dropped, without I/O (retried with backoff)",
                self.url,
                message,
                f"; {check}" if check else "",
            )

    def _up_again(self, admission: Admission) -> None:
        if self._health.succeeded(admission):
            self._counters.reconnects_total += 1
            logger.warning("Redis tier at %s answers again", self.url)

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
