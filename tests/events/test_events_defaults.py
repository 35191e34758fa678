"""Tiering's own event endpoint defaults to loopback; every interface comes with a warning.

Before: `KVEventsConfig()` bound ``tcp://*:5557`` (vLLM's default), every
interface, for a stream without authentication, and nothing said so. Now
tiering's default binds ``tcp://127.0.0.1:5557``; a config with vLLM's values
keeps vLLM's rule (a ``*`` binds, a host connects); and a publisher or
`tiering events` bound on every interface logs one warning line (on stderr from
the command line).
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys

import pytest

from tiering.cli import build_parser
from tiering.errors import ConfigError
from tiering.events import KVEventsConfig
from tiering.events.config import DEFAULT_ENDPOINT, binds_every_interface, loopback_of
from tiering.events.publisher import ZmqEventPublisher
from tiering.events.subscriber import ZmqSubscriber

pytestmark = pytest.mark.anyio


def unauthenticated(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]


def test_the_default_binds_loopback_and_vllms_values_keep_vllms_rule() -> None:
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    config = KVEventsConfig()
    assert (config.endpoint, config.bind) == (DEFAULT_ENDPOINT, True)
    assert config == KVEventsConfig(endpoint=DEFAULT_ENDPOINT) == KVEventsConfig(bind=True)
    # vLLM's default and any other endpoint: vLLM's rule (None), as vLLM gives them.
    assert KVEventsConfig(endpoint="tcp://*:5557").bind is None
    assert KVEventsConfig(endpoint="tcp://127.0.0.1:5558").bind is None
    assert KVEventsConfig(endpoint=DEFAULT_ENDPOINT, bind=False).bind is False
    with pytest.raises(ConfigError, match=r"KVEventsConfig.bind must be true .*got 'yes'"):
        KVEventsConfig(bind="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "everywhere", "loopback"),
    [
        ("tcp://*:5557", True, "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:5557", True, "tcp://127.0.0.1:5557"),
        ("tcp://[::]:5557", True, "tcp://[::1]:5557"),
        ("tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5557"),
        ("tcp://10.1.2.3:*", False, "tcp://10.1.2.3:*"),
        ("ipc:///tmp/x", False, "ipc:///tmp/x"),
    ],
)
def test_which_endpoints_bind_every_interface(
    endpoint: str, everywhere: bool, loopback: str
) -> None:
    assert binds_every_interface(endpoint) is everywhere
    assert loopback_of(endpoint) == loopback


def test_bind_true_binds_a_concrete_loopback_address(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a free port (the default's own 5557 may be taken)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    with caplog.at_level(logging.WARNING):
        publisher = ZmqEventPublisher(KVEventsConfig(endpoint=endpoint, bind=True))
        try:
            assert publisher.binds
            assert publisher.endpoint == endpoint
        finally:
            publisher.close()
        # vLLM's rule without ``bind``: a concrete host connects.
        connecting = ZmqEventPublisher(KVEventsConfig(endpoint=endpoint))
        try:
            assert not connecting.binds
        finally:
            connecting.close()
    assert unauthenticated(caplog) == []


def test_a_publisher_bound_on_every_interface_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        publisher = ZmqEventPublisher(
            KVEventsConfig(endpoint="tcp://*:*", replay_endpoint="tcp://0.0.0.0:*")
        )
        try:
            assert publisher.binds
        finally:
            publisher.close()
    (message,) = unauthenticated(caplog)  # one line for both sockets, as bound
    assert re.match(
        r"KV cache events: bound tcp://0\.0\.0\.0:\d+ and tcp://0\.0\.0\.0:\d+ on every "
        r"interface; the stream is unauthenticated",
        message,
    )
    assert "anyone who reaches the port reads every block hash and can ask for replays" in message
    assert "instead: tiering's default tcp://127.0.0.1:5557, tcp://127.0.0.1:*" in message


async def test_a_subscriber_bound_on_every_interface_warns_once(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        async with ZmqSubscriber("tcp://*:*") as subscriber:
            assert subscriber.binds
        async with ZmqSubscriber("tcp://127.0.0.1:*"):
            pass
    (message,) = unauthenticated(caplog)
    assert "anyone who reaches the port can publish events here" in message


def test_the_cli_defaults_to_the_loopback_endpoint() -> None:
    parser = build_parser()
    assert parser.parse_args(["events"]).endpoint == DEFAULT_ENDPOINT
    replay = parser.parse_args(["replay", "--workload", "chat", "--events-endpoint"])
    assert replay.events_endpoint == DEFAULT_ENDPOINT
    assert parser.parse_args(["replay", "--workload", "chat"]).events_endpoint is None


def test_tiering_events_bound_on_every_interface_says_so_once_on_stderr() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tiering.cli", "events", "tcp://*:*", "--timeout", "0.1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2  # nothing came: as before
    lines = [line for line in run.stderr.splitlines() if "unauthenticated" in line]
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_endpoints_bind_and_connect(caplog: pytest.LogCaptureFixture) -> None:
    # ZeroMQ refuses an IPv6 address ("No such device") on a socket without its IPV6
    # option: `tcp://[::]:PORT` could not be bound at all, nor `[::1]` connected to.
    with caplog.at_level(logging.WARNING):
        everywhere = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://[::]:*"))
        everywhere.close()
    assert len(unauthenticated(caplog)) == 1
    publisher = ZmqEventPublisher(KVEventsConfig(endpoint="tcp://[::1]:*", bind=True))
    try:
        assert publisher.binds
        port = publisher.endpoint.rsplit(":", 1)[1]
        async with ZmqSubscriber(f"tcp://[::1]:{port}") as subscriber:
            assert subscriber.statistics().malformed_total == 0
    finally:
        publisher.close()
