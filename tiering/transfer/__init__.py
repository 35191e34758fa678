"""The data plane: host memory, the KV layout, and the transfer backends.

Backends are loaded lazily by name (`get_backend_class`, `create_backend`), so
importing this package never imports the CUDA backend nor initializes CUDA::

    layout = KVLayout([KVCacheTensor(t, num_blocks=n, page_bytes=p)], blocks_per_chunk=4)
    pool = HostMemoryPool(layout.pool_bytes(num_chunks))
    backend = create_backend(default_backend_name(layout), layout, pool)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiering.errors import ConfigError
from tiering.transfer.base import (
    BackendState,
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

if TYPE_CHECKING:
    from tiering.transfer.cpu import CpuBackend
    from tiering.transfer.cuda import CudaBackend
    from tiering.transfer.mock import MockBackend, MockJob

__all__ = [
    "BACKEND_NAMES",
    "BackendState",
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

_BACKENDS = {
    "cpu": ("tiering.transfer.cpu", "CpuBackend"),
    "cuda": ("tiering.transfer.cuda", "CudaBackend"),
    "mock": ("tiering.transfer.mock", "MockBackend"),
}

#: Backend classes, importable from here but imported only on first use.
_LAZY = {
    "CpuBackend": "tiering.transfer.cpu",
    "CudaBackend": "tiering.transfer.cuda",
    "MockBackend": "tiering.transfer.mock",
    "MockJob": "tiering.transfer.mock",
}

#: The names `get_backend_class` knows.
BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)


def get_backend_class(name: str) -> type[TransferBackend]:
    """The backend class called ``name`` (``"cpu"``, ``"cuda"`` or ``"mock"``), imported now."""
    try:
        module_name, class_name = _BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown transfer backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        ) from None
    cls: type[TransferBackend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def create_backend(
    name: str, layout: KVLayout, pool: HostMemoryPool, **kwargs: Any
) -> TransferBackend:
    """Build backend ``name`` over ``layout`` and ``pool``; ``kwargs`` go to its constructor."""
    backend: TransferBackend = get_backend_class(name)(layout, pool, **kwargs)  # type: ignore[call-arg]
    return backend


def default_backend_name(layout: KVLayout) -> str:
    """``"cuda"`` when the registered KV tensors are on a CUDA device, else ``"cpu"``."""
    return "cuda" if layout.device.type == "cuda" else "cpu"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
