"""The `tiering` command line.

Bad input (a missing file, a malformed trace line, an impossible number, an
unknown name) prints one line on stderr and exits with code 2, without a
traceback; every subcommand reports through `_fail`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import msgspec

from tiering.config import DEFAULT_POLICY
from tiering.errors import TieringError
from tiering.policies import POLICY_NAMES
from tiering.simulate import (
    ALL_POLICIES,
    OPTIMAL,
    SimulationResult,
    check_plotting,
    expand_policies,
    plot_hit_rates,
    requests_to_keys,
    simulate_keys,
)
from tiering.workload import WORKLOADS, Request, load_workload, read_trace

if TYPE_CHECKING:
    from tiering.engine import TieringEngine
    from tiering.metrics import MetricsServer

__all__ = ["main"]

_EXIT_USAGE = 2


class _UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(_EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port from 0 to 65535 (0 for any free port), got {text!r}"
        )
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers (``1000000,3000000``)."""
    return [_positive_int(part.strip()) for part in text.split(",")]


def _name_list(choices: Sequence[str]) -> argparse._ActionType:
    def parse(text: str) -> list[str]:
        names = [part.strip().lower() for part in text.split(",")]
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown name {name!r}; choose from {', '.join(choices)}"
                )
        return names

    return parse


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a Mooncake-format JSON-lines trace")
    source.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="a built-in synthetic workload"
    )
    parser.add_argument(
        "--requests", type=_positive_int, metavar="N", help="use only the first N requests"
    )


def _load_requests(args: argparse.Namespace) -> list[Request]:
    if args.trace is not None:
        return read_trace(args.trace, limit=args.requests)
    return load_workload(args.workload, args.requests)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tiering",
        description="A KV-cache tiering engine for LLM inference servers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = sub.add_parser(
        "simulate",
        help="hit rate of a CPU tier on a workload, per policy and capacity (no bytes moved)",
        description=(
            "Replay a request trace through the chunk manager for every policy and "
            "capacity given, and report hit rates, evictions and store failures."
        ),
    )
    _add_workload_args(sim)
    sim.add_argument(
        "--capacity-tokens",
        type=_int_list,
        default=[1_000_000, 3_000_000, 10_000_000],
        metavar="N[,N...]",
        help="tier capacities in tokens (default: 1000000,3000000,10000000)",
    )
    sim.add_argument(
        "--policy",
        type=_name_list((*ALL_POLICIES, "all")),
        default=list(POLICY_NAMES),
        metavar="P[,P...]",
        help=(
            f"cache policies ({', '.join(POLICY_NAMES)}), {OPTIMAL} (the offline optimum, "
            f"Belady), or all of them: all (default: {','.join(POLICY_NAMES)})"
        ),
    )
    sim.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw hit rate against capacity per policy, the offline optimum dashed "
        "(needs matplotlib: the plot extra)",
    )
    sim.add_argument(
        "--block-tokens",
        type=_positive_int,
        default=512,
        metavar="N",
        help="tokens per hash id (and per chunk), default 512",
    )
    sim.add_argument("--json", action="store_true", help="one JSON object per line")
    sim.set_defaults(run=_run_simulate)

    rep = sub.add_parser(
        "replay",
        help="run the engine over a workload, moving real bytes on an emulated GPU KV cache",
        description=(
            "Drive a TieringEngine over a request trace as an inference server would: "
            "look up, load hits, compute and store the rest, flush, with --concurrency "
            "requests in flight on one event loop. The GPU KV cache is emulated with CPU "
            "tensors where there is no GPU."
        ),
    )
    _add_workload_args(rep)
    size = rep.add_mutually_exclusive_group()
    size.add_argument(
        "--capacity-tokens",
        type=_positive_int,
        metavar="N",
        help="CPU tier capacity in tokens (default 3000000)",
    )
    size.add_argument("--cpu-bytes", type=_positive_int, metavar="B", help="CPU tier size in bytes")
    rep.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help=f"cache policy (default {DEFAULT_POLICY})",
    )
    rep.add_argument(
        "--bytes-per-token",
        type=_positive_int,
        default=128,
        metavar="B",
        help="KV bytes per token of the emulated model (default 128)",
    )
    rep.add_argument(
        "--block-tokens", type=_positive_int, default=512, metavar="N",
        help="tokens per hash id, block and chunk (default 512)",
    )  # fmt: skip
    rep.add_argument(
        "--concurrency", type=_positive_int, default=4, metavar="C",
        help="requests in flight at once (default 4)",
    )  # fmt: skip
    rep.add_argument(
        "--backend", choices=("auto", "cpu", "cuda", "mock"), default="auto",
        help="transfer backend (default auto: cuda for CUDA tensors, else cpu)",
    )  # fmt: skip
    rep.add_argument("--verify", action="store_true", help="check every loaded chunk byte for byte")
    rep.add_argument(
        "--metrics-port", type=_port, metavar="P",
        help="serve Prometheus metrics on port P while the replay runs (0: any free port)",
    )  # fmt: skip
    rep.add_argument(
        "--metrics-host", default="127.0.0.1", metavar="H",
        help="address the metrics server binds to (default 127.0.0.1)",
    )  # fmt: skip
    rep.add_argument(
        "--hold", type=_seconds, default=0.0, metavar="S",
        help="stay up S seconds after the replay, the engine still open (for a last scrape)",
    )  # fmt: skip
    rep.add_argument(
        "--events-endpoint", metavar="E",
        help="publish KV cache events on this ZMQ endpoint (tcp://*:5557 binds; "
        "tcp://127.0.0.1:* binds a free port)",
    )  # fmt: skip
    rep.add_argument(
        "--replay-endpoint", metavar="E",
        help="serve replays of past event batches on this ZMQ endpoint (ROUTER)",
    )  # fmt: skip
    rep.add_argument(
        "--remote", metavar="URL",
        help="a shared tier below the CPU tier: redis://[user:password@]host:port[/db] "
        "or rediss://; a Redis Cluster is detected",
    )  # fmt: skip
    rep.add_argument(
        "--remote-namespace", default="", metavar="NS",
        help="share remote chunks only with engines of the same namespace (and model)",
    )  # fmt: skip
    rep.add_argument("--json", action="store_true", help="print one JSON object")
    rep.set_defaults(run=_run_replay)

    ev = sub.add_parser(
        "events",
        help="print the KV cache events an engine publishes",
        description="Subscribe to an engine's KV cache events and print them, one line "
        "each (a gap in the sequence is filled from the replay endpoint, or reported).",
    )
    ev.add_argument("endpoint", help="the publisher's ZMQ endpoint, e.g. tcp://127.0.0.1:5557")
    ev.add_argument(
        "--replay-endpoint", metavar="E",
        help="its replay endpoint: fills gaps, and first prints the history it still holds",
    )  # fmt: skip
    ev.add_argument("--limit", type=_positive_int, metavar="N", help="stop after N events")
    ev.add_argument("--json", action="store_true", help="JSON lines (hashes as hex)")
    ev.set_defaults(run=_run_events)
    return parser


def _run_simulate(args: argparse.Namespace) -> None:
    requests = _load_requests(args)
    if not requests:
        raise _UsageError("the workload has no requests")
    if args.plot is not None:
        check_plotting(args.plot)  # fail before a long run, not after it
    request_keys = requests_to_keys(requests)
    encoder = msgspec.json.Encoder()
    results: list[SimulationResult] = []
    policies = expand_policies(args.policy)
    for policy in policies:
        for capacity in args.capacity_tokens:
            result = simulate_keys(
                request_keys,
                capacity_tokens=capacity,
                policy=policy,
                block_tokens=args.block_tokens,
            )
            if args.json:
                sys.stdout.buffer.write(encoder.encode(result) + b"\n")
                sys.stdout.flush()
            results.append(result)
    if not args.json:
        print(_simulation_table(results))
    if args.plot is not None:
        drawn = list(results)
        if OPTIMAL not in policies:  # the plot always shows the optimum
            drawn += [
                simulate_keys(request_keys, capacity_tokens=capacity, policy=OPTIMAL,
                              block_tokens=args.block_tokens)
                for capacity in args.capacity_tokens
            ]  # fmt: skip
        source = Path(args.trace).name if args.trace is not None else f"{args.workload} workload"
        title = f"{source}: {len(requests):,} requests, {results[0].blocks:,} blocks"
        plot_hit_rates(drawn, args.plot, title=title)


def _run_replay(args: argparse.Namespace) -> None:
    from tiering.replay import ReplayOptions, run_replay  # torch and anyio: only when used

    requests = _load_requests(args)
    if not requests:
        raise _UsageError("the workload has no requests")
    size = {"cpu_bytes": args.cpu_bytes} if args.cpu_bytes else {}
    if args.capacity_tokens:  # else ReplayOptions' default capacity, unless bytes are given
        size["capacity_tokens"] = args.capacity_tokens
    options = ReplayOptions(
        **size,
        policy=args.policy,
        bytes_per_token=args.bytes_per_token,
        block_tokens=args.block_tokens,
        concurrency=args.concurrency,
        verify=args.verify,
        backend=args.backend,
        hold=args.hold,
        events_endpoint=args.events_endpoint,
        replay_endpoint=args.replay_endpoint,
        remote=args.remote,
        remote_namespace=args.remote_namespace,
    )
    result = run_replay(
        requests,
        options,
        show_progress=not args.json and sys.stderr.isatty(),
        on_open=_services(args),
    )
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
        return
    r = result
    rows = [
        ("requests", f"{r.requests:,} ({r.concurrency} at once, {r.backend} backend)"),
        ("CPU tier", f"{r.capacity_chunks:,} chunks, {r.cpu_bytes / 2**20:,.1f} MiB, {r.policy}"),
        ("hit rate", f"{r.hit_rate:.2%} ({r.hit_blocks:,} of {r.blocks:,} blocks loaded back)"),
        ("stored", f"{r.stored_chunks:,} chunks, {r.store_bytes / 1e9:.2f} GB at "
                   f"{r.store_gbps:.2f} GB/s"),
        ("loaded", f"{r.loaded_chunks:,} chunks, {r.load_bytes / 1e9:.2f} GB at "
                   f"{r.load_gbps:.2f} GB/s"),
        ("evictions", f"{r.evictions:,}"),
        ("job latency", f"p50 {r.job_latency_p50_ms:.2f} ms, p99 {r.job_latency_p99_ms:.2f} ms"),
        ("failed jobs", f"{r.failed_jobs:,} (and {r.no_room_stores:,} stores found no room)"),
        ("corrupt chunks", f"{r.corrupt_chunks:,}" if args.verify else "not checked (--verify)"),
        ("remote tier", f"{r.remote_hit_blocks:,} hit blocks, {r.remote_read_bytes / 1e9:.2f} GB "
                        f"read, {r.remote_write_bytes / 1e9:.2f} GB written, {r.remote_errors:,} "
                        "errors" if args.remote else "none (--remote)"),
        ("events", f"{r.events_published:,} published, {r.events_dropped:,} dropped"
                   if args.events_endpoint else "off (--events-endpoint)"),
        ("seconds", f"{r.seconds:.2f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def _services(
    args: argparse.Namespace,
) -> Callable[[TieringEngine], contextlib.AbstractAsyncContextManager[object]]:
    """What runs beside the replay once its engine is open: metrics, and where events go."""
    serve: Callable[..., MetricsServer] | None = None
    if args.metrics_port is not None:
        from tiering.metrics import serve_metrics  # prometheus-client: only when asked for

        serve = serve_metrics

    @contextlib.asynccontextmanager
    async def services(engine: TieringEngine) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if serve is not None:
                server = await stack.enter_async_context(
                    serve(engine, args.metrics_host, port=args.metrics_port)
                )
                print(f"tiering: serving metrics at {server.url}", file=sys.stderr, flush=True)
            if engine.event_endpoints is not None:
                endpoint, replay = engine.event_endpoints
                where = endpoint + (f", replay at {replay}" if replay else "")
                print(
                    f"tiering: publishing KV cache events at {where}", file=sys.stderr, flush=True
                )
            yield

    return services


def _run_events(args: argparse.Namespace) -> None:
    import anyio

    from tiering.events.tool import print_events  # pyzmq: only when used

    anyio.run(print_events, args.endpoint, args.replay_endpoint, args.json, sys.stdout, args.limit)


def _simulation_table(results: Sequence[SimulationResult]) -> str:
    header = ("policy", "capacity tokens", "chunks", "hit rate", "hit blocks", "evictions",
              "store failures", "keys/s")  # fmt: skip
    rows = [
        (
            r.policy,
            f"{r.capacity_tokens:,}",
            f"{r.capacity_chunks:,}",
            f"{r.hit_rate:.2%}",
            f"{r.hit_blocks:,}",
            f"{r.evictions:,}",
            f"{r.store_failures:,}",
            f"{r.keys_per_s:,.0f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in (header, *rows)
    ]
    first = results[0]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"{first.requests:,} requests, {first.blocks:,} blocks")
    return "\n".join(lines)


def _fail(message: str) -> NoReturn:
    print(f"tiering: error: {message}", file=sys.stderr)
    raise SystemExit(_EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (bad input exits with 2)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (TieringError, _UsageError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
