"""KVEventsConfig: vLLM's defaults, clear errors, and a package that imports light."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from tiering.errors import ConfigError
from tiering.events import HashFormat, KVEventsConfig


def test_defaults_are_vllms_but_the_endpoint() -> None:
    config = KVEventsConfig()
    assert config == KVEventsConfig(
        endpoint="tcp://127.0.0.1:5557",  # vLLM's tcp://*:5557 binds every interface
        bind=True,
        replay_endpoint=None,
        topic="",
        buffer_steps=10_000,
        hwm=100_000,
        max_queue_size=100_000,
        hash_format=HashFormat.INT,
    )
    assert KVEventsConfig(hash_format="bytes").hash_format is HashFormat.BYTES  # type: ignore[arg-type]
    decoded = msgspec.json.decode(b'{"hash_format": "bytes", "hwm": 0}', type=KVEventsConfig)
    assert (decoded.hash_format, decoded.hwm) == (HashFormat.BYTES, 0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"endpoint": "localhost:5557"}, "KVEventsConfig.endpoint must be a ZeroMQ endpoint"),
        ({"endpoint": "http://x:1"}, r"transports: tcp, ipc.*got 'http://x:1'"),
        ({"endpoint": "tcp://"}, "got 'tcp://'"),
        ({"replay_endpoint": "5558"}, "KVEventsConfig.replay_endpoint must be a ZeroMQ endpoint"),
        ({"topic": 7}, "KVEventsConfig.topic must be a string, got 7"),
        ({"buffer_steps": 0}, r"KVEventsConfig.buffer_steps must be an integer >= 1 .*got 0"),
        ({"hwm": -1}, r"KVEventsConfig.hwm must be an integer >= 0 .*got -1"),
        ({"max_queue_size": True}, r"KVEventsConfig.max_queue_size must be .*got True"),
        ({"max_queue_size": 2.5}, r"KVEventsConfig.max_queue_size must be .*got 2.5"),
        ({"hash_format": "hex"}, "KVEventsConfig.hash_format must be 'int' or 'bytes', got 'hex'"),
        # ZeroMQ binds port 99999 as 34463 (modulo 65536) and retries a connect to it for ever.
        ({"endpoint": "tcp://127.0.0.1:99999"}, r"port in 1-65535, or '\*' .*got 'tcp://127"),
        ({"endpoint": "tcp://*:99999"}, "got 'tcp://\\*:99999'"),
        ({"endpoint": "tcp://127.0.0.1:0"}, "port in 1-65535"),
        ({"endpoint": "tcp://127.0.0.1:-1"}, "port in 1-65535"),
        ({"endpoint": "tcp://127.0.0.1:\u00b2"}, "port in 1-65535"),  # a digit, not ASCII
        ({"endpoint": "tcp://127.0.0.1"}, "must be tcp://HOST:PORT"),
        ({"endpoint": "tcp://:5557"}, "must be tcp://HOST:PORT"),
        (
            {"replay_endpoint": "tcp://127.0.0.1:5558;127.0.0.1:70000"},
            "replay_endpoint must be tcp",
        ),
    ],
)
def test_bad_values_name_the_field_and_the_value(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVEventsConfig(**fields)  # type: ignore[arg-type]


def test_importing_the_package_loads_neither_zmq_nor_anyio() -> None:
    code = (
        "import sys, tiering.events as ev\n"
        "assert ev.KVEventsConfig and ev.encode_batch\n"
        "print(','.join(m for m in ('zmq', 'anyio') if m in sys.modules))\n"
        "ev.ZmqSubscriber\n"
        "print('zmq' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize(
    ("endpoint", "replay_endpoint"),
    [
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:05557"),
        ("tcp://127.0.0.1:5557", "tcp://*:5557"),  # the PUB would connect to its own ROUTER
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv"),
    ],
)
def test_the_replay_endpoint_needs_an_address_of_its_own(
    endpoint: str, replay_endpoint: str
) -> None:
    with pytest.raises(ConfigError, match=r"names the address of endpoint .*address of its own"):
        KVEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)


@pytest.mark.parametrize(
    ("endpoint", "replay_endpoint"),
    [
        ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),  # two free ports
        ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
        ("tcp://10.0.0.1:5557", "tcp://127.0.0.1:5557"),
        ("tcp://[::1]:65535", "tcp://eth0:1"),
        ("ipc:///tmp/kv", "ipc:///tmp/kv-replay"),
    ],
)
def test_endpoints_that_can_both_be_used_are_accepted(endpoint: str, replay_endpoint: str) -> None:
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
    assert (config.endpoint, config.replay_endpoint) == (endpoint, replay_endpoint)


def test_a_numpy_integer_is_refused_as_before() -> None:
    # The record keeps the value, and msgspec cannot encode numpy's integers.
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigError, match=r"KVEventsConfig\.buffer_steps must be an integer"):
        KVEventsConfig(buffer_steps=np.int64(5))
