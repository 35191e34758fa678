"""The built-in synthetic workloads, by name."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from tiering.errors import WorkloadError
from tiering.workload.chat import chat_workload
from tiering.workload.documents import documents_workload
from tiering.workload.trace import Request

__all__ = ["CAPACITY_TOKENS", "WORKLOADS", "WorkloadFactory", "load_workload"]


class WorkloadFactory(Protocol):
    """A built-in workload: ``num_requests`` requests, deterministic for a ``seed``."""

    def __call__(self, num_requests: int = ..., *, seed: int = ...) -> list[Request]: ...


#: The built-in workloads by name (read-only): multi-turn chat over shared system
#: prompts, and short questions over long shared documents.
WORKLOADS: Mapping[str, WorkloadFactory] = MappingProxyType(
    {"chat": chat_workload, "documents": documents_workload}
)

#: Per built-in workload, CPU tier capacities in tokens from a small part of its
#: reuse to nearly all of it (the README's table, `bench/policy.py`): hit rates
#: that still rise with capacity. `tiering simulate --workload NAME` uses them.
CAPACITY_TOKENS: Mapping[str, tuple[int, ...]] = MappingProxyType(
    {"chat": (25_600, 102_400, 409_600), "documents": (51_200, 153_600, 512_000, 1_536_000)}
)


def load_workload(name: str, num_requests: int | None = None, *, seed: int = 0) -> list[Request]:
    """The built-in workload ``name`` with ``num_requests`` requests (``None``: its default).

    Raises `WorkloadError` for an unknown name (the message lists the known ones)
    or a bad ``num_requests`` or ``seed``.
    """
    factory = WORKLOADS.get(name)
    if factory is None:
        known = ", ".join(repr(known_name) for known_name in sorted(WORKLOADS))
        raise WorkloadError(f"unknown workload {name!r}; known workloads: {known}")
    if num_requests is None:
        return factory(seed=seed)
    return factory(num_requests, seed=seed)
