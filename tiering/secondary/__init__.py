"""Secondary tiers: stores below the CPU tier (a local disk, in-process, or shared on Redis).

The contract is `SecondaryTier`; values are namespaced and self-checking
(`ChunkCodec`, `RemoteNamespace`; with an `AuthKey`, writable only by its
holders). `DiskTier` is the persistent disk tier;
`MemoryTier` is the in-process twin used by tests. `TierChain` joins a CPU tier to
the tiers below it in order: a `SecondaryCascade` writes landed stores through to
each, and promotion brings chunks back from the first that has them. The Redis tier
lives in `tiering.secondary.redis` and is imported only where it is used (it needs
the ``redis`` extra).
"""

from __future__ import annotations

from tiering.secondary.auth import AuthKey
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
from tiering.secondary.chain import TierChain
from tiering.secondary.codec import ChunkCodec, RemoteNamespace, Verdict, writable_row
from tiering.secondary.disk import DiskTier
from tiering.secondary.health import HealthGate, TierState
from tiering.secondary.memory import MemoryStore, MemoryTier

__all__ = [
    "AuthKey",
    "CascadeLimits",
    "ChunkCodec",
    "DiskTier",
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
    "TierChain",
    "TierState",
    "Verdict",
    "WriteItem",
    "writable_row",
]
