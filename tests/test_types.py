from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tiering._types import get_offload_block_hash, get_offload_group_idx, make_offload_key
from tiering.errors import InvalidKeyError, SpecError
from tiering.events.config import HashFormat
from tiering.events.schema import key_wire_hash


def test_an_int_hash_is_its_8_big_endian_bytes() -> None:
    # vLLM's integer hashes are the low 64 bits of the hash bytes, big-endian.
    assert make_offload_key(101) == (101).to_bytes(8, "big") + bytes(4)
    assert make_offload_key(10**8, 3) == (10**8).to_bytes(8, "big") + (3).to_bytes(4, "big")
    assert make_offload_key(2**64 - 1) == b"\xff" * 8 + bytes(4)
    assert make_offload_key(0) == bytes(12)
    assert make_offload_key(np.uint64(7)) == make_offload_key(7)


@pytest.mark.parametrize("h", [0, 1, 101, 10**8, 2**63, 2**64 - 1])
def test_an_int_hash_is_what_the_events_carry(h: int) -> None:
    key = make_offload_key(h, 2)
    assert key_wire_hash(key, HashFormat.INT) == h  # the KV events' int hash, round trip
    assert get_offload_block_hash(key) == h.to_bytes(8, "big")
    assert get_offload_group_idx(key) == 2


def test_bytes_hashes_are_kept() -> None:
    digest = bytes(range(32))
    key = make_offload_key(digest, 1)
    assert key == digest + b"\x00\x00\x00\x01"
    assert make_offload_key(bytearray(digest), 1) == key
    assert make_offload_key(memoryview(digest), 1) == key
    assert type(make_offload_key(bytearray(digest))) is bytes


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        ("abc", "'abc' of type str"),
        (1.5, "1.5 of type float"),
        (None, "None of type NoneType"),
        (True, "True of type bool"),
        ([1, 2], r"\[1, 2\] of type list"),
    ],
)
def test_other_hashes_are_refused(bad: Any, shown: str) -> None:
    with pytest.raises(InvalidKeyError, match=rf"bytes .*or an int in \[0, 2\*\*64\), got {shown}"):
        make_offload_key(bad)


@pytest.mark.parametrize(
    ("bad", "shown"), [(np.array([5]), r"array\(\[5\]\)"), (np.array([1, 2]), r"array\(\[1, 2\]\)")]
)
def test_an_array_hash_is_refused_as_a_key_error(bad: Any, shown: str) -> None:
    # An array has __index__ (numpy's TypeError for more than one element): not a hash.
    with pytest.raises(InvalidKeyError, match=rf"or an int in \[0, 2\*\*64\), got {shown} of type"):
        make_offload_key(bad)


@pytest.mark.parametrize("bad", [-1, 2**64, 10**30])
def test_an_int_hash_outside_64_bits_is_refused(bad: int) -> None:
    with pytest.raises(InvalidKeyError, match=rf"in \[0, 2\*\*64\).*got {bad}; pass a larger"):
        make_offload_key(bad)


def test_an_empty_hash_is_refused() -> None:
    with pytest.raises(InvalidKeyError, match="must not be empty"):
        make_offload_key(b"")


@pytest.mark.parametrize(
    "bad", [-1, 2**32, True, "0", 1.0, np.True_, np.int64(-1), np.uint64(2**32), np.array([1])]
)
def test_a_bad_group_index_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidKeyError, match=r"group_idx must be .*in \[0, 2\*\*32\)"):
        make_offload_key(b"h" * 8, bad)


@pytest.mark.parametrize("group", [np.int64(3), np.uint32(3), np.int8(3)])
def test_a_numpy_group_index_is_taken_as_its_int(group: Any) -> None:
    # As numpy's integers are taken for hashes.
    assert make_offload_key(b"h" * 8, group) == make_offload_key(b"h" * 8, 3)
    assert type(make_offload_key(np.uint64(7), group)) is bytes


def test_the_error_is_a_type_error_and_a_spec_error() -> None:
    assert issubclass(InvalidKeyError, TypeError)
    assert issubclass(InvalidKeyError, SpecError)
    assert issubclass(InvalidKeyError, ValueError)
