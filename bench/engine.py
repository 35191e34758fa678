"""The engine's own cost: scheduler overhead per job, and replay throughput.

1. Per-job overhead: small (one 4 KiB block) store jobs through `TieringEngine`
   with the ``mock`` backend at zero delay and no copy, submit -> await result.
   Reported pipelined (a window of jobs in flight; overhead = 1 / jobs per
   second) and sequential (one job at a time: includes two thread hand-offs).
   The ``inline`` row uses a backend that completes each job on the spot, so it
   shows the scheduler and manager alone, without the worker thread.
2. Replay: `tiering replay` on the conversation trace (or the chat workload)
   with the ``cpu`` backend, bytes moved per second of wall time, beside the
   cpu backend's own throughput on the very jobs the replay gave it, run again
   alone in the same order (same KV shape and pool size): the ratio is what the
   replay's own work costs (the emulated compute, which writes every stored
   page once more, the per-request Python, and the waits between steps).

Like a server after start-up, the process freezes its start-up heap out of the
garbage collector (`gc.freeze`, as vLLM does) before measuring; ``--no-freeze``
measures without it.

    python bench/engine.py [--jobs N] [--requests N] [--json] [--no-freeze]
"""

from __future__ import annotations

import argparse
import contextlib
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


class _Recorder:
    """Records every job the replay's backend is given, to run them again alone."""

    def __init__(self) -> None:
        self.jobs: list[tuple[LoadStoreSpec, LoadStoreSpec]] = []
        self.kv_shape: tuple[int, ...] = ()
        self.pool_bytes = 0

    def __call__(self, engine: TieringEngine) -> contextlib.AbstractAsyncContextManager[None]:
        backend = engine.backend
        submit = backend.submit
        self.kv_shape = tuple(engine.layout.tensors[0].tensor.shape)
        self.pool_bytes = engine.layout.pool_bytes(engine.manager.capacity)

        def recording(job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
            submit(job_id, src, dst)
            self.jobs.append((src, dst))

        backend.submit = recording  # type: ignore[method-assign]
        return contextlib.nullcontext()


def backend_throughput(recorder: _Recorder, window: int = 64) -> float:
    """GB/s of the cpu backend alone on the replay's own jobs, in the same order.

    The same KV tensor shape and pool size, the pool faulted in first (as the
    engine does), at most ``window`` jobs in flight: only the replay's own
    work (the emulated compute, the per-request Python, the waits) is left out.
    """
    kv = torch.ones(recorder.kv_shape, dtype=torch.int64)
    page_bytes = kv[0].numel() * kv.element_size()
    layout = KVLayout([KVCacheTensor(kv, kv.shape[0], page_bytes)], 1)
    pool = HostMemoryPool(recorder.pool_bytes, populate=True)
    backend = CpuBackend(layout, pool)
    moved = 0
    try:
        start = time.perf_counter()
        for j, (src, dst) in enumerate(recorder.jobs):
            if j >= window:
                backend.wait([j - window])
            backend.submit(j, src, dst)
            moved += layout.plan(src, dst, layout.num_chunks(pool.nbytes)).nbytes
        backend.wait(range(len(recorder.jobs)))
        seconds = time.perf_counter() - start
    finally:
        backend.close()
        pool.close()
    return moved / seconds / 1e9


def replay_row(requests: int) -> dict[str, Any]:
    workload = read_trace(TRACE, limit=requests) if TRACE.exists() else chat_workload(requests)
    options = ReplayOptions(capacity_tokens=3_000_000, concurrency=4)
    recorder = _Recorder()
    result = anyio.run(lambda: replay(workload, options, on_open=recorder))
    moved = result.store_bytes + result.load_bytes
    replay_gbps = moved / result.seconds / 1e9
    limit = backend_throughput(recorder)
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
