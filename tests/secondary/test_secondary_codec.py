"""The value format: namespaces, remote keys, checksums, and every way a value is rejected."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import xxhash

from tiering._types import make_offload_key
from tiering.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from tiering.errors import ConfigError, SpecError
from tiering.secondary import ChunkCodec, RemoteNamespace, Verdict, writable_row
from tiering.secondary.checksum import Checksum, checksum, checksum_copy, ml64, splitmix64

MASK = (1 << 64) - 1
NS = RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4)
KEY = make_offload_key(bytes(range(16)), 3)
OTHER_KEY = make_offload_key(bytes(range(1, 17)), 3)


def row(n: int = 4096, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def reference_ml64(data: bytes) -> int:
    """ML64 written out plainly, from its definition in tiering/secondary/checksum.py."""
    state, h = 0, 0
    padded = data + bytes(-len(data) % 8)
    for i in range(len(padded) // 8):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        z ^= z >> 31
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        h = (h + (z | 1) * word) & MASK
    return h


# -- namespaces and keys ---------------------------------------------------------


def test_the_namespace_digest_is_pinned_and_names_every_field() -> None:
    assert NS.digest().hex() == "d50a226c3984f6c7f14689dcef501a73"  # the wire format
    variants = [
        RemoteNamespace(model="m2", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4),
        RemoteNamespace(model="m", dtype="float16", row_bytes=4096, blocks_per_chunk=4),
        RemoteNamespace(model="m", dtype="bfloat16", row_bytes=8192, blocks_per_chunk=4),
        RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=8),
        RemoteNamespace(
            model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4, page_bytes=(1024,)
        ),
        RemoteNamespace(
            model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4, tokens_per_block=(16,)
        ),
        RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4, shard="x"),
        RemoteNamespace(
            model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4, namespace="tenant"
        ),
    ]
    digests = {ns.digest() for ns in variants} | {NS.digest()}
    assert len(digests) == len(variants) + 1


@pytest.mark.parametrize(
    "fields",
    [
        {"model": ""},
        {"dtype": 3},
        {"row_bytes": 0},
        {"blocks_per_chunk": -1},
        {"row_bytes": True},
        {"page_bytes": (4096, 0)},
    ],
)
def test_a_bad_namespace_is_refused(fields: dict[str, object]) -> None:
    base: dict[str, object] = {
        "model": "m",
        "dtype": "bf16",
        "row_bytes": 4096,
        "blocks_per_chunk": 4,
    }
    with pytest.raises(ConfigError, match=next(iter(fields))):
        RemoteNamespace(**{**base, **fields})  # type: ignore[arg-type]


def test_the_namespace_of_an_engine_config() -> None:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("k", "v")),),
        worker_kv_bytes_per_block=8192,
        engine_id="e",
        model=OffloadingModelConfig(name="llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(
            rank=1,
            world_size=2,
            tp_size=2,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=3,
            is_parallelism_agnostic=False,
        ),
    )
    ns = RemoteNamespace.from_config(
        config, row_bytes=32768, page_bytes=(4096, 4096), namespace="a"
    )
    assert ns.model == "llama"
    assert ns.dtype == "bfloat16"
    assert ns.blocks_per_chunk == 4
    assert ns.tokens_per_block == (16,)
    assert ns.shard == "rank1of2.tp2.pp1.pcp1.dcp1"  # the data-parallel index is left out
    assert ns.namespace == "a"


def test_remote_keys_are_hash_tagged_and_namespaced() -> None:
    codec = ChunkCodec(NS)
    remote = codec.remote_key(KEY)
    assert remote == b"tkv:{" + NS.digest().hex()[:16].encode() + b":" + KEY.hex().encode() + b"}"
    tag = remote[remote.index(b"{") + 1 : remote.index(b"}")]
    assert codec.remote_key(KEY, b":meta").startswith(remote)  # same tag, same slot
    assert tag.count(b"{") == 0
    other = ChunkCodec(RemoteNamespace(model="x", dtype="bf16", row_bytes=4096, blocks_per_chunk=4))
    assert other.remote_key(KEY) != remote


# -- checksums -------------------------------------------------------------------


def test_splitmix64_is_the_reference_sequence() -> None:
    assert [int(x) for x in splitmix64(3)] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4096, 4099, (256 << 10) + 13, 600_000])
def test_ml64_matches_its_definition(size: int) -> None:
    data = row(size, seed=size).tobytes()
    assert ml64(memoryview(data)) == reference_ml64(data)


def test_ml64_is_pinned() -> None:
    assert ml64(memoryview(bytes(range(256)) * 4 + b"abc")) == 0xF45ED8D0713CFE61


def test_ml64_catches_every_single_bit_error_and_swapped_words() -> None:
    data = bytearray(row(64).tobytes())
    good = ml64(memoryview(data))
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        assert ml64(memoryview(data)) != good, bit
        data[bit // 8] ^= 1 << (bit % 8)
    swapped = data[8:16] + data[:8] + data[16:]
    assert ml64(memoryview(swapped)) != good


def test_xxh3_is_xxhash_xxh3_64_seed_0_and_what_a_codec_writes() -> None:
    # The published XXH3_64bits test vector of empty input, and sizes across
    # the copy's slices: streamed (with a copy) and one-shot agree.
    assert checksum(Checksum.XXH3, memoryview(b"")) == 0x2D06800538D394C2
    for size in (1, 240, 241, (256 << 10) - 1, (256 << 10) + 1, 600_001):
        data = row(size, seed=size)
        out = np.zeros_like(data)
        value = checksum_copy(Checksum.XXH3, memoryview(data), memoryview(out))
        assert (
            value
            == xxhash.xxh3_64_intdigest(data.tobytes())
            == checksum(Checksum.XXH3, memoryview(data))
        )
        assert np.array_equal(out, data)
    assert ChunkCodec(NS).checksum is Checksum.XXH3
    assert ChunkCodec(NS).encode(KEY, memoryview(row(NS.row_bytes)))[5] == Checksum.XXH3


@pytest.mark.parametrize("kind", list(Checksum))
def test_checksum_copy_copies_exactly_and_agrees_with_checksum(kind: Checksum) -> None:
    src = row(700_001)
    dst = np.zeros_like(src)
    value = checksum_copy(kind, memoryview(src), memoryview(dst))
    assert value == checksum(kind, memoryview(src))
    assert np.array_equal(dst, src)
    if kind is Checksum.CRC32:
        assert value == zlib.crc32(src.tobytes())


# -- values ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(Checksum))
@pytest.mark.parametrize("row_bytes", [4096, 4101])
def test_a_value_round_trips_byte_for_byte(kind: Checksum, row_bytes: int) -> None:
    ns = RemoteNamespace(model="m", dtype="bf16", row_bytes=row_bytes, blocks_per_chunk=4)
    codec = ChunkCodec(ns, kind)
    payload = row(row_bytes)
    value = codec.encode(KEY, memoryview(payload))
    assert len(value) == codec.value_bytes(KEY) == codec.header_bytes(KEY) + row_bytes
    assert codec.header_bytes(KEY) % 8 == 0  # the payload is 8-byte aligned
    assert value[5] == kind
    out = np.zeros(row_bytes, dtype=np.uint8)
    assert codec.decode_into(KEY, value, memoryview(out)) is Verdict.OK
    assert np.array_equal(out, payload)
    assert ChunkCodec(ns).check(KEY, value) is Verdict.OK  # every kind is read


def test_encode_takes_any_contiguous_buffer_of_one_row() -> None:
    codec = ChunkCodec(NS)
    payload = row()
    as_words = payload.view(np.uint32)
    assert codec.encode(KEY, memoryview(as_words)) == codec.encode(KEY, payload.tobytes())
    with pytest.raises(SpecError, match="4096 bytes, got 4095"):
        codec.encode(KEY, payload[:-1].tobytes())
    with pytest.raises(SpecError, match="contiguous"):
        codec.encode(KEY, memoryview(np.zeros(8192, dtype=np.uint8))[::2])


def _patched(value: bytes, offset: int, data: bytes) -> bytes:
    return value[:offset] + data + value[offset + len(data) :]


@pytest.mark.parametrize(
    ("damage", "verdict"),
    [
        (lambda v: b"hello world", Verdict.BAD_MAGIC),
        (lambda v: b"", Verdict.BAD_MAGIC),
        (lambda v: b"TKV", Verdict.BAD_MAGIC),
        (lambda v: v[:30], Verdict.BAD_LENGTH),  # shorter than a header
        (lambda v: _patched(v, 4, b"\x02"), Verdict.BAD_VERSION),
        (lambda v: _patched(v, 5, b"\x09"), Verdict.BAD_CHECKSUM_KIND),
        (lambda v: _patched(v, 16, bytes(16)), Verdict.FOREIGN_NAMESPACE),
        (lambda v: v[:-1], Verdict.BAD_LENGTH),  # truncated
        (lambda v: v + b"x", Verdict.BAD_LENGTH),  # padded
        (lambda v: v[:50], Verdict.BAD_LENGTH),  # cut inside the key
        (lambda v: _patched(v, 32, struct.pack(">Q", 4095))[:-1], Verdict.BAD_LENGTH),
        (lambda v: _patched(v, 6, struct.pack(">H", 19)), Verdict.WRONG_KEY),
        (lambda v: _patched(v, len(v) - 100, bytes([v[-100] ^ 1])), Verdict.BAD_CHECKSUM),
        (lambda v: _patched(v, 8, bytes(8)), Verdict.BAD_CHECKSUM),
    ],
    ids=[
        "garbage",
        "empty",
        "short-magic",
        "short-header",
        "version",
        "checksum-kind",
        "namespace",
        "truncated",
        "padded",
        "cut-in-key",
        "length-field",
        "key-length",
        "payload-bit",
        "checksum-field",
    ],
)
def test_every_damaged_value_is_rejected(damage: object, verdict: Verdict) -> None:
    codec = ChunkCodec(NS)
    value = codec.encode(KEY, row())
    damaged = damage(value)  # type: ignore[operator]
    out = np.zeros(4096, dtype=np.uint8)
    assert codec.decode_into(KEY, damaged, memoryview(out)) is verdict
    assert codec.check(KEY, damaged) is verdict
    if verdict is not Verdict.BAD_CHECKSUM:
        assert not out.any()  # checks before the payload leave the buffer untouched


def test_a_valid_value_of_another_chunk_or_namespace_is_rejected() -> None:
    codec = ChunkCodec(NS)
    other_ns = ChunkCodec(
        RemoteNamespace(model="m", dtype="bfloat16", row_bytes=4096, blocks_per_chunk=4, shard="b")
    )
    out = memoryview(np.zeros(4096, dtype=np.uint8))
    assert codec.decode_into(KEY, codec.encode(OTHER_KEY, row()), out) is Verdict.WRONG_KEY
    assert codec.decode_into(KEY, other_ns.encode(KEY, row()), out) is Verdict.FOREIGN_NAMESPACE


def test_read_buffers_must_be_writable_rows() -> None:
    with pytest.raises(SpecError, match="writable"):
        writable_row(bytes(4096), 4096)
    with pytest.raises(SpecError, match="exactly one row of 4096 bytes, got 4095"):
        writable_row(bytearray(4095), 4096)
    with pytest.raises(SpecError, match="contiguous"):
        writable_row(memoryview(bytearray(8192))[::2], 4096)
    view = writable_row(np.zeros(1024, dtype=np.uint32), 4096)
    assert view.format == "B"
    assert view.nbytes == 4096
    assert "tkv:{" in repr(ChunkCodec(NS))


@pytest.mark.parametrize("hash_bytes", [16, 20])  # keys of 20 bytes (padded) and 24 (not)
def test_the_streamed_checks_give_the_verdicts_of_decode_into(hash_bytes: int) -> None:
    # A reader that checks the header first, then the payload in the caller's
    # row (the Redis tier's), must reject exactly what decode_into rejects, for
    # the same reason. Includes a key length field longer than the key whose
    # first bytes are the key (a check of the bytes alone would pass it).
    codec = ChunkCodec(NS)
    key = make_offload_key(bytes(range(hash_bytes)), 3)
    good = codec.encode(key, memoryview(row(NS.row_bytes)))
    longer = bytearray(good)
    struct.pack_into(">H", longer, 6, len(bytes(key)) + 1)
    values = [good, bytes(longer), good[:-1], good + b"x", good[:30], b"TKVC" + good[4:5]]
    for i in range(0, len(good), 7):
        damaged = bytearray(good)
        damaged[i] ^= 0x10
        values.append(bytes(damaged))
    for value in values:
        whole = codec.decode_into(key, value, memoryview(np.zeros(NS.row_bytes, np.uint8)))
        view = memoryview(value)
        head = codec.check_head(key, view[: codec.header_bytes(key)], len(value))
        if isinstance(head, Verdict):
            streamed = head
        else:
            streamed = codec.check_payload(*head, view[codec.header_bytes(key) :])
        assert streamed is whole, (value[:48], whole, streamed)
