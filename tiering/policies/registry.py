"""The policies by name: what ``--policy`` and a config's ``eviction_policy`` choose from."""

from __future__ import annotations

from tiering.errors import ConfigError
from tiering.policies.arc import ARCPolicy
from tiering.policies.aslru import ASLRUPolicy
from tiering.policies.base import CachePolicy
from tiering.policies.dslru import DSLRUPolicy
from tiering.policies.lru import LRUPolicy

__all__ = ["POLICY_NAMES", "create_policy"]

#: Names accepted by `create_policy` (and by ``--policy`` on the command line).
POLICY_NAMES: tuple[str, ...] = ("lru", "arc", "aslru", "dslru")


def create_policy(name: str, capacity: int) -> CachePolicy:
    """A fresh policy called ``name`` for a tier of ``capacity`` chunks."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(capacity)
    if name == "aslru":
        return ASLRUPolicy(capacity)
    if name == "dslru":
        return DSLRUPolicy(capacity)
    raise ConfigError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
