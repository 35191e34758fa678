"""Secrets of the Redis tier: never shown, never needed in argv or in a logged config.

`redact_url` over every shape of URL (a password with unencoded ``/ # ? @ :``,
no user, IPv6, TLS, a unix socket, one that does not parse), the URL errors,
`resolve_url` (the URL from the environment, the password from a file), and
`tiering replay` against a real server with ``requirepass``: every output of a
run with a password (stdout, stderr, --json, logs, metrics) is searched for it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tiering.errors import ConfigError
from tiering.replay import ReplayOptions, run_replay
from tiering.secondary import RemoteNamespace
from tiering.secondary.redis import RedisTier
from tiering.secondary.redis.address import parse_url, read_password, redact_url, resolve_url
from tiering.workload import load_workload

from .conftest import RedisServer

#: A password with every character that ends a URL's userinfo early, in pieces
#: distinct enough that finding any one of them in an output is a leak.
SECRET = "Kx7Qw/9vZ#m2Rt?Lp8@Hj4:Yb"


def leaks(text: str, secret: str = SECRET) -> list[str]:
    """The pieces of ``secret`` (3 characters or more) found in ``text``."""
    pieces = {secret, urllib.parse.quote(secret, safe="")}
    for sep in "/#?@:":
        pieces |= {p for part in pieces for p in part.split(sep)}
    return sorted(p for p in pieces if len(p) >= 3 and p in text)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://user:{SECRET}@host:6379/0", "redis://user:***@host:6379/0"),
        (f"redis://:{SECRET}@host", "redis://:***@host"),
        (f"redis://{SECRET}@host:1/2", "redis://***@host:1/2"),  # only a password
        ("redis://user:pa/ss@host", "redis://user:***@host"),
        ("redis://user:pa#ss@host/3", "redis://user:***@host/3"),
        ("redis://user:pa?ss@host", "redis://user:***@host"),
        ("redis://user:p@ss@host:7000", "redis://user:***@host:7000"),
        ("redis://user:p:ss@host", "redis://user:***@host"),
        ("redis://:secret@[::1]:7000/1", "redis://:***@[::1]:7000/1"),
        ("rediss://u:secret@host:6380/2?ssl_cert_reqs=none", "rediss://u:***@host:6380/2"),
        ("redis://host:6379/0?password=secret", "redis://host:6379/0"),
        ("rediss://host/0?ssl_password=secret&cluster=yes", "rediss://host/0"),
        ("unix://u:secret@/run/redis.sock?password=secret", "unix://u:***@/run/redis.sock"),
        ("redis://host:6379/0#secret", "redis://host:6379/0"),
        ("redis://:secret", "redis://***"),  # no @: the password stands where a port would
        ("redis://u:secret", "redis://***"),
        ("redis://u:secret/more", "redis://***"),
        ("redis://[::1:secret", "redis://***"),  # does not parse
        ("redis://host/secret", "redis://host/***"),
        ("re dis://u:secret@host", "***"),
        ("u:secret@host:6379", "u:***@host:6379"),
        ("s3cretPW", "***"),  # a password where the URL belongs
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://engine:secret\n@host", "redis://engine:***@host"),
        ("redis://us er:secret@host", "redis://***@host"),
    ],
)
def test_redact_url_hides_the_userinfo_whatever_its_shape(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "secret" not in redact_url(url)
    assert leaks(redact_url(url)) == []


@pytest.mark.parametrize(
    ("url", "error"),
    [
        (f"redis://:{SECRET}@127.0.0.1:6379/0", "names no host"),
        (f"redis://user:{SECRET}@127.0.0.1:6379/0", "port out of range"),
        ("redis://:Kx7Qw/9vZ@host", "names no host"),
        ("redis://:Kx7Qw#9vZ@host", "names no host"),
        ("redis://:Kx7Qw?9vZ@host", "names no host"),
        ("redis://u:Kx7Qw/9vZ@host/0", "port out of range"),
        ("redis://:Kx7Qw9vZ", "names no host"),
        ("redis://u:Kx7Qw/9vZ", "port out of range"),
        ("redis://[::1:Kx7Qw9vZ", "not a valid URL"),
        ("http://u:Kx7Qw9vZ@host", "must start with redis://"),
        ("redis://host/0?password=Kx7Qw9vZ", "has the option 'password'"),
        ("redis://host/0?Kx7Qw9vZ%2F", "of an unknown name"),
    ],
)
def test_a_url_error_never_shows_the_password(url: str, error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_url(url, None)
    message = str(caught.value)
    assert error in message
    assert "\n" not in message
    assert leaks(message) == [], message
    assert "Kx7Qw" not in message
    assert "9vZ" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:4321?cluster=Kx7Qw9vZ@127.0.0.1:6379/0",
        "redis://u:4321?db=Kx7Qw9vZ@127.0.0.1",
        "redis://u:4321?ssl_cert_reqs=Kx7Qw9vZ@127.0.0.1",
        "redis://u:4321?ssl_check_hostname=Kx7Qw9vZ@127.0.0.1",
        "redis://u:4321?Kx7Qw9vZ&x@127.0.0.1",
        "redis://Kx7Qw?cluster=9vZ@127.0.0.1",
        "redis://u:4321#Kx7Qw9vZ@127.0.0.1:6379/0",  # parsed as host u, port 4321
        "redis://Kx7Qw#9vZ@127.0.0.1:6379/0",  # parsed as host Kx7Qw: redis-py names it
    ],
)
def test_a_password_read_as_host_option_or_fragment_is_refused_unshown(url: str) -> None:
    """A password with an unencoded ``?`` or ``#`` before its ``@``: urlsplit takes its
    start for the host and its rest for options (whose values errors quoted) or a
    fragment (ignored: the tier connected to a host named by the password)."""
    with pytest.raises(ConfigError) as caught:
        parse_url(url, None)
    message = str(caught.value).lower()
    assert "must be percent-encoded" in message
    for piece in ("kx7qw", "9vz", "4321"):
        assert piece not in message, message


@pytest.mark.parametrize(
    "option", ["cluster=yes", "db=0", "ssl_cert_reqs=none", "ssl_check_hostname=no"]
)
def test_a_query_with_a_question_mark_for_an_ampersand_never_shows_the_password(
    option: str,
) -> None:
    """``?cluster=yes?ssl_password=...``: the password is part of the first option's
    value, which the option's error quoted."""
    with pytest.raises(ConfigError) as caught:
        parse_url(f"rediss://h:6380/0?{option}?ssl_password=Kx7Qw9vZ", None)
    message = str(caught.value)
    assert "not shown" in message
    assert "kx7qw" not in message.lower()
    with pytest.raises(ConfigError, match="got 'maybe'"):  # a plain word is still named
        parse_url("redis://h/0?cluster=maybe", None)


def test_an_address_never_shows_its_passwords() -> None:
    quoted = urllib.parse.quote(SECRET, safe="")
    address, _, _ = parse_url(f"rediss://u:{quoted}@h:1/0?ssl_password=Kx7Qw9vZ", None)
    assert address.password == SECRET
    for text in (repr(address), str(address), str(address.__rich_repr__())):
        assert leaks(text) == [], text
        assert "Kx7Qw9vZ" not in text


def test_a_redis_py_error_that_quotes_the_password_is_redacted() -> None:
    pytest.importorskip("redis")
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tiering.secondary.redis.failures import config_error

    exc = RedisConnectionError(f"cannot connect to redis://:{SECRET}@h:1/0")
    message = str(config_error("redis://:***@h:1/0", exc, SECRET))
    assert "cannot reach the Redis tier at redis://:***@h:1/0" in message
    assert SECRET not in message


def test_a_misplaced_at_says_to_encode_the_password() -> None:
    with pytest.raises(ConfigError, match="must be percent-encoded: %2F"):
        parse_url("redis://:pa/ss@host", None)


def test_the_url_from_the_environment(tmp_path: Path) -> None:
    url = "redis://u:pw@host:1/0"
    assert resolve_url(url_env="REDIS_URL_X", environ={"REDIS_URL_X": url}) == url
    assert resolve_url(url) == url
    with pytest.raises(ConfigError) as caught:
        resolve_url(url_env="REDIS_URL_X", environ={})
    assert "the environment variable REDIS_URL_X is not set" in str(caught.value)
    with pytest.raises(ConfigError, match="is not set"):
        resolve_url(url_env="REDIS_URL_X", environ={"REDIS_URL_X": "  "})
    with pytest.raises(ConfigError, match="got both"):
        resolve_url(url, url_env="REDIS_URL_X")
    with pytest.raises(ConfigError, match="got neither"):
        resolve_url()
    with pytest.raises(ConfigError, match="must name an environment variable"):
        resolve_url(url_env="A=B")


def test_the_password_from_a_file_whatever_its_characters(tmp_path: Path) -> None:
    secret_file = tmp_path / "password"
    secret_file.write_text(f"  {SECRET}  \nsecond line\n")
    assert read_password(secret_file) == SECRET
    for base in ("redis://127.0.0.1:6379/0", "redis://engine@127.0.0.1:6379/0"):
        url = resolve_url(base, password_file=secret_file)
        address, _, _ = parse_url(url, None)
        assert address.password == SECRET
        assert address.host == "127.0.0.1"
        assert address.db == 0
        assert leaks(redact_url(url)) == []
    address, _, _ = parse_url(resolve_url("redis://engine@h/3", password_file=secret_file), None)
    assert (address.username, address.db) == ("engine", 3)


@pytest.mark.parametrize("kind", ["missing", "empty", "directory", "fifo", "blank first line"])
def test_a_bad_password_file_is_one_error_naming_it(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "password"
    if kind == "empty":
        path.write_text("")
    elif kind == "blank first line":
        path.write_text("\nsecret-on-line-two\n")
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # never blocks the read
    with pytest.raises(ConfigError) as caught:
        resolve_url("redis://127.0.0.1:6379/0", password_file=path)
    message = str(caught.value)
    assert str(path) in message
    assert "\n" not in message
    assert "secret-on-line-two" not in message


def test_a_password_both_in_the_url_and_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "password"
    path.write_text("from-the-file\n")
    with pytest.raises(ConfigError) as caught:
        resolve_url("redis://u:in-the-url@127.0.0.1/0", password_file=path)
    message = str(caught.value)
    assert "give the password once" in message
    assert "in-the-url" not in message
    assert "from-the-file" not in message


def test_replay_options_never_show_the_password() -> None:
    options = ReplayOptions(remote=f"redis://user:{SECRET}@127.0.0.1:6379/0")
    for text in (repr(options), str(options), str(options.__rich_repr__())):
        assert leaks(text) == [], text
        assert "redis://user:***@127.0.0.1:6379/0" in text
    with pytest.raises(ConfigError) as caught:
        ReplayOptions(remote=f"redis://:{SECRET}@h/0", remote_url_env="X")
    assert "not both" in str(caught.value)
    assert leaks(str(caught.value)) == []
    with pytest.raises(ConfigError) as caught:  # the URL where the variable's name belongs
        ReplayOptions(remote="redis://h/0", remote_url_env=f"redis://:{SECRET}@h/0")
    assert "not both" in str(caught.value)
    assert leaks(str(caught.value)) == []
    with pytest.raises(ConfigError, match="no remote tier was given"):
        ReplayOptions(remote_password_file="/nonexistent")


# -- a real server with requirepass -----------------------------------------------


@pytest.mark.anyio
async def test_the_tier_logs_in_with_a_password_from_a_file(
    redis_acl_server: RedisServer, acl: dict[str, str], namespace: RemoteNamespace, tmp_path: Path
) -> None:
    path = tmp_path / "password"
    path.write_text(acl["default"] + "\n")
    url = resolve_url(f"redis://127.0.0.1:{redis_acl_server.port}/0", password_file=path)
    async with await RedisTier.open(url, namespace) as tier:
        assert tier.url == f"redis://:***@127.0.0.1:{redis_acl_server.port}/0"
        assert acl["default"] not in repr(tier)


@pytest.mark.anyio
async def test_a_library_tier_takes_its_url_from_the_environment(
    redis_acl_server: RedisServer,
    acl: dict[str, str],
    namespace: RemoteNamespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "TIERING_REMOTE_URL", f"redis://:{acl['default']}@127.0.0.1:{redis_acl_server.port}/0"
    )
    tier = RedisTier.from_env(namespace)
    async with tier:
        await tier.connect()
        assert tier.url == f"redis://:***@127.0.0.1:{redis_acl_server.port}/0"
        assert acl["default"] not in repr(tier)
    monkeypatch.delenv("TIERING_REMOTE_URL")
    with pytest.raises(ConfigError, match="TIERING_REMOTE_URL is not set"):
        RedisTier.from_env(namespace)


REPLAY = [
    sys.executable, "-m", "tiering", "replay", "--workload", "chat", "--requests", "60",
    "--capacity-tokens", "20480", "--bytes-per-token", "16", "--verify",
]  # fmt: skip


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*REPLAY, *argv],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_replay_takes_the_url_from_the_environment(
    redis_acl_server: RedisServer, acl: dict[str, str]
) -> None:
    port = redis_acl_server.port
    url = f"redis://{acl['user']}:{acl['password']}@127.0.0.1:{port}/0"
    done = _run("--remote-url-env", "SECRET_REDIS_URL", "--json", env={"SECRET_REDIS_URL": url})
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["remote_write_bytes"] > 0
    assert (summary["remote_errors"], summary["corrupt_chunks"]) == (0, 0)
    # --remote-url-env alone reads TIERING_REMOTE_URL
    done = _run("--remote-url-env", env={"TIERING_REMOTE_URL": url})
    assert done.returncode == 0, done.stderr
    assert "remote tier" in done.stdout
    assert "0 failed calls" in done.stdout
    for text in (done.stdout, done.stderr):
        assert acl["password"] not in text


def test_replay_takes_the_password_from_a_file(
    redis_acl_server: RedisServer, acl: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "password"
    path.write_text(acl["password"] + "\n")
    url = f"redis://{acl['user']}@127.0.0.1:{redis_acl_server.port}/0"
    done = _run("--remote", url, "--remote-password-file", str(path), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["remote_write_bytes"] > 0
    assert summary["remote_errors"] == 0
    assert acl["password"] not in done.stdout + done.stderr


@pytest.mark.parametrize("where", ["env", "file"])
@pytest.mark.parametrize("server", ["right password", "refused password", "down"])
def test_no_output_of_a_replay_holds_the_password(
    redis_acl_server: RedisServer,
    acl: dict[str, str],
    unused_port: int,
    tmp_path: Path,
    where: str,
    server: str,
) -> None:
    """stdout, stderr (text and --json) of the command; the logs and the metrics of
    the same replay run in this process."""
    port = unused_port if server == "down" else redis_acl_server.port
    password = acl["password"] if server == "right password" else SECRET
    base = f"redis://{acl['user']}@127.0.0.1:{port}/0"
    path = tmp_path / "password"
    path.write_text(password + "\n")
    if where == "env":
        quoted = urllib.parse.quote(password, safe="")
        flags = ["--remote-url-env", "R_URL"]
        env = {"R_URL": f"redis://{acl['user']}:{quoted}@127.0.0.1:{port}/0"}
        options = ReplayOptions(remote_url_env="R_URL", bytes_per_token=16, concurrency=2)
    else:
        flags, env = ["--remote", base, "--remote-password-file", str(path)], {}
        options = ReplayOptions(
            remote=base, remote_password_file=str(path), bytes_per_token=16, concurrency=2
        )
    outputs = []
    for json_flag in ([], ["--json"]):
        done = _run(*flags, *json_flag, env=env)
        outputs += [done.stdout, done.stderr]
        if server == "right password":
            assert done.returncode == 0, done.stderr
        else:  # refused at open, or counted: never a traceback
            assert "Traceback" not in done.stderr
    assert any(outputs)
    # The same replay in this process: every log record, and the metrics text.
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Keep(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    seen: dict[str, Any] = {}

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def metrics(engine: Any) -> AsyncIterator[None]:
        from tiering.metrics import render_metrics

        yield
        seen["metrics"] = render_metrics(engine).decode()
        seen["repr"] = repr(engine) + repr(engine.tiers)

    old = os.environ.copy()
    os.environ.update(env)
    try:
        result = run_replay(load_workload("chat", 40), options, on_open=metrics)
        outputs.append(json.dumps(seen) + repr(result))
    except ConfigError as exc:  # a refused password: one line, at open
        assert server != "right password"
        outputs.append(str(exc))
    finally:
        os.environ.clear()
        os.environ.update(old)
        root.removeHandler(handler)
        root.setLevel(level)
    outputs += records
    outputs.append(repr(options))
    text = "\n".join(outputs)
    assert leaks(text, password) == [], [o for o in outputs if leaks(o, password)]
    if server == "right password":
        assert "metrics" in seen
        assert "tiering_" in seen["metrics"]
