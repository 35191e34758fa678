"""`tiering simulate`: hit rates per policy and capacity, no bytes moved (`tiering.sim`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from tiering.cli.arguments import (
    UsageError,
    add_hint_args,
    add_workload_args,
    check_hint_args,
    int_list,
    load_requests,
    name_list,
    positive_int,
)
from tiering.cli.progress import ProgressBar
from tiering.cli.tables import simulation_table
from tiering.policies import POLICY_NAMES
from tiering.sim import (
    ALL_POLICIES,
    OPTIMAL,
    Progress,
    SimulationResult,
    capacity_chunks,
    check_plotting,
    expand_policies,
    plot_hit_rates,
    plot_hit_rates_by_tier,
    requests_to_keys,
    simulate_keys,
)
from tiering.workload import CAPACITY_TOKENS
from tiering.workload.hints import arrival_times_s, workload_hints

__all__ = ["add_parser"]

#: `tiering simulate --trace`'s capacities: the conversation trace's (README).
_TRACE_CAPACITY_TOKENS = (1_000_000, 3_000_000, 10_000_000)


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``simulate`` subcommand: its flags, and what runs it."""
    sim = sub.add_parser(
        "simulate",
        help="hit rate of a CPU tier on a workload, per policy and capacity (no bytes moved)",
        description=(
            "Replay a request trace through the chunk manager for every policy and "
            "capacity given, and report hit rates, evictions and store failures."
        ),
    )
    add_workload_args(sim)
    sim.add_argument(
        "--capacity-tokens",
        type=int_list,
        metavar="N[,N...]",
        help="tier capacities in tokens (default: for a trace "
        + ",".join(map(str, _TRACE_CAPACITY_TOKENS))
        + "; "
        + "; ".join(f"{name} {','.join(map(str, c))}" for name, c in CAPACITY_TOKENS.items())
        + ")",
    )
    sim.add_argument(
        "--policy",
        type=name_list((*ALL_POLICIES, "all")),
        default=list(POLICY_NAMES),
        metavar="P[,P...]",
        help=(
            f"cache policies ({', '.join(POLICY_NAMES)}), {OPTIMAL} (the offline optimum, "
            f"Belady), or all of them: all (default: {','.join(POLICY_NAMES)})"
        ),
    )
    sim.add_argument(
        "--disk-tokens",
        type=int_list,
        metavar="N[,N...]",
        help="also model a disk tier of N tokens below the CPU tier (as `tiering replay "
        "--disk`), each capacity a run: promotion from it, write-through to it, hits by tier",
    )
    sim.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw hit rate against capacity per policy, the offline optimum dashed "
        "(with --disk-tokens: hit rate by tier against disk capacity), in the format the "
        "suffix names (.png, .svg, .pdf; needs matplotlib: the plot extra)",
    )
    sim.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        metavar="N",
        help="tokens per hash id (and per chunk), default 512",
    )
    add_hint_args(sim)
    sim.add_argument("--json", action="store_true", help="one JSON object per line")
    sim.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    plot_format = None if args.plot is None else check_plotting(args.plot)  # before a long run
    source, hint_error, hint_seed = check_hint_args(args)
    requests = load_requests(args)
    capacities = args.capacity_tokens or (
        _TRACE_CAPACITY_TOKENS if args.trace is not None else CAPACITY_TOKENS[args.workload]
    )
    encoder = msgspec.json.Encoder()
    policies = expand_policies(args.policy)
    disks: list[int | None] = list(args.disk_tokens or [None])
    if args.disk_tokens is not None:  # before a long run
        if OPTIMAL in policies:
            raise UsageError(
                "the offline optimum models one tier; drop --disk-tokens or the optimal policy "
                f"(--policy all includes it: list the others, {','.join(POLICY_NAMES)})"
            )
        for disk in args.disk_tokens:
            capacity_chunks(disk, args.block_tokens, tier="disk")
    request_keys = requests_to_keys(requests)
    hints = workload_hints(
        requests,
        source,
        error=hint_error,
        seed=hint_seed,
        block_tokens=args.block_tokens,
    )
    times_s = None if hints is None else arrival_times_s(requests)
    runs = [(p, c, d) for p in policies for c in capacities for d in disks]
    if plot_format is not None and OPTIMAL not in policies and args.disk_tokens is None:
        runs += [(OPTIMAL, capacity, None) for capacity in capacities]  # the plot shows it
    bar = ProgressBar() if not args.json and sys.stderr.isatty() else None
    results: list[SimulationResult] = []
    for index, (policy, capacity, disk) in enumerate(runs):
        progress = None
        if bar is not None:
            on_disk = "" if disk is None else f", disk {disk:,}"
            bar.label = f"{policy} at {capacity:,} tokens{on_disk} ({index + 1}/{len(runs)}) "
            progress = _run_of(bar, index, len(runs))
        result = simulate_keys(
            request_keys,
            capacity_tokens=capacity,
            policy=policy,
            block_tokens=args.block_tokens,
            progress=progress,
            disk_tokens=disk,
            hints=hints,
            times_s=times_s,
            labels=(source, hint_error),
        )
        if args.json and policy in policies:
            sys.stdout.buffer.write(encoder.encode(result) + b"\n")
            sys.stdout.flush()
        results.append(result)
    if not args.json:
        asked = len(policies) * len(capacities) * len(disks)
        print(simulation_table(results[:asked], args, requests))
    if args.plot is not None:
        source = Path(args.trace).name if args.trace is not None else f"{args.workload} workload"
        title = f"{source}: {len(requests):,} requests, {results[0].blocks:,} blocks"
        if args.disk_tokens is None:
            plot_hit_rates(results, args.plot, title=title)
        else:
            plot_hit_rates_by_tier(results, args.plot, title=title)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)


def _run_of(bar: Progress, index: int, runs: int) -> Progress:
    """The progress of run ``index`` of ``runs`` (each over the same requests) as a
    part of them all."""

    def report(done: int, total: int, hits: int, blocks: int) -> None:
        bar(index * total + done, runs * total, hits, blocks)

    return report
