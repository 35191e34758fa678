"""``tiering events``: print the KV events a publisher sends, one line per event.

Human lines read ``seq=12 ts=1757500000.250000 BlockStored medium=CPU group=0
hashes=4 first=0x00000000deadbeef block_size=256 tokens=0 parent=-``; a lost
range reads ``seq=5..9 Gap lost=5``. JSON lines carry every field of the
event plus ``seq``, ``ts`` and ``data_parallel_rank``, with bytes as hex.

Both ends of a ZeroMQ stream may connect, and then nothing ever arrives and
nothing fails: a publisher given ``tcp://127.0.0.1:5557`` connects (vLLM's
rule), and so does this client. So it says where it connects or binds, and
after ``first_timeout`` seconds without a first batch it gives up with a
`TimeoutError` that says whether any publisher was met there and how to fix
the endpoints (bind one side with ``tcp://*:PORT``).
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import anyio
import msgspec

from tiering.events.config import DEFAULT_ENDPOINT, loopback_of, wildcard_of
from tiering.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockStored,
    EventItem,
    Gap,
    KVEvent,
    SequencedBatch,
)
from tiering.events.subscriber import ZmqSubscriber

__all__ = ["format_event", "print_events", "silence_message", "skipped_line", "waiting_line"]


async def print_events(
    endpoint: str,
    replay_endpoint: str | None,
    json_lines: bool,
    out: TextIO,
    limit: int | None = None,
    *,
    first_timeout: float | None = None,
    status: TextIO | None = None,
) -> int:
    """Print events from ``endpoint`` to ``out`` until ``limit`` events; return how many.

    With ``replay_endpoint`` the history the publisher still buffers is
    printed first (from sequence 0; a range it no longer holds is one gap line).
    Without ``limit`` it runs until cancelled. ``endpoint`` is connected to,
    or bound when it has a ``*`` (see `ZmqSubscriber`); once it is, one line
    on ``status`` says so and what it waits for. Without a first batch (or
    gap) within ``first_timeout`` seconds (None: no limit) it raises
    `TimeoutError`, whose one-line message says whether a publisher was met
    and how to fix the endpoints. A message that is not a batch is skipped
    (the subscriber logs the first one); at the end, however it ends, one line
    on ``status`` says how many were skipped, if any.
    """
    if limit is not None and limit <= 0:
        return 0
    start = 0 if replay_endpoint is not None else None
    async with ZmqSubscriber(endpoint, replay_endpoint, start_seq=start) as subscriber:
        if status is not None:
            status.write(waiting_line(subscriber, first_timeout) + "\n")
            status.flush()
        try:
            return await _print(subscriber, json_lines, out, limit, first_timeout)
        finally:
            skipped = subscriber.statistics().malformed_total
            if status is not None and skipped:
                status.write(skipped_line(skipped) + "\n")
                status.flush()


def skipped_line(skipped: int) -> str:
    """The summary of ``skipped`` malformed messages (one line)."""
    were = "message that was" if skipped == 1 else "messages that were"
    return f"tiering events: skipped {skipped} malformed {were} not KV event batches"


async def _print(
    subscriber: ZmqSubscriber,
    json_lines: bool,
    out: TextIO,
    limit: int | None,
    first_timeout: float | None,
) -> int:
    printed = 0
    item = await _first(subscriber, first_timeout)
    while item is not None:  # None: closed
        if isinstance(item, Gap):
            out.write(_gap_json(item) if json_lines else _gap_text(item))
            out.write("\n")
        else:
            for event in item.batch.events:
                out.write(format_event(item, event, json_lines))
                out.write("\n")
                printed += 1
                if printed == limit:
                    out.flush()
                    return printed
        out.flush()
        item = await anext(subscriber, None)
    return printed


async def _first(subscriber: ZmqSubscriber, timeout: float | None) -> EventItem | None:
    """The first item, or `TimeoutError` explaining the silence after ``timeout`` seconds."""
    if timeout is None:
        return await anext(subscriber, None)
    with anyio.move_on_after(timeout):
        return await anext(subscriber, None)
    raise TimeoutError(silence_message(subscriber, timeout))


def waiting_line(subscriber: ZmqSubscriber, first_timeout: float | None) -> str:
    """What `print_events` waits for at ``subscriber``'s endpoint, and for how long."""
    endpoint = subscriber.endpoint
    limit = "no time limit" if first_timeout is None else f"up to {first_timeout:g} s (--timeout)"
    if subscriber.binds:
        return (
            f"tiering events: bound {endpoint}; waiting for a publisher that connects to it "
            f"(e.g. --events-endpoint {loopback_of(endpoint)}), {limit}"
        )
    wild = DEFAULT_ENDPOINT if endpoint == DEFAULT_ENDPOINT else wildcard_of(endpoint)
    example = f" (e.g. --events-endpoint {wild})" if wild is not None else ""
    return (
        f"tiering events: connecting to {endpoint}; waiting for a publisher that binds "
        f"it{example}, {limit}"
    )


def silence_message(subscriber: ZmqSubscriber, seconds: float) -> str:
    """Why nothing came from ``subscriber``'s endpoint in ``seconds``, and what to do (one line)."""
    endpoint = subscriber.endpoint
    after = f"no KV cache events at {endpoint} in {seconds:g} s"
    forever = "--timeout 0 waits for ever"
    if subscriber.has_publisher:
        return (
            f"{after}: a publisher is connected but sent nothing (an engine publishes only "
            f"when its cache changes); {forever}"
        )
    if subscriber.binds:
        return (
            f"{after}: no publisher connected to it, so nothing publishes here; start one "
            f"that connects here (e.g. --events-endpoint {loopback_of(endpoint)}); {forever}"
        )
    if endpoint == DEFAULT_ENDPOINT:  # tiering's default: a publisher binds it on loopback
        return (
            f"{after}: no publisher accepted the connection, so nothing publishes there; "
            f"start one with --events-endpoint alone (it binds {endpoint}); {forever}"
        )
    wild = wildcard_of(endpoint)
    if wild is None:
        return (
            f"{after}: no publisher is bound there, so nothing publishes there; start one with "
            f"--events-endpoint {endpoint}; {forever}"
        )
    return (
        f"{after}: no publisher accepted the connection, so nothing publishes there. A "
        f"publisher binds only an endpoint with '*' (vLLM's rule) and connects to any other, "
        f"as this command does: start it with --events-endpoint {wild}, or, for one that "
        f"connects to {endpoint}, bind here instead: tiering events {wild}; {forever}"
    )


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
