"""One core's MAC speed, the bound of a keyed tier: shared by `bench/disk.py` and
`bench/remote.py` (imported as a sibling script module)."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from typing import Any


def mac_speed(row: Any, kind: str, repeat: int = 20) -> float:
    """GB/s of one core's MAC over ``row`` (bytes-like, or a size to make one of; best
    of ``repeat``). AES-GMAC's is a whole value's: its subkey derived, then the
    payload's tag (0: the ``cryptography`` package is not installed)."""
    if isinstance(row, int):
        row = os.urandom(row)
    key = os.urandom(32)
    if kind == "aes-gmac":
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            return 0.0
        base = hmac.new(key, digestmod=hashlib.sha256)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        if kind == "blake2b":
            hashlib.blake2b(row, key=key, digest_size=32).digest()
        elif kind == "aes-gmac":
            derive = base.copy()
            derive.update(bytes(96))
            AESGCM(derive.digest()).encrypt(bytes(12), b"", row)
        else:
            hmac.new(key, row, hashlib.sha256).digest()
        best = min(best, time.perf_counter() - start)
    return float(memoryview(row).nbytes / best / 1e9)
