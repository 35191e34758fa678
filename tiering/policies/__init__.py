"""Cache policies: the eviction order of a tier, behind the `CachePolicy` contract."""

from __future__ import annotations

from tiering.config import DEFAULT_POLICY
from tiering.policies.arc import ARCPolicy
from tiering.policies.aslru import ASLRUPolicy
from tiering.policies.base import CachePolicy, PolicyStatistics
from tiering.policies.dslru import DSLRUPolicy
from tiering.policies.lru import LRUPolicy
from tiering.policies.registry import POLICY_NAMES, create_policy

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
