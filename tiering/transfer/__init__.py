"""The data plane: host memory, the KV layout, and the transfer backends.

Backends are loaded lazily by name (`registry`: `get_backend_class`, `create_backend`), so
importing this package never imports the CUDA backend nor initializes CUDA::

    layout = KVLayout([KVCacheTensor(t, num_blocks=n, page_bytes=p)], blocks_per_chunk=4)
    pool = HostMemoryPool(layout.pool_bytes(num_chunks))
    backend = create_backend(default_backend_name(layout), layout, pool)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiering._exports import RESOURCE_STATE, load
from tiering.transfer.base import (
    BackendStatistics,
    CompletionCallback,
    DirectionStatistics,
    TransferBackend,
    TransferResult,
)
from tiering.transfer.layout import (
    GroupPlan,
    KVCacheTensor,
    KVLayout,
    TransferDirection,
    TransferPlan,
)
from tiering.transfer.memory import HostMemoryPool, PoolStatistics, available_host_bytes
from tiering.transfer.registry import (
    BACKEND_NAMES,
    create_backend,
    default_backend_name,
    get_backend_class,
)

if TYPE_CHECKING:
    from tiering.transfer.cpu import CpuBackend
    from tiering.transfer.cuda import CudaBackend
    from tiering.transfer.mock import MockBackend, MockJob

__all__ = [
    "BACKEND_NAMES",
    "BackendStatistics",
    "CompletionCallback",
    "CpuBackend",
    "CudaBackend",
    "DirectionStatistics",
    "GroupPlan",
    "HostMemoryPool",
    "KVCacheTensor",
    "KVLayout",
    "MockBackend",
    "MockJob",
    "PoolStatistics",
    "TransferBackend",
    "TransferDirection",
    "TransferPlan",
    "TransferResult",
    "available_host_bytes",
    "create_backend",
    "default_backend_name",
    "get_backend_class",
]

#: Backend classes, importable from here but imported only on first use.
_LAZY = {
    "CpuBackend": "tiering.transfer.cpu",
    "CudaBackend": "tiering.transfer.cuda",
    "MockBackend": "tiering.transfer.mock",
    "MockJob": "tiering.transfer.mock",
}

#: Names kept from earlier shapes: each warns, naming its replacement.
_DEPRECATED = {"BackendState": RESOURCE_STATE}


def __getattr__(name: str) -> Any:
    return load(__name__, globals(), name, _LAZY, deprecated=_DEPRECATED)
