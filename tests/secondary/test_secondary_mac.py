"""Values only key holders can write (issue 26): the keyed value format, the disk and
Redis tiers with an `AuthKey`, and `tiering replay --auth-key-file`.

A forger here is what the audit was: someone who can write to the store and
knows the public namespace, so who can build any value the unkeyed codec
builds (`ChunkCodec` without a key), but not the key itself. The keyed tests
run for both MACs a key writes with (`mac` below: AES-GMAC, HMAC-SHA256).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from tiering._types import OffloadKey, make_offload_key
from tiering.errors import ConfigError
from tiering.secondary import ChunkCodec, RemoteNamespace, Verdict, auth
from tiering.secondary.auth import SALT_BYTES, TAG_BYTES, AuthKey, MacKind
from tiering.secondary.checksum import Checksum
from tiering.secondary.codec import FORMAT_VERSION, KEYED_VERSION, MAGIC
from tiering.secondary.disk import DiskTier
from tiering.secondary.disk.files import file_bytes, head_bytes

from .conftest import RedisServer

NS = RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4)
KEY = make_offload_key(bytes(range(16)), 3)
OTHER_KEY = make_offload_key(bytes(range(1, 17)), 3)
SECRET = b"0123456789abcdef-the-shared-secret"
SECRET_B = b"another secret, 32 bytes long..!"
KEY_A = AuthKey(SECRET)
KEY_B = AuthKey(SECRET_B)


@pytest.fixture(params=["gmac", "hmac"])
def mac(request: pytest.FixtureRequest) -> str:
    """The MAC the keys of a test write with (they read both)."""
    return str(request.param)


@pytest.fixture
def key_a(mac: str) -> AuthKey:
    return AuthKey(SECRET, mac=mac)  # type: ignore[arg-type]


@pytest.fixture
def key_b(mac: str) -> AuthKey:
    return AuthKey(SECRET_B, mac=mac)  # type: ignore[arg-type]


def other_key(key: AuthKey) -> AuthKey:
    """Another secret, writing with ``key``'s MAC."""
    return AuthKey(SECRET_B, mac="gmac" if key.mac_kind is MacKind.AES_GMAC else "hmac")


Row = np.ndarray[Any, np.dtype[np.uint8]]


def row(n: int = 4096, seed: int = 0) -> Row:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def row_of(key: OffloadKey, row_bytes: int) -> Row:
    return np.frombuffer(hashlib.shake_128(bytes(key)).digest(row_bytes), dtype=np.uint8)


def items(keys: list[OffloadKey], rows: list[Any]) -> list[tuple[OffloadKey, memoryview]]:
    return [(k, memoryview(r)) for k, r in zip(keys, rows, strict=True)]


def patched(value: bytes, offset: int, data: bytes) -> bytes:
    return value[:offset] + data + value[offset + len(data) :]


def v1_value(codec: ChunkCodec, key: OffloadKey, payload: bytes, kind: Checksum) -> bytes:
    """A version-1 value built by hand from the format's description (what a forger can)."""
    if kind is Checksum.CRC32:
        digest = zlib.crc32(payload)
    else:
        assert kind is Checksum.XXH3
        digest = xxhash.xxh3_64_intdigest(payload)
    raw = bytes(key)
    head = struct.pack(
        ">4sBBHQ16sQ", MAGIC, FORMAT_VERSION, kind, len(raw), digest, codec.digest, len(payload)
    )
    return head + raw + bytes(-len(raw) % 8) + payload


# -- the format --------------------------------------------------------------------------


def test_unkeyed_values_are_bit_for_bit_as_before() -> None:
    payload = row().tobytes()
    codec = ChunkCodec(NS)
    assert not codec.keyed
    assert codec.encode(KEY, payload) == v1_value(codec, KEY, payload, Checksum.XXH3)
    assert codec.header_bytes(KEY) == 40 + 24


def gmac_tag(secret: bytes, value: bytes, tag_at: int, payload: bytes) -> bytes:
    """An AES-GMAC value's tag, from the format's description: AES-256-GCM under the
    subkey HMAC-SHA256(secret, label || salt || the bytes before the tag area), with 12
    zero bytes as the nonce, no plaintext and the payload as associated data."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    salt = value[tag_at : tag_at + SALT_BYTES]
    subkey = hmac.new(secret, b"tiering gmac v1" + salt + value[:tag_at], "sha256").digest()
    return AESGCM(subkey).encrypt(bytes(12), b"", payload)


def test_a_keyed_value_round_trips_and_carries_its_tag(key_a: AuthKey) -> None:
    payload = row()
    codec = ChunkCodec(NS, auth_key=key_a)
    value = codec.encode(KEY, payload)
    assert value[4] == KEYED_VERSION
    assert value[5] == key_a.mac_kind
    assert codec.header_bytes(KEY) == ChunkCodec(NS).header_bytes(KEY) + TAG_BYTES
    assert len(value) == codec.value_bytes(KEY) == codec.header_bytes(KEY) + 4096
    assert value[codec.header_bytes(KEY) :] == payload.tobytes()  # the row, unchanged
    tag_at = codec.header_bytes(KEY) - TAG_BYTES
    if key_a.mac_kind is MacKind.HMAC_SHA256:
        # The tag: HMAC-SHA256 under the key of the bytes before it, then the payload.
        expected = hmac.new(SECRET, value[:tag_at] + payload.tobytes(), "sha256").digest()
        assert value[tag_at : codec.header_bytes(KEY)] == expected
        # The three ways to write a value agree.
        assert codec.encode_header(KEY, payload) + payload.tobytes() == value
    else:
        # The tag area: a fresh salt, then the GMAC of the payload under its subkey.
        tag = value[tag_at + SALT_BYTES : codec.header_bytes(KEY)]
        assert tag == gmac_tag(SECRET, value, tag_at, payload.tobytes())
        # The three ways to write a value agree but for the salt (and so the tag).
        again = codec.encode_header(KEY, payload) + payload.tobytes()
        assert again[:tag_at] == value[:tag_at]
        assert again[tag_at : tag_at + SALT_BYTES] != value[tag_at : tag_at + SALT_BYTES]
        assert codec.check(KEY, again) is Verdict.OK
    out = np.zeros(4096, dtype=np.uint8)
    assert codec.decode_into(KEY, value, memoryview(out)) is Verdict.OK
    assert np.array_equal(out, payload)
    assert codec.check(KEY, value) is Verdict.OK
    # Another codec with the same key (another engine) reads it, whatever MAC it writes.
    for writes in ("auto", "gmac", "hmac"):
        reader = ChunkCodec(NS, auth_key=AuthKey(SECRET, mac=writes))
        assert reader.check(KEY, value) is Verdict.OK


def test_gmac_values_never_share_a_subkey() -> None:
    """GMAC under a repeated (key, nonce) pair gives its hash key away: every value,
    even of the same chunk and row, gets a fresh salt, so a subkey of its own."""
    codec = ChunkCodec(NS, auth_key=AuthKey(SECRET, mac="gmac"))
    tag_at = codec.header_bytes(KEY) - TAG_BYTES
    salts = {codec.encode(KEY, row())[tag_at : tag_at + SALT_BYTES] for _ in range(64)}
    salts |= {codec.encode_header(KEY, row())[tag_at : tag_at + SALT_BYTES] for _ in range(64)}
    assert len(salts) == 128


def test_a_key_writes_gmac_by_default_and_hmac_when_asked() -> None:
    assert AuthKey(SECRET).mac_kind is MacKind.AES_GMAC  # `cryptography` is a dev extra
    assert AuthKey(SECRET, mac="gmac").mac_kind is MacKind.AES_GMAC
    assert AuthKey(SECRET, mac="hmac").mac_kind is MacKind.HMAC_SHA256
    with pytest.raises(ConfigError, match="'auto', 'gmac' or 'hmac', got 'md5'"):
        AuthKey(SECRET, mac="md5")  # type: ignore[arg-type]


def test_without_cryptography_a_key_writes_hmac_and_rejects_gmac_values(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gmac_value = ChunkCodec(NS, auth_key=AuthKey(SECRET, mac="gmac")).encode(KEY, row())
    monkeypatch.setattr(auth, "_aesgcm", lambda: None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"'cryptography'.*pip install 'tiering\[auth\]'"):
        AuthKey(SECRET, mac="gmac")
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.auth"):
        key = AuthKey(SECRET)  # auto: HMAC-SHA256, with one warning line at the load
    assert key.mac_kind is MacKind.HMAC_SHA256
    assert [r.getMessage().count("tiering[auth]") for r in caplog.records] == [1]
    assert "HMAC-SHA256" in caplog.records[0].getMessage()
    assert SECRET.decode() not in caplog.text
    caplog.clear()
    codec = ChunkCodec(NS, auth_key=key)
    value = codec.encode(KEY, row())
    assert value[5] == MacKind.HMAC_SHA256
    assert codec.check(KEY, value) is Verdict.OK
    # A GMAC value cannot be checked here: never loaded, one warning line however many.
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.auth"):
        for _ in range(3):
            out = np.zeros(4096, dtype=np.uint8)
            assert codec.decode_into(KEY, gmac_value, memoryview(out)) is Verdict.UNAUTHENTICATED
            assert not out.any()
    assert len(caplog.records) == 1
    assert "tiering[auth]" in caplog.records[0].getMessage()
    assert AuthKey(SECRET, mac="hmac").mac_kind is MacKind.HMAC_SHA256


def _forged(value: bytes, key: AuthKey) -> bytes:
    """The unkeyed codec's value: built from the public namespace alone."""
    return ChunkCodec(NS).encode(KEY, row(seed=9))


def _relabelled(value: bytes, key: AuthKey) -> bytes:
    """Chunk OTHER_KEY's keyed value with KEY written over its key: a move."""
    other = ChunkCodec(NS, auth_key=key).encode(OTHER_KEY, row(seed=3))
    return patched(other, 40, bytes(KEY))


@pytest.mark.parametrize(
    "damage",
    [
        _forged,
        lambda v, k: v1_value(ChunkCodec(NS), KEY, row(seed=9).tobytes(), Checksum.CRC32),
        lambda v, k: ChunkCodec(NS, Checksum.ML64).encode(KEY, row(seed=9)),
        lambda v, k: ChunkCodec(NS, auth_key=other_key(k)).encode(KEY, row(seed=9)),
        lambda v, k: patched(v, len(v) - 100, bytes([v[-100] ^ 1])),  # a payload bit
        lambda v, k: patched(v, 8, b"\x01"),  # the header's (zero) checksum field
        lambda v, k: patched(v, 4, bytes([FORMAT_VERSION])),  # keyed, labelled unkeyed
        lambda v, k: patched(v, 40 + 24, bytes(TAG_BYTES)),  # the tag zeroed
        lambda v, k: patched(v, 40 + 24 + 5, bytes([v[40 + 24 + 5] ^ 0x80])),  # a salt bit
        lambda v, k: patched(v, 40 + 24 + 21, bytes([v[40 + 24 + 21] ^ 0x01])),  # a tag bit
        lambda v, k: patched(v, 5, bytes([3 - v[5]])),  # labelled with the other MAC
        _relabelled,
    ],
    ids=[
        "forged-unkeyed",
        "legacy-crc32",
        "legacy-ml64",
        "another-key",
        "payload-bit",
        "header-field",
        "version-byte",
        "tag-zeroed",
        "tag-bit-early",
        "tag-bit-late",
        "other-mac-kind",
        "moved-to-another-key",
    ],
)
def test_a_keyed_reader_rejects_every_value_without_a_valid_tag(
    damage: Any, key_a: AuthKey
) -> None:
    codec = ChunkCodec(NS, auth_key=key_a)
    value = codec.encode(KEY, row())
    bad = damage(value, key_a)
    out = np.zeros(4096, dtype=np.uint8)
    assert codec.decode_into(KEY, bad, memoryview(out)) is Verdict.UNAUTHENTICATED
    assert codec.check(KEY, bad) is Verdict.UNAUTHENTICATED
    # The streamed path (a Redis read, a disk read): head first, then the payload.
    head = codec.check_head(KEY, memoryview(bad)[: codec.header_bytes(KEY)], len(bad))
    if not isinstance(head, Verdict):
        kind, expected = head
        payload = memoryview(bad)[codec.header_bytes(KEY) :]
        assert codec.check_payload(kind, expected, payload) is Verdict.UNAUTHENTICATED
        again = codec.check_head(KEY, memoryview(bad), len(bad))  # a fresh MAC state
        assert not isinstance(again, Verdict)
        verdict = codec.check_payload(*again, payload, memoryview(out))
        assert verdict is Verdict.UNAUTHENTICATED


def test_the_other_checks_still_name_what_failed_under_a_key(key_a: AuthKey) -> None:
    codec = ChunkCodec(NS, auth_key=key_a)
    value = codec.encode(KEY, row())
    assert codec.check(KEY, value[:-1]) is Verdict.BAD_LENGTH
    assert codec.check(OTHER_KEY, value) is Verdict.WRONG_KEY
    assert codec.check(KEY, b"garbage") is Verdict.BAD_MAGIC
    assert codec.check(KEY, patched(value, 4, b"\x07")) is Verdict.UNAUTHENTICATED
    assert codec.check(KEY, patched(value, 5, b"\x09")) is Verdict.BAD_CHECKSUM_KIND
    assert codec.check(KEY, patched(value, 16, bytes(16))) is Verdict.FOREIGN_NAMESPACE


def test_an_unkeyed_reader_rejects_keyed_values_as_a_version_it_does_not_read(
    key_a: AuthKey,
) -> None:
    keyed = ChunkCodec(NS, auth_key=key_a).encode(KEY, row())
    out = np.zeros(4096, dtype=np.uint8)
    assert ChunkCodec(NS).decode_into(KEY, keyed, memoryview(out)) is Verdict.BAD_VERSION
    assert not out.any()


# -- the key -----------------------------------------------------------------------------


def test_a_key_file_is_read_once_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    key = AuthKey.from_file(path)
    assert key.key_id == KEY_A.key_id  # the same bytes as SECRET
    path.write_bytes(b"changed, and long enough to be a key")
    value = ChunkCodec(NS, auth_key=key).encode(KEY, row())
    # Read once: a later change of the file is not seen.
    assert ChunkCodec(NS, auth_key=KEY_A).check(KEY, value) is Verdict.OK
    assert KEY_B.key_id != KEY_A.key_id


@pytest.mark.parametrize("secret", [SECRET, SECRET.decode()], ids=["bytes", "str"])
def test_a_raw_secret_given_as_the_auth_key_is_a_config_error_not_showing_it(
    tmp_path: Path, namespace: RemoteNamespace, secret: Any
) -> None:
    # Not taken and then failing at the first write (AttributeError, counted 'cancelled').
    for make in (
        lambda: ChunkCodec(NS, auth_key=secret),
        lambda: DiskTier(tmp_path / "disk", 1 << 20, namespace, auth_key=secret),
    ):
        with pytest.raises(ConfigError, match="must be an AuthKey") as error:
            make()
        assert SECRET.decode() not in str(error.value)


def test_the_key_is_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    key = AuthKey.from_file(path)
    codec = ChunkCodec(NS, auth_key=key)
    for text in (repr(key), str(key), repr(codec)):
        assert SECRET.decode() not in text
        assert SECRET.hex() not in text
        assert key.key_id in text


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b"short\n"), "holds 5 bytes"),
        (lambda p: p.write_bytes(b""), "holds 0 bytes"),
        (lambda p: p.write_bytes(b"x" * 5000), "at most 4096 bytes"),
        (lambda p: os.mkfifo(p), "not a regular file"),
    ],
    ids=["missing", "directory", "short", "empty", "long", "fifo"],
)
def test_a_bad_key_file_is_one_config_error_naming_it(
    tmp_path: Path, make: Any, words: str
) -> None:
    path = tmp_path / "key"
    make(path)
    with pytest.raises(ConfigError) as error:
        AuthKey.from_file(path)
    message = str(error.value)
    assert str(path) in message
    assert words in message
    assert "openssl rand" in message  # what would be right


def test_a_key_file_others_may_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "key"
    path.write_bytes(SECRET)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.auth"):
        AuthKey.from_file(path)
    assert len(caplog.records) == 1
    assert "chmod 600" in caplog.records[0].getMessage()
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="tiering.secondary.auth"):
        AuthKey.from_file(path)
    assert caplog.records == []


def test_the_key_may_come_from_the_environment(tmp_path: Path) -> None:
    assert AuthKey.from_env({}) is None
    assert AuthKey.from_env({"TIERING_AUTH_KEY": ""}) is None
    env = {"TIERING_AUTH_KEY": SECRET.decode() + "\n"}
    key = AuthKey.from_env(env)
    assert key is not None
    assert key.key_id == KEY_A.key_id
    assert "TIERING_AUTH_KEY" in repr(key)
    with pytest.raises(ConfigError, match="holds 5 bytes"):
        AuthKey.from_env({"TIERING_AUTH_KEY": "short"})
    path = tmp_path / "key"
    path.write_bytes(b"the file's key, which wins over the variable")
    path.chmod(0o600)
    loaded = AuthKey.load(path, env)
    assert loaded is not None
    assert loaded.key_id != KEY_A.key_id  # the file first
    assert AuthKey.load(None, {}) is None


# -- the disk tier ------------------------------------------------------------------------


def disk(root: Path, namespace: RemoteNamespace, **options: Any) -> DiskTier:
    options.setdefault("timeout_s", 5.0)
    options.setdefault("backoff_s", (60.0, 60.0))
    return DiskTier(root, 64 << 20, namespace, **options)


async def read_back(tier: Any, keys: list[OffloadKey]) -> tuple[list[bool], list[Row]]:
    buffers = [np.zeros(tier.row_bytes, dtype=np.uint8) for _ in keys]
    return await tier.read(items(keys, buffers)), buffers


def exact(keys: list[OffloadKey], buffers: list[Row], row_bytes: int) -> bool:
    return all(np.array_equal(b, row_of(k, row_bytes)) for k, b in zip(keys, buffers, strict=True))


@pytest.mark.anyio
async def test_a_keyed_disk_tier_round_trips_and_survives_a_restart(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, key_a: AuthKey
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(4)
    async with disk(root, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, [row_of(k, rb) for k in keys])) == 4
        filled, buffers = await read_back(tier, keys)
        assert filled == [True] * 4
        assert exact(keys, buffers, rb)
        raw = tier._files.path(keys[0]).read_bytes()
        assert (raw[4], raw[5]) == (KEYED_VERSION, key_a.mac_kind)
    async with disk(root, namespace, auth_key=AuthKey(SECRET)) as again:  # same key
        report = await again.open()
        assert report.dropped == {}
        filled, buffers = await read_back(again, keys)
        assert filled == [True] * 4
        assert exact(keys, buffers, rb)
        assert again.statistics().rejected_total == 0


@pytest.mark.anyio
async def test_values_planted_in_a_keyed_disk_tiers_folder_are_never_loaded(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, key_a: AuthKey, key_b: AuthKey
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(5)
    unkeyed, crc, other_key, flipped, kept = keys
    async with disk(root, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, [row_of(k, rb) for k in keys])) == 5
        path = tier._files.path
        public = ChunkCodec(namespace)  # all a forger needs: the namespace is public
        evil = np.full(rb, 0x66, dtype=np.uint8)
        path(unkeyed).write_bytes(file_bytes(public, unkeyed, public.encode(unkeyed, evil)))
        legacy = v1_value(public, crc, evil.tobytes(), Checksum.CRC32)
        path(crc).write_bytes(file_bytes(public, crc, legacy))
        stranger = ChunkCodec(namespace, auth_key=key_b)
        path(other_key).write_bytes(
            file_bytes(stranger, other_key, stranger.encode(other_key, evil))
        )
        data = bytearray(path(flipped).read_bytes())
        data[head_bytes(tier.codec, flipped) + 77] ^= 0x04
        path(flipped).write_bytes(bytes(data))

        filled, buffers = await read_back(tier, keys)
        assert filled == [False, False, False, False, True]
        assert exact([kept], buffers[4:], rb)
        # Unkeyed ones fail at their head: not a byte reaches the row. The others'
        # payloads land in the row before their tag fails, and are not hits.
        assert not buffers[0].any()
        assert not buffers[1].any()
        s = tier.statistics()
        assert s.rejected_by_reason == {Verdict.UNAUTHENTICATED.value: 4}
        assert (s.rejected_total, s.reads_total, s.errors_total) == (4, 1, 0)
        assert await tier.contains(keys) == [False] * 4 + [True]  # never offered again

    # Planted while the tier was closed: the scan drops the unkeyed ones; a keyed
    # one of another key passes the head's checks but is rejected at its read.
    plant = chunks.keys(2)
    forged_unkeyed, forged_keyed = plant
    for key, codec in ((forged_unkeyed, public), (forged_keyed, stranger)):
        p = path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(file_bytes(codec, key, codec.encode(key, evil)))
    async with disk(root, namespace, auth_key=key_a) as tier:
        report = await tier.open()
        assert report.dropped == {Verdict.UNAUTHENTICATED.value: 1}
        filled, buffers = await read_back(tier, plant)
        assert filled == [False, False]
        assert tier.statistics().rejected_by_reason == {Verdict.UNAUTHENTICATED.value: 1}


@pytest.mark.anyio
@pytest.mark.parametrize("key_len", [4040, 4100])  # its tag, or its key too, past a block
async def test_a_keyed_value_of_a_long_key_survives_a_restart(
    tmp_path: Path, namespace: RemoteNamespace, key_a: AuthKey, key_len: int
) -> None:
    # Its head spans more than one block: the scan at open must read the tag area too,
    # or it judged its own value unauthenticated and deleted it.
    root = tmp_path / "disk"
    key = OffloadKey(b"\x05" * key_len)
    async with disk(root, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items([key], [row_of(key, rb)])) == 1
    async with disk(root, namespace, auth_key=key_a) as again:
        report = await again.open()
        assert report.dropped == {}
        assert len(report.values) == 1
        filled, buffers = await read_back(again, [key])
        assert filled == [True]
        assert exact([key], buffers, rb)


@pytest.mark.anyio
async def test_a_tier_without_the_key_does_not_load_keyed_values(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, key_a: AuthKey
) -> None:
    root = tmp_path / "disk"
    keys = chunks.keys(2)
    async with disk(root, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, [row_of(k, rb) for k in keys])) == 2
    async with disk(root, namespace, read_only=True) as unkeyed:
        report = await unkeyed.open()
        assert report.dropped == {Verdict.BAD_VERSION.value: 2}
        filled, _ = await read_back(unkeyed, keys)
        assert filled == [False, False]


@pytest.mark.anyio
async def test_a_run_without_the_key_leaves_the_keyed_values_on_disk(
    tmp_path: Path, namespace: RemoteNamespace, chunks: Any, key_a: AuthKey
) -> None:
    # An operator who starts one run without the key must not lose the keyed cache.
    root = tmp_path / "disk"
    keys = chunks.keys(2)
    async with disk(root, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, [row_of(k, rb) for k in keys])) == 2
    async with disk(root, namespace) as unkeyed:  # the owner, not read-only
        report = await unkeyed.open()
        assert report.dropped == {Verdict.BAD_VERSION.value: 2}
        filled, _ = await read_back(unkeyed, keys)
        assert filled == [False, False]
    async with disk(root, namespace, auth_key=key_a) as again:
        report = await again.open()
        assert report.dropped == {}
        assert len(report.values) == 2
        filled, buffers = await read_back(again, keys)
        assert filled == [True, True]
        assert exact(keys, buffers, rb)


# -- the Redis tier ---------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_values_planted_in_redis_are_never_loaded_by_a_keyed_tier(
    redis_tls_server: Any,
    namespace: RemoteNamespace,
    chunks: Any,
    tls: bool,
    key_a: AuthKey,
    key_b: AuthKey,
) -> None:
    from tiering.secondary.redis import RedisTier

    url = redis_tls_server.tls_url if tls else redis_tls_server.url
    keys = chunks.keys(6)
    unkeyed, crc, other_key, flipped, moved, kept = keys
    async with await RedisTier.open(url, namespace, auth_key=key_a) as tier:
        rb = tier.row_bytes
        assert await tier.write(items(keys, [row_of(k, rb) for k in keys])) == 6
        filled, buffers = await read_back(tier, keys)
        assert filled == [True] * 6
        assert exact(keys, buffers, rb)

        raw = redis_tls_server.client()
        remote = tier.codec.remote_key
        assert raw.get(remote(kept))[4:6] == bytes([KEYED_VERSION, key_a.mac_kind])
        public = ChunkCodec(namespace)
        evil = np.full(rb, 0x66, dtype=np.uint8)
        raw.set(remote(unkeyed), public.encode(unkeyed, evil))  # the audit's forgery
        raw.set(remote(crc), v1_value(public, crc, evil.tobytes(), Checksum.CRC32))
        raw.set(remote(other_key), ChunkCodec(namespace, auth_key=key_b).encode(other_key, evil))
        value = bytearray(raw.get(remote(flipped)))
        value[-10] ^= 0x01
        raw.set(remote(flipped), bytes(value))
        # A valid value of another chunk, relabelled: its header passes, its tag fails.
        stolen = bytearray(raw.get(remote(kept)))
        stolen[40 : 40 + len(bytes(moved))] = bytes(moved)
        raw.set(remote(moved), bytes(stolen))

        filled, buffers = await read_back(tier, keys)
        assert filled == [False] * 5 + [True]
        assert exact([kept], buffers[5:], rb)
        s = tier.statistics()
        assert s.rejected_by_reason == {Verdict.UNAUTHENTICATED.value: 5}
        assert (s.rejected_total, s.errors_total) == (5, 0)

    # An unkeyed tier of the same store does not load the keyed values either.
    async with await RedisTier.open(url, namespace) as unkeyed_tier:
        filled, _ = await read_back(unkeyed_tier, [kept])
        assert filled == [False]
        assert unkeyed_tier.statistics().rejected_by_reason == {Verdict.BAD_VERSION.value: 1}


@pytest.mark.anyio
async def test_unkeyed_redis_values_are_as_before(
    redis_server: Any, namespace: RemoteNamespace, chunks: Any
) -> None:
    from tiering.secondary.redis import RedisTier

    keys = chunks.keys(2)
    async with await RedisTier.open(redis_server.url, namespace) as tier:
        rows = [row_of(k, tier.row_bytes) for k in keys]
        assert await tier.write(items(keys, rows)) == 2
        raw = redis_server.client()
        assert raw.get(tier.codec.remote_key(keys[0])) == v1_value(
            tier.codec, keys[0], rows[0].tobytes(), Checksum.XXH3
        )


# -- the command line -----------------------------------------------------------------------

REPLAY = [
    "replay", "--workload", "chat", "--requests", "150", "--capacity-tokens", "20480",
    "--bytes-per-token", "16", "--verify", "--json",
]  # fmt: skip


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "TIERING_AUTH_KEY"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "tiering", *args],
        capture_output=True, text=True, timeout=180, env=environ,
    )  # fmt: skip


def test_a_replay_with_a_key_file_or_the_variable_shares_keyed_values(
    own_redis_server: RedisServer, tmp_path: Path
) -> None:
    redis_server = own_redis_server  # its values are this test's alone
    key_file = tmp_path / "key"
    key_file.write_bytes(SECRET + b"\n")
    key_file.chmod(0o600)
    ns = ["--remote", redis_server.url, "--remote-namespace", f"mac-{tmp_path.name}"]
    first = run_cli(*REPLAY, *ns, "--auth-key-file", str(key_file))
    assert first.returncode == 0, first.stderr
    one = json.loads(first.stdout)
    assert one["remote_write_bytes"] > 0
    assert (one["corrupt_chunks"], one["remote_errors"], one["remote_rejected"]) == (0, 0, 0)
    assert SECRET.decode() not in first.stdout + first.stderr
    raw = redis_server.client()
    stored = [raw.get(k) for k in raw.scan_iter(match="tkv:*", count=1000)]
    assert stored
    assert all(v[4] == KEYED_VERSION for v in stored if v is not None)
    # The same key from the environment: the values are read, byte for byte.
    second = run_cli(*REPLAY, *ns, env={"TIERING_AUTH_KEY": SECRET.decode()})
    assert second.returncode == 0, second.stderr
    two = json.loads(second.stdout)
    assert two["remote_hit_blocks"] > 0
    assert (two["corrupt_chunks"], two["remote_rejected"]) == (0, 0)
    # Another key loads none of them: each is rejected, and counted.
    other = tmp_path / "other"
    other.write_bytes(b"a different secret of the same length!\n")
    other.chmod(0o600)
    third = run_cli(*REPLAY, *ns, "--auth-key-file", str(other))
    assert third.returncode == 0, third.stderr
    three = json.loads(third.stdout)
    assert three["corrupt_chunks"] == 0
    assert three["remote_rejected_by_reason"].get("unauthenticated", 0) > 0
    assert set(three["remote_rejected_by_reason"]) == {"unauthenticated"}


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(b"too short\n"), "holds 9 bytes"),
        (lambda p: p.mkdir(), "is a directory"),
    ],
    ids=["missing", "short", "directory"],
)
def test_a_bad_key_file_exits_2_with_one_line(tmp_path: Path, make: Any, words: str) -> None:
    path = tmp_path / "key"
    make(path)
    done = run_cli(
        *REPLAY, "--disk", str(tmp_path / "disk"), "--disk-bytes", "100000000",
        "--auth-key-file", str(path),
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert str(path) in lines[0]
    assert words in lines[0]
    assert "Traceback" not in done.stderr


def test_a_short_key_in_the_variable_exits_2_and_a_key_without_a_tier_is_an_error(
    tmp_path: Path,
) -> None:
    disk_args = ["--disk", str(tmp_path / "disk"), "--disk-bytes", "100000000"]
    done = run_cli(*REPLAY, *disk_args, env={"TIERING_AUTH_KEY": "tiny"})
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "TIERING_AUTH_KEY" in done.stderr
    assert "tiny" not in done.stderr
    key_file = tmp_path / "key"
    key_file.write_bytes(SECRET)
    done = run_cli(*REPLAY, "--auth-key-file", str(key_file))
    assert done.returncode == 2
    assert "--disk DIR or --remote URL" in done.stderr


def test_the_summary_says_whether_the_values_are_keyed_and_by_which_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(SECRET + b"\n")
    key_file.chmod(0o600)
    disk_args = ["--disk", str(tmp_path / "disk"), "--disk-bytes", "100000000"]
    text = [a for a in REPLAY if a != "--json"]
    keyed = run_cli(*text, *disk_args, "--auth-key-file", str(key_file))
    assert keyed.returncode == 0, keyed.stderr
    (line,) = [x for x in keyed.stdout.splitlines() if x.startswith("values ")]
    assert f"keyed: only holders of auth key {AuthKey(SECRET).key_id} (from" in line
    assert SECRET.decode() not in keyed.stdout + keyed.stderr
    plain = run_cli(*text, "--disk", str(tmp_path / "other"), "--disk-bytes", "100000000")
    assert plain.returncode == 0, plain.stderr
    (line,) = [x for x in plain.stdout.splitlines() if x.startswith("values ")]
    assert "unkeyed" in line
