"""`tiering events` and `tiering replay --events-endpoint` on endpoints that cannot work.

Two sides that both connect never meet, and ZeroMQ says nothing: the commands
say which side binds, `tiering events` gives up after ``--timeout`` with the
fix, and endpoints that cannot be used at all are refused with one line (exit 2).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from tiering.cli import events as cli
from tiering.cli import main


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The stderr lines of ``tiering argv``, which must exit with status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_events_at_an_endpoint_nobody_serves_says_so_and_how_to_fix_it(
    refused_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"tcp://127.0.0.1:{refused_port}"
    waiting, error = fails(["events", endpoint, "--timeout", "0.2"], capsys)
    assert waiting == (
        f"tiering events: connecting to {endpoint}; waiting for a publisher that binds it "
        f"(e.g. --events-endpoint tcp://*:{refused_port}), up to 0.2 s (--timeout)"
    )
    assert error.startswith(f"tiering: error: no KV cache events at {endpoint} in 0.2 s: ")
    assert "no publisher accepted the connection, so nothing publishes there" in error
    assert f"start it with --events-endpoint tcp://*:{refused_port}" in error
    assert f"bind here instead: tiering events tcp://*:{refused_port}" in error
    assert "--timeout 0 waits for ever" in error


def test_events_that_binds_says_where_a_publisher_should_connect(
    capsys: pytest.CaptureFixture[str],
) -> None:
    waiting, error = fails(["events", "tcp://127.0.0.1:*", "--timeout", "0.1"], capsys)
    assert waiting.startswith("tiering events: bound tcp://127.0.0.1:")
    bound = waiting.split()[3].rstrip(";")
    assert (
        f"waiting for a publisher that connects to it (e.g. --events-endpoint {bound})" in waiting
    )
    assert error.startswith(f"tiering: error: no KV cache events at {bound} in 0.1 s: ")
    assert "no publisher connected to it" in error


@pytest.mark.parametrize("terminal", [True, False])
def test_events_waits_a_few_seconds_on_a_terminal_and_longer_in_a_script(
    terminal: bool,
    refused_port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert (cli._EVENTS_WAIT_TTY, cli._EVENTS_WAIT_PIPED) == (5.0, 60.0)
    # The defaults themselves, shortened: which one applies is what is tested.
    monkeypatch.setattr(cli, "_EVENTS_WAIT_TTY", 0.1)
    monkeypatch.setattr(cli, "_EVENTS_WAIT_PIPED", 0.2)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    waiting, error = fails(["events", f"tcp://127.0.0.1:{refused_port}"], capsys)
    wait = "0.1" if terminal else "0.2"
    assert waiting.endswith(f"up to {wait} s (--timeout)")
    assert f" in {wait} s: " in error


@pytest.mark.parametrize(
    ("flags", "named", "bad"),
    [
        # ZeroMQ would bind port 99999 as 34463, and retry a connect to it or to 0 for ever.
        (["tcp://*:99999"], "endpoint", "tcp://*:99999"),
        (["tcp://127.0.0.1:99999"], "endpoint", "tcp://127.0.0.1:99999"),
        (["tcp://127.0.0.1:0"], "endpoint", "tcp://127.0.0.1:0"),
        (["tcp://:5557"], "endpoint", "tcp://:5557"),
        (
            ["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:99999"],
            "--replay-endpoint",
            "tcp://127.0.0.1:99999",
        ),
    ],
)
def test_events_refuses_the_endpoints_the_replay_refuses(
    flags: list[str], named: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = fails(["events", *flags, "--timeout", "0.1"], capsys)
    assert line == (
        f"tiering: error: {named} must be tcp://HOST:PORT with a port in 1-65535, or '*' for a "
        f"free one (e.g. 'tcp://*:5557', 'tcp://127.0.0.1:*'), got {bad!r}"
    )
    (replay_line,) = fails(["replay", "--workload", "chat", "--requests", "3",
                            "--events-endpoint", bad], capsys)  # fmt: skip
    assert replay_line.endswith(f"got {bad!r}")


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A loopback port another program listens on."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--events-endpoint", "tcp://127.0.0.1:99999"], "port in 1-65535"),
        (["--events-endpoint", "tcp://*:70000"], "got 'tcp://*:70000'"),
        (
            [
                "--events-endpoint",
                "tcp://127.0.0.1:5557",
                "--replay-endpoint",
                "tcp://127.0.0.1:5557",
            ],
            "names the address of endpoint 'tcp://127.0.0.1:5557'",
        ),
        (
            ["--events-endpoint", "tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://*:5557"],
            "replay socket needs an address of its own",
        ),
    ],
)
def test_replay_refuses_an_endpoint_that_cannot_work(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = fails(["replay", "--workload", "chat", "--requests", "3", *flags], capsys)
    assert line.startswith("tiering: error: KVEventsConfig.")
    assert named in line


@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
def test_replay_refuses_to_bind_an_address_another_program_holds(
    field: str, listening_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    if field == "endpoint":
        taken = f"tcp://*:{listening_port}"
        flags = ["--events-endpoint", taken]
    else:  # the replay endpoint always binds
        taken = f"tcp://127.0.0.1:{listening_port}"
        flags = ["--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", taken]
    (line,) = fails(["replay", "--workload", "chat", "--requests", "3", *flags], capsys)
    assert f"cannot bind KVEventsConfig.{field} {taken!r}: Address already in use" in line


@pytest.mark.parametrize("binds", [True, False])
def test_replay_says_whether_its_publisher_binds_or_connects(
    binds: bool, refused_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = "tcp://127.0.0.1:*" if binds else f"tcp://127.0.0.1:{refused_port}"
    argv = ["replay", "--workload", "chat", "--requests", "3", "--json"]
    assert main([*argv, "--events-endpoint", endpoint]) == 0
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "publishing" in x]
    if binds:
        assert line.startswith("tiering: publishing KV cache events at tcp://127.0.0.1:")
        assert line.endswith(" (bound: subscribers connect to it)")
    else:
        assert line == (
            f"tiering: publishing KV cache events at {endpoint} (it connects: a subscriber "
            f"must bind it, e.g. tiering events tcp://*:{refused_port})"
        )
