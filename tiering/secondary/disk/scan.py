"""Opening a `DiskTier`: what its folder holds, found by a scan of the values' heads.

`DiskScan.scan` runs in a thread of its own at open (and after the folder was
made again); it reads 4 KiB a value, never a payload (checked at each read).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from tiering._types import OffloadKey
from tiering.secondary.codec import Verdict
from tiering.secondary.disk.folder import DiskFolder
from tiering.secondary.disk.layout import (
    BLOCK,
    KEPT_VERSION,
    NOT_REGULAR,
    READ,
    SHARD_NAMES,
    SUFFIX,
    TMP_SUFFIX,
    NotRegular,
    ScanResult,
    check_regular,
    entries,
    head_buffer,
    head_bytes,
    open_at,
    open_folder_at,
)

__all__ = ["DiskScan"]


class DiskScan(DiskFolder):
    """`DiskFolder` and the scan of what it holds (see `scan`)."""

    def scan(self) -> ScanResult:
        """Every sound value of this namespace, oldest use first; drop what is not sound.

        A value is sound when its header passes every check of the codec but
        the checksum (checked at each read) and its file has the right length.
        Half-written values (temporary names) and values that fail are deleted,
        unless the tier is read-only; but a value of a format version this tier
        does not read (a keyed value where no key is given, or a later
        release's) is only left out (counted ``bad_version``): a run started
        once without the key must not delete the keyed tier's values. What is not a
        regular file (a link, FIFO, socket, device or folder where a value or a
        shard belongs) is never opened through, never blocks the scan and is never
        deleted: counted, left alone.
        """
        start = time.perf_counter()
        values: list[tuple[OffloadKey, int, int]] = []
        dropped: dict[str, int] = {}
        odd = 0  # not regular files

        def drop(folder: int, name: str, reason: str) -> None:
            dropped[reason] = dropped.get(reason, 0) + 1
            if reason == KEPT_VERSION:
                return  # another release's or another key's value: not this tier's to delete
            if not self.read_only:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=folder)

        held = self._enter()
        try:
            for shard in entries(held.fd):
                name = shard.name
                if not shard.is_dir(follow_symlinks=False):
                    if name.endswith(TMP_SUFFIX) and shard.is_file(follow_symlinks=False):
                        drop(held.fd, name, "half-written")
                    elif name.endswith(TMP_SUFFIX) or name in SHARD_NAMES:
                        odd += 1
                    continue
                try:
                    if name in SHARD_NAMES:
                        folder, own = self._shard(held, name), False
                    else:  # not a shard the tier makes: looked into, not kept open
                        folder, own = open_folder_at(held.fd, name, 0, create=False), True
                except NotRegular:  # replaced by a link since listed
                    odd += 1
                    continue
                except FileNotFoundError:
                    continue
                try:
                    odd += self._scan_shard(folder, name, values, drop)
                finally:
                    if own:
                        os.close(folder)
        finally:
            held.exit()
        values.sort(key=lambda v: v[2])
        foreign = sum(
            1
            for entry in entries(self.root)
            if entry.is_dir(follow_symlinks=False) and entry.name != self.folder.name
        )
        return ScanResult(
            values=values,
            dropped=dropped,
            foreign_namespaces=foreign,
            seconds=time.perf_counter() - start,
            not_regular=odd,
        )

    def _scan_shard(
        self,
        folder: int,
        shard: str,
        values: list[tuple[OffloadKey, int, int]],
        drop: Any,
    ) -> int:
        """Scan one shard folder into ``values`` (dropping what is not sound); how many of
        its entries are not regular files."""
        odd = 0
        for entry in entries(folder):
            name = entry.name
            if not name.endswith((SUFFIX, TMP_SUFFIX)):
                continue
            if not entry.is_file(follow_symlinks=False):  # the listing's type: no open
                odd += 1
            elif name.endswith(TMP_SUFFIX):
                drop(folder, name, "half-written")
            else:
                found = self._check_file(folder, name)
                if found == NOT_REGULAR:  # replaced since listed
                    odd += 1
                elif isinstance(found, str):
                    drop(folder, name, found)
                elif self.where(found[0]) != (shard, name):
                    drop(folder, name, "misnamed")
                else:
                    values.append(found)
        return odd

    def _check_file(self, folder: int, name: str) -> tuple[OffloadKey, int, int] | str:
        """``(key, bytes, mtime)`` of a sound value file, else why not."""
        try:
            fd = open_at(os, folder, name, READ)
        except NotRegular:
            return NOT_REGULAR
        except OSError:
            return "unreadable"
        try:
            st = check_regular(fd, name)
            head = head_buffer(BLOCK)
            got = os.preadv(fd, [head], 0)
            key_bytes = self.codec.peek_key_bytes(head[:got])
            if key_bytes is None:
                return Verdict.BAD_MAGIC.value
            view = head[:got]
            if key_bytes > got:  # a long key: its head spans more than one block
                view = memoryview(os.pread(fd, key_bytes, 0))
            long_key = self.codec.peek_key(view)
            if long_key is not None and self.codec.header_bytes(long_key) > view.nbytes:
                # the whole head: a keyed value's tag area follows its key
                view = memoryview(os.pread(fd, self.codec.header_bytes(long_key), 0))
        except NotRegular:
            return NOT_REGULAR
        except OSError:
            return "unreadable"
        finally:
            os.close(fd)
        key = self.codec.peek_key(view)
        if key is None:
            return Verdict.BAD_LENGTH.value
        verdict = self._check_head(key, view, st.st_size)
        if verdict is not None:
            return verdict.value
        return key, st.st_size, st.st_mtime_ns

    def _check_head(self, key: OffloadKey, head: memoryview, file_bytes: int) -> Verdict | None:
        """The failed check of a value file's head (None: it passes), given its size."""
        codec = self.codec
        size = head_bytes(codec, key)
        if file_bytes < size:
            # Too short for its head: judged as the codec judges a short value.
            verdict = codec.check_head(key, head, min(file_bytes, head.nbytes))
            return verdict if isinstance(verdict, Verdict) else Verdict.BAD_LENGTH
        found = codec.check_head(key, head, file_bytes - size + codec.header_bytes(key))
        if isinstance(found, Verdict):
            return found
        pad = head[codec.header_bytes(key) : size]
        if pad.nbytes and pad != bytes(pad.nbytes):  # a C compare, not any()
            return Verdict.BAD_LENGTH  # not a head this format writes
        return None
