"""Secondary tiers: stores below the CPU tier (in-process, or shared on Redis).

The contract is `SecondaryTier`; values are namespaced and self-checking
(`ChunkCodec`, `RemoteNamespace`). `MemoryTier` is the in-process twin used by
tests. `SecondaryCascade` joins a CPU tier to one: it writes landed stores through and
promotes chunks back. The Redis tier lives in `tiering.secondary.redis` and is imported only
where it is used (it needs the ``redis`` extra).
"""

from __future__ import annotations

from tiering.secondary.base import (
    Locality,
    ReadItem,
    SecondaryStatistics,
    SecondaryTier,
    WriteItem,
)
from tiering.secondary.cascade import (
    CascadeLimits,
    Promotion,
    SecondaryCascade,
    SecondaryTierStatistics,
)
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, Verdict, writable_row
from tiering.secondary.health import HealthGate, TierState
from tiering.secondary.memory import MemoryStore, MemoryTier

__all__ = [
    "CascadeLimits",
    "ChunkCodec",
    "HealthGate",
    "Locality",
    "MemoryStore",
    "MemoryTier",
    "Promotion",
    "ReadItem",
    "RemoteNamespace",
    "SecondaryCascade",
    "SecondaryStatistics",
    "SecondaryTier",
    "SecondaryTierStatistics",
    "TierState",
    "Verdict",
    "WriteItem",
    "writable_row",
]
