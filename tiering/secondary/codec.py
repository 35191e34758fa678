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

Value, format version 2: *keyed* (written by a codec given an `AuthKey`)::

    header     40 bytes  as version 1, with version 2, the MAC's kind
                         (`MacKind`: 2 = AES-GMAC, 1 = HMAC-SHA256) and a
                         zero checksum
    key        key length bytes, then zeros up to a multiple of 8 bytes
    tag        32 bytes  AES-GMAC: a fresh random 16-byte salt, then the
                         16-byte GMAC of the payload under the value's
                         subkey (see the design note);
                         HMAC-SHA256: its 32-byte MAC under the key of every
                         byte before the tag, then of the payload
    payload    the chunk's row, byte for byte

Both kinds' tag areas are 32 bytes, so a value's header size does not depend
on its kind (a reader knows where the payload starts before it reads the kind).

Decoding checks all of it (magic, version, checksum kind, namespace, key,
length, checksum or tag) before the value counts as read. A value that
fails any check is *rejected*: a miss for the caller, counted by the tier, and
the reason is a `Verdict`. Nothing here does I/O; the functions are pure and
safe to call from worker threads.

Design note: values only key holders can write.

- **What the tag guards against.** The unkeyed checksums catch damage, not
  intent: anyone who can write to the store can write a value that passes
  them, and it would be loaded into a request's KV cache. With a key, the tag
  covers the header (so the namespace, the length and the version), the
  chunk key (so a value moved under another chunk's key fails) and the
  payload; without the key no valid tag can be made. A key holder can still
  write anything; a value stays a value of its chunk (chunk keys name their
  tokens), so replaying an old one gives the same bytes.
- **Which MAC, and why.** The MAC bounds a keyed tier's speed: one thread
  MACs each value as it moves, and the unkeyed tier moves values faster than
  a hash runs. Hashes were too slow: HMAC-SHA256 (RFC 2104; OpenSSL's SHA-256
  with the CPU's SHA instructions), and keyed BLAKE2b slower still, left a
  keyed tier a fraction of an unkeyed one's speed. GMAC (NIST SP 800-38D:
  AES-GCM with an empty plaintext and the payload as associated data) is a
  polynomial MAC (GHASH) that OpenSSL runs on the CPU's carry-less multiply
  and AES instructions, several times faster, releasing the GIL (Poly1305,
  as fast and as standard, did not release it in ``cryptography``). So
  values are written with **AES-256-GMAC** (`MacKind.AES_GMAC`) when the
  ``cryptography`` package is installed (the ``auth`` extra), else with
  HMAC-SHA256 from the standard library (one warning line at the key's
  load); a key reads both kinds.

  GMAC's one rule: a (key, nonce) pair must never tag two messages, or the
  two tags give away GHASH's hash key and anyone can then forge. Values are
  written by many engines with no shared counter, so the nonce cannot be
  managed; instead each value gets its own *subkey*: the writer draws a
  fresh random 16-byte salt, stores it in the tag area, and derives
  ``subkey = HMAC-SHA256(key, b"tiering gmac v1" || salt || header)`` (the
  header, chunk key and padding: the bytes before the tag area; about a
  microsecond), then ``tag = AES-GCM(subkey).encrypt(nonce = 12 zero bytes,
  plaintext = b"", associated data = payload)``. A subkey tags one payload
  only (two writes share one only if their random salts collide: about
  2**-64 after 2**32 values), so the fixed nonce is never reused under a
  key; a reader recomputes a tag, which tells a forger nothing new. The
  subkey binds the header (namespace, length, version, MAC kind) and the
  chunk key; GMAC binds the payload. A forger without the key cannot derive
  any subkey (HMAC is a PRF), and a guessed 16-byte tag passes with odds of
  about 2**-128 per try, times the payload's length in blocks. The label
  keeps subkeys apart from HMAC-SHA256 tags (those MACs start with the
  value's magic, ``TKVC``) and from the key's id.

  A MAC over the payload's XXH3 digest instead of the payload would be
  far cheaper and is not sound: XXH3 is not a cryptographic hash, so a
  second payload with the same digest can be made. The figures are in the
  README ("Values only key holders can write"), from ``bench/remote.py``
  and ``bench/disk.py``.
- **Verified before it counts.** A reader checks the header as today, then
  lands the payload in the caller's row and computes the tag of the row
  (GMAC's one-shot call needs the payload whole; HMAC-SHA256's is fed as it
  lands), and compares tags in constant time; a value whose tag fails is
  `Verdict.UNAUTHENTICATED`: a miss, counted, never loaded (the row's bytes
  are not a hit, as with a failed checksum). An AES-GMAC value read where
  ``cryptography`` is missing cannot be checked: it is `UNAUTHENTICATED`
  too, never loaded, with one warning line naming the extra.
- **Keyed and unkeyed readers.** A keyed codec rejects every value that is
  not keyed under its key: unkeyed values (version 1, legacy CRC-32 ones
  included), forgeries, values of another key, tampered ones, all
  `Verdict.UNAUTHENTICATED`. An unkeyed codec reads only version 1: it
  cannot check a keyed value's tag, so it rejects the value as a version it
  does not read (`Verdict.BAD_VERSION`), as an engine of an older release
  does; an operator who sees ``bad_version`` next to ``unauthenticated`` in
  a tier's counts has engines that disagree about the key. The key is in no
  header: a value of another key fails as a forgery does.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from typing import Any

import msgspec

from tiering._checks import check_int, is_int
from tiering._types import OffloadKey
from tiering.config import OffloadingConfig
from tiering.errors import ConfigError, SpecError
from tiering.secondary.auth import SALT_BYTES, TAG_BYTES, AuthKey, Gmac, Mac, MacKind
from tiering.secondary.checksum import Checksum, checksum, checksum_copy, mac_copy

__all__ = [
    "FORMAT_VERSION",
    "KEYED_VERSION",
    "MAGIC",
    "Checksum",
    "ChunkCodec",
    "MacKind",
    "PayloadCheck",
    "RemoteNamespace",
    "Verdict",
    "payload_row",
    "writable_row",
]

MAGIC = b"TKVC"
FORMAT_VERSION = 1
#: The format version of keyed values (a tag after the key; see the design note).
KEYED_VERSION = 2
#: Remote keys start with this; the namespace digest and the chunk key follow.
KEY_PREFIX = b"tkv:"

_HEADER = struct.Struct(">4sBBHQ16sQ")  # 40 bytes
_DIGEST_BYTES = 16
_PREFIX_HEX = 16  # digits of the digest in a remote key (64 bits; the value holds all 128)


#: What a value's payload must match, from its header (`ChunkCodec.check_head`): a
#: checksum kind and value, or a MAC (an HMAC state fed with the header, or the value's
#: GMAC) and the tag it must give.
PayloadCheck = tuple[Checksum, int] | tuple[Mac | Gmac, bytes]


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
            check_int(f"{owner}.{name}", getattr(self, name), minimum=1)
        for name in ("page_bytes", "tokens_per_block"):
            values = getattr(self, name)
            if any(not is_int(v) or v < 1 for v in values):
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
    UNAUTHENTICATED = "unauthenticated"  # keyed reader: no valid tag under its key


def writable_row(buffer: Any, row_bytes: int) -> memoryview:
    """``buffer`` as a writable, contiguous byte memoryview of exactly ``row_bytes`` bytes.

    Raises `SpecError` (a programming error) when it is not one.
    """
    view = memoryview(buffer)
    if view.readonly:
        raise SpecError("a read buffer must be writable, got a read-only buffer")
    return _one_row(view, row_bytes, "a read buffer", "hold exactly")


def payload_row(payload: Any, row_bytes: int) -> memoryview:
    """``payload`` as a contiguous byte memoryview of exactly ``row_bytes`` bytes (read
    only is fine); `SpecError` (a programming error) when it is not one."""
    return _one_row(memoryview(payload), row_bytes, "a chunk payload", "be exactly")


def _one_row(view: memoryview, row_bytes: int, what: str, verb: str) -> memoryview:
    """``view`` as bytes if it is one contiguous row; `SpecError` naming ``what`` if not."""
    if not view.c_contiguous:
        raise SpecError(f"{what} must be C-contiguous")
    if view.nbytes != row_bytes:
        raise SpecError(f"{what} must {verb} one row of {row_bytes} bytes, got {view.nbytes}")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


_KINDS = {int(kind): kind for kind in Checksum}
_MAC_KINDS = {int(kind) for kind in MacKind}


def _padded(n: int) -> int:
    return -(-n // 8) * 8


class ChunkCodec:
    """Remote keys and values of one `RemoteNamespace`. Immutable; thread-safe.

    Without ``auth_key``, values are written with ``checksum`` and values of
    every checksum kind are read (keyed ones are rejected as `Verdict.BAD_VERSION`).
    With it, values are written keyed (format version 2) and only values with
    a valid tag under that key are read (`Verdict.UNAUTHENTICATED` otherwise).
    """

    def __init__(
        self,
        namespace: RemoteNamespace,
        checksum: Checksum = Checksum.XXH3,
        auth_key: AuthKey | None = None,
    ) -> None:
        self.namespace = namespace
        self.checksum = Checksum(checksum)
        self.row_bytes = namespace.row_bytes
        if auth_key is not None and not isinstance(auth_key, AuthKey):
            # never shown: it may be the secret itself (bytes or str)
            raise ConfigError(
                f"auth_key must be an AuthKey (AuthKey.from_file, AuthKey.from_env), "
                f"got {type(auth_key).__name__}"
            )
        self.auth_key = auth_key
        self._tag = 0 if auth_key is None else TAG_BYTES
        self._digest = namespace.digest()
        #: ``tkv:{<digest prefix>:`` - every remote key of this namespace starts so.
        self.key_prefix = KEY_PREFIX + b"{" + self._digest.hex()[:_PREFIX_HEX].encode() + b":"

    @property
    def digest(self) -> bytes:
        return self._digest

    def remote_key(self, key: OffloadKey, suffix: bytes = b"") -> bytes:
        """The store's key of chunk ``key`` (``suffix`` names a sibling on the same slot)."""
        return self.key_prefix + bytes(key).hex().encode() + b"}" + suffix

    @property
    def keyed(self) -> bool:
        """Whether values are written and read with a tag (an `AuthKey` is set)."""
        return self.auth_key is not None

    def header_bytes(self, key: OffloadKey) -> int:
        """Bytes of a value before its payload (its tag included, when keyed)."""
        return _HEADER.size + _padded(len(key)) + self._tag

    def _pack_head(self, out: memoryview, key_bytes: bytes, length: int, digest: int) -> int:
        """Write a value's header, key and padding to ``out``; where the tag goes."""
        auth = self.auth_key is not None
        _HEADER.pack_into(
            out,
            0,
            MAGIC,
            KEYED_VERSION if auth else FORMAT_VERSION,
            self.auth_key.mac_kind if self.auth_key is not None else self.checksum,
            len(key_bytes),
            digest,
            self._digest,
            length,
        )
        tag_at = _HEADER.size + _padded(len(key_bytes))
        out[_HEADER.size : _HEADER.size + len(key_bytes)] = key_bytes
        out[_HEADER.size + len(key_bytes) : tag_at] = bytes(tag_at - _HEADER.size - len(key_bytes))
        return tag_at

    def _mac_of_head(self, head: memoryview, tag_at: int) -> Mac:
        assert self.auth_key is not None
        mac = self.auth_key.mac()
        mac.update(head[:tag_at])
        return mac

    def _gmac_of_head(self, head: memoryview, tag_at: int) -> Gmac | None:
        assert self.auth_key is not None
        salt = bytes(head[tag_at : tag_at + SALT_BYTES])
        return self.auth_key.gmac(salt, head[:tag_at])

    def _write_tag(
        self, head: memoryview, tag_at: int, body: memoryview, out: memoryview | None
    ) -> None:
        """Write a keyed value's tag area to ``head`` after its header; copy ``body`` to
        ``out`` on the way, if given (the tag is of ``body``, so a row that changes during
        the copy gives a value that fails its tag)."""
        assert self.auth_key is not None
        if self.auth_key.mac_kind is MacKind.AES_GMAC:
            head[tag_at : tag_at + SALT_BYTES] = os.urandom(SALT_BYTES)  # a fresh subkey
            gmac = self._gmac_of_head(head, tag_at)
            assert gmac is not None  # the key writes GMAC only where it can
            head[tag_at + SALT_BYTES : tag_at + TAG_BYTES] = gmac.tag(body)
            if out is not None:
                out[:] = body
        else:
            head[tag_at : tag_at + TAG_BYTES] = mac_copy(self._mac_of_head(head, tag_at), body, out)

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
        start = _HEADER.size + _padded(len(key_bytes)) + self._tag
        end = start + body.nbytes
        if out.nbytes < end:
            raise SpecError(f"a value buffer must hold {end} bytes, got {out.nbytes}")
        if self.auth_key is not None:
            tag_at = self._pack_head(out, key_bytes, body.nbytes, 0)
            self._write_tag(out, tag_at, body, out[start:end])
            return end
        digest = checksum_copy(self.checksum, body, out[start:end])
        self._pack_head(out, key_bytes, body.nbytes, digest)
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
        head = memoryview(bytearray(_HEADER.size + _padded(len(key_bytes)) + self._tag))
        if self.auth_key is not None:
            tag_at = self._pack_head(head, key_bytes, body.nbytes, 0)
            self._write_tag(head, tag_at, body, None)
        else:
            self._pack_head(head, key_bytes, body.nbytes, checksum_copy(self.checksum, body, None))
        return head.tobytes()

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
        checksum or tag it holds the rejected payload, on any other verdict it
        is untouched.
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
        return self.check_payload(kind, expected, data[self.header_bytes(key) :], out)

    def check_head(
        self, key: OffloadKey, head: memoryview, value_bytes: int
    ) -> Verdict | PayloadCheck:
        """Every check of a value but its checksum or tag, from its first bytes and its size.

        ``head`` is a byte view of the value's first `header_bytes` bytes (or
        of all of it) and ``value_bytes`` the value's full size. Returns the
        failed check's `Verdict`, or, when all pass, what the payload (the
        value's bytes after `header_bytes`) must match: a checksum kind and
        value, or a keyed MAC state and its tag (see `check_payload`, which
        takes either): a reader can then receive the payload straight into the
        caller's row. Each call returns a fresh state, to be checked once.
        """
        if head.nbytes < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            return Verdict.BAD_MAGIC
        if value_bytes < _HEADER.size or head.nbytes < _HEADER.size:
            return Verdict.BAD_LENGTH
        _, version, kind, key_len, expected, digest, length = _HEADER.unpack_from(head)
        keyed = version == KEYED_VERSION
        if self.auth_key is None:
            if version != FORMAT_VERSION:  # keyed ones too: their tags cannot be checked
                return Verdict.BAD_VERSION
        elif not keyed:
            return Verdict.UNAUTHENTICATED  # unkeyed, or of a version this code does not read
        if kind not in (_MAC_KINDS if keyed else _KINDS):
            return Verdict.BAD_CHECKSUM_KIND
        if digest != self._digest:
            return Verdict.FOREIGN_NAMESPACE
        tag_at = _HEADER.size + _padded(key_len)
        start = tag_at + self._tag
        if value_bytes < start:
            return Verdict.BAD_LENGTH
        if key_len != len(key) or head[_HEADER.size : _HEADER.size + key_len] != bytes(key):
            return Verdict.WRONG_KEY
        if length != self.row_bytes or value_bytes - start != length:
            return Verdict.BAD_LENGTH
        if keyed:
            if expected != 0 or head.nbytes < start:
                return Verdict.UNAUTHENTICATED  # not a head this format writes
            if kind == MacKind.AES_GMAC:
                gmac = self._gmac_of_head(head, tag_at)
                if gmac is None:  # no `cryptography` here: it cannot be checked
                    return Verdict.UNAUTHENTICATED
                return gmac, bytes(head[tag_at + SALT_BYTES : start])
            return self._mac_of_head(head, tag_at), bytes(head[tag_at:start])
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
    def check_payload(
        kind: Checksum | Mac | Gmac,
        expected: int | bytes,
        payload: memoryview,
        out: memoryview | None = None,
    ) -> Verdict:
        """`OK` when ``payload`` has the checksum, or the tag, its header (`check_head`)
        gave; copied to ``out`` (one row) on the way, if given. A keyed value is
        `Verdict.UNAUTHENTICATED` unless its tag is right (compared in constant time);
        a GMAC's is taken of ``out`` once the payload is there (of what the caller gets)."""
        if isinstance(kind, Checksum):
            found = checksum(kind, payload) if out is None else checksum_copy(kind, payload, out)
            return Verdict.OK if found == expected else Verdict.BAD_CHECKSUM
        if isinstance(kind, Gmac):
            if out is not None:
                out[:] = payload
                payload = out
            tag = kind.tag(payload)
        else:
            tag = mac_copy(kind, payload, out)
        if isinstance(expected, bytes) and hmac.compare_digest(tag, expected):
            return Verdict.OK
        return Verdict.UNAUTHENTICATED

    def __repr__(self) -> str:
        return (
            f"<ChunkCodec [{self.key_prefix.decode()}...}}; {self.namespace.model}, "
            f"{self.namespace.dtype}, {self.row_bytes} B rows"
            f"{'' if self.auth_key is None else f'; keyed, key id {self.auth_key.key_id}'}]>"
        )
