"""The command line as a whole: its version, and flags that mean nothing without another."""

from __future__ import annotations

import importlib.metadata

import pytest

from tiering.cli import main


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


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("tiering: error: ")
    return captured.err


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
