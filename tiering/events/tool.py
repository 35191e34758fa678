"""``tiering events``: print the KV events a publisher sends, one line per event.

Human lines read ``seq=12 ts=1757500000.250000 BlockStored medium=CPU group=0
hashes=4 first=0x00000000deadbeef block_size=256 tokens=0 parent=-``; a lost
range reads ``seq=5..9 Gap lost=5``. JSON lines carry every field of the
event plus ``seq``, ``ts`` and ``data_parallel_rank``, with bytes as hex.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import msgspec

from tiering.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockStored,
    Gap,
    KVEvent,
    SequencedBatch,
)
from tiering.events.subscriber import ZmqSubscriber

__all__ = ["format_event", "print_events"]


async def print_events(
    endpoint: str,
    replay_endpoint: str | None,
    json_lines: bool,
    out: TextIO,
    limit: int | None = None,
) -> int:
    """Print events from ``endpoint`` to ``out`` until ``limit`` events; return how many.

    With ``replay_endpoint`` the history the publisher still buffers is
    printed first (from sequence 0; a range it no longer holds is one gap line).
    Without ``limit`` it runs until cancelled.
    """
    printed = 0
    if limit is not None and limit <= 0:
        return printed
    start = 0 if replay_endpoint is not None else None
    async with ZmqSubscriber(endpoint, replay_endpoint, start_seq=start) as subscriber:
        async for item in subscriber:
            if isinstance(item, Gap):
                out.write(_gap_json(item) if json_lines else _gap_text(item))
                out.write("\n")
                continue
            for event in item.batch.events:
                out.write(format_event(item, event, json_lines))
                out.write("\n")
                printed += 1
                if printed == limit:
                    out.flush()
                    return printed
            out.flush()
    return printed


def format_event(item: SequencedBatch, event: KVEvent, json_lines: bool) -> str:
    """One line for ``event`` of ``item``: human-readable, or one JSON object."""
    if json_lines:
        record: dict[str, Any] = {
            "seq": item.seq,
            "ts": item.batch.ts,
            "data_parallel_rank": item.batch.data_parallel_rank,
            "type": type(event).__name__,
        }
        for field in msgspec.structs.fields(event):
            record[field.name] = _jsonable(getattr(event, field.name))
        return json.dumps(record, separators=(",", ":"))
    head = f"seq={item.seq} ts={item.batch.ts:.6f} {type(event).__name__}"
    if isinstance(event, AllBlocksCleared):
        return head
    hashes = event.block_hashes
    first = _hash_text(hashes[0]) if hashes else "-"
    line = (
        f"{head} medium={event.medium} group={event.group_idx} hashes={len(hashes)} first={first}"
    )
    if isinstance(event, BlockStored):
        parent = "-" if event.parent_block_hash is None else _hash_text(event.parent_block_hash)
        line += f" block_size={event.block_size} tokens={len(event.token_ids)} parent={parent}"
    if event.locality is not None:
        line += f" locality={event.locality}"
    return line


def _hash_text(block_hash: BlockHash) -> str:
    return f"0x{block_hash:016x}" if isinstance(block_hash, int) else block_hash.hex()


def _gap_text(gap: Gap) -> str:
    return f"seq={gap.first_seq}..{gap.last_seq} Gap lost={gap.count}"


def _gap_json(gap: Gap) -> str:
    return json.dumps({"type": "Gap", "first_seq": gap.first_seq, "last_seq": gap.last_seq})


def _jsonable(value: Any) -> Any:
    """``value`` with bytes as hex strings and tuples as lists, for `json.dumps`."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
