"""Payload checksums of the value format: XXH3 (written), ML64 and CRC-32 (read).

A write checksums its row in one extra pass over memory, on the writing
thread, so the checksum's speed bounds the remote tier's write throughput:

- XXH3 (64 bits, the ``xxhash`` package, seed 0) runs at memory speed on a
  cold row and several times faster than ML64 on every row (the figures:
  README.md, beside ``checksum="ml64"``). It is what a value is written with.
- ML64 below (numpy only) was written by format version 1 before XXH3, and
  such values are still read and checked.
- CRC-32 (``zlib.crc32``, the slowest of the three in CPython) is read too.

ML64 is a *multilinear hash* modulo 2**64, computed by one numpy sum of
products::

    w_i = the payload's 64-bit little-endian words (the last one zero-padded)
    k_i = splitmix64 output number i + 1 (seed 0), with its lowest bit set
    ML64 = sum(k_i * w_i) mod 2**64

What it catches (it is an error check, not a MAC: the keys are public):
every change confined to one word, always (each ``k_i`` is odd, so invertible
modulo 2**64), hence every single-bit error and every burst within a word;
for damage over many words (torn or mixed-up values, words moved, garbage),
a collision takes ``sum(d_i * k_i) == 0 mod 2**64`` for the differences
``d_i``, which for damage that does not conspire with the keys happens about
once in 2**64, against CRC-32's once in 2**32. Lengths, keys and namespaces are
checked by the header, not by the checksum.

The keys are part of the wire format: `splitmix64` is defined here, in numpy
integer arithmetic (wrapping modulo 2**64), and pinned by tests.
"""

from __future__ import annotations

import enum
import threading
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

if TYPE_CHECKING:
    from hmac import HMAC

__all__ = ["Checksum", "checksum", "checksum_copy", "mac_copy", "ml64", "splitmix64"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1
#: Bytes checksummed, then copied, at a time: the copy reads what is still in cache.
_SLICE = 256 << 10


class Checksum(enum.IntEnum):
    """The checksum kinds a value header may name (its byte on the wire)."""

    CRC32 = 1  # zlib.crc32: 32 bits
    ML64 = 2  # the multilinear hash above: 64 bits
    XXH3 = 3  # xxhash's XXH3_64bits, seed 0: 64 bits


def splitmix64(count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """The first ``count`` outputs of splitmix64 seeded with 0 (output 1 is 0xE220A8397B1DCDAF)."""
    z = np.arange(1, count + 1, dtype=np.uint64) * _GAMMA
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    out: np.ndarray[Any, np.dtype[np.uint64]] = z ^ (z >> np.uint64(31))
    return out


class _Keys:
    """ML64's key table, grown on demand and shared by every codec (rows are mostly one size)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: np.ndarray[Any, np.dtype[np.uint64]] = np.empty(0, dtype=np.uint64)

    def get(self, count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
        keys = self._keys
        if len(keys) < count:
            with self._lock:
                keys = self._keys
                if len(keys) < count:
                    keys = splitmix64(count) | np.uint64(1)
                    keys.flags.writeable = False
                    self._keys = keys
        return keys[:count]


_KEYS = _Keys()


def ml64(data: memoryview) -> int:
    """ML64 of ``data`` (a contiguous byte view)."""
    return checksum_copy(Checksum.ML64, data, None)


def checksum(kind: Checksum, data: memoryview) -> int:
    """The checksum of ``data`` of the given kind."""
    return checksum_copy(kind, data, None)


def checksum_copy(kind: Checksum, src: memoryview, dst: memoryview | None) -> int:
    """The checksum of ``src``, copying ``src`` to ``dst`` (same size) on the way if given.

    One pass over memory instead of two: each slice is checksummed, then
    copied while it is still in cache.
    """
    n = src.nbytes
    if kind is Checksum.XXH3:
        if dst is None:
            return int(xxhash.xxh3_64_intdigest(src))
        state = xxhash.xxh3_64()
        for start in range(0, n, _SLICE):
            piece = src[start : start + _SLICE]
            state.update(piece)
            dst[start : start + _SLICE] = piece
        return int(state.intdigest())
    if kind is Checksum.CRC32:
        crc = 0
        for start in range(0, n, _SLICE):
            piece = src[start : start + _SLICE]
            crc = zlib.crc32(piece, crc)
            if dst is not None:
                dst[start : start + _SLICE] = piece
        return crc
    full = n // 8
    keys = _KEYS.get(-(-n // 8))
    h = 0
    if full:
        # einsum's sum of products runs about 25 % faster than np.dot on uint64
        # (both wrap modulo 2**64: the same value). Without a copy to make, one
        # call takes the whole row.
        words = np.frombuffer(src, dtype="<u8", count=full)
        step = _SLICE // 8 if dst is not None else full
        for start in range(0, full, step):
            stop = min(full, start + step)
            h += int(np.einsum("i,i->", words[start:stop], keys[start:stop]))
            if dst is not None:
                dst[start * 8 : stop * 8] = src[start * 8 : stop * 8]
    if n % 8:
        h += int.from_bytes(src[full * 8 :], "little") * int(keys[full])
        if dst is not None:
            dst[full * 8 :] = src[full * 8 :]
    return h & _MASK


def mac_copy(mac: HMAC, src: memoryview, dst: memoryview | None) -> bytes:
    """Feed ``src`` to ``mac`` (copying it to ``dst`` on the way, if given); the tag.

    As `checksum_copy`, slice by slice; each update of a slice releases the
    GIL (hashlib does for more than 2 KiB), so threads MAC in parallel.
    """
    if dst is None:
        mac.update(src)
    else:
        for start in range(0, src.nbytes, _SLICE):
            piece = src[start : start + _SLICE]
            mac.update(piece)
            dst[start : start + _SLICE] = piece
    return mac.digest()
