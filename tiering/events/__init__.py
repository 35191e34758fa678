"""KV cache events: the wire schema, the in-process bus, the ZMQ publisher and its client.

The schema and the settings import only msgspec. The bus (anyio) and the ZMQ
side (pyzmq, the ``events`` extra) load when one of their names is first used, so
importing this package never imports pyzmq.
"""

from __future__ import annotations

import typing as _typing

from tiering._exports import load as _load
from tiering.errors import EventSchemaError
from tiering.events.config import HashFormat, KVEventsConfig
from tiering.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    ChunkBlocks,
    EventItem,
    EventTranslator,
    Gap,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
    SequencedBatch,
    decode_batch,
    encode_batch,
    key_wire_hash,
    wire_hash,
)

if _typing.TYPE_CHECKING:
    from tiering.events.bus import (
        EventBus,
        EventSink,
        EventStatistics,
        EventSubscription,
        SinkStatistics,
    )
    from tiering.events.publisher import ZmqEventPublisher
    from tiering.events.subscriber import SubscriberStatistics, ZmqSubscriber
    from tiering.events.tool import print_events

#: Names loaded on first use, and the module each comes from.
_LAZY = {
    "EventBus": "tiering.events.bus",
    "EventSink": "tiering.events.bus",
    "EventStatistics": "tiering.events.bus",
    "EventSubscription": "tiering.events.bus",
    "SinkStatistics": "tiering.events.bus",
    "ZmqEventPublisher": "tiering.events.publisher",
    "SubscriberStatistics": "tiering.events.subscriber",
    "ZmqSubscriber": "tiering.events.subscriber",
    "print_events": "tiering.events.tool",
}


def __getattr__(name: str) -> _typing.Any:
    return _load(__name__, globals(), name, _LAZY)


__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ChunkBlocks",
    "EventBus",
    "EventItem",
    "EventSchemaError",
    "EventSink",
    "EventStatistics",
    "EventSubscription",
    "EventTranslator",
    "Gap",
    "HashFormat",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "SequencedBatch",
    "SinkStatistics",
    "SubscriberStatistics",
    "ZmqEventPublisher",
    "ZmqSubscriber",
    "decode_batch",
    "encode_batch",
    "key_wire_hash",
    "print_events",
    "wire_hash",
]
