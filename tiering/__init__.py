"""tiering: an async, event-driven KV-cache tiering engine for LLM inference servers.

The public surface is re-exported here. Importing `tiering` is light: it does
not import torch, anyio or any optional extra; the data plane
(`tiering.transfer`) loads torch when it is first used.
"""

from __future__ import annotations

from tiering._types import (
    Medium,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
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
    ResourceClosedError,
    SpecError,
    TieringError,
    TransferError,
    UnknownKeyError,
    WorkloadError,
)
from tiering.integrations.vllm import build_offloading_config, is_kv_cache_tensor_packed
from tiering.policies import ARCPolicy, CachePolicy, LRUPolicy, create_policy
from tiering.simulate import SimulationResult, simulate
from tiering.specs import BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec

__version__ = "0.1.0"

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
    "GPULoadStoreSpec",
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
    "PrepareStoreOutput",
    "ResourceClosedError",
    "SimulationResult",
    "SpecError",
    "TieringError",
    "TransferError",
    "UnknownKeyError",
    "WorkloadError",
    "build_offloading_config",
    "create_policy",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "is_kv_cache_tensor_packed",
    "load_config",
    "make_offload_key",
    "simulate",
]
