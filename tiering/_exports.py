"""A module's ``__getattr__``: names loaded on first use, and old names kept a while (layer 0).

A package that re-exports a heavy module's names (torch, anyio, pyzmq behind
them) lists them in a ``lazy`` table and loads each on first use, so that
importing the package stays light. A name that must go, but is public, stays
for a while in a ``deprecated`` table: using it warns `DeprecationWarning`
naming what replaces it, and returns that. Both are one call::

    def __getattr__(name: str) -> Any:
        return load(__name__, globals(), name, _LAZY, deprecated=_DEPRECATED)

A module with old names only writes ``__getattr__ = deprecations(__name__, {...})``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["RESOURCE_STATE", "Deprecated", "deprecations", "load"]

#: An old name's replacement: ``(module, attribute, what to write instead)``.
Deprecated = tuple[str, str, str]

#: What the old per-class names of the one lifecycle's enum (``BusState``, ...) became.
RESOURCE_STATE: Deprecated = ("tiering._state", "ResourceState", "tiering.ResourceState")


def load(
    module: str,
    namespace: MutableMapping[str, Any],
    name: str,
    lazy: Mapping[str, str] | None = None,
    *,
    deprecated: Mapping[str, Deprecated] | None = None,
) -> Any:
    """``module``'s attribute ``name``: a deprecated name's replacement (warning), or a lazy
    name's value (kept in ``namespace``, so it loads once); else `AttributeError`."""
    if deprecated is not None and name in deprecated:
        source, attribute, instead = deprecated[name]
        warnings.warn(
            f"{module}.{name} is deprecated; use {instead}", DeprecationWarning, stacklevel=3
        )
        return getattr(importlib.import_module(source), attribute)
    source_module = None if lazy is None else lazy.get(name)
    if source_module is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source_module), name)
    namespace[name] = value
    return value


def deprecations(module: str, deprecated: Mapping[str, Deprecated]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562 takes any callable) that keeps only ``deprecated``'s
    old names; mypy does not see them, so no code of the library can use them."""

    def __getattr__(name: str) -> Any:
        return load(module, {}, name, deprecated=deprecated)  # no lazy names: nothing is kept

    return __getattr__
