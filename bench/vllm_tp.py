"""What tensor parallelism costs `TieringSpec`'s scheduler side with tiers below its CPU tier.

The conversation trace's first ``--requests`` requests replayed through vLLM's real
``Scheduler`` (the harness of ``tests/vllm``, vLLM's engine core minus the model, on
CPU) with ``TieringSpec`` over a lower tier (``--tier``: ``disk``, a temporary
folder; ``redis``, a redis-server of the run's own; ``disk+redis``, both in
order), at tensor-parallel size 1, 2 and 4 on one node: one vLLM worker connector
per rank moves real bytes between its pages and its own host pool, and the
scheduler maps every rank's pool, its lower tier keeping a value per rank
(`tiering.integrations.vllm.ranks.RankedTier`). The CPU tier holds
``--capacity-tokens`` trace tokens at every size (the same chunks: each rank holds
its share of every chunk), so the hits are the same and what differs is the
scheduler's work per chunk: N lookups, N store and N load jobs, N results.

Scheduler-side seconds are the time in vLLM's ``schedule`` and
``update_from_output`` (every connector, manager, link and tier call); the tiers'
I/O threads, the workers' copies and the model's time (``--step-ms`` after each
step, while the tiers' threads work, as in a server) are not in it. The sizes alternate,
``--rounds`` times, and the fastest round of each counts (the machine is noisy);
the cost is the ratio to TP 1's within the run.

    PYTHONPATH=.vllm-env/site python bench/vllm_tp.py [--requests N] [--tier T] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
ROOT = Path(__file__).resolve().parents[1]
# bench/vllm.py is beside this file: its folder must not shadow the vllm package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from tiering.cli.arguments import positive_int  # noqa: E402  (after the path is set)

SIZES = (1, 2, 4)
#: `SecondaryLink.statistics`' counts of chunks not written through or not promoted.
LOSSES = ("cascade_dropped", "cascade_failed", "promote_failed")


@contextlib.contextmanager
def tiers(harness: Any, kind: str, chunk_bytes: int, chunks: int) -> Iterator[list[dict[str, Any]]]:
    """Fresh lower tiers of ``kind`` for one run (a folder, a redis-server, or both)."""
    from bench._vllm_lower import redis_server

    with tempfile.TemporaryDirectory(prefix="tiering-bench-tp-") as folder:
        entries: list[dict[str, Any]] = []
        if "disk" in kind:  # room for all the trace writes
            entries.append(harness.disk_entry(Path(folder) / "disk", 100 * chunks * chunk_bytes))
        with contextlib.ExitStack() as stack:
            if "redis" in kind:
                entries.append(harness.redis_entry(stack.enter_context(redis_server(Path(folder)))))
            yield entries


def run_once(
    harness: Any, model: Path, prompts: list[list[int]], tp: int, args: Any
) -> dict[str, Any]:
    chunks = args.capacity_tokens // harness.TRACE_BLOCK_TOKENS
    chunk_bytes = harness.attention_spec(tp=tp).page_size_bytes * len(harness.LAYERS) * tp
    with tiers(harness, args.tier, chunk_bytes, chunks) as entries:
        engine = harness.build_engine(
            model,
            harness.tiering_extra(
                chunks * chunk_bytes, eviction_policy="lru", secondary_tiers=entries
            ),
            num_gpu_blocks=2048,
            max_model_len=8192,
            max_num_batched_tokens=8192,
            tp=tp,
        )
        engine.attach_model()
        step = engine.step

        def paced() -> Any:  # the model's forward: the tiers' threads work meanwhile
            output = step()
            time.sleep(args.step_ms / 1000)
            return output

        engine.step = paced
        started = time.perf_counter()
        try:
            harness.replay(engine, prompts)
            link = engine.manager.link
            stats = link.statistics()
        finally:
            engine.scheduler.shutdown()
            for worker in engine.models:
                worker.connector.shutdown()
        return {
            "hit_tokens": engine.hit_tokens,
            "steps": engine.steps,
            "scheduler_seconds": engine.scheduler_seconds,
            "ms_per_step": 1000 * engine.scheduler_seconds / engine.steps,
            "promoted": stats["promoted"],
            "written": stats["cascade_written"],
            # What the tiers did not take or give (the lines that say it are silenced).
            **{name: stats[name] for name in LOSSES},
            "wall_seconds": time.perf_counter() - started,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=positive_int, default=500, help="first N requests")
    parser.add_argument(
        "--capacity-tokens", type=positive_int, default=50_000, help="of the CPU tier"
    )
    parser.add_argument("--tier", choices=("disk", "redis", "disk+redis"), default="disk")
    parser.add_argument("--rounds", type=positive_int, default=2)
    parser.add_argument(
        "--step-ms", type=float, default=2.0, help="the model's time after each step"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's imports warn about their own affairs
        from tests.vllm import harness
    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("tiering").setLevel(logging.ERROR)  # a tier's drops: counted in the rows
    prompts = harness.trace_prompts(harness.TRACE, args.requests)
    model = harness.write_model(Path(os.environ.get("TMPDIR", "/tmp")) / "tiering-bench-model")
    rows: dict[int, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for tp in SIZES:
            row = run_once(harness, model, prompts, tp, args)
            if tp not in rows or row["scheduler_seconds"] < rows[tp]["scheduler_seconds"]:
                rows[tp] = row
    base = rows[1]
    for row in rows.values():
        row["cost_vs_tp1"] = row["scheduler_seconds"] / base["scheduler_seconds"]
    result = {"requests": len(prompts), "tier": args.tier, "by_tp": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"TieringSpec over {args.tier}, {len(prompts)} requests, CPU tier of "
        f"{args.capacity_tokens:,} trace tokens; fastest of {args.rounds} rounds"
    )
    print(
        "TP  hit tokens  promoted  written  dropped  failed  promote failed  steps  scheduler s"
        "  ms/step  cost vs TP 1"
    )
    for tp, row in rows.items():
        print(
            f"{tp:<3} {row['hit_tokens']:>10,} {row['promoted']:>9,} {row['written']:>8,} "
            f"{row['cascade_dropped']:>8,} {row['cascade_failed']:>7,} "
            f"{row['promote_failed']:>15,} "
            f"{row['steps']:>6} {row['scheduler_seconds']:>12.3f} {row['ms_per_step']:>8.3f} "
            f"{row['cost_vs_tp1']:>13.2f}x"
        )


if __name__ == "__main__":
    main()
