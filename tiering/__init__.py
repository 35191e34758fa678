"""tiering: an async, event-driven KV-cache tiering engine for LLM inference servers.

The public surface is re-exported here. Importing `tiering` is light: it does
not import torch, anyio or any optional extra. The engine, the scheduler and
the data plane are re-exported lazily: their modules (and torch) load when one
of their names is first used.
"""

from __future__ import annotations

import typing as _typing

from tiering._exports import load as _load
from tiering._state import ResourceState
from tiering._types import (
    Medium,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tiering._types import TransferDirection as TransferDirection  # JobKind's one name
from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
    load_config,
)
from tiering.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from tiering.cpu.manager import (
    AllChunksCleared,
    ChunkEvent,
    ChunksRemoved,
    ChunksStored,
    CPUOffloadingManager,
    LookupResult,
    ManagerStatistics,
    PrepareStoreOutput,
)
from tiering.errors import (
    CapacityError,
    ChunkStateError,
    ConfigError,
    CopyFailedError,
    InvalidKeyError,
    ResourceClosedError,
    SpecError,
    TieringError,
    TransferError,
    UnknownKeyError,
    WorkloadError,
)
from tiering.integrations.vllm.config import build_offloading_config, is_kv_cache_tensor_packed
from tiering.policies import ARCPolicy, CachePolicy, LRUPolicy, create_policy
from tiering.simulate import SimulationResult, simulate
from tiering.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec

if _typing.TYPE_CHECKING:
    from tiering.engine import EngineStatistics, PrefixLookup, TieringEngine
    from tiering.scheduler import JobHandle, JobOutcome, JobResult, SchedulerLimits
    from tiering.transfer import (
        HostMemoryPool,
        KVCacheTensor,
        KVLayout,
        TransferBackend,
        TransferResult,
        create_backend,
    )

__version__ = "0.1.0"

#: Names loaded on first use, and the module each comes from.
_LAZY = {
    "TieringEngine": "tiering.engine",
    "EngineStatistics": "tiering.engine",
    "PrefixLookup": "tiering.engine",
    "JobHandle": "tiering.scheduler",
    "JobOutcome": "tiering.scheduler",
    "JobResult": "tiering.scheduler",
    "SchedulerLimits": "tiering.scheduler",
    "HostMemoryPool": "tiering.transfer",
    "KVCacheTensor": "tiering.transfer",
    "KVLayout": "tiering.transfer",
    "TransferBackend": "tiering.transfer",
    "TransferResult": "tiering.transfer",
    "create_backend": "tiering.transfer",
}


#: Names kept from earlier shapes: each warns, naming its replacement.
_DEPRECATED = {"JobKind": ("tiering._types", "TransferDirection", "tiering.TransferDirection")}


def __getattr__(name: str) -> _typing.Any:
    return _load(__name__, globals(), name, _LAZY, deprecated=_DEPRECATED)


__all__ = [
    "ARCPolicy",
    "AllChunksCleared",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CPUOffloadingInfo",
    "CPUOffloadingManager",
    "CachePolicy",
    "CapacityError",
    "ChunkEvent",
    "ChunkStateError",
    "ChunksRemoved",
    "ChunksStored",
    "ConfigError",
    "CopyFailedError",
    "EngineStatistics",
    "GPULoadStoreSpec",
    "HostMemoryPool",
    "InvalidKeyError",
    "JobHandle",
    "JobOutcome",
    "JobResult",
    "KVCacheTensor",
    "KVLayout",
    "LRUPolicy",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStatistics",
    "Medium",
    "OffloadKey",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "PrefixLookup",
    "PrepareStoreOutput",
    "ResourceClosedError",
    "ResourceState",
    "SchedulerLimits",
    "SimulationResult",
    "SpecError",
    "TieringEngine",
    "TieringError",
    "TransferBackend",
    "TransferDirection",
    "TransferError",
    "TransferResult",
    "UnknownKeyError",
    "WorkloadError",
    "build_offloading_config",
    "create_backend",
    "create_policy",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "is_kv_cache_tensor_packed",
    "load_config",
    "make_offload_key",
    "simulate",
]
