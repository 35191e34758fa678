"""The disk tier: `DiskTier`, a persistent local-disk `SecondaryTier` (see `tier`).

Its parts: `tier` (the contract and its writes) over `shell` (admission, the
worker threads, recovery, statistics), `index` (what it holds and each write's
plan, no I/O), `opening` (the scan at open), and the file work run in worker
threads: `files` (values), `scan`, `folder` (folder and lock) and `layout`.
"""

from __future__ import annotations

from tiering.secondary.disk.layout import FSYNC_POLICIES, ScanResult
from tiering.secondary.disk.opening import DIRECT_WRITE_MIN
from tiering.secondary.disk.tier import (  # noqa: F401 (names kept from the one module)
    DEFAULT_FILE_MODE,
    SPACE_CHECK_S,
    UNWRITTEN_NO_ROOM,
    UNWRITTEN_READ_ONLY,
    DiskTier,
)

__all__ = ["DEFAULT_FILE_MODE", "DIRECT_WRITE_MIN", "FSYNC_POLICIES", "DiskTier", "ScanResult"]
