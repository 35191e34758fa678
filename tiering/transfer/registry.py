"""The transfer backends by name: which class each name loads, and building one.

A backend's module is imported only when its class is asked for, so that
naming the backends never imports the CUDA one nor initializes CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiering.errors import ConfigError
from tiering.transfer.base import TransferBackend
from tiering.transfer.layout import KVLayout
from tiering.transfer.memory import HostMemoryPool

__all__ = ["BACKEND_NAMES", "create_backend", "default_backend_name", "get_backend_class"]

_BACKENDS = {
    "cpu": ("tiering.transfer.cpu", "CpuBackend"),
    "cuda": ("tiering.transfer.cuda", "CudaBackend"),
    "mock": ("tiering.transfer.mock", "MockBackend"),
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
