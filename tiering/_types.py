"""Small shared types of layer 0: offload keys, the media that hold chunks, directions."""

from __future__ import annotations

import enum
import operator
from typing import NewType, SupportsIndex

from tiering._checks import is_int
from tiering.errors import InvalidKeyError

__all__ = [
    "Medium",
    "OffloadKey",
    "TransferDirection",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

#: A chunk key: the prefix hash of the chunk's last hash-block, then the KV-cache
#: group index as 4 big-endian bytes. Equal keys mean equal content.
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 4
#: An integer hash is the low 64 bits of the hash bytes, big-endian (vLLM's
#: ``maybe_convert_block_hash``: ``int.from_bytes(h, "big") & (2**64 - 1)``).
_INT_HASH_BYTES = 8


def make_offload_key(
    block_hash: bytes | bytearray | memoryview | SupportsIndex, group_idx: SupportsIndex = 0
) -> OffloadKey:
    """Key of the chunk whose last hash-block has ``block_hash``, in group ``group_idx``.

    ``block_hash`` is the hash's bytes (``bytes``, ``bytearray`` or a
    ``memoryview``; not empty), or an integer hash in ``[0, 2**64)``, which
    becomes its 8 big-endian bytes: the form vLLM's integer block hashes (KV
    events with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) and traces' hash ids
    take, so ``make_offload_key(h)`` and ``make_offload_key(h.to_bytes(8, "big"))``
    are the same key. ``group_idx`` is an integer in ``[0, 2**32)``; numpy's
    integers do for both. Anything else (a str, a float, None, a bool, an array,
    a negative or too large int) is an `InvalidKeyError`.
    """
    if isinstance(block_hash, bytes):
        digest = block_hash
    elif isinstance(block_hash, (bytearray, memoryview)):
        digest = bytes(block_hash)
    elif hasattr(type(block_hash), "__index__") and not isinstance(block_hash, bool):
        try:
            value = operator.index(block_hash)  # an int, or numpy's integers
        except TypeError:  # an array of more than one element has __index__ but refuses it
            raise _not_a_hash(block_hash) from None
        if not 0 <= value < 1 << (8 * _INT_HASH_BYTES):
            raise InvalidKeyError(
                f"an integer block hash must be in [0, 2**64) (vLLM's 64-bit hashes), got "
                f"{value}; pass a larger hash as its bytes"
            )
        digest = value.to_bytes(_INT_HASH_BYTES, "big")
    else:
        raise _not_a_hash(block_hash)
    if not digest:
        raise InvalidKeyError("a block hash must not be empty, got b''")
    if not is_int(group_idx):
        raise InvalidKeyError(
            f"group_idx must be an int in [0, 2**32), got {_shown(group_idx)} "
            f"of type {type(group_idx).__name__}"
        )
    group = operator.index(group_idx)  # an int, or numpy's integers
    if not 0 <= group < 1 << (8 * _GROUP_BYTES):
        raise InvalidKeyError(f"group_idx must be in [0, 2**32), got {group}")
    return OffloadKey(digest + group.to_bytes(_GROUP_BYTES, "big"))


def _not_a_hash(value: object) -> InvalidKeyError:
    return InvalidKeyError(
        f"a block hash must be bytes (bytes, bytearray, memoryview) or an int in "
        f"[0, 2**64), got {_shown(value)} of type {type(value).__name__}"
    )


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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


class TransferDirection(enum.Enum):
    """Which way a job moves bytes."""

    STORE = "store"  # GPU blocks -> CPU chunk slots
    LOAD = "load"  # CPU chunk slots -> GPU blocks

    # Members are singletons compared by identity: hash them the same way, in
    # C, instead of `Enum.__hash__` (Python code, on every per-job dict lookup).
    __hash__ = object.__hash__
