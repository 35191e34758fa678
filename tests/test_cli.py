"""The command line as a whole: its version, flags that mean nothing without another,
what --help says, capacities with thousands separators, and endpoints that clash."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from pathlib import Path

import pytest

from tiering.cli import main
from tiering.cli.arguments import default_requests, positive_int
from tiering.cli.parser import build_parser
from tiering.errors import ConfigError
from tiering.workload import WORKLOADS, load_workload
from tiering.workload.synthetic import MAX_REQUESTS

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_installed_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"tiering {importlib.metadata.version('tiering')}\n"


def test_version_without_package_metadata_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == "tiering unknown (not installed: pip install -e .)\n"


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one line an argparse error prints (exit 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    err = _usage_error(capsys, argv)
    assert err.startswith("tiering: error: ")
    return err


@pytest.mark.parametrize(
    ("flags", "named", "needed"),
    [
        (["--metrics-host", "0.0.0.0"], "--metrics-host 0.0.0.0", "--metrics-port"),
        (["--hold", "5"], "--hold 5", "--metrics-port P or --events-endpoint"),
        (["--hold", "0"], "--hold 0", "--metrics-port P or --events-endpoint"),
        (["--remote-namespace", "team-a"], "--remote-namespace 'team-a'", "--remote URL"),
        (["--metrics-host", "0.0.0.0", "--hold", "1"], "--metrics-host", "--metrics-port"),
    ],
)
def test_a_flag_that_needs_another_is_refused_without_it(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str, needed: str
) -> None:
    err = _one_error_line(capsys, ["replay", "--workload", "chat", "--requests", "5", *flags])
    assert named in err
    assert needed in err


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_too_many_requests_of_a_workload_name_the_flag(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    err = _one_error_line(capsys, [command, "--workload", "chat", "--requests", "1000000000"])
    assert "--requests 1,000,000,000" in err
    assert "at most 10,000,000" in err
    assert "num_requests" not in err


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:99999", "port out of range"),
        ("redis://", "names no host"),
        ("redis://127.0.0.1:6380/abc", "names database 'abc'"),
    ],
)
def test_a_bad_remote_url_is_one_line(
    capsys: pytest.CaptureFixture[str], url: str, message: str
) -> None:
    pytest.importorskip("redis")
    argv = ["replay", "--workload", "chat", "--requests", "5", "--remote", url]
    assert message in _one_error_line(capsys, argv)


# -- what --help and the README say of the built-in workloads ---------------------------


@pytest.mark.parametrize("command", ["simulate", "replay"])
def test_help_gives_each_built_in_workloads_default_request_count(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    for name in sorted(WORKLOADS):
        count = len(load_workload(name))  # what it makes without --requests
        assert count == default_requests(name)
        assert f"{name} {count:,}" in text
    assert f"at most {MAX_REQUESTS:,}" in text


def test_the_readme_gives_the_built_in_workloads_default_request_count() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    (count,) = {default_requests(name) for name in WORKLOADS}  # one count for all of them
    assert (
        f"new ones), each of {count:,} requests unless `--requests N` says otherwise (at most "
        f"{MAX_REQUESTS:,}; `--help` says so too)"
    ) in readme


# -- capacities: commas separate them --------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "text", "said"),
    [
        ("--capacity-tokens", "1,000,000",
         "1,000,000 reads as capacities 1, 0, 0; commas separate capacities: write 1000000"),
        ("--capacity-tokens", "2,048,000",
         "2,048,000 reads as capacities 2, 48, 0; commas separate capacities: write 2048000"),
        ("--capacity-tokens", "3,000,000,10,000,000",
         "reads as capacities 3, 0, 0, 10, 0, 0; commas separate capacities: write each "
         "without thousands separators (1000000, not 1,000,000)"),
        ("--disk-tokens", "10,000,000",
         "10,000,000 reads as capacities 10, 0, 0; commas separate capacities: write 10000000"),
    ],
)  # fmt: skip
def test_a_capacity_with_thousands_separators_says_commas_separate_capacities(
    capsys: pytest.CaptureFixture[str], flag: str, text: str, said: str
) -> None:
    err = _usage_error(capsys, ["simulate", "--workload", "chat", flag, text])
    assert err.startswith(f"tiering simulate: error: argument {flag}: ")
    assert err.rstrip("\n").endswith(said)


def test_replays_one_capacity_with_thousands_separators_says_to_write_it_without(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(
        ["replay", "--workload", "chat", "--capacity-tokens", "3000000"]
    )
    assert args.capacity_tokens == 3_000_000
    err = _usage_error(capsys, ["replay", "--workload", "chat", "--capacity-tokens", "3,000,000"])
    assert err == (
        "tiering replay: error: argument --capacity-tokens: expected a positive integer, "
        "got '3,000,000': write 3000000, without commas\n"
    )
    with pytest.raises(argparse.ArgumentTypeError, match=r"got '3,0'$"):  # no such number
        positive_int("3,0")


def test_a_list_of_capacities_is_still_a_list() -> None:
    args = build_parser().parse_args(
        ["simulate", "--workload", "chat", "--capacity-tokens", "25600,51200,512,100"]
    )
    assert args.capacity_tokens == [25_600, 51_200, 512, 100]


# -- tiering events: the replay endpoint is not the events endpoint ----------------------


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [
        ("tcp://127.0.0.1:5599", "tcp://127.0.0.1:5599"),
        ("tcp://*:5599", "tcp://127.0.0.1:5599"),  # binds every interface: that address too
        ("ipc:///tmp/tiering-events", "ipc:///tmp/tiering-events"),
    ],
)
def test_events_refuses_a_replay_endpoint_on_the_events_endpoint(
    capsys: pytest.CaptureFixture[str], endpoint: str, replay: str
) -> None:
    err = _one_error_line(capsys, ["events", endpoint, "--replay-endpoint", replay])
    assert err == (
        f"tiering: error: --replay-endpoint {replay!r} names the address of endpoint "
        f"{endpoint!r}: the publisher's replay socket has an address of its own; give the "
        "port its --replay-endpoint binds (tiering replay prints it at start)\n"
    )


def test_a_subscriber_refuses_a_replay_endpoint_on_its_endpoint() -> None:
    pytest.importorskip("zmq")
    from tiering.events import ZmqSubscriber

    said = re.escape("replay_endpoint 'tcp://127.0.0.1:5599' names the address of endpoint")
    with pytest.raises(ConfigError, match=said):
        ZmqSubscriber("tcp://127.0.0.1:5599", "tcp://127.0.0.1:5599")
