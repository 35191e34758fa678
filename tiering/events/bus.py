"""The in-process fan-out of KV event batches, and the statistics of every sink.

The engine hands each step's batch to `EventBus.publish`, on its event loop.
The bus numbers it (``seq`` from 0), copies it into the bounded buffer of
every `EventSubscription` and passes it to its sinks (the ZMQ publisher).

Design note: a subscriber must never slow the engine, so ``publish`` never
waits. When a subscription's buffer is full the *oldest* batch is dropped, not
the new one: a consumer that falls behind wants the freshest state of the tier,
and the loss shows up in its stream as a `Gap` before the next batch it gets.
anyio's memory streams drop or refuse the newest item instead, so a
subscription is a deque plus an `anyio.Event` that is created only while its
consumer waits.

Statistics count events (not batches) per sink. The in-process subscriptions
together are the sink ``"subscribers"``: an event copied to two of them counts
twice, and its counts include subscriptions already closed, so they only grow.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from typing import Protocol

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import AsyncResource

from tiering._checks import is_int
from tiering._closing import AsyncLifecycle
from tiering._exports import RESOURCE_STATE, deprecations
from tiering._state import Lifecycle, ResourceState
from tiering.errors import ConfigError
from tiering.events.schema import EventItem, Gap, KVEventBatch, SequencedBatch

__all__ = [
    "EventBus",
    "EventSink",
    "EventStatistics",
    "EventSubscription",
    "SinkStatistics",
]


class SinkStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Events one sink has passed on, and events it dropped, since it was created."""

    name: str
    published_total: int
    dropped_total: int


class EventStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Events and batches published to the bus, and each sink's counts."""

    events_total: int
    batches_total: int
    sinks: tuple[SinkStatistics, ...]


class EventSink(Protocol):
    """Somewhere batches go besides the in-process subscriptions (the ZMQ publisher)."""

    def publish(self, batch: KVEventBatch) -> None:
        """Take ``batch``; never block and never raise because a consumer is slow."""

    def statistics(self) -> SinkStatistics:
        """The sink's counts."""

    def close(self) -> None:
        """Flush within a bounded time and release everything; idempotent. May block."""


class EventSubscription(AsyncResource):
    """A bounded view of the bus: ``async for item in subscription`` yields `EventItem`.

    Items are `SequencedBatch` in sequence order, and a `Gap` before a batch
    when older ones were dropped because the buffer was full. Iteration ends
    when the subscription is closed (at once) or the bus is closed (after the
    buffered batches). Use it from the event loop that publishes to the bus.
    """

    def __init__(self, bus: EventBus, max_batches: int, next_seq: int) -> None:
        self._bus = bus
        self._max = max_batches
        self._buffer: deque[tuple[int, KVEventBatch]] = deque()
        self._next_seq = next_seq
        self._wakeup: anyio.Event | None = None
        self._life = Lifecycle("the subscription", opened=True)  # closed by the consumer: stop now
        self._ended = False  # by the bus: stop once the buffer is empty
        self._dropped_batches = 0
        self._dropped_events = 0

    def _push(self, seq: int, batch: KVEventBatch) -> int:
        """Buffer ``batch``; return the number of events dropped to make room."""
        buffer = self._buffer
        dropped = 0
        if len(buffer) >= self._max:
            _, oldest = buffer.popleft()
            dropped = len(oldest.events)
            self._dropped_batches += 1
            self._dropped_events += dropped
        buffer.append((seq, batch))
        if self._wakeup is not None:
            self._wakeup.set()
        return dropped

    def _end(self) -> None:
        self._ended = True
        if self._wakeup is not None:
            self._wakeup.set()

    @property
    def pending(self) -> int:
        """Batches buffered, not yet read."""
        return len(self._buffer)

    @property
    def dropped_batches(self) -> int:
        """Batches dropped unread because the buffer was full."""
        return self._dropped_batches

    @property
    def dropped_events(self) -> int:
        """Events in those batches."""
        return self._dropped_events

    def __aiter__(self) -> EventSubscription:
        return self

    async def __anext__(self) -> EventItem:
        if self._buffer:  # a checkpoint even with batches at hand (trio's rule)
            await anyio.lowlevel.checkpoint()
        while not self._buffer:
            if self._life.closed or self._ended:
                raise StopAsyncIteration
            self._wakeup = anyio.Event()
            try:
                await self._wakeup.wait()
            finally:
                self._wakeup = None
        if self._life.closed:
            raise StopAsyncIteration
        seq, batch = self._buffer[0]
        if seq > self._next_seq:
            gap = Gap(self._next_seq, seq - 1)
            self._next_seq = seq
            return gap
        self._buffer.popleft()
        self._next_seq = seq + 1
        return SequencedBatch(seq, batch)

    async def aclose(self) -> None:
        """Stop now: unread batches are discarded and iteration ends. Idempotent."""
        if self._life.close_now():
            self._buffer.clear()
            self._bus._detach(self)
            if self._wakeup is not None:
                self._wakeup.set()
        await anyio.lowlevel.checkpoint()  # closed whatever the cancellation

    def __repr__(self) -> str:
        state = "closed" if self._life.closed else "ended" if self._ended else "open"
        return (
            f"<EventSubscription [{state}; {len(self._buffer)}/{self._max} batches buffered, "
            f"{self._dropped_batches} dropped]>"
        )


class EventBus(AsyncResource):
    """Numbers KV event batches and fans them out to subscriptions and sinks.

    ``publish`` is synchronous, never waits and never raises because a
    consumer is slow; call it from the event loop that runs the subscribers.
    The bus owns its ``sinks``: `aclose` closes them (in a worker thread, as
    closing may block for a bounded time). Also an async context manager.
    """

    def __init__(self, sinks: Iterable[EventSink] = ()) -> None:
        self._sinks = tuple(sinks)
        # Weak: a subscription its reader dropped without closing stops
        # buffering (and costing every publish) as soon as it is collected.
        self._subscriptions: weakref.WeakSet[EventSubscription] = weakref.WeakSet()
        self._life = AsyncLifecycle("the event bus", opened=True)
        self._seq = 0
        self._events = 0
        self._subscriber_published = 0
        self._subscriber_dropped = 0

    @property
    def state(self) -> ResourceState:
        return self._life.state

    @property
    def subscribers(self) -> int:
        """Subscriptions open now (closed and dropped ones are not counted)."""
        return len(self._subscriptions)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._seq

    def subscribe(self, max_batches: int = 1024) -> EventSubscription:
        """A new subscription that sees every batch published from now on.

        It buffers at most ``max_batches`` batches; past that its oldest are dropped.
        """
        if not is_int(max_batches) or max_batches < 1:
            raise ConfigError(
                f"max_batches must be an integer >= 1 (batches a subscription buffers), "
                f"got {max_batches!r}"
            )
        self._life.check_open("cannot subscribe")
        subscription = EventSubscription(self, max_batches, self._seq)
        self._subscriptions.add(subscription)
        return subscription

    def _detach(self, subscription: EventSubscription) -> None:
        self._subscriptions.discard(subscription)

    def publish(self, batch: KVEventBatch) -> int:
        """Number ``batch``, hand it to every subscription and sink, and return its ``seq``."""
        self._life.check_open("cannot publish")
        seq = self._seq
        self._seq = seq + 1
        n = len(batch.events)
        self._events += n
        subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            self._subscriber_dropped += subscription._push(seq, batch)
        self._subscriber_published += n * len(subscriptions)
        for sink in self._sinks:
            sink.publish(batch)
        return seq

    def statistics(self) -> EventStatistics:
        """Counts since the bus was created."""
        subscribers = SinkStatistics(
            name="subscribers",
            published_total=self._subscriber_published,
            dropped_total=self._subscriber_dropped,
        )
        return EventStatistics(
            events_total=self._events,
            batches_total=self._seq,
            sinks=(subscribers, *(sink.statistics() for sink in self._sinks)),
        )

    async def aclose(self) -> None:
        """End every subscription (after its buffered batches) and close the sinks.

        Idempotent; always a checkpoint, and closed even when cancelled.
        """
        if not await self._life.begin_aclose():
            return
        for subscription in list(self._subscriptions):
            subscription._end()
        self._subscriptions.clear()
        try:
            # Shielded: closing is bounded, and a sink left open would leak its thread.
            with anyio.CancelScope(shield=True):
                for sink in self._sinks:
                    await anyio.to_thread.run_sync(sink.close)
        finally:
            self._life.end_close()
        await anyio.lowlevel.checkpoint()  # a cancellation point, once closed

    def __repr__(self) -> str:
        return (
            f"<EventBus [{self._life.state.value}; {self._seq} batches, {self._events} events, "
            f"{len(self._subscriptions)} subscriptions, {len(self._sinks)} sinks, "
            f"{self._subscriber_dropped} events dropped by subscribers]>"
        )


__getattr__ = deprecations(__name__, {"BusState": RESOURCE_STATE})
