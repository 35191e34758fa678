"""`tiering replay`'s remote tier secrets: the URL from the environment, the password
from a file, and every refusal one line (exit 2) that never shows the password."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.cli import main

SECRET = "Kx7Qw/9vZ#m2Rt?Lp8"
REPLAY = ["replay", "--workload", "chat", "--requests", "5"]


@pytest.fixture(autouse=True)
def _redis_py() -> None:
    pytest.importorskip("redis")


def _one_error_line(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([*REPLAY, *flags])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("tiering: error: ")
    for piece in ("Kx7Qw", "9vZ", "m2Rt", "Lp8", "pa/ss", "in-url", "in-file"):
        assert piece not in captured.err
    return captured.err


def test_an_unset_variable_is_named_never_its_value(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MY_REDIS_URL", raising=False)
    err = _one_error_line(capsys, "--remote-url-env", "MY_REDIS_URL")
    assert "the environment variable MY_REDIS_URL is not set" in err
    monkeypatch.delenv("TIERING_REMOTE_URL", raising=False)
    err = _one_error_line(capsys, "--remote-url-env")  # alone: the default variable
    assert "TIERING_REMOTE_URL is not set" in err


def test_a_bad_url_in_the_variable_hides_its_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_REDIS_URL", f"redis://:{SECRET}@127.0.0.1:6379/0")
    err = _one_error_line(capsys, "--remote-url-env", "MY_REDIS_URL")
    assert "names no host" in err
    assert "redis://:***@127.0.0.1:6379/0" in err


def test_a_password_with_a_slash_is_never_in_the_no_host_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _one_error_line(capsys, "--remote", "redis://:pa/ss@127.0.0.1:6379/0")
    assert "names no host" in err
    assert "percent-encoded" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--remote", "redis://h/0", "--remote-url-env", "X"], "give one of them"),
        # the URL where the variable's name belongs: never shown
        (["--remote", "redis://h/0", "--remote-url-env", f"redis://:{SECRET}@h/0"], "one of"),
        (["--remote-password-file", "/run/pw"], "--remote-password-file '/run/pw'"),
        (["--remote-url-env", "NOT=A NAME"], "must name an environment variable"),
    ],
)
def test_remote_flags_that_do_not_fit_are_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    assert named in _one_error_line(capsys, *flags)


def test_a_bad_password_file_is_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    err = _one_error_line(capsys, "--remote", "redis://h/0", "--remote-password-file", str(missing))
    assert f"the password file {missing} does not exist" in err
    err = _one_error_line(
        capsys, "--remote", "redis://h/0", "--remote-password-file", str(tmp_path)
    )
    assert "is not a regular file" in err
    both = tmp_path / "password"
    both.write_text("in-file\n")
    err = _one_error_line(
        capsys, "--remote", "redis://u:in-url@h/0", "--remote-password-file", str(both)
    )
    assert "give the password once" in err
    assert "redis://u:***@h/0" in err


def test_a_url_given_where_the_variable_name_belongs_is_never_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--remote-url-env "$REDIS_URL"`` (the value, not the name): before, the error
    quoted the argument, password and all."""
    err = _one_error_line(capsys, "--remote-url-env", f"redis://app:{SECRET}@10.0.0.5:6379/0")
    assert "must name an environment variable" in err
    assert "give the name of the variable that holds it" in err
    assert "app" not in err
    assert "10.0.0.5" not in err


def test_a_bare_password_in_the_variable_is_never_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the password where the URL belongs (TIERING_REMOTE_URL=$REDIS_PASSWORD): the
    # scheme error once quoted the whole value
    monkeypatch.setenv("MY_REDIS_URL", "Kx7Qw9vZm2RtLp8")
    err = _one_error_line(capsys, "--remote-url-env", "MY_REDIS_URL")
    assert "must start with redis:// or rediss://" in err
    assert "Kx7Qw9vZm2RtLp8" not in err
    err = _one_error_line(capsys, "--remote", "http://:Kx7Qw@127.0.0.1:6379")
    assert "'http://:***@127.0.0.1:6379'" in err  # a URL of another scheme: still shown
