"""The wire format of a secondary tier: namespaced remote keys and self-checking values.

A secondary tier may be shared by many engines, and by engines that are not
alike. A chunk's bytes are only interchangeable between engines that run the
same model with the same KV dtype, the same layout (page sizes, row size,
blocks per chunk) and the same shard of the model (parallel position), so every
remote key is *namespaced* by a digest of those facts (`RemoteNamespace`), and
an operator can split one store further with a free-form ``namespace`` string.

Remote key (ASCII, readable in ``redis-cli``)::

    tkv:{<namespace digest, 16 hex digits>:<chunk key, hex>}

The braces are a Redis Cluster hash tag: every key a chunk may ever need (its
value now, metadata later, as ``<remote key><suffix>``) hashes to one slot.

Value, format version 1 (header fields big-endian)::

    magic      4 bytes   b"TKVC"
    version    1 byte    1
    checksum   1 byte    its kind (`Checksum`): 3 = XXH3 (written), 2 = ML64, 1 = CRC-32
    key length 2 bytes
    checksum   8 bytes   of the payload (CRC-32 in the low 32 bits)
    namespace 16 bytes   the full namespace digest
    payload    8 bytes   payload length
    key        key length bytes: the full chunk key, then zeros up to a
               multiple of 8 bytes (so the payload is 8-byte aligned)
    payload    the chunk's row, byte for byte

Decoding checks all of it (magic, version, checksum kind, namespace, key,
length, checksum) before one byte reaches the caller's buffer. A value that
fails any check is *rejected*: a miss for the caller, counted by the tier, and
the reason is a `Verdict`. Nothing here does I/O; the functions are pure and
safe to call from worker threads.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import Any

import msgspec

from tiering._types import OffloadKey
from tiering.config import OffloadingConfig
from tiering.errors import ConfigError, SpecError
from tiering.secondary.checksum import Checksum, checksum, checksum_copy

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Checksum",
    "ChunkCodec",
    "RemoteNamespace",
    "Verdict",
    "payload_row",
    "writable_row",
]

MAGIC = b"TKVC"
FORMAT_VERSION = 1
#: Remote keys start with this; the namespace digest and the chunk key follow.
KEY_PREFIX = b"tkv:"

_HEADER = struct.Struct(">4sBBHQ16sQ")  # 40 bytes
_DIGEST_BYTES = 16
_PREFIX_HEX = 16  # digits of the digest in a remote key (64 bits; the value holds all 128)


class RemoteNamespace(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What makes two engines' chunk bytes interchangeable.

    Engines share chunks only when every field is equal. ``page_bytes`` are the
    page sizes of the registered KV tensors in registration order; ``shard``
    names the part of the model this worker holds (see `from_config`);
    ``namespace`` is free for the operator (a deployment, a tenant, a model
    revision). Fields are hashed with their defaults omitted, so a field added
    later with a default leaves existing digests as they were.
    """

    model: str
    dtype: str
    row_bytes: int
    blocks_per_chunk: int
    page_bytes: tuple[int, ...] = ()
    tokens_per_block: tuple[int, ...] = ()
    shard: str = ""
    namespace: str = ""

    def __post_init__(self) -> None:
        owner = "RemoteNamespace"
        for name in ("model", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{owner}.{name} must be a non-empty string, got {value!r}")
        for name in ("row_bytes", "blocks_per_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")
        for name in ("page_bytes", "tokens_per_block"):
            values = getattr(self, name)
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ConfigError(
                    f"{owner}.{name} must hold positive integers, got {list(values)!r}"
                )

    @classmethod
    def from_config(
        cls,
        config: OffloadingConfig,
        *,
        row_bytes: int,
        page_bytes: tuple[int, ...] = (),
        namespace: str = "",
    ) -> RemoteNamespace:
        """The namespace of an engine built from ``config`` with this layout.

        ``shard`` is the worker's place in the parallel layout (rank, world
        size, tensor/pipeline/context-parallel sizes); the data-parallel index
        is left out on purpose: data-parallel replicas hold the same shards and
        should share chunks.
        """
        p = config.parallel
        return cls(
            model=config.model.name,
            dtype=config.model.dtype,
            row_bytes=row_bytes,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            page_bytes=tuple(page_bytes),
            tokens_per_block=tuple(g.tokens_per_block for g in config.groups),
            shard=(
                f"rank{p.rank}of{p.world_size}.tp{p.tp_size}.pp{p.pp_size}"
                f".pcp{p.pcp_size}.dcp{p.dcp_size}"
            ),
            namespace=namespace,
        )

    def digest(self) -> bytes:
        """16 bytes that name this namespace: BLAKE2b of its canonical msgpack encoding."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=_DIGEST_BYTES).digest()


class Verdict(enum.Enum):
    """What decoding a value found. Only `OK` fills the caller's buffer."""

    OK = "ok"
    BAD_MAGIC = "bad_magic"  # not a value of this format at all
    BAD_VERSION = "bad_version"  # a format version this code does not read
    BAD_CHECKSUM_KIND = "bad_checksum_kind"
    FOREIGN_NAMESPACE = "foreign_namespace"  # written by an engine whose bytes differ
    WRONG_KEY = "wrong_key"  # a valid value of another chunk, under this chunk's key
    BAD_LENGTH = "bad_length"  # truncated, padded, or not one row
    BAD_CHECKSUM = "bad_checksum"  # the payload is not what was written


def writable_row(buffer: Any, row_bytes: int) -> memoryview:
    """``buffer`` as a writable, contiguous byte memoryview of exactly ``row_bytes`` bytes.

    Raises `SpecError` (a programming error) when it is not one.
    """
    view = memoryview(buffer)
    if view.readonly:
        raise SpecError("a read buffer must be writable, got a read-only buffer")
    if not view.c_contiguous:
        raise SpecError("a read buffer must be C-contiguous")
    if view.nbytes != row_bytes:
        raise SpecError(
            f"a read buffer must hold exactly one row of {row_bytes} bytes, got {view.nbytes}"
        )
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def payload_row(payload: Any, row_bytes: int) -> memoryview:
    """``payload`` as a contiguous byte memoryview of exactly ``row_bytes`` bytes (read
    only is fine); `SpecError` (a programming error) when it is not one."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise SpecError("a chunk payload must be C-contiguous")
    if view.nbytes != row_bytes:
        raise SpecError(
            f"a chunk payload must be exactly one row of {row_bytes} bytes, got {view.nbytes}"
        )
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_KINDS = {int(kind): kind for kind in Checksum}


def _padded(n: int) -> int:
    return -(-n // 8) * 8


class ChunkCodec:
    """Remote keys and values of one `RemoteNamespace`. Immutable; thread-safe.

    ``checksum`` is the kind written; values of every kind are read.
    """

    def __init__(self, namespace: RemoteNamespace, checksum: Checksum = Checksum.XXH3) -> None:
        self.namespace = namespace
        self.checksum = Checksum(checksum)
        self.row_bytes = namespace.row_bytes
        self._digest = namespace.digest()
        #: ``tkv:{<digest prefix>:`` - every remote key of this namespace starts so.
        self.key_prefix = KEY_PREFIX + b"{" + self._digest.hex()[:_PREFIX_HEX].encode() + b":"

    @property
    def digest(self) -> bytes:
        return self._digest

    def remote_key(self, key: OffloadKey, suffix: bytes = b"") -> bytes:
        """The store's key of chunk ``key`` (``suffix`` names a sibling on the same slot)."""
        return self.key_prefix + bytes(key).hex().encode() + b"}" + suffix

    def header_bytes(self, key: OffloadKey) -> int:
        """Bytes of a value before its payload."""
        return _HEADER.size + _padded(len(key))

    def value_bytes(self, key: OffloadKey) -> int:
        """Bytes of the value of chunk ``key``: header, key, padding and one row."""
        return self.header_bytes(key) + self.row_bytes

    def encode_into(self, key: OffloadKey, payload: Any, out: memoryview) -> int:
        """Write the value of ``payload`` (one row) as chunk ``key`` to ``out``; return its size.

        ``out`` is a writable byte view of at least `value_bytes` bytes. The
        checksum is taken of ``payload`` itself, slice by slice, each slice
        copied right after: if the caller's buffer changes during the copy,
        the stored value fails its checksum and is never loaded. Raises
        `SpecError` when the payload is not one row.
        """
        body = payload_row(payload, self.row_bytes)
        key_bytes = bytes(key)
        if len(key_bytes) > 0xFFFF:
            raise SpecError(f"a chunk key must be at most 65535 bytes, got {len(key_bytes)}")
        start = _HEADER.size + _padded(len(key_bytes))
        end = start + body.nbytes
        if out.nbytes < end:
            raise SpecError(f"a value buffer must hold {end} bytes, got {out.nbytes}")
        digest = checksum_copy(self.checksum, body, out[start:end])
        _HEADER.pack_into(
            out,
            0,
            MAGIC,
            FORMAT_VERSION,
            self.checksum,
            len(key_bytes),
            digest,
            self._digest,
            body.nbytes,
        )
        out[_HEADER.size : _HEADER.size + len(key_bytes)] = key_bytes
        out[_HEADER.size + len(key_bytes) : start] = bytes(start - _HEADER.size - len(key_bytes))
        return end

    def encode_header(self, key: OffloadKey, payload: Any) -> bytes:
        """The bytes of the value of ``payload`` (one row) as chunk ``key`` before the row.

        The value is these bytes followed by the row itself, unchanged: a
        sender can send them and then the caller's row, without copying it
        (the checksum is taken of ``payload`` now, in one read-only pass; if
        the row changes before it is sent, the stored value fails its checksum
        and is never loaded). Raises `SpecError` when the payload is not one row.
        """
        body = payload_row(payload, self.row_bytes)
        key_bytes = bytes(key)
        if len(key_bytes) > 0xFFFF:
            raise SpecError(f"a chunk key must be at most 65535 bytes, got {len(key_bytes)}")
        digest = checksum_copy(self.checksum, body, None)
        head = _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.checksum,
            len(key_bytes),
            digest,
            self._digest,
            body.nbytes,
        )
        return head + key_bytes + bytes(_padded(len(key_bytes)) - len(key_bytes))

    def encode(self, key: OffloadKey, payload: Any) -> bytes:
        """The value that stores ``payload`` (one row) as chunk ``key`` (a copy)."""
        value = bytearray(self.value_bytes(key))
        self.encode_into(key, payload, memoryview(value))
        return bytes(value)

    def check(self, key: OffloadKey, value: Any) -> Verdict:
        """The verdict on ``value`` as chunk ``key``, without copying anything."""
        return self._decode(key, value, None)

    def decode_into(self, key: OffloadKey, value: Any, out: memoryview) -> Verdict:
        """Check ``value`` as chunk ``key``, copying its payload to ``out`` on the way.

        ``out`` must be a writable byte view of one row (see `writable_row`).
        Only an `OK` verdict means ``out`` holds the chunk: on a failed
        checksum it holds the damaged payload, on any other verdict it is
        untouched.
        """
        return self._decode(key, value, out)

    def _decode(self, key: OffloadKey, value: Any, out: memoryview | None) -> Verdict:
        data = memoryview(value)
        if data.format != "B" or data.ndim != 1:
            data = data.cast("B")
        head = self.check_head(key, data, data.nbytes)
        if isinstance(head, Verdict):
            return head
        kind, expected = head
        if checksum_copy(kind, data[self.header_bytes(key) :], out) != expected:
            return Verdict.BAD_CHECKSUM
        return Verdict.OK

    def check_head(
        self, key: OffloadKey, head: memoryview, value_bytes: int
    ) -> Verdict | tuple[Checksum, int]:
        """Every check of a value but its checksum, from its first bytes and its size.

        ``head`` is a byte view of the value's first `header_bytes` bytes (or
        of all of it) and ``value_bytes`` the value's full size. Returns the
        failed check's `Verdict`, or, when all pass, the checksum kind and
        value that the payload (the value's bytes after `header_bytes`) must
        match (see `check_payload`): a reader can then receive the payload
        straight into the caller's row.
        """
        if head.nbytes < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            return Verdict.BAD_MAGIC
        if value_bytes < _HEADER.size or head.nbytes < _HEADER.size:
            return Verdict.BAD_LENGTH
        _, version, kind, key_len, expected, digest, length = _HEADER.unpack_from(head)
        if version != FORMAT_VERSION:
            return Verdict.BAD_VERSION
        if kind not in _KINDS:
            return Verdict.BAD_CHECKSUM_KIND
        if digest != self._digest:
            return Verdict.FOREIGN_NAMESPACE
        start = _HEADER.size + _padded(key_len)
        if value_bytes < start:
            return Verdict.BAD_LENGTH
        if key_len != len(key) or head[_HEADER.size : _HEADER.size + key_len] != bytes(key):
            return Verdict.WRONG_KEY
        if length != self.row_bytes or value_bytes - start != length:
            return Verdict.BAD_LENGTH
        return _KINDS[kind], expected

    @staticmethod
    def peek_key_bytes(head: memoryview) -> int | None:
        """How many bytes of a value's head hold its header and key; None: not a value
        of this format (its magic is wrong, or its header is cut short)."""
        if head.nbytes < _HEADER.size or head[: len(MAGIC)] != MAGIC:
            return None
        return _HEADER.size + int(_HEADER.unpack_from(head)[3])

    @classmethod
    def peek_key(cls, head: memoryview) -> OffloadKey | None:
        """The chunk key a value's head names, unchecked (None: not there whole)."""
        end = cls.peek_key_bytes(head)
        if end is None or head.nbytes < end:
            return None
        return OffloadKey(bytes(head[_HEADER.size : end]))

    @staticmethod
    def check_payload(kind: Checksum, expected: int, payload: memoryview) -> Verdict:
        """`OK` when ``payload`` has the checksum its header (`check_head`) gave."""
        return Verdict.OK if checksum(kind, payload) == expected else Verdict.BAD_CHECKSUM

    def __repr__(self) -> str:
        return (
            f"<ChunkCodec [{self.key_prefix.decode()}...}}; {self.namespace.model}, "
            f"{self.namespace.dtype}, {self.row_bytes} B rows]>"
        )
