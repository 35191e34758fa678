"""Small shared types of layer 0: offload keys and the media that hold chunks."""

from __future__ import annotations

import enum
from typing import NewType

__all__ = [
    "Medium",
    "OffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

#: A chunk key: the prefix hash of the chunk's last hash-block, then the KV-cache
#: group index as 4 big-endian bytes. Equal keys mean equal content.
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Key of the chunk whose last hash-block has ``block_hash``, in group ``group_idx``."""
    if not 0 <= group_idx < 1 << (8 * _GROUP_BYTES):
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The prefix-hash part of ``key``."""
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key``."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


class Medium(enum.StrEnum):
    """Where a chunk lives, in the words KV cache events use."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"
