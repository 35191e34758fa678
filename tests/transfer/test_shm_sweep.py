"""Shared host pools in /dev/shm are never left behind by a process that died.

Before: a pool file outlived a process killed before it removed it (its RAM
held until a reboot), and its name carried no pid, so no later start could
tell it was stale. Now tiering names its files ``tiering-<pid>-<tag>`` (0600),
and every new shared pool first removes the files of that pattern whose
process no longer lives: regular files of this user only, never through a
link, never another name, never a live process's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiering.errors import ConfigError
from tiering.transfer import HostMemoryPool
from tiering.transfer.memory import SHM_DIR, SHM_NAME_PATTERN, shm_file_name, sweep_stale_pools

MIB = 1 << 20

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"no {SHM_DIR} here")


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@contextlib.contextmanager
def pool_in_a_child(name_code: str, made: list[Path]) -> Iterator[tuple[int, Path]]:
    """A process holding a shared pool named by the expression ``name_code`` (its pid
    and the pool's file), SIGKILLed when the block ends: nothing of it removes the file."""
    script = (
        "import sys, threading\n"
        "from tiering.transfer import HostMemoryPool\n"
        "from tiering.transfer.memory import shm_file_name\n"
        f"pool = HostMemoryPool({MIB}, shm_name={name_code})\n"
        "print(pool._path, flush=True)\n"
        "threading.Event().wait()\n"  # until killed
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            path = Path(child.stdout.readline().strip())
            made.append(path)
            yield child.pid, path
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()


@pytest.fixture
def tag() -> str:
    return f"sweep-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def made(tag: str) -> Iterator[list[Path]]:
    """Paths a test makes in /dev/shm; whatever is left of them is removed after it."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        if path.parent != Path(SHM_DIR):  # a child that died before it said: nothing made
            continue
        with contextlib.suppress(OSError):  # each one, whatever the others did
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                path.rmdir()


def test_names_carry_the_pid_in_a_documented_pattern(tag: str) -> None:
    name = shm_file_name(tag)
    assert name == f"tiering-{os.getpid()}-{tag}"
    found = SHM_NAME_PATTERN.fullmatch(name)
    assert found is not None
    assert (int(found["pid"]), found["tag"]) == (os.getpid(), tag)
    assert shm_file_name(tag, pid=7) == f"tiering-7-{tag}"
    for bad in ("", "a/b"):
        with pytest.raises(Exception, match="tag must be a non-empty file name"):
            shm_file_name(bad)


def test_a_pool_of_a_killed_process_is_swept_by_the_next_pool(tag: str, made: list[Path]) -> None:
    with pool_in_a_child(f"shm_file_name({tag + '-killed'!r})", made) as (pid, stale):
        pass
    assert stale.name == f"tiering-{pid}-{tag}-killed"
    assert stale.is_file()  # SIGKILL: nothing removed it
    assert stat.S_IMODE(stale.stat().st_mode) == 0o600
    with HostMemoryPool(MIB, shm_name=shm_file_name(tag)) as pool:
        assert pool.shared
        assert not stale.exists()  # the next start swept it
    assert not Path(SHM_DIR, shm_file_name(tag)).exists()  # and its own is gone on close


def test_only_tiering_files_of_dead_processes_are_swept(tag: str, made: list[Path]) -> None:
    shm = Path(SHM_DIR)
    dead = dead_pid()
    stale = shm / shm_file_name(f"{tag}-stale", dead)
    live = shm / shm_file_name(f"{tag}-live", os.getppid())  # a process that lives
    mine = shm / shm_file_name(f"{tag}-mine")  # this process's own
    foreign = shm / f"other-{dead}-{tag}"  # not tiering's name
    unpatterned = shm / f"tiering-x{dead}-{tag}"  # tiering's prefix, not its pattern
    target = shm / f"target-{tag}"  # what a link points at
    link = shm / shm_file_name(f"{tag}-link", dead)
    folder = shm / shm_file_name(f"{tag}-dir", dead)
    made.extend([stale, live, mine, foreign, unpatterned, target, link, folder])
    for path in (stale, live, mine, foreign, unpatterned, target):
        path.write_bytes(b"kv")
    link.symlink_to(target)
    folder.mkdir()
    result = sweep_stale_pools()
    assert stale.name in result.removed
    assert not stale.exists()
    for kept in (live, mine, foreign, unpatterned, target, folder):
        assert kept.exists(), kept
    assert link.is_symlink()  # a link is never followed, never removed
    assert target.read_bytes() == b"kv"
    assert not {p.name for p in (live, mine, foreign, unpatterned, link, folder)} & set(
        result.removed
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_another_users_file_is_left_alone(tag: str, made: list[Path]) -> None:
    theirs = Path(SHM_DIR) / shm_file_name(tag, dead_pid())
    made.append(theirs)
    theirs.write_bytes(b"kv")
    os.chown(theirs, 65534, 65534)
    assert theirs.name not in sweep_stale_pools().removed
    assert theirs.exists()


def test_a_pool_file_is_0600_whatever_the_umask(tag: str) -> None:
    old = os.umask(0)
    try:
        with HostMemoryPool(MIB, shm_name=shm_file_name(tag)):
            mode = os.stat(Path(SHM_DIR, shm_file_name(tag))).st_mode
    finally:
        os.umask(old)
    assert stat.S_IMODE(mode) == 0o600


def test_a_link_where_a_pool_is_mapped_is_refused(tag: str, made: list[Path]) -> None:
    target = Path(SHM_DIR) / f"target-{tag}"
    link = Path(SHM_DIR) / shm_file_name(tag)
    made.extend([target, link])
    target.write_bytes(b"\0" * MIB)
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="not a regular file of this user"):
        HostMemoryPool(MIB, shm_name=link.name, create=False)


def test_a_pool_a_live_process_maps_is_kept_whatever_pid_its_name_carries(
    tag: str, made: list[Path]
) -> None:
    """Containers that share /dev/shm (``--ipc=host``) have their own pids: a live
    worker's name may carry a pid that no process has here. Before, a sweep there
    removed that live pool before its scheduler mapped it; now the creator's lock,
    held as long as it is mapped, keeps it, and only its death frees it."""
    name = shm_file_name(tag, dead_pid())  # a pid that means nothing here
    with pool_in_a_child(repr(name), made) as (_, path):
        assert path.name == name
        assert name not in sweep_stale_pools().removed
        assert path.is_file()  # mapped by a live process: kept
    sweep_stale_pools()
    assert not path.exists()  # its mapping gone with it: swept (by this sweep or another's)
