"""`tiering replay --disk`: a persistent disk tier survives the process, and a SIGKILL.

Every replay runs in a process of its own (its own CPU tier), one after another
on one folder; every loaded chunk is checked byte for byte (``--verify``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# A CPU tier far smaller than the workload's reuse: most hits of a second run
# must come from the disk, verified byte for byte.
REPLAY = [
    "replay", "--workload", "chat", "--requests", "300", "--capacity-tokens", "20480",
    "--bytes-per-token", "16", "--verify", "--json", "--concurrency", "2",
]  # fmt: skip
DISK_BYTES = str(1 << 30)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiering", *args], capture_output=True, text=True, timeout=timeout
    )


def replay(folder: Path, *extra: str) -> dict[str, Any]:
    """One `tiering replay --disk` in its own process; its JSON summary."""
    done = run(*REPLAY, "--disk", str(folder), "--disk-bytes", DISK_BYTES, *extra)
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def disk(summary: dict[str, Any]) -> dict[str, Any]:
    (tier,) = [t for t in summary["tiers"] if t["label"] == "disk"]
    return tier


def values(folder: Path) -> list[Path]:
    return list(folder.rglob("*.tkv"))


def test_a_second_process_hits_what_the_first_left_on_disk(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    first = replay(folder)
    d1 = disk(first)
    assert d1["found_at_open"] == 0
    assert d1["write_bytes"] > 0
    assert d1["chunks"] > 0
    assert (first["corrupt_chunks"], first["failed_jobs"], d1["errors"], d1["rejected"]) == (
        0, 0, 0, 0
    )  # fmt: skip
    assert len(values(folder)) == d1["chunks"]
    second = replay(folder)
    d2 = disk(second)
    assert d2["found_at_open"] == d1["chunks"]  # every value the first run left
    assert d2["dropped_at_open"] == {}
    assert second["hit_blocks_by_tier"]["disk"] > first["hit_blocks_by_tier"]["disk"]
    assert second["hit_rate"] > first["hit_rate"]
    assert (second["corrupt_chunks"], second["failed_jobs"], d2["errors"], d2["rejected"]) == (
        0, 0, 0, 0
    )  # fmt: skip
    by_tier = second["hit_blocks_by_tier"]
    assert set(by_tier) == {"cpu", "disk"}
    assert sum(by_tier.values()) == second["hit_blocks"]
    assert d2["hit_blocks"] == by_tier["disk"]
    assert d2["used_bytes"] <= d2["capacity_bytes"] == int(DISK_BYTES)


def test_the_summary_names_each_tier_and_bad_flags_exit_2(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    done = run(*[a for a in REPLAY if a != "--json"], "--disk", str(folder), "--disk-bytes",
               DISK_BYTES)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = {line.split("  ")[0]: line for line in done.stdout.splitlines()}
    assert "found 0 chunks at open" in lines["disk tier"]
    assert "hit blocks" in lines["disk tier"]
    assert lines["hit by tier"].startswith("hit by tier     cpu ")
    assert "none (--remote)" in lines["remote tier"]
    for args, words in (
        (["--disk", str(folder)], "--disk-bytes"),
        (["--disk-bytes", "100"], "--disk DIR"),
        (["--disk", str(folder), "--disk-bytes", "100"], "holds no value"),
        (["--disk", str(tmp_path / "file"), "--disk-bytes", DISK_BYTES], "is a file"),
    ):
        (tmp_path / "file").write_text("not a folder")
        bad = run(*REPLAY, *args)
        assert bad.returncode == 2, bad.stderr
        assert words in bad.stderr
        assert "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


def test_one_replay_owns_the_folder_at_a_time(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    hold = subprocess.Popen(
        [sys.executable, "-m", "tiering", *REPLAY, "--disk", str(folder), "--disk-bytes",
         DISK_BYTES, "--requests", "20", "--metrics-port", "0", "--hold", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hold.stderr is not None
        assert "serving metrics" in hold.stderr.readline()  # open: it holds the folder
        second = run(*REPLAY, "--disk", str(folder), "--disk-bytes", DISK_BYTES)
        assert second.returncode == 2
        assert f"in use by process {hold.pid}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        hold.kill()
        hold.communicate()  # and close its pipes
    assert replay(folder)["corrupt_chunks"] == 0  # a dead owner's lock is free


def test_a_replay_killed_mid_run_leaves_a_folder_the_next_one_opens(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    killed = subprocess.Popen(
        [sys.executable, "-m", "tiering", *REPLAY, "--disk", str(folder), "--disk-bytes",
         DISK_BYTES, "--requests", "3000", "--bytes-per-token", "512"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(values(folder)) < 200 and time.monotonic() < deadline:
        assert killed.poll() is None, "the replay ended before it was killed"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left = len(values(folder))
    assert left >= 200
    # What a write was doing when the process died: a value under its temporary name.
    shard = next(p for p in (folder).rglob("*") if p.is_dir() and len(p.name) == 2)
    (shard / "deadbeef.tkv.999-1.tmp").write_bytes(b"half a value")
    after = replay(folder, "--bytes-per-token", "512")
    d = disk(after)
    assert d["found_at_open"] >= left - 8  # at most a batch in flight was cut short
    assert d["dropped_at_open"].get("half-written", 0) >= 1
    assert set(d["dropped_at_open"]) <= {"half-written", "bad_length", "bad_magic"}
    assert (after["corrupt_chunks"], after["failed_jobs"], d["errors"], d["rejected"]) == (
        0, 0, 0, 0
    )  # fmt: skip
    assert after["hit_blocks_by_tier"]["disk"] > 0
    assert not list(folder.rglob("*.tmp"))  # nothing half-written is left


def test_a_namespace_folder_that_is_a_link_or_a_file_is_one_line_naming_it(
    tmp_path: Path,
) -> None:
    # the refusal once said "not a regular file" of a folder, and of a regular file
    folder = tmp_path / "disk"
    small = ["--disk", str(folder), "--disk-bytes", DISK_BYTES, "--requests", "5"]
    assert run(*REPLAY, *small).returncode == 0
    (namespace,) = [p for p in folder.iterdir() if p.is_dir()]
    elsewhere = tmp_path / "elsewhere"
    namespace.rename(elsewhere)
    for make in (lambda: namespace.symlink_to(elsewhere), lambda: namespace.write_text("x")):
        make()
        bad = run(*REPLAY, *small)
        assert bad.returncode == 2, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert f"{namespace.name} is a symbolic link or not a folder" in bad.stderr
        assert "not a regular file" not in bad.stderr
        namespace.unlink()
