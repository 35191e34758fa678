"""Host memory for the CPU tier: one exact-size mapping, viewed as a tensor.

Why not ``torch.empty(..., pin_memory=True)``: torch's pinned allocator rounds
every request up to a power of two, so a 40 GiB tier would reserve 64 GiB of
host RAM. Here the tier is one anonymous mapping (or one file in ``/dev/shm``
when several processes share it) of exactly the size asked, rounded only to
the host page size; ``torch.frombuffer`` views it without copying. Pinning for
DMA is the CUDA backend's business (``cudaHostRegister`` over this region).

Pages are touched lazily unless ``populate=True``; `resident_bytes` reports
how much of the pool is in RAM right now (``mincore``), so "the pool costs its
size, not twice it" can be checked.

Shared pools are never left behind. A file in ``/dev/shm`` outlives a process
killed before it removed it (SIGKILL, OOM, a crash before the other process
mapped it and removed the name), and holds its size of RAM until a reboot. So
tiering names its shared files ``tiering-<pid>-<tag>`` (`shm_file_name`,
`SHM_NAME_PATTERN`), ``<pid>`` the process that made it, created 0600; and
every new shared pool first sweeps (`sweep_stale_pools`) the files of that
pattern whose process no longer lives. It removes only what it can tell is
tiering's and dead: a name of that pattern, a regular file (``lstat`` through
the folder's descriptor, no link followed), owned by this user, whose pid
``kill(pid, 0)`` answers "no such process" (``EPERM``: alive, another user's),
and that no process maps: its creator takes a shared ``flock`` on it, which
lasts as long as a mapping does, and the sweep removes only a file whose
exclusive lock it gets at once. A pid reused by a new process keeps its file
until that one ends too. A ``/dev/shm`` shared by processes of different pid
namespaces (containers run with ``--ipc=host``) cannot tell their pids apart:
the lock keeps a live process's file from a sweep there, but a file left by a
process of another namespace whose pid lives here waits for that pid to end.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import sys
import threading

import msgspec
import numpy as np
import torch

from tiering._state import Lifecycle
from tiering.errors import CapacityError, ConfigError, ResourceClosedError

__all__ = [
    "SHM_NAME_PATTERN",
    "HostMemoryPool",
    "PoolStatistics",
    "SweepResult",
    "available_host_bytes",
    "shm_file_name",
    "sweep_stale_pools",
]

logger = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
SHM_DIR = "/dev/shm"
#: The name of every shared pool file tiering makes: ``tiering-<pid>-<tag>``.
SHM_NAME_PATTERN = re.compile(r"tiering-(?P<pid>[1-9][0-9]{0,9})-(?P<tag>[^/]+)")


def shm_file_name(tag: str, pid: int | None = None) -> str:
    """The shared pool file name of ``tag`` made by process ``pid`` (default: this one)."""
    name = f"tiering-{os.getpid() if pid is None else pid}-{tag}"
    if not tag or SHM_NAME_PATTERN.fullmatch(name) is None:
        raise CapacityError(f"a shared pool's tag must be a non-empty file name, got {tag!r}")
    return name


class SweepResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `sweep_stale_pools` did: the names it removed, and those it could not."""

    removed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    except (OverflowError, ValueError):  # beyond any pid: not a name tiering made
        return True
    return True


def _mapped(name: str, dir_fd: int, st: os.stat_result) -> bool:
    """Whether a process still holds the pool file ``name`` (``st``): its creator's
    shared lock, which lasts as long as a mapping of it does. Unknown (it cannot be
    opened, or is another file now) counts as held: the file is left alone."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return True
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nothing maps it
    except OSError:  # BlockingIOError: held
        return True
    finally:
        os.close(fd)
    return False


def sweep_stale_pools(shm_dir: str = SHM_DIR) -> SweepResult:
    """Remove the shared pool files of processes that no longer live (see the module note).

    Only names of `SHM_NAME_PATTERN`, regular files (never through a link),
    owned by this user, of a pid with no process. Each removal is logged; a
    file that cannot be removed is logged as a warning and returned in
    ``failed``. Returns at once where ``shm_dir`` does not exist.
    """
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return SweepResult()
    removed: list[str] = []
    failed: list[str] = []
    try:
        uid, me = os.geteuid(), os.getpid()
        for name in os.listdir(dir_fd):
            found = SHM_NAME_PATTERN.fullmatch(name)
            if found is None:
                continue
            pid = int(found["pid"])
            if pid == me or _pid_alive(pid):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                    continue  # not a file tiering made: left alone
                if _mapped(name, dir_fd, st):
                    continue  # a live process of another pid namespace: its pid means nothing here
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # another sweep was first
            except OSError as exc:
                failed.append(name)
                logger.warning(
                    "host memory pool: cannot remove %s/%s, left by process %d that no longer "
                    "lives: %s",
                    shm_dir,
                    name,
                    pid,
                    exc,
                )
                continue
            removed.append(name)
            logger.info(
                "host memory pool: removed %s/%s (%d bytes), left by process %d that no "
                "longer lives",
                shm_dir,
                name,
                st.st_size,
                pid,
            )
    finally:
        os.close(dir_fd)
    return SweepResult(removed=tuple(removed), failed=tuple(failed))


class PoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a `HostMemoryPool`."""

    nbytes: int
    mapped_bytes: int
    resident_bytes: int | None  # None unless asked for: measuring scans the whole region
    shared: bool
    closed: bool


def available_host_bytes(shm_dir: str | None = None) -> int:
    """Bytes a new allocation can take: ``MemAvailable``, and free space of ``shm_dir`` if given."""
    avail = _mem_available()
    if shm_dir is not None:
        st = os.statvfs(shm_dir)
        avail = min(avail, st.f_bavail * st.f_frsize)
    return avail


def _mem_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _fmt(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


class HostMemoryPool:
    """One exact-size host allocation for the whole CPU tier.

    Guarantees: the mapping is ``nbytes`` rounded up to the host page size and
    page-aligned; construction refuses (`CapacityError`, saying how much was
    asked and how much there is) a pool that does not fit in the available
    memory (or ``/dev/shm`` space); `close` is idempotent and unmaps the
    region as soon as no tensor view of it is left alive (views handed out by
    `tensor`/`words` keep the memory mapped, never dangling).

    ``shm_name`` puts the pool in ``/dev/shm/<shm_name>`` so other processes can
    map it: with ``create=True`` the file must not exist, is made 0600 and is
    removed on close, and first the files dead processes left are swept
    (`sweep_stale_pools`; name yours with `shm_file_name` to be swept in turn);
    with ``create=False`` an existing file of exactly ``nbytes`` is mapped (no
    space check: it is already paid for).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        shm_name: str | None = None,
        create: bool = True,
        populate: bool = False,
    ) -> None:
        if nbytes < 1:
            raise CapacityError(f"a host memory pool needs at least 1 byte, got {nbytes}")
        self.nbytes = nbytes
        self.mapped_bytes = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        self._lock = threading.Lock()
        self._path: str | None = None
        self._owns_file = False
        if shm_name is not None and ("/" in shm_name or not shm_name):
            raise CapacityError(f"shm_name must be a plain file name, got {shm_name!r}")
        if shm_name is not None and create:
            sweep_stale_pools()  # first: what they hold counts as free space again
        if shm_name is None or create:
            avail = available_host_bytes(SHM_DIR if shm_name is not None else None)
            if self.mapped_bytes > avail:
                where = f"{SHM_DIR} space and MemAvailable" if shm_name else "MemAvailable"
                raise CapacityError(
                    f"the CPU tier asks for {nbytes} bytes ({_fmt(nbytes)}) of host memory, "
                    f"but only {avail} bytes ({_fmt(avail)}) are available ({where}); "
                    "make the tier smaller"
                )
        flags = mmap.MAP_SHARED
        if populate:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        if shm_name is None:
            self._mmap = mmap.mmap(-1, self.mapped_bytes, flags=flags)
        else:
            self._path = os.path.join(SHM_DIR, shm_name)
            self._mmap = self._map_file(self._path, create, flags)
            self._owns_file = create
        self._tensor: torch.Tensor | None = torch.frombuffer(
            self._mmap, dtype=torch.uint8, count=nbytes
        )
        self.data_ptr: int = self._tensor.data_ptr()
        self._life = Lifecycle("the host memory pool", opened=True)  # under _lock

    def _map_file(self, path: str, create: bool, flags: int) -> mmap.mmap:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                # Exactly 0600 whatever the umask: this user's other process maps it
                # read-write, and no one else reads the rows (users' KV data).
                os.fchmod(fd, 0o600)
                # Held while any mapping of it lives (the mapping keeps the open file):
                # what tells a sweep of another pid namespace that it is not stale.
                fcntl.flock(fd, fcntl.LOCK_SH)
                # Reserve the space now: a sparse tmpfs file would SIGBUS on a full /dev/shm.
                os.posix_fallocate(fd, 0, self.mapped_bytes)
                return mmap.mmap(fd, self.mapped_bytes, flags=flags)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                raise
            finally:
                os.close(fd)
        foreign = ConfigError(
            f"{path} is not a regular file of this user (a link, a device, another user's "
            "file): not a pool tiering made, so it is not mapped; remove it"
        )
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link
                raise foreign from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise foreign
            size = st.st_size
            if size < self.nbytes:
                raise CapacityError(f"{path} holds {size} bytes, but the pool needs {self.nbytes}")
            return mmap.mmap(fd, self.mapped_bytes, flags=flags)
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def shared(self) -> bool:
        return self._path is not None

    @property
    def tensor(self) -> torch.Tensor:
        """The pool as a flat ``uint8`` tensor of ``nbytes`` elements (zero-copy)."""
        t = self._tensor
        if t is None:
            raise ResourceClosedError("the host memory pool is closed")
        return t

    def words(self, dtype: torch.dtype) -> torch.Tensor:
        """The pool as a flat tensor of ``dtype`` (``nbytes`` must be a multiple of its size)."""
        return self.tensor.view(dtype)

    def resident_bytes(self) -> int:
        """Bytes of the pool in RAM now (pages counted by ``mincore``); 0 once closed."""
        with self._lock:
            if self._life.closed:
                return 0
            return _resident_bytes(self.data_ptr, self.mapped_bytes)

    def statistics(self, *, resident: bool = True) -> PoolStatistics:
        """A snapshot; ``resident=False`` skips `resident_bytes` (a scan of every page)."""
        return PoolStatistics(
            nbytes=self.nbytes,
            mapped_bytes=self.mapped_bytes,
            resident_bytes=self.resident_bytes() if resident else None,
            shared=self.shared,
            closed=self.closed,
        )

    def close(self) -> None:
        """Release the pool. Idempotent.

        The region is unmapped now if no view of it is alive, else when the
        last view is garbage-collected (a view never points at unmapped memory).
        """
        with self._lock:
            if not self._life.close_now():
                return
            self._tensor = None
            mm = self._mmap
            del self._mmap
            # Ours plus getrefcount's argument; every torch storage viewing the
            # mapping holds one more reference.
            if sys.getrefcount(mm) <= 2:
                mm.close()
            else:
                logger.debug("host memory pool: views still alive, unmapping when they are freed")
            del mm
            if self._owns_file and self._path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path)

    def __enter__(self) -> HostMemoryPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"<HostMemoryPool [closed, {self.nbytes} bytes]>"
        where = f", {self._path}" if self._path else ""
        return (
            f"<HostMemoryPool [{_fmt(self.nbytes)}, {_fmt(self.resident_bytes())} resident{where}]>"
        )


_libc: ctypes.CDLL | None = None


def _resident_bytes(addr: int, length: int) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc.mincore.restype = ctypes.c_int
    vec = np.zeros(length // PAGE_SIZE, dtype=np.uint8)
    if _libc.mincore(addr, length, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return int(np.count_nonzero(vec & 1)) * PAGE_SIZE
