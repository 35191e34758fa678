"""Cache policies: the eviction order of a tier, behind the `CachePolicy` contract."""

from __future__ import annotations

from tiering.config import DEFAULT_POLICY
from tiering.errors import ConfigError
from tiering.policies.arc import ARCPolicy
from tiering.policies.aslru import ASLRUPolicy
from tiering.policies.base import CachePolicy, PolicyStatistics
from tiering.policies.dslru import DSLRUPolicy
from tiering.policies.lru import LRUPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "ARCPolicy",
    "ASLRUPolicy",
    "CachePolicy",
    "DSLRUPolicy",
    "LRUPolicy",
    "PolicyStatistics",
    "create_policy",
]

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
