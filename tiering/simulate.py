"""Capacity planning without moving bytes: replay a trace through the chunk manager.

Each request is handled as a server would handle it: look up its chunks from
the head until the first that is not ready (those are hits), pin the hits (a
load), store the rest while the hits are pinned, unpin the hits, and commit the
request's recency head to tail. One chunk per hash id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from tiering._types import OffloadKey, make_offload_key
from tiering.cpu.manager import CPUOffloadingManager
from tiering.errors import CapacityError
from tiering.policies import create_policy

__all__ = ["SimulationResult", "requests_to_keys", "simulate", "simulate_keys"]


class _HasHashIds(Protocol):
    @property
    def hash_ids(self) -> Sequence[int]: ...


class SimulationResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of one (policy, capacity) simulation."""

    policy: str
    capacity_tokens: int
    capacity_chunks: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_rate: float
    store_failures: int
    evictions: int
    seconds: float
    keys_per_s: float


def requests_to_keys(requests: Iterable[_HasHashIds]) -> list[list[OffloadKey]]:
    """The chunk keys of each request: one key per hash id, equal ids giving one shared key.

    Hash ids are unsigned 64-bit integers (the trace reader checks it); a key is
    the id's 8 big-endian bytes and group 0.
    """
    cache: dict[int, OffloadKey] = {}
    out = []
    for request in requests:
        keys = []
        for hash_id in request.hash_ids:
            key = cache.get(hash_id)
            if key is None:
                key = cache[hash_id] = make_offload_key(hash_id.to_bytes(8, "big"))
            keys.append(key)
        out.append(keys)
    return out


def capacity_chunks(capacity_tokens: int, block_tokens: int) -> int:
    """Chunks a tier of ``capacity_tokens`` holds, one ``block_tokens`` chunk per hash id."""
    if block_tokens < 1:
        raise CapacityError(f"block tokens must be at least 1, got {block_tokens}")
    if capacity_tokens < block_tokens:
        raise CapacityError(
            f"a capacity of {capacity_tokens} tokens holds no chunk of {block_tokens} tokens; "
            f"give at least {block_tokens}"
        )
    return capacity_tokens // block_tokens


def simulate_keys(
    request_keys: Sequence[Sequence[OffloadKey]],
    *,
    capacity_tokens: int,
    policy: str = "lru",
    block_tokens: int = 512,
) -> SimulationResult:
    """Replay requests given as chunk keys (see `requests_to_keys`) through a fresh manager."""
    num_chunks = capacity_chunks(capacity_tokens, block_tokens)
    manager = CPUOffloadingManager(num_chunks, create_policy(policy, num_chunks))
    lookup_prefix = manager.lookup_prefix
    prepare_load = manager.prepare_load
    complete_load = manager.complete_load
    prepare_store = manager.prepare_store
    complete_store = manager.complete_store
    touch = manager.touch
    blocks = hit_blocks = store_failures = 0
    start = time.perf_counter()
    for keys in request_keys:
        blocks += len(keys)
        hits = lookup_prefix(keys)
        hit_keys = keys[:hits]
        if hits:
            hit_blocks += hits
            prepare_load(hit_keys)
        if hits < len(keys):
            output = prepare_store(keys[hits:])
            if output is None:
                store_failures += 1
            elif output.keys_to_store:
                complete_store(output.keys_to_store)
        if hits:
            complete_load(hit_keys)
        touch(keys)
    seconds = time.perf_counter() - start
    return SimulationResult(
        policy=policy,
        capacity_tokens=capacity_tokens,
        capacity_chunks=num_chunks,
        requests=len(request_keys),
        blocks=blocks,
        hit_blocks=hit_blocks,
        hit_rate=hit_blocks / blocks if blocks else 0.0,
        store_failures=store_failures,
        evictions=manager.statistics().evictions_total,
        seconds=seconds,
        keys_per_s=blocks / seconds if seconds > 0 else 0.0,
    )


def simulate(
    requests: Iterable[_HasHashIds],
    *,
    capacity_tokens: int,
    policy: str = "lru",
    block_tokens: int = 512,
) -> SimulationResult:
    """Replay ``requests`` (anything with ``hash_ids``) through a fresh manager."""
    return simulate_keys(
        requests_to_keys(requests),
        capacity_tokens=capacity_tokens,
        policy=policy,
        block_tokens=block_tokens,
    )
