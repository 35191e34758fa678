"""KV cache events on the wire, byte for byte as vLLM sends them, and how chunks become events.

The records follow ``vllm/distributed/kv_events.py``: a `KVEventBatch` is a
msgpack array ``[ts, events, data_parallel_rank]`` (``omit_defaults`` does not
shorten an array, so an absent rank is a trailing nil); each event is a msgpack
map whose first key ``"type"`` is the class name, and whose fields with a
default are left out while they hold it. Maps let fields be added later without
breaking readers: add new fields with a default, at the end, and never reorder
or retype one.

Block hashes travel as vLLM sends them by default, as unsigned 64-bit ints (the
low 8 bytes of the hash, big-endian), or as the raw hash bytes
(`HashFormat.BYTES`).

`EventTranslator` turns the manager's chunk events into wire events. By
default a stored chunk is described as vLLM's offloading connector describes
one: one `BlockStored` per chunk, named by its key's hash, with
``block_size=0``, no tokens, no parent, its KV-cache group and nothing else
(``kv_connector_extra_config["self_describing_kv_events"]`` off). Asked to be
self-describing, the translator describes more: a chunk without `ChunkBlocks`
is one block of ``tokens_per_chunk`` tokens, and the chunks of one manager
event that share a KV-cache group go in one `BlockStored`; with `ChunkBlocks`
for a chunk, its event carries those blocks, and a chunk whose parent is the
previous chunk's last block extends the same `BlockStored`, as a prefix chain
does in vLLM's GPU events. Removals retract exactly the hashes that were
announced, one `BlockRemoved` per KV-cache group (as vLLM groups them). A
reset of a tier retracts what it held with `BlockRemoved` events of its
medium, never `AllBlocksCleared`: that event names no medium, and a router
would drop what it knows of the GPU's blocks too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import msgspec

from tiering._checks import is_int
from tiering._types import OffloadKey, get_offload_block_hash, get_offload_group_idx
from tiering.cpu.manager import ChunkEvent, ChunksRemoved, ChunksStored
from tiering.errors import ConfigError, EventSchemaError
from tiering.events.config import HashFormat

# No ``__all__``: `tiering.events` lists the names of this module that it exposes.

#: A block hash on the wire: the low 64 bits as an int, or the raw bytes.
BlockHash = int | bytes


class KVCacheEvent(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False, tag=True
):
    """Base of the KV cache events: a msgpack map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent, frozen=True, kw_only=True):
    """Blocks now held by ``medium``, in prefix order, the first after ``parent_block_hash``."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: The tokens past each block that went into its hash, one list per block (vLLM 0.33).
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent, frozen=True, kw_only=True):
    """Blocks no longer held by ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True, kw_only=True):
    """Every block was dropped (a reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(
    msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True, gc=False
):
    """The events of one engine step, in order; the unit of publication and replay."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class SequencedBatch(msgspec.Struct, frozen=True, gc=False):
    """A batch as a subscriber receives it, with its sequence number."""

    seq: int
    batch: KVEventBatch


class Gap(msgspec.Struct, frozen=True, gc=False):
    """Batches ``first_seq..last_seq`` (inclusive) were lost and cannot be recovered."""

    first_seq: int
    last_seq: int

    @property
    def count(self) -> int:
        """How many batches are missing."""
        return self.last_seq - self.first_seq + 1


#: What a subscription yields: the next batch, or a range lost before it.
EventItem = SequencedBatch | Gap

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``, as vLLM's publisher encodes it."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """The batch in ``payload``; a payload that is not one raises `EventSchemaError`."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventSchemaError(
            f"a payload of {len(payload)} bytes is not a KVEventBatch: {exc}"
        ) from exc


def wire_hash(block_hash: BlockHash, hash_format: HashFormat) -> BlockHash:
    """``block_hash`` as sent: bytes become their low 8 bytes read big-endian, or stay bytes.

    An int is taken to be in wire form already and is returned as it is.
    """
    if isinstance(block_hash, int) or hash_format is HashFormat.BYTES:
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")


def key_wire_hash(key: OffloadKey, hash_format: HashFormat) -> BlockHash:
    """The wire hash of a chunk key: its prefix hash, in ``hash_format``."""
    return wire_hash(get_offload_block_hash(key), hash_format)


class ChunkBlocks(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The GPU blocks one chunk covers, for events finer than one hash per chunk.

    ``block_hashes`` in prefix order (bytes are converted to the translator's
    hash format, ints are sent as they are); ``token_ids``, when given, are
    the tokens of all those blocks (``block_size`` per block);
    ``parent_block_hash`` is the hash of the block just before the chunk.
    """

    block_hashes: Sequence[BlockHash]
    block_size: int
    token_ids: Sequence[int] | None = None
    parent_block_hash: BlockHash | None = None

    def __post_init__(self) -> None:
        if not self.block_hashes:
            raise EventSchemaError("ChunkBlocks.block_hashes is empty; a chunk covers >= 1 block")
        # An int, not numpy's: it goes on the wire as it is.
        if not (is_int(self.block_size) and isinstance(self.block_size, int)):
            raise EventSchemaError(
                f"ChunkBlocks.block_size must be an int, got {self.block_size!r}"
            )
        if self.block_size < 1:
            raise EventSchemaError(f"ChunkBlocks.block_size must be >= 1, got {self.block_size}")
        hashes = [*self.block_hashes]
        if self.parent_block_hash is not None:
            hashes.append(self.parent_block_hash)
        for h in hashes:
            if not (isinstance(h, bytes) or (type(h) is int and 0 <= h < 1 << 64)):
                raise EventSchemaError(
                    f"ChunkBlocks hashes must be bytes or integers in [0, 2**64), got {h!r}"
                )
        if self.token_ids is not None and not all(type(t) is int for t in self.token_ids):
            bad = next(t for t in self.token_ids if type(t) is not int)
            raise EventSchemaError(f"ChunkBlocks.token_ids must be integers, got {bad!r}")
        tokens = self.token_ids
        if tokens is not None and len(tokens) != len(self.block_hashes) * self.block_size:
            n = len(self.block_hashes)
            raise EventSchemaError(
                f"ChunkBlocks.token_ids holds {len(tokens)} tokens; {n} blocks of "
                f"{self.block_size} tokens need {n * self.block_size}"
            )


class _Run(msgspec.Struct, gc=False):
    """Consecutive chunks of one manager event that go out as one wire event."""

    group_idx: int
    hashes: list[BlockHash]
    block_size: int = 0
    parent: BlockHash | None = None
    tokens: list[int] | None = None
    per_block: bool = False  # from ChunkBlocks, rather than one hash per chunk


class EventTranslator:
    """Turns the manager's `ChunkEvent` records into wire events for ``medium`` of each event.

    ``self_describing`` picks the description of a store (module docstring):
    False, vLLM's default, one block per chunk with ``block_size=0``, and any
    `ChunkBlocks` given are ignored; True, tiering's own richer one, where
    ``tokens_per_chunk`` is the block size announced for a chunk without
    `ChunkBlocks`. ``locality`` (e.g. ``"REMOTE"``) is copied into every store
    and removal. The hashes announced from `ChunkBlocks` are remembered until
    their chunk is removed or the tier cleared, so a removal retracts exactly
    them (a removal the manager dropped leaves its entry behind until the next
    clear).
    """

    def __init__(
        self,
        tokens_per_chunk: int | Sequence[int],
        *,
        hash_format: HashFormat | str = HashFormat.INT,
        locality: str | None = None,
        self_describing: bool = False,
    ) -> None:
        per_group = (
            tokens_per_chunk if isinstance(tokens_per_chunk, (list, tuple)) else (tokens_per_chunk,)
        )
        values: list[object] = [*per_group] or [None]
        for tokens in values:
            if not is_int(tokens) or cast(int, tokens) < 1:
                raise ConfigError(
                    "tokens_per_chunk must be an integer >= 1 (or one per KV-cache group), "
                    f"got {tokens_per_chunk!r}"
                )
        try:
            self._format = HashFormat(hash_format)
        except ValueError:
            raise ConfigError(
                f"hash_format must be 'int' or 'bytes', got {hash_format!r}"
            ) from None
        if not isinstance(self_describing, bool):
            raise ConfigError(f"self_describing must be True or False, got {self_describing!r}")
        # By group; Python ints (a numpy integer would fail the batch's encoding).
        self._tokens_per_chunk = tuple(int(cast(int, t)) for t in per_group)
        self._locality = locality
        self._self_describing = self_describing
        self._announced: dict[OffloadKey, list[BlockHash]] = {}

    @property
    def self_describing(self) -> bool:
        """Whether stores are described beyond vLLM's default (one hash, ``block_size=0``)."""
        return self._self_describing

    @property
    def hash_format(self) -> HashFormat:
        return self._format

    @property
    def tokens_per_chunk(self) -> tuple[int, ...]:
        """Tokens of a chunk without `ChunkBlocks`, by KV-cache group."""
        return self._tokens_per_chunk

    def _tokens_of(self, group: int) -> int:
        tokens = self._tokens_per_chunk
        return tokens[group] if group < len(tokens) else tokens[-1]

    def translate(
        self,
        events: Iterable[ChunkEvent],
        blocks: Mapping[OffloadKey, ChunkBlocks] | None = None,
    ) -> list[KVEvent]:
        """Wire events for ``events``, in order; ``blocks`` describes some stored chunks."""
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, ChunksStored):
                if self._self_describing:
                    self._stored(event, blocks or {}, out)
                else:
                    self._stored_plain(event, out)
            elif isinstance(event, ChunksRemoved):
                self._removed(event.keys, event.medium.value, out)
            else:  # a reset: what the tier held is gone from it, and only from it
                self._removed(event.keys, event.medium.value, out)
                self._announced.clear()
        return out

    def batch(
        self,
        events: Iterable[ChunkEvent],
        blocks: Mapping[OffloadKey, ChunkBlocks] | None = None,
        *,
        ts: float | None = None,
        data_parallel_rank: int | None = None,
    ) -> KVEventBatch | None:
        """A batch of the wire events for ``events``, stamped ``ts`` (now); None if none."""
        wire = self.translate(events, blocks)
        if not wire:
            return None
        return KVEventBatch(
            ts=time.time() if ts is None else ts,
            events=wire,
            data_parallel_rank=data_parallel_rank,
        )

    def _stored_plain(self, event: ChunksStored, out: list[KVEvent]) -> None:
        """vLLM's description of an offloaded chunk: its key's hash, nothing more."""
        medium = event.medium.value
        for key in event.keys:
            out.append(
                BlockStored(
                    block_hashes=[key_wire_hash(key, self._format)],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=get_offload_group_idx(key),
                    locality=self._locality,
                )
            )

    def _stored(
        self, event: ChunksStored, blocks: Mapping[OffloadKey, ChunkBlocks], out: list[KVEvent]
    ) -> None:
        medium = event.medium.value
        fmt = self._format
        run: _Run | None = None
        for key in event.keys:
            group = get_offload_group_idx(key)
            info = blocks.get(key)
            if info is None:
                chunk_hash = key_wire_hash(key, fmt)
                if run is not None and not run.per_block and run.group_idx == group:
                    run.hashes.append(chunk_hash)
                    continue
                self._flush_stored(run, medium, out)
                run = _Run(group, [chunk_hash], self._tokens_of(group))
                continue
            hashes = [wire_hash(h, fmt) for h in info.block_hashes]
            parent = info.parent_block_hash
            parent = None if parent is None else wire_hash(parent, fmt)
            tokens = None if info.token_ids is None else list(info.token_ids)
            self._announced[key] = hashes
            if (
                run is not None
                and run.per_block
                and run.group_idx == group
                and run.block_size == info.block_size
                and (run.tokens is None) == (tokens is None)
                and parent is not None
                and parent == run.hashes[-1]
            ):
                run.hashes.extend(hashes)
                if run.tokens is not None and tokens is not None:
                    run.tokens.extend(tokens)
                continue
            self._flush_stored(run, medium, out)
            run = _Run(group, list(hashes), info.block_size, parent, tokens, per_block=True)
        self._flush_stored(run, medium, out)

    def _flush_stored(self, run: _Run | None, medium: str, out: list[KVEvent]) -> None:
        if run is None:
            return
        out.append(
            BlockStored(
                block_hashes=run.hashes,
                parent_block_hash=run.parent,
                token_ids=run.tokens if run.tokens is not None else [],
                block_size=run.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                group_idx=run.group_idx,
                locality=self._locality,
            )
        )

    def _removed(self, keys: Sequence[OffloadKey], medium: str, out: list[KVEvent]) -> None:
        """One `BlockRemoved` per KV-cache group of ``keys``, in the order the groups come."""
        announced = self._announced
        by_group: dict[int, list[BlockHash]] = {}
        for key in keys:
            hashes = by_group.setdefault(get_offload_group_idx(key), [])
            held = announced.pop(key, None)
            if held is None:
                hashes.append(key_wire_hash(key, self._format))
            else:
                hashes.extend(held)
        out.extend(self._removal(hashes, medium, group) for group, hashes in by_group.items())

    def _removal(self, hashes: list[BlockHash], medium: str, group: int) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=hashes, medium=medium, group_idx=group, locality=self._locality
        )

    def __repr__(self) -> str:
        mode = "self-describing" if self._self_describing else "vLLM's plain"
        return (
            f"<EventTranslator [{mode} stores, {self._format.value} hashes, "
            f"{self._tokens_per_chunk} tokens per chunk, {len(self._announced)} chunks with "
            "block info]>"
        )
