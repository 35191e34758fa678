"""The module path `tiering.integrations.vllm.link` had before it was named for what it is
(a link to the secondary tier, not a second cascade): its names still load from here, and
warn `DeprecationWarning` naming their new module."""

from __future__ import annotations

from typing import Any

from tiering._exports import Deprecated, load

__all__: list[str] = []  # nothing new is to be imported from here

_DEPRECATED: dict[str, Deprecated] = {
    name: ("tiering.integrations.vllm.link", name, f"tiering.integrations.vllm.link.{name}")
    for name in ("CascadeMetrics", "SecondaryLink")
}


def __getattr__(name: str) -> Any:
    return load(__name__, globals(), name, deprecated=_DEPRECATED)
