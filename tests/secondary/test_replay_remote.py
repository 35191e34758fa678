"""`tiering replay --remote`: engines in separate processes share chunks through real Redis."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .conftest import RedisClusterRig, RedisServer

# A tier far smaller than the workload's reuse: most hits of the second run
# must come from the remote tier, verified byte for byte.
REPLAY = [
    "replay", "--workload", "chat", "--requests", "300", "--capacity-tokens", "20480",
    "--bytes-per-token", "16", "--verify", "--json",
]  # fmt: skip


def replay(url: str, *extra: str, timeout: float = 120) -> dict[str, Any]:
    """One `tiering replay` in its own process (its own CPU tier); its JSON summary."""
    done = subprocess.run(
        [sys.executable, "-m", "tiering", *REPLAY, "--remote", url, *extra],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def check_shared(url: str) -> None:
    first = replay(url, "--remote-namespace", "shared")
    assert first["remote_write_bytes"] > 0
    assert (first["corrupt_chunks"], first["remote_errors"]) == (0, 0)
    second = replay(url, "--remote-namespace", "shared")
    assert second["remote_hit_blocks"] > first["remote_hit_blocks"]
    assert second["hit_rate"] > first["hit_rate"]
    assert (second["corrupt_chunks"], second["failed_jobs"], second["remote_errors"]) == (0, 0, 0)
    # Another namespace shares nothing, though the keys are the same: like the
    # first run, it only hits what it wrote itself.
    other = replay(url, "--remote-namespace", "other")
    assert other["remote_hit_blocks"] < second["remote_hit_blocks"]
    assert other["corrupt_chunks"] == 0


def test_a_second_process_hits_what_the_first_stored(redis_server: RedisServer) -> None:
    check_shared(redis_server.url)


def test_the_same_on_a_redis_cluster(redis_cluster: RedisClusterRig) -> None:
    check_shared(redis_cluster.url)


def test_redis_killed_mid_replay_and_restarted(own_redis_server: RedisServer) -> None:
    url = own_redis_server.url
    client = own_redis_server.client()
    client.config_set("notify-keyspace-events", "E$")  # an event per SET
    events = client.pubsub(ignore_subscribe_messages=True)
    events.subscribe("__keyevent@0__:set")
    run = subprocess.Popen(
        [sys.executable, "-m", "tiering", *REPLAY, "--requests", "4000", "--remote", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Wait (on the server's events, not a clock) until the replay is well under way.
        deadline = time.monotonic() + 60
        sets = 0
        while sets < 200:
            assert time.monotonic() < deadline, f"the replay wrote {sets} chunks in a minute"
            assert run.poll() is None, "the replay ended early"
            sets += events.get_message(timeout=1.0) is not None
        events.close()
        client.close()
        own_redis_server.kill()
        # The port answers, but only to close each connection: once the tier has
        # tried one, it has seen the outage (and counted it). Then Redis is back.
        with socket.create_server(("127.0.0.1", own_redis_server.port)) as stand_in:
            stand_in.settimeout(60)
            connection, _ = stand_in.accept()
            connection.close()
        own_redis_server.start()  # same port: the tier reconnects by itself
        out, err = run.communicate(timeout=180)
    finally:
        run.kill()
    assert run.returncode == 0, err
    summary = json.loads(out)
    assert summary["requests"] == 4000  # the replay completed
    assert (summary["corrupt_chunks"], summary["failed_jobs"]) == (0, 0)
    assert summary["remote_errors"] > 0  # the outage was counted, never hidden
    # ... apart from the write-throughs it cost, which say why they were dropped.
    assert summary["remote_writes_dropped"] == sum(
        summary["remote_writes_dropped_by_reason"].values()
    )
    assert summary["remote_writes_dropped"] > 0
    after = replay(url)  # the tier is back for the next engine
    assert after["remote_write_bytes"] > 0


def test_a_wrong_password_is_one_clear_line(redis_acl_server: RedisServer, tmp_path: Path) -> None:
    url = f"redis://default@127.0.0.1:{redis_acl_server.port}/0"
    password = tmp_path / "password"
    password.write_text("wrong\n")
    password.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-m", "tiering", *REPLAY, "--remote", url,
         "--remote-password-file", str(password)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "wrong" not in lines[0]  # the password is never shown
    assert str(redis_acl_server.port) in lines[0]


def test_a_password_on_the_command_line_is_warned_of_never_shown(
    redis_acl_server: RedisServer,
) -> None:
    """A password in --remote's URL works, and is said to be readable by others (ps, the
    shell's history), with the flags that keep it off the command line."""
    url = f"redis://default:wrong@127.0.0.1:{redis_acl_server.port}/0"
    done = subprocess.run(
        [sys.executable, "-m", "tiering", *REPLAY, "--remote", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr  # the warning, then the refusal
    assert lines[0].startswith("tiering: warning: --remote's URL holds a password")
    assert "--remote-url-env" in lines[0]
    assert "--remote-password-file" in lines[0]
    assert "wrong" not in done.stderr


def test_a_full_redis_is_shown_in_the_summary_by_reason(own_redis_server: RedisServer) -> None:
    """Under ``maxmemory`` with ``noeviction`` the summary says how many write-throughs
    were dropped and why (refused OOM, then backing off), not "0 errors"."""
    client = own_redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (256 << 10))
    client.close()
    summary = replay(own_redis_server.url)
    dropped = summary["remote_writes_dropped_by_reason"]
    assert dropped.get("refused OOM", 0) > 0
    assert dropped.get("backing off", 0) > 0  # after a refusal, writes were not all sent
    assert summary["remote_writes_dropped"] == sum(dropped.values())
    assert summary["remote_errors"] == 0  # nothing failed: the server refused, and said so
    assert (summary["remote_rejected"], summary["remote_rejected_by_reason"]) == (0, {})
    assert (summary["corrupt_chunks"], summary["failed_jobs"]) == (0, 0)

    table = [a for a in REPLAY if a != "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "tiering", *table, "--remote", own_redis_server.url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = [row for row in done.stdout.splitlines() if row.startswith("remote tier")]
    assert "chunk writes dropped (" in line
    assert "refused OOM" in line
    assert "backing off" in line
    assert "commands refused by the store: " in line  # reads' refusals would show here too
    assert summary["remote_refused_by_reason"]["OOM"] == dropped["refused OOM"]


def _disk(folder: Path) -> list[str]:
    return ["--disk", str(folder), "--disk-bytes", str(1 << 30)]


def test_disk_then_redis_each_hit_counted_where_it_came_from(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    first = replay(redis_server.url, *_disk(tmp_path / "one"), "--remote-namespace", "chain")
    assert first["hit_blocks_by_tier"].keys() == {"cpu", "disk", "remote"}
    assert [t["label"] for t in first["tiers"]] == ["disk", "remote"]
    # A new disk: what the first run wrote through to Redis comes back from there.
    second = replay(redis_server.url, *_disk(tmp_path / "two"), "--remote-namespace", "chain")
    by_tier = second["hit_blocks_by_tier"]
    assert by_tier["remote"] > first["hit_blocks_by_tier"]["remote"]
    assert sum(by_tier.values()) == second["hit_blocks"]
    assert second["corrupt_chunks"] == 0
    assert all(t["errors"] == 0 and t["rejected"] == 0 for t in second["tiers"])
