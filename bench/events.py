"""KV events per second, encoded, published over ZeroMQ and delivered to a live subscriber.

Events are shaped like this engine's: one `BlockStored` per stored chunk with
one 64-bit hash, no tokens, in batches of 1 and of 256. Per transport (ipc in
a temporary directory, tcp on a free loopback port) and batch size, one event
loop publishes through `ZmqEventPublisher` (whose thread encodes and sends)
while a `ZmqSubscriber` on the same loop receives and decodes; the figure is
events delivered per second, first publish to last delivery. An ``encode`` row
gives the encoder alone. Target: at least 200,000 events/s delivered in
batches of 256. Best of ``--repeat`` runs (these machines are noisy).

A ``replay`` row runs `tiering replay` (the conversation trace, or the chat
workload) with events off and on (published over ipc with a replay socket),
alternately, and compares the best times: the engine's whole cost of events
(translation, batching, encoding and sending in the publisher thread). No
subscriber runs, so its work does not count against the engine on this
small machine. Target: under 5 % slower with events on.

    python bench/events.py [--events N] [--repeat R] [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import anyio

from tiering.events import (
    BlockStored,
    Gap,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
    ZmqSubscriber,
    encode_batch,
)

TOKENS_PER_CHUNK = 256
DISTINCT_BATCHES = 16


def make_batches(batch_size: int) -> list[KVEventBatch]:
    """A few distinct batches of ``batch_size`` one-hash `BlockStored` events."""
    rng = random.Random(batch_size)
    return [
        KVEventBatch(
            ts=time.time(),
            events=[
                BlockStored(
                    block_hashes=[rng.getrandbits(64)],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=TOKENS_PER_CHUNK,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=0,
                )
                for _ in range(batch_size)
            ],
            data_parallel_rank=0,
        )
        for _ in range(DISTINCT_BATCHES)
    ]


def encode_rate(batch_size: int, events: int) -> float:
    """Events per second through `encode_batch` alone."""
    batches = make_batches(batch_size)
    n = max(1, events // batch_size)
    start = time.perf_counter()
    for i in range(n):
        encode_batch(batches[i % DISTINCT_BATCHES])
    return n * batch_size / (time.perf_counter() - start)


async def deliver(endpoint: str, replay: str, batch_size: int, events: int) -> dict[str, float]:
    """Publish ``events`` events and count them at a live subscriber; the row's figures."""
    batches = make_batches(batch_size)
    n = max(1, events // batch_size)
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay, max_queue_size=n + 1)
    publisher = ZmqEventPublisher(config)
    delivered = 0
    gaps = 0
    try:
        async with ZmqSubscriber(publisher.endpoint, publisher.replay_endpoint, start_seq=0) as sub:

            async def produce() -> None:
                for i in range(n):
                    publisher.publish(batches[i % DISTINCT_BATCHES])
                    if i % 64 == 63:
                        await anyio.sleep(0)

            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                with anyio.fail_after(120):
                    async for item in sub:
                        if isinstance(item, Gap):
                            gaps += item.count
                        else:
                            delivered += len(item.batch.events)
                            if item.seq == n - 1:
                                break
            seconds = time.perf_counter() - start
    finally:
        publisher.close()
    dropped = publisher.statistics().dropped_total
    return {
        "events": delivered,
        "seconds": round(seconds, 4),
        "events_per_s": round(delivered / seconds),
        "dropped": dropped,
        "lost_batches": gaps,
    }


def replay_slowdown(requests: int, repeat: int, tmp: str) -> dict[str, object]:
    from tiering.replay import ReplayOptions, replay
    from tiering.workload import chat_workload, read_trace

    trace = Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
    workload = read_trace(trace, limit=requests) if trace.exists() else chat_workload(requests)
    off = ReplayOptions(capacity_tokens=3_000_000)
    on = ReplayOptions(
        capacity_tokens=3_000_000,
        events_endpoint=f"ipc://{Path(tmp) / 'replay-events'}",
        replay_endpoint=f"ipc://{Path(tmp) / 'replay-replay'}",
    )
    best = {"off": float("inf"), "on": float("inf")}
    published = 0
    for _ in range(repeat):
        for name, options in (("off", off), ("on", on)):
            result = anyio.run(lambda options=options: replay(workload, options))
            best[name] = min(best[name], result.seconds)
            published = max(published, result.events_published)
    return {
        "transport": "replay",
        "requests": len(workload),
        "seconds_off": round(best["off"], 3),
        "seconds_on": round(best["on"], 3),
        "slowdown": round(best["on"] / best["off"] - 1, 4),
        "events": published,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=400_000, help="events per row")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000, help="requests of the replay row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows: list[dict[str, object]] = []
    for batch_size in (1, 256):
        events = args.events // 8 if batch_size == 1 else args.events
        best = max(encode_rate(batch_size, events) for _ in range(args.repeat))
        rows.append({"transport": "encode", "batch": batch_size, "events_per_s": round(best)})
    with tempfile.TemporaryDirectory(prefix="tiering-bench-") as tmp:
        transports = {
            "ipc": (f"ipc://{Path(tmp) / 'events'}", f"ipc://{Path(tmp) / 'replay'}"),
            "tcp": ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        }
        for name, (endpoint, replay) in transports.items():
            for batch_size in (1, 256):
                events = args.events // 8 if batch_size == 1 else args.events
                runs = [
                    anyio.run(deliver, endpoint, replay, batch_size, events)
                    for _ in range(args.repeat)
                ]
                best_run = max(runs, key=lambda r: r["events_per_s"])
                rows.append({"transport": name, "batch": batch_size, **best_run})
        slowdown = replay_slowdown(args.requests, args.repeat, tmp)
    if args.json:
        for row in [*rows, slowdown]:
            print(json.dumps(row))
        return
    print(
        f"KV events, best of {args.repeat}: events/s (encoded only, or delivered to a subscriber)"
    )
    for row in rows:
        extra = ""
        if row["transport"] != "encode":
            extra = (f"  {row['events']:>9,} events in {row['seconds']:.3f} s, "
                     f"dropped {row['dropped']}, lost batches {row['lost_batches']}")  # fmt: skip
        print(f"  {row['transport']:<7} batch {row['batch']:>4}  "
              f"{row['events_per_s']:>12,} events/s{extra}")  # fmt: skip
    print(
        f"replay of {slowdown['requests']:,} requests, best of {args.repeat}: "
        f"{slowdown['seconds_off']:.2f} s with events off, {slowdown['seconds_on']:.2f} s on "
        f"({slowdown['events']:,} events): {float(str(slowdown['slowdown'])):+.1%}"
    )


if __name__ == "__main__":
    main()
