"""No secret in vLLM's log: a ``secondary_tiers`` entry takes ``url_env`` / ``password_file``.

``vllm serve`` logs its non-default arguments at startup, ``--kv-transfer-config``
whole: an entry whose ``url`` holds a password puts it in the server's log (shown
here with vLLM's own logging), so the entry names an environment variable or a
file instead, and the tier still logs in, on a real server with ``requirepass``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tiering.errors import ConfigError
from tiering.integrations.vllm.redis_tier import RedisSecondaryTier

from ..secondary import conftest as secondary
from .harness import build_engine, write_model

redis_acl_server = secondary.redis_acl_server
CHUNK = 16 << 10  # one 16-token block of the harness's model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def entry(**keys: Any) -> dict[str, Any]:
    return {
        "type": "RedisSecondaryTier",
        "module_path": "tiering.integrations.vllm",
        "namespace": f"test-{uuid.uuid4().hex}",
        "connect_on_start": True,
        **keys,
    }


def extra(tier: dict[str, Any]) -> dict[str, Any]:
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 16 * CHUNK,
        "secondary_tiers": [tier],
    }


@pytest.fixture
def vllm_log() -> Iterator[list[str]]:
    """What vLLM's startup module logs (at INFO, as ``vllm serve`` does)."""
    from vllm.entrypoints.common import startup

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = Keep(), startup.logger.level
    startup.logger.addHandler(handler)
    startup.logger.setLevel(logging.INFO)
    yield lines
    startup.logger.removeHandler(handler)
    startup.logger.setLevel(level)


def serve_args_logged(tier: dict[str, Any], model: Path) -> str:
    """What `vllm serve --kv-transfer-config JSON` logs of its arguments at startup."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.common.startup import log_non_default_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra(tier),
    }
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model), "--kv-transfer-config", json.dumps(config)])
    log_non_default_args(args)
    return repr(args)


def test_vllm_logs_the_entry_whole_and_url_env_keeps_the_secret_out(
    model: Path, vllm_log: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    password = "Vq8-zL3#pW"
    serve_args_logged(entry(url=f"redis://:{password}@127.0.0.1:6379/0"), model)
    assert any(password in line for line in vllm_log)  # why url_env exists
    vllm_log.clear()
    monkeypatch.setenv("MY_REDIS_URL", f"redis://:{password}@127.0.0.1:6379/0")
    path = tmp_path / "password"
    path.write_text(password + "\n")
    shown = serve_args_logged(entry(url_env="MY_REDIS_URL"), model)
    shown += serve_args_logged(
        entry(url="redis://127.0.0.1:6379/0", password_file=str(path)), model
    )
    assert any("MY_REDIS_URL" in line for line in vllm_log)
    assert any("password_file" in line for line in vllm_log)
    assert password not in "\n".join(vllm_log) + shown


@pytest.mark.parametrize("how", ["url_env", "password_file"])
def test_an_entry_with_url_env_or_password_file_logs_in(
    model: Path,
    redis_acl_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    password = secondary.DEFAULT_PASSWORD
    port = redis_acl_server.port
    if how == "url_env":
        monkeypatch.setenv("MY_REDIS_URL", f"redis://:{password}@127.0.0.1:{port}/0")
        tier_entry = entry(url_env="MY_REDIS_URL")
    else:
        path = tmp_path / "password"
        path.write_text(password + "\n")
        tier_entry = entry(url=f"redis://127.0.0.1:{port}/0", password_file=str(path))
    caplog.set_level(logging.DEBUG)
    engine = build_engine(model, extra(tier_entry))
    try:
        tier = engine.manager.secondary_tiers[0]
        assert isinstance(tier, RedisSecondaryTier)
        assert tier.url == f"redis://:***@127.0.0.1:{port}/0"
        assert tier.statistics().redis.state == "up"  # connected and logged in at start
        config = engine.vllm_config.kv_transfer_config
        shown = [repr(config), repr(tier), str(tier.config_info()), caplog.text]
        assert password not in "\n".join(shown)
        assert "holds a password" not in caplog.text
    finally:
        engine.manager.shutdown()


def test_a_password_in_the_entry_is_warned_of(
    model: Path, redis_acl_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    password = secondary.DEFAULT_PASSWORD
    url = f"redis://:{password}@127.0.0.1:{redis_acl_server.port}/0"
    engine = build_engine(model, extra(entry(url=url)))
    try:
        assert "its 'url' holds a password" in caplog.text
        assert "give 'url_env'" in caplog.text
        assert password not in caplog.text
    finally:
        engine.manager.shutdown()


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"url_env": "UNSET_REDIS_URL_X"}, "the environment variable UNSET_REDIS_URL_X is not set"),
        ({"url": "redis://h/0", "url_env": "X"}, "got both"),
        ({}, "or 'url_env' the name of an environment variable"),
        ({"url": "redis://h/0", "password_file": "/nonexistent/pw"}, "/nonexistent/pw does not"),
        ({"url_env": 3}, "'url_env' must be a string"),
        ({"url": "redis://u:in-url@h/0", "password_file": __file__}, "give the password once"),
    ],
)
def test_a_bad_url_env_or_password_file_is_one_error(
    model: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, Any], named: str
) -> None:
    monkeypatch.delenv("UNSET_REDIS_URL_X", raising=False)
    with pytest.raises(ConfigError) as caught:
        RedisSecondaryTier.check_entry("RedisSecondaryTier", entry(**keys))
    message = str(caught.value)
    assert named in message
    assert "RedisSecondaryTier" in message
    assert "in-url" not in message
    assert "\n" not in message


def test_a_bare_password_in_the_url_variable_is_never_in_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERING_TEST_URL", "s3cretPW")
    with pytest.raises(ConfigError) as caught:
        RedisSecondaryTier.check_entry("RedisSecondaryTier", {"url_env": "TIERING_TEST_URL"})
    assert "TIERING_TEST_URL" in str(caught.value)
    assert "s3cretPW" not in str(caught.value)
