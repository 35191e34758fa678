"""EventBus and its subscriptions, on asyncio and trio."""

from __future__ import annotations

import gc

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from tiering._state import ResourceState
from tiering.errors import ConfigError, ResourceClosedError
from tiering.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventBus,
    EventItem,
    EventStatistics,
    EventSubscription,
    Gap,
    KVEventBatch,
    SequencedBatch,
    SinkStatistics,
)

from ..conftest import turns_during

pytestmark = pytest.mark.anyio


def batch(i: int, n: int = 1) -> KVEventBatch:
    return KVEventBatch(
        ts=float(i), events=[BlockRemoved(block_hashes=[i], medium="CPU") for _ in range(n)]
    )


async def take(subscription: EventSubscription, n: int) -> list[EventItem]:
    return [await anext(subscription) for _ in range(n)]


class RecordingSink:
    """A sink that keeps what it gets."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.closed = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def statistics(self) -> SinkStatistics:
        events = sum(len(b.events) for b in self.batches)
        return SinkStatistics(name="recording", published_total=events, dropped_total=0)

    def close(self) -> None:
        self.closed += 1


async def test_every_subscription_gets_every_batch_in_order() -> None:
    async with EventBus() as bus:
        a, b = bus.subscribe(), bus.subscribe()
        assert [bus.publish(batch(i)) for i in range(5)] == [0, 1, 2, 3, 4]
        late = bus.subscribe()
        bus.publish(batch(5))
        expected = [SequencedBatch(i, batch(i)) for i in range(6)]
        assert await take(a, 6) == expected
        assert await take(b, 6) == expected
        assert await take(late, 1) == [SequencedBatch(5, batch(5))]
        assert bus.next_seq == 6


async def test_a_waiting_subscriber_wakes_on_publish() -> None:
    got: list[EventItem] = []
    async with EventBus() as bus:
        subscription = bus.subscribe()

        async def consume() -> None:
            async for item in subscription:
                got.append(item)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await wait_all_tasks_blocked()
            bus.publish(batch(0))
            await wait_all_tasks_blocked()
            assert got == [SequencedBatch(0, batch(0))]
            await subscription.aclose()
    assert got == [SequencedBatch(0, batch(0))]


async def test_a_slow_subscriber_loses_its_oldest_batches_counted_as_a_gap() -> None:
    async with EventBus() as bus:
        slow, fast = bus.subscribe(max_batches=2), bus.subscribe(max_batches=100)
        for i in range(5):
            bus.publish(batch(i, n=3))
        assert slow.pending == 2
        assert (slow.dropped_batches, slow.dropped_events) == (3, 9)
        assert await take(slow, 3) == [
            Gap(0, 2),
            SequencedBatch(3, batch(3, n=3)),
            SequencedBatch(4, batch(4, n=3)),
        ]
        assert await take(fast, 5) == [SequencedBatch(i, batch(i, n=3)) for i in range(5)]
        assert fast.dropped_batches == 0
        assert bus.statistics() == EventStatistics(
            events_total=15,
            batches_total=5,
            sinks=(SinkStatistics(name="subscribers", published_total=30, dropped_total=9),),
        )
        assert "9 events dropped" in repr(bus)
        assert "3 dropped" in repr(slow)


async def test_closing_the_bus_ends_iteration_after_the_buffered_batches() -> None:
    sink = RecordingSink()
    bus = EventBus(sinks=[sink])
    subscription = bus.subscribe()
    waiting = bus.subscribe()
    ended: list[EventItem] = []

    async def wait_for_end() -> None:
        await take(waiting, 1)
        async for item in waiting:
            ended.append(item)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_end)
        bus.publish(batch(0))
        await wait_all_tasks_blocked()
        bus.publish(batch(1, n=2))
        await bus.aclose()
    assert ended == [SequencedBatch(1, batch(1, n=2))]
    assert [item async for item in subscription] == [
        SequencedBatch(0, batch(0)),
        SequencedBatch(1, batch(1, n=2)),
    ]
    assert bus.state is ResourceState.CLOSED
    await bus.aclose()
    assert sink.closed == 1
    assert sink.batches == [batch(0), batch(1, n=2)]
    assert bus.statistics().sinks[1] == SinkStatistics(
        name="recording", published_total=3, dropped_total=0
    )
    with pytest.raises(ResourceClosedError, match="closed"):
        bus.publish(batch(2))
    with pytest.raises(ResourceClosedError, match="closed"):
        bus.subscribe()


async def test_closing_a_subscription_stops_it_at_once() -> None:
    async with EventBus() as bus:
        async with bus.subscribe() as subscription:
            bus.publish(batch(0))
            bus.publish(batch(1))
            assert await take(subscription, 1) == [SequencedBatch(0, batch(0))]
        assert [item async for item in subscription] == []
        assert "closed" in repr(subscription)
        bus.publish(batch(2))  # a closed subscription no longer buffers
        assert subscription.pending == 0
        assert bus.statistics().sinks[0].published_total == 2


async def test_a_subscription_dropped_unclosed_stops_costing_the_bus() -> None:
    async with EventBus() as bus:
        kept = bus.subscribe()
        dropped = bus.subscribe()
        assert bus.subscribers == 2
        del dropped  # its reader forgot it, never closing it
        gc.collect()
        assert bus.subscribers == 1
        bus.publish(batch(0))
        assert bus.statistics().sinks[0].published_total == 1  # delivered to one, not two
        assert await take(kept, 1) == [SequencedBatch(0, batch(0))]
        await kept.aclose()
        assert bus.subscribers == 0


async def test_cancelled_waits_lose_nothing() -> None:
    async with EventBus() as bus:
        subscription = bus.subscribe()
        with anyio.move_on_after(0.01):
            await anext(subscription)
        bus.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        assert await take(subscription, 1) == [
            SequencedBatch(0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        ]


def test_bad_subscription_size_is_a_config_error() -> None:
    bus = EventBus()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"max_batches must be an integer >= 1.*got"):
            bus.subscribe(max_batches=bad)  # type: ignore[arg-type]


async def test_sinks_are_closed_even_when_closing_is_cancelled() -> None:
    sink = RecordingSink()
    bus = EventBus(sinks=[sink])
    with anyio.CancelScope() as scope:
        scope.cancel()
        await bus.aclose()
    assert sink.closed == 1
    assert bus.state is ResourceState.CLOSED


@pytest.mark.parametrize("with_sink", [False, True])
async def test_closing_a_bus_is_a_checkpoint(with_sink: bool) -> None:
    """Trio's rule: each first close yields, even of a bus with nothing to close."""
    calls = 40
    buses = [EventBus(sinks=[RecordingSink()] if with_sink else []) for _ in range(calls)]
    closing = iter(buses)
    counted = await turns_during(lambda: next(closing).aclose(), calls)
    assert all(bus.state is ResourceState.CLOSED for bus in buses)
    # One turn per close on asyncio, at least one per two on trio (random order); none
    # without a checkpoint.
    assert counted >= calls // 2, f"the counting task got {counted} turns in {calls} closes"


async def test_a_bus_without_sinks_is_closed_even_when_closing_is_cancelled() -> None:
    bus = EventBus()
    subscription = bus.subscribe()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await bus.aclose()
    assert scope.cancelled_caught  # a cancellation point, after the close
    assert bus.state is ResourceState.CLOSED
    assert [item async for item in subscription] == []
