"""Prometheus metrics of a `TieringEngine`, read from its `statistics()` at scrape time.

Design note: a pull collector, one registry per engine.

- Nothing is added to the transfer path. `MetricsCollector.collect` takes one
  ``engine.statistics()`` snapshot per scrape and turns it into metric
  families; the engine keeps its plain integer counters and never calls into
  prometheus-client. Scrapes by `serve_metrics` run in the HTTP server's
  thread: every statistic is a plain read (ints, ``len`` of a deque, a tuple
  copy, or taken under the component's own lock), so a snapshot may be a few
  operations apart across fields but each value is whole, and counters never
  go back. `metrics_app` collects on the event loop's thread instead.
- One `CollectorRegistry` per engine (`metrics_registry`), made on first use
  and kept as long as the engine lives. Two engines in one process, or a new
  engine under the id of a closed one, each get their own registry, so no name
  is ever registered twice. Registering a `MetricsCollector` in a registry of
  one's own (the global ``REGISTRY`` of a server, say) works too, once per
  engine: every family carries the ``engine`` label, but prometheus-client
  refuses two collectors of the same names in one registry.
- The engine is duck-typed (`MetricsSource`): this layer sits below the engine
  and never imports it. Event statistics are read with ``getattr`` from the
  snapshot's ``events`` (an ``EventStatistics`` with per-sink counts, or None
  when events are off): the event families are always exported, with no
  sample while there is no sink, so dashboards and rules see the same names
  either way.

- Every tier below the CPU tier (``statistics().tiers``, in chain order; a
  source without ``tiers`` is read through its ``secondary``) exports the same
  families as the CPU tier where they mean the same thing, under its own
  ``tier`` label (``disk``, ``remote``): its flows, its lookups, and what it
  holds where it says (a disk tier does, Redis does not: no sample then).
- The CPU tier's retention hints (`tiering.hint_metrics`): what its hints hold
  and did, with no sample until a hint was given.

Names follow the Prometheus conventions: ``tiering_`` prefix, base units
(bytes, seconds), ``_total`` counters, ``_ratio`` fractions. Every series has an
``engine`` label, the engine's id (`TieringEngine.engine_id`: its config's
``engine_id`` unless the engine was given one; under vLLM, its
``kv_transfer_config.engine_id``); the CPU tier's series have ``tier="cpu"``, a tier below it
``tier=<its label>``, and the transfer series ``direction`` (``store``: GPU to
CPU, or CPU to the tier below; ``load``: CPU to GPU, or the tier below to CPU).
`FAMILIES` lists the families; `UNDASHBOARDED` those that no panel or rule of
``dashboards/`` uses on purpose.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any, Protocol, Self
from wsgiref.simple_server import WSGIServer

import anyio.to_thread
from anyio.abc import AsyncResource
from prometheus_client import generate_latest, make_asgi_app, start_http_server
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from tiering._checks import is_int
from tiering._state import Lifecycle
from tiering.cpu.common import CPUOffloadingInfo
from tiering.cpu.manager import ManagerStatistics
from tiering.errors import ConfigError
from tiering.hint_metrics import HINT_FAMILIES, HintFamilies
from tiering.scheduler import LATENCY_BUCKETS, DirectionStatistics, SchedulerStatistics

__all__ = [
    "FAMILIES",
    "UNDASHBOARDED",
    "ASGIApp",
    "MetricsCollector",
    "MetricsServer",
    "MetricsSource",
    "metrics_app",
    "metrics_registry",
    "render_metrics",
    "serve_metrics",
]

#: Every metric family the collector exports (exposition names).
FAMILIES: tuple[str, ...] = (
    "tiering_info",
    "tiering_chunks_capacity",
    "tiering_chunks_used",
    "tiering_chunks_writing",
    "tiering_chunks_pinned",
    "tiering_chunks_evictable",
    "tiering_occupancy_ratio",
    "tiering_tier_bytes",
    "tiering_transfer_bytes_total",
    "tiering_transfer_seconds",
    "tiering_jobs_total",
    "tiering_jobs_queued",
    "tiering_jobs_in_flight",
    "tiering_lookups_total",
    "tiering_evictions_total",
    "tiering_allocation_failures_total",
    "tiering_events_published_total",
    "tiering_events_dropped_total",
    "tiering_tier_up",
    "tiering_tier_errors_total",
    *HINT_FAMILIES,
)

#: Families that no dashboard panel or alert rule uses, on purpose (none yet).
UNDASHBOARDED: frozenset[str] = frozenset()

TIER = "cpu"
#: The ``tier`` label of a tier below the CPU tier that gives none (a shared store).
REMOTE_TIER = "remote"

#: ``kind`` label of ``tiering_tier_errors_total`` -> field of `SecondaryStatistics`.
#: Each thing is counted once (see `SecondaryStatistics`): a failed call (timeouts
#: included), a call answered at once while the tier was down or backing off its
#: writes, a call that found every worker busy, a command the store refused, a
#: value read that failed its check, a value the tier had and found gone.
_ERROR_KINDS = (
    ("failed", "errors_total"),
    ("unavailable", "unavailable_total"),
    ("busy", "busy_total"),
    ("refused", "refused_total"),
    ("rejected", "rejected_total"),
    ("lost", "lost_total"),
)

#: ``outcome`` label of ``tiering_jobs_total`` -> field of `DirectionStatistics`.
_OUTCOMES = (
    ("ok", "succeeded"),
    ("failed", "failed"),
    ("cancelled", "cancelled"),
    ("rejected", "no_room"),
)

_INFO_FIELDS = tuple(CPUOffloadingInfo.__struct_fields__)

#: An ASGI application: ``await app(scope, receive, send)``.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class _Policy(Protocol):
    @property
    def name(self) -> str: ...


class _Manager(Protocol):
    @property
    def policy(self) -> _Policy: ...


class _Statistics(Protocol):
    @property
    def manager(self) -> ManagerStatistics: ...

    @property
    def scheduler(self) -> SchedulerStatistics | None:  # None: no transfers seen here
        ...


class MetricsSource(Protocol):
    """What the collector reads: a `TieringEngine`, or anything shaped like one.

    ``statistics()`` is called once per scrape; its result may also carry
    ``events`` (per-sink event counts, or None when events are off) and the
    tiers below the CPU tier: ``tiers`` (`SecondaryTierStatistics` in chain
    order), or only ``secondary`` (one, or None).
    """

    @property
    def engine_id(self) -> str: ...

    @property
    def info(self) -> CPUOffloadingInfo: ...

    @property
    def backend_name(self) -> str: ...

    @property
    def manager(self) -> _Manager: ...

    def statistics(self) -> _Statistics: ...


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("tiering")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a bare tree
        return "unknown"


class MetricsCollector:
    """A prometheus-client collector over one engine's `statistics()`.

    It holds the engine weakly: once the engine is garbage-collected, scrapes
    return nothing. The static facts (``tiering_info``) are read once, here.
    """

    def __init__(self, engine: MetricsSource) -> None:
        self.engine_id = str(engine.engine_id)
        self._engine: Callable[[], MetricsSource | None]
        try:
            self._engine = weakref.ref(engine)
        except TypeError:  # not weakly referable: keep it alive instead
            self._engine = lambda: engine
        info = engine.info
        # A fact not known (None) has no label: never an empty value.
        facts = {name: getattr(info, name) for name in _INFO_FIELDS}
        self._info = {name: str(value) for name, value in facts.items() if value is not None}
        self._info["policy"] = str(engine.manager.policy.name)
        self._info["backend"] = str(engine.backend_name)
        self._info["version"] = _version()
        self._tier_bytes = info.cpu_kv_cache_size_bytes

    def describe(self) -> Iterator[Metric]:
        """The families, without samples (prometheus-client checks names with these)."""
        return iter(_Families(self.engine_id).all())

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return iter(())
        stats = engine.statistics()
        families = _Families(self.engine_id)
        families.add_info(self._info, self._tier_bytes)
        families.add_manager(stats.manager)
        scheduler = stats.scheduler
        if scheduler is not None:  # None on vLLM's scheduler side: its workers move the bytes
            families.add_direction("store", scheduler.stores)
            families.add_direction("load", scheduler.loads)
        families.add_events(getattr(stats, "events", None), stats.manager)
        for tier in _tiers_below(stats):
            families.add_tier(tier)
        return iter(families.all())

    def __repr__(self) -> str:
        alive = "" if self._engine() is not None else " (engine gone)"
        return f"<MetricsCollector engine={self.engine_id!r}{alive}>"


def _tiers_below(stats: object) -> tuple[Any, ...]:
    """The tiers below the CPU tier in a snapshot: its ``tiers``, else its ``secondary``."""
    tiers = tuple(getattr(stats, "tiers", None) or ())
    if tiers:
        return tiers
    secondary = getattr(stats, "secondary", None)
    return () if secondary is None else (secondary,)


class _Families:
    """The metric families of one scrape, filled from one statistics snapshot."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        tier = ("engine", "tier")
        direction = (*tier, "direction")

        def gauge(name: str, doc: str, labels: tuple[str, ...] = tier) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str, labels: tuple[str, ...] = tier) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        self.info = InfoMetricFamily(
            "tiering",
            "Static facts of the tier: CPUOffloadingInfo's fields (those known), policy, "
            "backend, version.",
            labels=tier,
        )
        self.capacity = gauge("tiering_chunks_capacity", "Chunk slots in the tier.")
        self.used = gauge(
            "tiering_chunks_used",
            "Chunks in the tier (CPU: being written or ready; below it: held, where it says).",
        )
        self.writing = gauge("tiering_chunks_writing", "Chunks being written (not readable yet).")
        self.pinned = gauge("tiering_chunks_pinned", "Chunks pinned by loads (never evicted).")
        self.evictable = gauge("tiering_chunks_evictable", "Ready, unpinned chunks.")
        self.ratio = gauge(
            "tiering_occupancy_ratio",
            "Used over capacity, 0 to 1 (CPU: chunks; below it: bytes, where it says).",
        )
        self.tier_bytes = gauge(
            "tiering_tier_bytes",
            "Capacity of the tier in bytes (CPU: host memory; below it: where it says).",
        )
        self.transfer_bytes = counter(
            "tiering_transfer_bytes_total", "Bytes moved by finished jobs.", direction
        )
        self.transfer_seconds = HistogramMetricFamily(
            "tiering_transfer_seconds",
            "Latency of finished jobs that reached the backend, from submission to completion.",
            labels=direction,
        )
        self.jobs = counter(
            "tiering_jobs_total",
            "Jobs ended, by outcome: ok, failed (transfer error), cancelled (before any byte "
            "moved), rejected (a store that found no room).",
            (*direction, "outcome"),
        )
        self.queued = gauge("tiering_jobs_queued", "Jobs waiting in the queue.", direction)
        self.in_flight = gauge(
            "tiering_jobs_in_flight", "Jobs with bytes at the transfer backend.", direction
        )
        self.lookups = counter(
            "tiering_lookups_total",
            "Chunk lookups, by result: hit (ready), pending (being written), miss.",
            (*tier, "result"),
        )
        self.evictions = counter("tiering_evictions_total", "Chunks evicted to make room.")
        self.alloc_failures = counter(
            "tiering_allocation_failures_total",
            "Stores refused because no room could be made (every chunk pinned or writing).",
        )
        self.published = counter(
            "tiering_events_published_total",
            "KV cache events published, by sink.",
            ("engine", "sink"),
        )
        self.dropped = counter(
            "tiering_events_dropped_total",
            "KV cache events a sink dropped (a slow subscriber, a full buffer).",
            ("engine", "sink"),
        )
        self.up = gauge(
            "tiering_tier_up",
            "1 while a tier below the CPU tier is up, 0 while it is down (or closed).",
        )
        self.errors = counter(
            "tiering_tier_errors_total",
            "What a tier below the CPU tier did not serve, by kind: failed (a call failed: "
            "unreachable, timeout, protocol error), unavailable (a call answered at once, "
            "the tier being down or backing off its writes), busy (a call that found every "
            "worker busy), refused (a command the store refused, e.g. OOM), rejected (a "
            "value read that failed its check: never loaded), lost (a value the tier had "
            "and found gone: deleted behind its back).",
            (*tier, "kind"),
        )
        self.hints = HintFamilies()

    def all(self) -> list[Metric]:
        return [
            self.info,
            self.capacity,
            self.used,
            self.writing,
            self.pinned,
            self.evictable,
            self.ratio,
            self.tier_bytes,
            self.transfer_bytes,
            self.transfer_seconds,
            self.jobs,
            self.queued,
            self.in_flight,
            self.lookups,
            self.evictions,
            self.alloc_failures,
            self.published,
            self.dropped,
            self.up,
            self.errors,
            *self.hints.all(),
        ]

    def add_info(self, info: dict[str, str], tier_bytes: int | None) -> None:
        tier = [self.engine_id, TIER]
        self.info.add_metric(tier, info)
        if tier_bytes is not None:
            self.tier_bytes.add_metric(tier, tier_bytes)

    def add_manager(self, m: ManagerStatistics) -> None:
        tier = [self.engine_id, TIER]
        self.capacity.add_metric(tier, m.capacity)
        self.used.add_metric(tier, m.used)
        self.writing.add_metric(tier, m.writing)
        self.pinned.add_metric(tier, m.pinned)
        self.evictable.add_metric(tier, m.evictable)
        self.ratio.add_metric(tier, m.used_ratio)
        self.lookups.add_metric([*tier, "hit"], m.lookups_hit_total)
        self.lookups.add_metric([*tier, "miss"], m.lookups_miss_total)
        self.lookups.add_metric([*tier, "pending"], m.lookups_pending_total)
        self.evictions.add_metric(tier, m.evictions_total)
        self.alloc_failures.add_metric(tier, m.allocation_failures_total)
        self.hints.add(tier, m.hints)

    def add_direction(self, name: str, d: DirectionStatistics) -> None:
        labels = [self.engine_id, TIER, name]
        self.transfer_bytes.add_metric(labels, d.bytes)
        for outcome, field in _OUTCOMES:
            self.jobs.add_metric([*labels, outcome], getattr(d, field))
        self.queued.add_metric(labels, d.queued)
        self.in_flight.add_metric(labels, d.in_flight)
        # The scheduler counts per bucket; Prometheus wants cumulative counts.
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(LATENCY_BUCKETS, d.latency_buckets, strict=False):
            total += count
            buckets.append((repr(float(bound)), total))
        buckets.append(("+Inf", sum(d.latency_buckets)))
        self.transfer_seconds.add_metric(labels, buckets, d.latency_seconds)

    def add_tier(self, below: Any) -> None:
        """A tier below the CPU tier (a `SecondaryTierStatistics`), as ``tier=<label>``.

        Bytes by direction (``store``: written through, ``load``: read back into
        the CPU tier), lookups (``contains`` answers), write-through jobs by
        outcome (``ok``, ``failed``: not written, ``rejected``: dropped, the tier
        being behind) in chunks, promotions as ``load`` outcomes (``ok``: this
        tier's hits as the engine served them), whether it is up, and what it did
        not serve by kind. What it holds only where it says (``capacity_bytes``,
        ``used_bytes``, ``chunks``; evictions where it manages its capacity).
        """
        t = below.tier
        tier = [self.engine_id, str(getattr(below, "label", None) or REMOTE_TIER)]
        store, load = [*tier, "store"], [*tier, "load"]
        self.transfer_bytes.add_metric(store, t.write_bytes_total)
        self.transfer_bytes.add_metric(load, t.read_bytes_total)
        self.lookups.add_metric([*tier, "hit"], t.hits_total)
        self.lookups.add_metric([*tier, "miss"], t.misses_total)
        self.jobs.add_metric([*store, "ok"], below.cascade_written)
        self.jobs.add_metric([*store, "failed"], below.cascade_failed)
        self.jobs.add_metric([*store, "rejected"], below.cascade_dropped)
        self.jobs.add_metric([*load, "ok"], below.promoted)
        self.jobs.add_metric([*load, "failed"], below.promote_failed)
        self.up.add_metric(tier, 1 if t.state == "up" else 0)
        for kind, field in _ERROR_KINDS:
            self.errors.add_metric([*tier, kind], getattr(t, field, 0))
        capacity = getattr(t, "capacity_bytes", None)
        used = getattr(t, "used_bytes", None)
        chunks = getattr(t, "chunks", None)
        evictions = getattr(t, "evictions_total", 0)
        if chunks is not None:
            self.used.add_metric(tier, chunks)
        if capacity is not None:
            self.tier_bytes.add_metric(tier, capacity)
            if used is not None and capacity > 0:
                self.ratio.add_metric(tier, used / capacity)
        if capacity is not None or evictions:  # 0 from a tier that does not say: no sample
            self.evictions.add_metric(tier, evictions)

    def add_events(self, events: Any, manager: ManagerStatistics) -> None:
        if events is None:
            return
        for sink in events.sinks:
            labels = [self.engine_id, str(sink.name)]
            self.published.add_metric(labels, sink.published_total)
            self.dropped.add_metric(labels, sink.dropped_total)
        # Lost before any sink: the manager's bounded queue of events overflowed.
        self.dropped.add_metric([self.engine_id, "manager"], manager.events_dropped_total)


_registries: weakref.WeakKeyDictionary[object, CollectorRegistry] = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def metrics_registry(engine: MetricsSource) -> CollectorRegistry:
    """The engine's own registry, holding its `MetricsCollector` (made on first use).

    The same registry is returned for the same engine object while it lives;
    other engines, including a new one under the same id, get their own.
    """
    with _registries_lock:
        try:
            registry = _registries.get(engine)
        except TypeError:  # not weakly referable (or unhashable): a registry per call
            registry = None
        if registry is None:
            registry = CollectorRegistry()
            registry.register(MetricsCollector(engine))
            with contextlib.suppress(TypeError):
                _registries[engine] = registry
        return registry


def render_metrics(engine: MetricsSource) -> bytes:
    """The engine's metrics in the Prometheus text format (version 0.0.4)."""
    return generate_latest(metrics_registry(engine))


def metrics_app(engine: MetricsSource) -> ASGIApp:
    """An ASGI app serving the engine's metrics, for servers that mount ``/metrics``.

    It collects on the event loop's thread, between the loop's other work.
    """
    return make_asgi_app(registry=metrics_registry(engine))


class MetricsServer(AsyncResource):
    """The HTTP endpoint that `serve_metrics` started: ``host``, ``port``, ``url``.

    `close` stops it (idempotent; it may take up to half a second, the server's
    poll interval); it is a context manager, sync or async (``aclose`` closes in
    a worker thread, so the event loop is never blocked).
    """

    def __init__(self, server: WSGIServer, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._thread = thread
        self._lock = threading.Lock()
        self._life = Lifecycle("the metrics server", opened=True)  # changed under _lock
        self.host = host
        self.port = int(server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    @property
    def closed(self) -> bool:
        return self._life.closed

    def close(self) -> None:
        with self._lock:
            if not self._life.begin_close():
                return
            try:
                self._server.shutdown()
                self._server.server_close()
                self._thread.join()
            finally:
                self._life.end_close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._life.closed else "serving"
        return f"<MetricsServer {self.url} [{state}]>"


def serve_metrics(engine: MetricsSource, host: str = "127.0.0.1", *, port: int) -> MetricsServer:
    """Serve the engine's metrics over HTTP on ``host:port`` (loopback by default).

    ``port=0`` takes any free port; the returned `MetricsServer` tells which.
    The server runs in a daemon thread until `MetricsServer.close`. A port out
    of range, a port in use or a host that cannot be bound raise `ConfigError`.
    """
    if not is_int(port) or not 0 <= port <= 65535:
        raise ConfigError(
            f"metrics port must be an integer from 0 to 65535 (0 for any free port), got {port!r}"
        )
    if not isinstance(host, str) or not host:
        raise ConfigError(f"metrics host must be a host name or address, got {host!r}")
    registry = metrics_registry(engine)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            reason = "the port is in use; choose another port, or 0 for any free one"
        else:
            reason = exc.strerror or str(exc)
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {reason}") from None
    return MetricsServer(server, thread, host)
