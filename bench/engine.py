"""The engine's own cost: scheduler overhead per job, and replay throughput.

1. Per-job overhead: small (one 4 KiB block) store jobs through `TieringEngine`
   with the ``mock`` backend at zero delay and no copy, submit -> await result.
   Reported pipelined (a window of jobs in flight; overhead = 1 / jobs per
   second) and sequential (one job at a time: includes two thread hand-offs).
   The ``inline`` row uses a backend that completes each job on the spot, so it
   shows the scheduler and manager alone, without the worker thread.
2. Replay: `tiering replay` on the conversation trace (or the chat workload)
   with the ``cpu`` backend, bytes moved per second of wall time, beside the
   cpu backend's own throughput on the same page size measured in the same run
   (jobs of a request's size submitted straight to the backend).

Like a server after start-up, the process freezes its start-up heap out of the
garbage collector (`gc.freeze`, as vLLM does) before measuring; ``--no-freeze``
measures without it.

    python bench/engine.py [--jobs N] [--requests N] [--json] [--no-freeze]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from tiering import make_offload_key
from tiering.cpu.common import CPULoadStoreSpec
from tiering.engine import TieringEngine
from tiering.replay import ReplayOptions, replay, replay_config
from tiering.specs import GPULoadStoreSpec, LoadStoreSpec
from tiering.transfer import (
    CompletionCallback,
    KVCacheTensor,
    KVLayout,
    TransferDirection,
    TransferResult,
)
from tiering.transfer.base import BackendStatistics, DirectionStatistics
from tiering.transfer.cpu import CpuBackend
from tiering.transfer.memory import HostMemoryPool
from tiering.workload import chat_workload, read_trace

TRACE = Path(__file__).resolve().parents[1].parent / "shared/traces/conversation_trace.jsonl"
PAGE_WORDS = 512  # 4 KiB blocks for the overhead runs


class InlineBackend:
    """Completes every job inside `submit`: the scheduler's cost without a worker thread."""

    name = "inline"

    def __init__(self, on_complete: CompletionCallback) -> None:
        self._on_complete = on_complete

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        direction = TransferDirection.STORE if isinstance(dst, CPULoadStoreSpec) else (
            TransferDirection.LOAD
        )  # fmt: skip
        self._on_complete(
            TransferResult(job_id=job_id, success=True, direction=direction, nbytes=0, seconds=0.0)
        )

    def close(self) -> None:
        pass

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            backend="inline",
            state="open",
            stores=DirectionStatistics(),
            loads=DirectionStatistics(),
        )


def _engine(backend: str) -> TieringEngine:
    options = ReplayOptions(bytes_per_token=8, block_tokens=512)
    kv = torch.zeros((64, PAGE_WORDS), dtype=torch.int64)
    engine = TieringEngine(
        replay_config(options), {"kv": kv}, cpu_bytes=1 << 30, backend="mock",
        backend_options={"copy": False},
    )  # fmt: skip
    if backend == "inline":
        engine.scheduler._backend_factory = InlineBackend  # type: ignore[assignment]
    return engine


async def overhead(backend: str, jobs: int, window: int) -> dict[str, Any]:
    engine = _engine(backend)
    keys = [make_offload_key(i.to_bytes(8, "big")) for i in range(2 * jobs)]
    spec = GPULoadStoreSpec([1])
    async with engine:
        start, cpu_start = time.perf_counter(), time.process_time()
        pending = []
        for i in range(jobs):
            pending.append(engine.submit_store_nowait([keys[i]], spec))
            if len(pending) >= window:
                for handle in pending:
                    await handle
                pending.clear()
        for handle in pending:
            await handle
        pipelined = (time.perf_counter() - start) / jobs
        cpu = (time.process_time() - cpu_start) / jobs
        n = max(1, jobs // 4)
        start = time.perf_counter()
        for i in range(jobs, jobs + n):
            await engine.submit_store_nowait([keys[i]], spec)
        sequential = (time.perf_counter() - start) / n
    return {
        "bench": "overhead",
        "backend": backend,
        "jobs_per_s": round(1 / pipelined),
        "overhead_us": round(pipelined * 1e6, 1),
        "cpu_us": round(cpu * 1e6, 1),
        "sequential_us": round(sequential * 1e6, 1),
    }


def backend_throughput(page_bytes: int, blocks_per_job: int, jobs: int) -> float:
    """GB/s of the cpu backend alone, storing then loading jobs of ``blocks_per_job`` pages."""
    words = page_bytes // 8
    kv = torch.ones((blocks_per_job, words), dtype=torch.int64)
    layout = KVLayout([KVCacheTensor(kv, blocks_per_job, page_bytes)], 1)
    pool = HostMemoryPool(layout.pool_bytes(blocks_per_job * jobs))
    backend = CpuBackend(layout, pool)
    try:
        gpu = GPULoadStoreSpec(list(range(blocks_per_job)))
        specs = [
            CPULoadStoreSpec(list(range(j * blocks_per_job, (j + 1) * blocks_per_job)))
            for j in range(jobs)
        ]
        pool.tensor.fill_(0)  # fault the pages in outside the timing
        start = time.perf_counter()
        for j, cpu in enumerate(specs):
            backend.submit(j, gpu, cpu)
        for j, cpu in enumerate(specs):
            backend.submit(jobs + j, cpu, gpu)
        backend.wait(range(2 * jobs))
        seconds = time.perf_counter() - start
    finally:
        backend.close()
        pool.close()
    return 2 * jobs * blocks_per_job * page_bytes / seconds / 1e9


def replay_row(requests: int) -> dict[str, Any]:
    workload = read_trace(TRACE, limit=requests) if TRACE.exists() else chat_workload(requests)
    options = ReplayOptions(capacity_tokens=3_000_000, concurrency=4)
    result = anyio.run(lambda: replay(workload, options))
    moved = result.store_bytes + result.load_bytes
    replay_gbps = moved / result.seconds / 1e9
    blocks = max(1, result.blocks // max(1, result.requests))
    page = options.bytes_per_token * options.block_tokens
    limit = backend_throughput(page, blocks, jobs=max(8, (256 << 20) // (blocks * page)))
    return {
        "bench": "replay",
        "backend": result.backend,
        "requests": result.requests,
        "gbps": round(replay_gbps, 3),
        "backend_gbps": round(limit, 3),
        "ratio": round(replay_gbps / limit, 3),
        "hit_rate": round(result.hit_rate, 4),
        "seconds": round(result.seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-freeze", action="store_true")
    args = parser.parse_args()
    if not args.no_freeze:
        gc.collect()
        gc.freeze()
    rows: list[dict[str, Any]] = []

    def run(backend: str) -> dict[str, Any]:
        return anyio.run(overhead, backend, args.jobs, args.window)

    rows += [run("inline"), run("mock")]
    rows.append(replay_row(args.requests))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    for row in rows[:2]:
        print(
            f"per job, {row['backend']:>6} backend: {row['overhead_us']:7.1f} us pipelined "
            f"({row['jobs_per_s']:,} jobs/s; {row['cpu_us']:.1f} us of CPU in all threads), "
            f"{row['sequential_us']:.1f} us one at a time"
        )
    r = rows[2]
    print(f"replay of {r['requests']:,} requests: {r['gbps']:.2f} GB/s moved, cpu backend alone "
          f"{r['backend_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
