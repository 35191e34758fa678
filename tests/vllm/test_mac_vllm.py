"""A vLLM ``secondary_tiers`` entry with ``auth_key_file`` (or ``$TIERING_AUTH_KEY``): the
tier writes keyed values and loads only those, in vLLM 0.33's own spec, on a real server."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")


from tiering.errors import ConfigError
from tiering.integrations.vllm.redis_tier import RedisSecondaryTier
from tiering.secondary.auth import AuthKey, MacKind
from tiering.secondary.codec import KEYED_VERSION, ChunkCodec

from ..secondary import conftest as secondary
from .harness import build_engine, write_model
from .test_redis_tier import finished, job

redis_server = secondary.redis_server
CHUNK = 16 << 10  # one 16-token block of the harness's model
SECRET = "a secret every engine of the store shares"
KEY = b"\x07" * 32 + b"\x00\x00\x00\x00"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def extra(**keys: Any) -> dict[str, Any]:
    tier = {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "namespace": f"test-{uuid.uuid4().hex}",
        **keys,
    }
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 16 * CHUNK,
        "secondary_tiers": [tier],
    }


@pytest.mark.parametrize("how", ["auth_key_file", "env"])
def test_a_keyed_entry_stores_keyed_values_and_loads_only_those(
    model: Path, redis_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    keys: dict[str, Any] = {"url": redis_server.url}
    if how == "env":
        monkeypatch.setenv("TIERING_AUTH_KEY", SECRET)
    else:
        path = tmp_path / "key"
        path.write_text(SECRET + "\n")
        path.chmod(0o600)
        keys["auth_key_file"] = str(path)
    engine = build_engine(model, extra(**keys))
    try:
        tier = engine.manager.secondary_tiers[0]
        assert isinstance(tier, RedisSecondaryTier)
        assert SECRET not in repr(tier)
        view = engine.manager.primary_tier.get_kv_memoryview().cast("B")
        rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, CHUNK)
        rows[4] = np.arange(CHUNK, dtype=np.uint8)
        tier.submit_store(job(1, [KEY], [4]))
        assert finished(tier)[0].success
        raw = redis_server.client()
        codec = ChunkCodec(tier.namespace)
        stored = raw.get(codec.remote_key(KEY))
        assert stored[4:6] == bytes([KEYED_VERSION, MacKind.AES_GMAC])  # the auth extra's
        rows[5] = 0
        tier.submit_load(job(2, [KEY], [5], promotion=True))
        assert finished(tier)[0].success
        assert rows[5].tobytes() == rows[4].tobytes()
        # A value forged with the public namespace, under the same key: not loaded.
        raw.set(codec.remote_key(KEY), codec.encode(KEY, np.full(CHUNK, 0x66, np.uint8)))
        tier.submit_load(job(3, [KEY], [6], promotion=True))
        (result,) = finished(tier)
        assert not result.success
        assert tier.statistics().redis.rejected_by_reason == {"unauthenticated": 1}
    finally:
        engine.manager.shutdown()


def test_a_bad_auth_key_file_is_one_error_naming_the_key(tmp_path: Path) -> None:
    entry = extra(url="redis://127.0.0.1:6390/0", auth_key_file=str(tmp_path / "missing"))
    tier = entry["secondary_tiers"][0]
    with pytest.raises(ConfigError) as caught:
        RedisSecondaryTier.check_entry("RedisSecondaryTier", tier)
    message = str(caught.value)
    assert "'auth_key_file'" in message
    assert "does not exist" in message
    assert "RedisSecondaryTier" in message
    assert AuthKey.from_env({}) is None


def test_a_bad_key_in_the_environment_is_named_as_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERING_AUTH_KEY", "short")
    tier = extra(url="redis://127.0.0.1:6390/0")["secondary_tiers"][0]
    with pytest.raises(ConfigError) as caught:
        RedisSecondaryTier.check_entry("RedisSecondaryTier", tier)
    message = str(caught.value)
    assert "$TIERING_AUTH_KEY" in message
    assert "auth_key_file" not in message
    assert "short" not in message
