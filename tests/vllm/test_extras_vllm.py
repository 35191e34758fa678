"""vLLM with a Redis tier configured and redis-py not installed: one `ConfigError` when
vLLM builds the spec or the tier, naming the extra; never an ``ImportError`` per step.

redis-py is made unimportable in this process (``sys.modules``, restored after each
test), as on a vLLM server where ``tiering`` was installed without its ``redis`` extra.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tiering.errors import ConfigError

from ..test_extras import without
from .harness import build_engine, tiering_extra, write_model

ENTRY = {
    "type": "RedisSecondaryTier",
    "module_path": "tiering.integrations.vllm",
    "url": "redis://127.0.0.1:1/0",  # never reached: refused before any connection
}
NEEDS = "needs redis-py, an optional part: pip install 'tiering[redis]'"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def test_tieringspec_with_a_redis_entry_is_refused_when_vllm_builds_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without(monkeypatch, "redis")
    entry = {**ENTRY, "namespace": f"test-{uuid.uuid4().hex}"}
    with pytest.raises(ConfigError) as caught:
        build_engine(model, tiering_extra(32 << 20, secondary_tiers=[entry]))
    assert str(caught.value) == f"secondary tier 'RedisSecondaryTier': the Redis tier {NEEDS}"


def test_the_redis_tier_under_vllms_own_spec_is_refused_when_its_factory_builds_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    without(monkeypatch, "redis")
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 32 << 20,
        "secondary_tiers": [{**ENTRY, "namespace": f"test-{uuid.uuid4().hex}"}],
    }
    # vLLM's SecondaryTierFactory builds the tier with the scheduler: the error is there,
    # at start, and the server does not come up with a tier shown "up" that fails each call.
    with pytest.raises(ConfigError) as caught:
        build_engine(model, extra)
    assert str(caught.value) == f"secondary tier 'RedisSecondaryTier': the Redis tier {NEEDS}"
