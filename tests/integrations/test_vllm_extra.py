"""`tiering.integrations.vllm.extra`: the keys tiering reads inside vLLM, decoded (no vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from tiering.errors import ConfigError
from tiering.integrations.vllm.extra import redis_options, spec_keys
from tiering.secondary.base import Locality

WHERE = "secondary tier 'redis' (RedisSecondaryTier): "


def refusal(**entry: Any) -> str:
    with pytest.raises(ConfigError) as info:
        redis_options("redis", {"url": "redis://127.0.0.1:6379/0", **entry})
    message = str(info.value)
    assert message.startswith(WHERE)
    assert "\n" not in message
    return message


def test_an_entry_becomes_the_tiers_options() -> None:
    options = redis_options(
        "redis",
        {"url": "redis://h/0", "namespace": "prod", "timeout_s": 1, "backoff_s": [0.5, 4],
         "checksum": "ML64", "locality": "local", "max_store_jobs": 8},
    )  # fmt: skip
    assert options.url == "redis://h/0"
    assert options.keys.namespace == "prod"
    assert options.keys.max_store_jobs == 8
    assert options.locality is Locality.LOCAL
    assert options.redis["timeout_s"] == 1.0
    assert options.redis["backoff_s"] == (0.5, 4.0)
    assert options.redis["checksum"] == "ML64"
    assert "max_batch" not in options.redis  # left out: the tier's default
    assert not options.password_in_entry


def test_an_unknown_key_names_the_key_it_misspells() -> None:
    message = refusal(timeout=2)
    assert "the entry has unknown key(s) 'timeout'; did you mean 'timeout_s'?" in message


def test_a_password_is_never_shown() -> None:
    message = refusal(url="redis://user:s3cret@h:99999/0", max_store_jobs=0)
    assert "'max_store_jobs' must be an integer of at least 1, got 0" in message
    assert "s3cret" not in message
    assert "s3cret" not in refusal(url="http://user:s3cret@h/0")


def test_a_password_in_the_url_is_noted() -> None:
    assert redis_options("redis", {"url": "redis://u:pw@h/0"}).password_in_entry


@pytest.mark.parametrize(
    ("keys", "port", "host"),
    [({}, None, "127.0.0.1"), ({"metrics_port": 0}, 0, "127.0.0.1"),
     ({"metrics_port": 9100, "metrics_host": "0.0.0.0"}, 9100, "0.0.0.0")],
)  # fmt: skip
def test_the_metrics_keys(keys: dict[str, Any], port: int | None, host: str) -> None:
    extra = spec_keys({"cpu_bytes_to_use": 1, **keys})
    assert extra.metrics_address == (None if port is None else (host, port))


def test_a_bad_metrics_port() -> None:
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\['metrics_port'\] must "):
        spec_keys({"cpu_bytes_to_use": 1, "metrics_port": True})


def test_numpy_numbers_are_taken_as_before() -> None:
    np = pytest.importorskip("numpy")
    options = redis_options(
        "redis", {"url": "redis://h/0", "timeout_s": np.float64(1.5), "ttl_s": np.float64(60)}
    )
    assert options.redis["timeout_s"] == 1.5
    assert type(options.redis["timeout_s"]) is float
    assert options.redis["ttl_s"] == 60.0


def test_metrics_host_needs_a_port() -> None:
    # Without a metrics_port no server starts: a metrics_host alone is refused (it was
    # accepted and ignored before issue 28).
    with pytest.raises(ConfigError, match=r"\['metrics_host'\] is '0.0.0.0' but metrics_port"):
        spec_keys({"cpu_bytes_to_use": 1, "metrics_host": "0.0.0.0"})
    with pytest.raises(ConfigError, match=r"\['metrics_host'\] must be a host address"):
        spec_keys({"cpu_bytes_to_use": 1, "metrics_port": 0, "metrics_host": ""})


def test_a_url_of_another_type_is_shown_once_and_without_its_secrets() -> None:
    message = refusal(url={"password": "hunter2"})
    assert message.endswith("got {'password': ***} of type dict")
    assert refusal(url=5).endswith("got 5 of type int")
