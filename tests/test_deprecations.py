"""Names kept from earlier shapes: each still works, and warns naming its replacement."""

from __future__ import annotations

import importlib

import pytest

import tiering
from tiering._state import ResourceState
from tiering._types import TransferDirection
from tiering.engine import TieringEngine
from tiering.secondary import MemoryTier
from tiering.transfer import KVLayout

from .test_engine import config, kv_caches


@pytest.mark.parametrize(
    ("module", "name", "replacement", "new"),
    [
        ("tiering", "JobKind", "tiering.TransferDirection", TransferDirection),
        ("tiering.scheduler", "JobKind", "tiering.TransferDirection", TransferDirection),
        ("tiering.events.bus", "BusState", "tiering.ResourceState", ResourceState),
        ("tiering.events.publisher", "PublisherState", "tiering.ResourceState", ResourceState),
        ("tiering.events.subscriber", "SubscriberState", "tiering.ResourceState", ResourceState),
        ("tiering.transfer", "BackendState", "tiering.ResourceState", ResourceState),
        ("tiering.transfer.base", "BackendState", "tiering.ResourceState", ResourceState),
    ],
)
def test_an_alias_warns_and_is_the_one_name(
    module: str, name: str, replacement: str, new: object
) -> None:
    with pytest.warns(
        DeprecationWarning, match=f"{module}.{name} is deprecated; use {replacement}"
    ):
        old = getattr(importlib.import_module(module), name)
    assert old is new


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'JobKinds'"):
        tiering.JobKinds  # noqa: B018 - the attribute access is the test


def test_kv_cache_tensors_warns_and_still_lists_the_layouts_tensors() -> None:
    import tiering.engine

    with pytest.warns(DeprecationWarning, match=r"KVLayout\.from_kv_caches"):
        kv_cache_tensors = tiering.engine.kv_cache_tensors
    kv = kv_caches()
    assert kv_cache_tensors(config(), kv) == list(KVLayout.from_kv_caches(config(), kv).tensors)


@pytest.mark.anyio
async def test_engine_secondary_warns_and_is_the_first_tier(anyio_backend: str) -> None:
    bare = TieringEngine(config(), kv_caches(), cpu_bytes=1 << 20, backend="mock")
    with pytest.warns(DeprecationWarning, match=r"use engine\.tiers\[0\]"):
        assert bare.secondary is None
    engine = TieringEngine(
        config(), kv_caches(), cpu_bytes=1 << 20, backend="mock", secondary=MemoryTier
    )
    async with engine:
        with pytest.warns(DeprecationWarning, match=r"use engine\.tiers\[0\]"):
            assert engine.secondary is engine.tiers[0]
