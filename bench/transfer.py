"""Store and load throughput of a transfer backend, beside one contiguous copy.

For each page size (16 KiB, 256 KiB, 2 MiB) a KV cache of ``--tensors`` tensors
(K and V by default) of ``--total-mib`` MiB in all is registered with
``--blocks-per-chunk`` blocks per chunk. A store job copies every block, in a
shuffled block order (GPU block ids come from a free list), into the pool; a
load job copies them back into another shuffled order. Chunk ids are handed out
in order, as the manager does with fresh slots (``--chunk-order sequential``),
or shuffled, the worst case (``shuffled``). Beside each, in the same run, a
single contiguous copy of the same number of bytes between the same two
memories gives the bandwidth limit. Each is timed ``--repeat`` times,
interleaved, and the best run counts (these machines are noisy). The figure
that matters is the ratio: job GB/s over limit GB/s.

    python bench/transfer.py [--backend cpu|cuda|mock] [--json] [--no-pin]

Targets: ratio >= 0.8 for pages of 256 KiB and up, >= 0.5 for 16 KiB pages; on
an H100/H200 over PCIe 5, >= 45 GB/s per direction for 2 MiB pages.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from tiering.cpu.common import CPULoadStoreSpec
from tiering.specs import GPULoadStoreSpec
from tiering.transfer import (
    HostMemoryPool,
    KVCacheTensor,
    KVLayout,
    TransferBackend,
    create_backend,
)

PAGE_SIZES = (16 << 10, 256 << 10, 2 << 20)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def run_page_size(
    backend_name: str,
    page_bytes: int,
    *,
    total_bytes: int,
    tensors: int,
    blocks_per_chunk: int,
    chunk_order: str,
    repeat: int,
    device: torch.device,
    rng: np.random.Generator,
    backend_options: dict[str, object] | None = None,
) -> list[dict[str, object]]:
    num_blocks = total_bytes // (tensors * page_bytes)
    num_blocks -= num_blocks % blocks_per_chunk
    num_chunks = num_blocks // blocks_per_chunk
    kv = torch.empty((tensors, num_blocks, page_bytes // 8), dtype=torch.int64, device=device)
    kv.random_()
    layout = KVLayout(
        [KVCacheTensor(kv[i], num_blocks, page_bytes) for i in range(tensors)], blocks_per_chunk
    )
    pool = HostMemoryPool(layout.pool_bytes(num_chunks))
    pool.tensor.fill_(1)  # fault the pages in before timing
    backend: TransferBackend = create_backend(backend_name, layout, pool, **(backend_options or {}))
    try:
        nbytes = num_blocks * tensors * page_bytes
        flat_kv = kv.view(-1)
        flat_pool = pool.words(torch.int64)[: flat_kv.numel()]
        chunks = np.arange(num_chunks)
        if chunk_order == "shuffled":
            chunks = rng.permutation(num_chunks)
        cpu_spec = CPULoadStoreSpec(chunks)
        store_spec = GPULoadStoreSpec(rng.permutation(num_blocks))
        load_spec = GPULoadStoreSpec(rng.permutation(num_blocks))
        job = iter(range(1 << 62))

        def run_job(src: object, dst: object) -> None:
            job_id = next(job)
            backend.submit(job_id, src, dst)  # type: ignore[arg-type]
            backend.wait([job_id])
            (result,) = backend.poll()
            if not result.success:
                raise RuntimeError(f"job failed: {result.error}")

        timings: dict[str, list[float]] = {k: [] for k in ("store", "load", "lstore", "lload")}
        for _ in range(repeat):
            timings["lstore"].append(
                _best(lambda: flat_pool.copy_(flat_kv, non_blocking=True), device)
            )
            timings["store"].append(_best(lambda: run_job(store_spec, cpu_spec), device))
            timings["lload"].append(
                _best(lambda: flat_kv.copy_(flat_pool, non_blocking=True), device)
            )
            timings["load"].append(_best(lambda: run_job(cpu_spec, load_spec), device))
        rows = []
        for direction in ("store", "load"):
            gbps = nbytes / min(timings[direction]) / 1e9
            limit = nbytes / min(timings["l" + direction]) / 1e9
            rows.append(
                {
                    "backend": backend_name,
                    "page_bytes": page_bytes,
                    "direction": direction,
                    "gbps": round(gbps, 3),
                    "limit_gbps": round(limit, 3),
                    "ratio": round(gbps / limit, 3),
                    "chunk_order": chunk_order,
                    "blocks_per_chunk": blocks_per_chunk,
                    "tensors": tensors,
                    "bytes": nbytes,
                    "pinned": getattr(backend, "pinned", None),
                }
            )
        return rows
    finally:
        backend.close()
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "mock"))
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per job")
    parser.add_argument("--tensors", type=int, default=2)
    parser.add_argument("--blocks-per-chunk", type=int, default=4)
    parser.add_argument("--chunk-order", default="all", choices=("sequential", "shuffled", "all"))
    parser.add_argument("--page-kib", type=int, nargs="*", help="page sizes in KiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--no-pin", action="store_true", help="cuda: leave the pool pageable")
    args = parser.parse_args()
    device = torch.device("cuda" if args.backend == "cuda" else "cpu")
    pages = [k << 10 for k in args.page_kib] if args.page_kib else list(PAGE_SIZES)
    orders = ["sequential", "shuffled"] if args.chunk_order == "all" else [args.chunk_order]
    rng = np.random.default_rng(0)
    options: dict[str, object] = {"pin": False} if args.no_pin and args.backend == "cuda" else {}
    if not args.json:
        print(f"{'backend':8} {'page':>9} {'chunks':>10} {'dir':6} {'GB/s':>7} {'limit':>7} ratio")
    for order in orders:
        for page in pages:
            for row in run_page_size(
                args.backend,
                page,
                total_bytes=args.total_mib << 20,
                tensors=args.tensors,
                blocks_per_chunk=args.blocks_per_chunk,
                chunk_order=order,
                repeat=args.repeat,
                device=device,
                rng=rng,
                backend_options=options,
            ):
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(
                        f"{row['backend']:8} {page >> 10:>6}KiB {order:>10} "
                        f"{row['direction']:6} {row['gbps']:7.2f} {row['limit_gbps']:7.2f} "
                        f"{row['ratio']:.2f}",
                        flush=True,
                    )
    sys.exit(0)


if __name__ == "__main__":
    main()
