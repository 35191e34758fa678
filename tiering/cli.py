"""The `tiering` command line.

Bad input (a missing file, a malformed trace line, an impossible number, an
unknown name) prints one line on stderr and exits with code 2, without a
traceback; every subcommand reports through `_fail`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import msgspec

from tiering.config import DEFAULT_POLICY
from tiering.errors import TieringError
from tiering.events.config import DEFAULT_ENDPOINT as _EVENTS_ENDPOINT  # msgspec only
from tiering.policies import POLICY_NAMES
from tiering.simulate import (
    ALL_POLICIES,
    OPTIMAL,
    Progress,
    ProgressBar,
    SimulationResult,
    capacity_chunks,
    check_plotting,
    expand_policies,
    plot_hit_rates,
    plot_hit_rates_by_tier,
    requests_to_keys,
    simulate_keys,
)
from tiering.workload import (
    CAPACITY_TOKENS,
    WORKLOADS,
    Request,
    check_trace,
    load_workload,
    read_trace,
)
from tiering.workload.synthetic import MAX_REQUESTS

if TYPE_CHECKING:
    from tiering.engine import TieringEngine
    from tiering.metrics import MetricsServer
    from tiering.replay import ReplayResult, TierReport
    from tiering.secondary.auth import AuthKey

__all__ = ["main"]

_EXIT_USAGE = 2
#: `tiering simulate --trace`'s capacities: the conversation trace's (README).
_TRACE_CAPACITY_TOKENS = (1_000_000, 3_000_000, 10_000_000)
_TIERS = ("cpu", "disk")  # `tiering simulate --disk-tokens`'s tiers, in its table
_METRICS_HOST = "127.0.0.1"
_REMOTE_URL_ENV = "TIERING_REMOTE_URL"  # --remote-url-env without a name


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
    """The requests of ``--trace`` or ``--workload``; a trace whose hash ids disagree
    with its lengths gets one warning line, and is run as given."""
    if args.trace is None:
        if args.requests is not None and args.requests > MAX_REQUESTS:
            raise _UsageError(
                f"--requests {args.requests:,} is more than a built-in workload makes; "
                f"give at most {MAX_REQUESTS:,}"
            )
        requests = load_workload(args.workload, args.requests)
    else:
        requests = read_trace(args.trace, limit=args.requests)
        _warn_inconsistent(args, requests)
    if not requests:
        raise _UsageError("the workload has no requests")
    return requests


def _warn_inconsistent(args: argparse.Namespace, requests: Sequence[Request]) -> None:
    check = check_trace(requests, block_tokens=args.block_tokens)
    if check.consistent:
        return
    found = []
    if check.first_mismatch is not None:
        r = requests[check.first_mismatch]
        found.append(
            f"{check.length_mismatches:,} have a number of hash ids that disagrees with their "
            f"input_length (request {check.first_mismatch + 1}: {r.input_length:,} tokens, "
            f"{len(r.hash_ids):,} ids; {args.block_tokens}-token blocks make "
            f"{-(-r.input_length // args.block_tokens):,})"
        )
    if check.first_repeat is not None:
        found.append(f"{check.repeated_ids:,} repeat a hash id (request {check.first_repeat + 1})")
    print(
        f"tiering: warning: {args.trace}: of {check.requests:,} requests, "
        f"{' and '.join(found)}; running them as given",
        file=sys.stderr,
    )


def _scope(args: argparse.Namespace, requests: Sequence[Request]) -> str:
    """Which requests ran: all of the trace, its first N, or a built-in workload's."""
    if args.trace is None:
        return f"{len(requests):,} requests of the {args.workload} workload"
    name = Path(args.trace).name
    if args.requests is not None and len(requests) == args.requests:
        return f"the first {len(requests):,} requests of {name}"
    return f"all {len(requests):,} requests of {name}"


def _version() -> str:
    try:
        return importlib.metadata.version("tiering")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tiering",
        description="A KV-cache tiering engine for LLM inference servers.",
    )
    parser.add_argument("--version", action="version", version=f"tiering {_version()}")
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
        metavar="N[,N...]",
        help="tier capacities in tokens (default: for a trace "
        + ",".join(map(str, _TRACE_CAPACITY_TOKENS))
        + "; "
        + "; ".join(f"{name} {','.join(map(str, c))}" for name, c in CAPACITY_TOKENS.items())
        + ")",
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
        "--disk-tokens",
        type=_int_list,
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
        "--metrics-host", metavar="H",
        help=f"address the metrics server binds to (default {_METRICS_HOST}; "
        "needs --metrics-port)",
    )  # fmt: skip
    rep.add_argument(
        "--hold", type=_seconds, metavar="S",
        help="stay up S seconds after the replay, the engine still open (for a last scrape "
        "or subscriber; needs --metrics-port or --events-endpoint)",
    )  # fmt: skip
    rep.add_argument(
        "--events-endpoint", metavar="E", nargs="?", const=_EVENTS_ENDPOINT,
        help=f"publish KV cache events on this ZMQ endpoint (alone: {_EVENTS_ENDPOINT}, "
        "bound on loopback; tcp://127.0.0.1:* binds a free port; tcp://*:5557 binds every "
        "interface, with a warning: the stream is unauthenticated)",
    )  # fmt: skip
    rep.add_argument(
        "--replay-endpoint", metavar="E",
        help="serve replays of past event batches on this ZMQ endpoint (ROUTER)",
    )  # fmt: skip
    rep.add_argument(
        "--disk", metavar="DIR",
        help="a persistent disk tier below the CPU tier, in folder DIR (made if missing; "
        "one replay at a time owns it; a later replay finds what this one left)",
    )  # fmt: skip
    rep.add_argument(
        "--disk-bytes", type=_positive_int, metavar="N",
        help="the disk tier's capacity in bytes of values (needs --disk)",
    )  # fmt: skip
    rep.add_argument(
        "--disk-fsync", choices=("none", "data", "full"),
        help="what of the disk tier survives a power loss: none (the default: a crash "
        "never leaves a half value visible), data (each value synced before it is "
        "visible), full (and its folder; needs --disk)",
    )  # fmt: skip
    rep.add_argument(
        "--remote", metavar="URL",
        help="a shared tier below the CPU tier (and below the disk tier, with --disk): "
        "redis://[user@]host:port[/db] or rediss://; a Redis Cluster is detected. A password "
        "here is seen by every local user (ps): give it with --remote-password-file, or the "
        "whole URL with --remote-url-env",
    )  # fmt: skip
    rep.add_argument(
        "--remote-url-env", metavar="NAME", nargs="?", const=_REMOTE_URL_ENV,
        help="the remote tier's URL, password included, from the environment variable NAME "
        f"(default {_REMOTE_URL_ENV}); instead of --remote",
    )  # fmt: skip
    rep.add_argument(
        "--remote-password-file", metavar="PATH",
        help="the remote tier's password: the first line of the file PATH (a regular "
        "file; the URL then holds none)",
    )  # fmt: skip
    rep.add_argument(
        "--remote-namespace", metavar="NS",
        help="share remote chunks only with engines of the same namespace (and model; "
        "needs --remote or --remote-url-env)",
    )  # fmt: skip
    rep.add_argument(
        "--auth-key-file", metavar="PATH",
        help="a secret shared by every engine of the disk and remote tiers: values are "
        "written with a MAC under it and only values with a valid one are loaded (a regular "
        "file of 16 to 4,096 bytes; else the variable TIERING_AUTH_KEY, if set)",
    )  # fmt: skip
    rep.add_argument("--json", action="store_true", help="print one JSON object")
    rep.set_defaults(run=_run_replay)

    ev = sub.add_parser(
        "events",
        help="print the KV cache events an engine publishes",
        description="Subscribe to an engine's KV cache events and print them, one line "
        "each (a gap in the sequence is filled from the replay endpoint, or reported). "
        "One end must bind: a publisher binds an endpoint with '*' (tcp://*:5557) and "
        f"tiering's default {_EVENTS_ENDPOINT}, and connects to any other; this command "
        "binds an endpoint with '*' and connects to any other. Without a first event in "
        "--timeout seconds it says why and exits with status 2; a message that is not an "
        "event batch is skipped and counted.",
    )
    ev.add_argument(
        "endpoint", nargs="?", default=_EVENTS_ENDPOINT,
        help=f"the publisher's ZMQ endpoint (default {_EVENTS_ENDPOINT}: connects, to a "
        "publisher given --events-endpoint alone); tcp://*:5557 binds every interface, for "
        "a publisher that connects",
    )  # fmt: skip
    ev.add_argument(
        "--replay-endpoint", metavar="E",
        help="its replay endpoint: fills gaps, and first prints the history it still holds",
    )  # fmt: skip
    ev.add_argument("--limit", type=_positive_int, metavar="N", help="stop after N events")
    ev.add_argument(
        "--timeout", type=_seconds, metavar="S",
        help="give up (exit status 2) when no event came in the first S seconds; 0: wait for "
        f"ever (default {_EVENTS_WAIT_TTY:g} on a terminal, else {_EVENTS_WAIT_PIPED:g})",
    )  # fmt: skip
    ev.add_argument("--json", action="store_true", help="JSON lines (hashes as hex)")
    ev.set_defaults(run=_run_events)
    return parser


def _run_simulate(args: argparse.Namespace) -> None:
    plot_format = None if args.plot is None else check_plotting(args.plot)  # before a long run
    requests = _load_requests(args)
    capacities = args.capacity_tokens or (
        _TRACE_CAPACITY_TOKENS if args.trace is not None else CAPACITY_TOKENS[args.workload]
    )
    encoder = msgspec.json.Encoder()
    policies = expand_policies(args.policy)
    disks: list[int | None] = list(args.disk_tokens or [None])
    if args.disk_tokens is not None:  # before a long run
        if OPTIMAL in policies:
            raise _UsageError(
                "the offline optimum models one tier; drop --disk-tokens or the optimal policy "
                f"(--policy all includes it: list the others, {','.join(POLICY_NAMES)})"
            )
        for disk in args.disk_tokens:
            capacity_chunks(disk, args.block_tokens, tier="disk")
    request_keys = requests_to_keys(requests)
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
        )
        if args.json and policy in policies:
            sys.stdout.buffer.write(encoder.encode(result) + b"\n")
            sys.stdout.flush()
        results.append(result)
    if not args.json:
        asked = len(policies) * len(capacities) * len(disks)
        print(_simulation_table(results[:asked], args, requests))
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


def _check_replay_flags(args: argparse.Namespace) -> None:
    """Refuse flags that mean nothing without another one."""
    if args.metrics_host is not None and args.metrics_port is None:
        raise _UsageError(
            f"--metrics-host {args.metrics_host} is the metrics server's address, and no "
            "server was asked for: add --metrics-port P, or drop --metrics-host"
        )
    if args.hold is not None and args.metrics_port is None and args.events_endpoint is None:
        raise _UsageError(
            f"--hold {args.hold:g} keeps metrics or events up after the replay, and neither "
            "is on: add --metrics-port P or --events-endpoint E, or drop --hold"
        )
    if args.disk is not None and args.disk_bytes is None:
        raise _UsageError(
            f"--disk {args.disk} needs the tier's size: add --disk-bytes N (bytes of values "
            "it may hold, e.g. 100000000000 for 100 GB)"
        )
    for flag, value in (("--disk-bytes", args.disk_bytes), ("--disk-fsync", args.disk_fsync)):
        if value is not None and args.disk is None:
            raise _UsageError(
                f"{flag} {value} sets the disk tier, and none was given: add --disk DIR, "
                f"or drop {flag}"
            )
    remote = args.remote is not None or args.remote_url_env is not None
    if args.remote is not None and args.remote_url_env is not None:
        raise _UsageError(
            "--remote and --remote-url-env both give the remote tier's URL: give one of them"
        )
    for flag, value in (
        ("--remote-namespace", args.remote_namespace),
        ("--remote-password-file", args.remote_password_file),
    ):
        if value is not None and not remote:
            raise _UsageError(
                f"{flag} {value!r} is for a remote tier, and none was given: add --remote URL "
                f"or --remote-url-env NAME, or drop {flag}"
            )
    if args.auth_key_file is not None and not remote and args.disk is None:
        raise _UsageError(
            f"--auth-key-file {args.auth_key_file!r} authenticates the values of a disk or "
            "remote tier, and none was given: add --disk DIR or --remote URL, or drop it"
        )


def _run_replay(args: argparse.Namespace) -> None:
    from tiering.replay import ReplayOptions, format_bytes, run_replay  # torch, anyio: if used

    _check_replay_flags(args)
    requests = _load_requests(args)
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
        hold=args.hold or 0.0,
        events_endpoint=args.events_endpoint,
        replay_endpoint=args.replay_endpoint,
        disk=args.disk,
        disk_bytes=args.disk_bytes,
        disk_fsync=args.disk_fsync or "none",
        remote=args.remote,
        remote_namespace=args.remote_namespace or "",
        remote_url_env=args.remote_url_env,
        remote_password_file=args.remote_password_file,
        auth_key=_auth_key(args),
    )
    options.remote_url()  # an unset variable or a bad password file: now, not after a load
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
        ("requests", f"{_scope(args, requests)}, {r.concurrency} at once, {r.backend} backend"),
        ("CPU tier", f"{r.capacity_chunks:,} chunks, {format_bytes(r.cpu_bytes)}, {r.policy}"),
        ("hit rate", f"{r.hit_rate:.2%} ({r.hit_blocks:,} of {r.blocks:,} blocks loaded back)"),
        ("stored", f"{r.stored_chunks:,} chunks, {format_bytes(r.store_bytes)} at "
                   f"{r.store_gbps:.2f} GB/s"),
        ("loaded", f"{r.loaded_chunks:,} chunks, {format_bytes(r.load_bytes)} at "
                   f"{r.load_gbps:.2f} GB/s"),
        ("evictions", f"{r.evictions:,}"),
        ("job latency", f"p50 {r.job_latency_p50_ms:.2f} ms, p99 {r.job_latency_p99_ms:.2f} ms"),
        ("failed jobs", f"{r.failed_jobs:,} (and {r.no_room_stores:,} stores found no room)"),
        ("corrupt chunks", f"{r.corrupt_chunks:,}" if args.verify else "not checked (--verify)"),
        ("hit by tier", _by_tier(r)),
        *_tier_rows(r, args),
        *([("values", _keyed(options.auth_key))] if r.tiers else []),
        ("events", f"{r.events_published:,} published, {r.events_dropped:,} dropped"
                   if args.events_endpoint else "off (--events-endpoint)"),
        ("seconds", f"{r.seconds:.2f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    print(_replay_against_simulate(r, args))
    block = format_bytes(args.bytes_per_token * args.block_tokens)
    print(
        f"block: {args.block_tokens} tokens of KV, {block}, one a chunk; hit rate: blocks "
        "loaded back from the tiers / all blocks; GB/s: over the copies' own time; "
        "1 GB = 10^9 bytes"
    )


def _auth_key(args: argparse.Namespace) -> AuthKey | None:
    """The key of --auth-key-file, else of $TIERING_AUTH_KEY, for a disk or remote tier."""
    from tiering.secondary.auth import AuthKey as Key  # the secondary package: if used

    if args.disk is None and args.remote is None and args.remote_url_env is None:
        return None  # nothing to authenticate: an exported variable is not an error
    return Key.load(args.auth_key_file)


def _keyed(key: AuthKey | None) -> str:
    """The summary's word on the lower tiers' values: keyed (by which key), or not."""
    if key is None:
        return "unkeyed: anyone who can write to the tiers can write a value (--auth-key-file)"
    return f"keyed: only holders of auth key {key.key_id} (from {key.source}) can write one"


def _replay_against_simulate(r: ReplayResult, args: argparse.Namespace) -> str:
    """Why the hit rate may differ from `tiering simulate`'s, in one line."""
    same = f" --requests {r.requests}" if args.requests is not None else ""
    if r.concurrency == 1:
        return (
            f"one request at a time: the hit rate is `tiering simulate{same}`'s at the same "
            "capacity and policy"
        )
    return (
        f"{r.concurrency} requests at once: one can miss chunks others are still storing, so "
        f"the hit rate can be below `tiering simulate{same}`'s (one at a time, as "
        "--concurrency 1)"
    )


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
                    serve(engine, args.metrics_host or _METRICS_HOST, port=args.metrics_port)
                )
                print(f"tiering: serving metrics at {server.url}", file=sys.stderr, flush=True)
            if engine.event_endpoints is not None:
                from tiering.events.config import wildcard_of

                endpoint, replay = engine.event_endpoints
                where = endpoint + (f", replay at {replay}" if replay else "")
                # Say which side binds: two sides that both connect never meet.
                how = "bound: subscribers connect to it"
                if not engine.event_publisher_binds:
                    wild = wildcard_of(endpoint)
                    how = "it connects: a subscriber must bind it" + (
                        f", e.g. tiering events {wild}" if wild else ""
                    )
                print(
                    f"tiering: publishing KV cache events at {where} ({how})",
                    file=sys.stderr,
                    flush=True,
                )
            yield

    return services


#: `tiering events`: seconds to wait for a first event by default, with a person watching
#: (stdout or stderr a terminal) and without (a script: time for a server to start, never
#: for ever; --timeout 0 listens for ever).
_EVENTS_WAIT_TTY = 5.0
_EVENTS_WAIT_PIPED = 60.0


def _run_events(args: argparse.Namespace) -> None:
    import functools

    import anyio

    from tiering.events.config import check_endpoint
    from tiering.events.tool import print_events  # pyzmq: only when used

    # As the replay's --events-endpoint: ZeroMQ would bind port 99999 as 34463,
    # and retry a connect to it (or to port 0) for ever.
    check_endpoint("endpoint", args.endpoint)
    if args.replay_endpoint is not None:
        check_endpoint("--replay-endpoint", args.replay_endpoint)
    timeout = args.timeout
    if timeout is None:
        watched = sys.stdout.isatty() or sys.stderr.isatty()
        timeout = _EVENTS_WAIT_TTY if watched else _EVENTS_WAIT_PIPED
    run = functools.partial(
        print_events,
        args.endpoint,
        args.replay_endpoint,
        args.json,
        sys.stdout,
        args.limit,
        first_timeout=timeout or None,
        status=sys.stderr,
    )
    try:
        anyio.run(run)
    except TimeoutError as exc:  # nothing came: the message says why and what to change
        _fail(str(exc))


def _simulation_table(
    results: Sequence[SimulationResult], args: argparse.Namespace, requests: Sequence[Request]
) -> str:
    disk = args.disk_tokens is not None
    header = ["policy", "capacity tokens", "chunks", "hit rate", "hit blocks", "evictions",
              "store failures", "keys/s"]  # fmt: skip
    if disk:  # the hit rate by tier, after the disk's capacity
        header[3:4] = ["disk tokens", "hit rate", "cpu hits", "disk hits"]
    rows = []
    for r in results:
        row = [r.policy, f"{r.capacity_tokens:,}", f"{r.capacity_chunks:,}", f"{r.hit_rate:.2%}",
               f"{r.hit_blocks:,}", f"{r.evictions:,}", f"{r.store_failures:,}",
               f"{r.keys_per_s:,.0f}"]  # fmt: skip
        if disk:
            cpu, on_disk = (r.hit_blocks_by_tier.get(t, 0) / (r.blocks or 1) for t in _TIERS)
            row[3:4] = [f"{r.disk_tokens or 0:,}", row[3], f"{cpu:.2%}", f"{on_disk:.2%}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in (header, *rows)
    ]
    lines.insert(1, "-" * len(lines[0]))
    scope = f"{_scope(args, requests)}, {results[0].blocks:,} blocks of {args.block_tokens} tokens"
    if not disk:
        lines.append(
            f"{scope}, one request at a time (as `tiering replay --concurrency 1`, which hits "
            "the same)"
        )
        lines.append(
            "hit rate: blocks found in the CPU tier / all blocks; chunks: blocks it holds; "
            "store failures: requests that found no room; keys/s: blocks simulated per second"
        )
        return "\n".join(lines)
    lines.append(
        f"{scope}, one request at a time, each write-through landed before the next (as "
        "`tiering replay --disk --concurrency 1` while its writes keep up: it drops those it "
        "falls behind on)"
    )
    lines.append(
        "disk hits: blocks the CPU tier lacked, read from the disk tier into it (the leading "
        "run after the CPU hits); every chunk stored in the CPU tier is written through to it"
    )
    lines.append(
        "hit rate: blocks found in either tier / all blocks (cpu hits + disk hits); chunks, "
        "evictions, store failures: the CPU tier's; keys/s: blocks simulated per second"
    )
    return "\n".join(lines)


def _by_tier(r: ReplayResult) -> str:
    """Where the hit blocks came from: ``cpu 12,345 (80.0 %), disk 3,086 (20.0 %)``."""
    total = r.hit_blocks or 1
    return ", ".join(
        f"{label} {n:,} ({n / total:.1%})" for label, n in r.hit_blocks_by_tier.items()
    )


def _tier_rows(r: ReplayResult, args: argparse.Namespace) -> list[tuple[str, str]]:
    """One summary line per tier below the CPU tier (and the ones not asked for)."""
    rows = [(f"{t.label} tier", _tier_summary(t)) for t in r.tiers]
    labels = {t.label for t in r.tiers}
    if "disk" not in labels:
        rows.append(("disk tier", "none (--disk)"))
    if "remote" not in labels:
        rows.append(("remote tier", "none (--remote)"))
    return rows


def _tier_summary(t: TierReport) -> str:
    """A tier's line: what it held and gave, and every chunk it did not take, by reason."""
    from tiering.replay import format_bytes

    text = ""
    if t.found_at_open is not None:
        text += f"found {t.found_at_open:,} chunks at open"
        if t.dropped_at_open:
            reasons = ", ".join(f"{n:,} {why}" for why, n in t.dropped_at_open.items())
            text += f" (dropped {reasons})"
        text += "; "
    if t.chunks is not None and t.capacity_bytes:
        of = format_bytes(t.capacity_bytes)
        effective = t.effective_capacity_bytes
        if effective is not None and effective != t.capacity_bytes:  # a small file system
            of += f" configured, {format_bytes(effective)} effective (what its file system holds)"
        text += f"holds {t.chunks:,} chunks, {format_bytes(t.used_bytes or 0)} of {of}; "
    text += (
        f"{t.hit_blocks:,} hit blocks, {format_bytes(t.read_bytes)} read, "
        f"{format_bytes(t.write_bytes)} written; "
    )
    if t.writes_dropped:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.writes_dropped_by_reason.items())
        text += f"{t.writes_dropped:,} chunk writes dropped ({reasons})"
    else:
        text += "no chunk write dropped"
    if t.rejected:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.rejected_by_reason.items())
        text += f"; {t.rejected:,} values rejected ({reasons})"
    if t.lost:
        text += f"; {t.lost:,} values lost (gone behind its back)"
    if t.refused_by_reason:
        reasons = ", ".join(f"{n:,} {why}" for why, n in t.refused_by_reason.items())
        text += f"; commands refused by the store: {reasons}"
    text += f"; {t.errors:,} failed calls"
    if t.busy:
        text += f"; {t.busy:,} calls found every worker busy (overload: answered as misses)"
    if t.writes_dropped_by_reason.get("behind"):
        text += "; the tier fell behind the stores (its write queue was full)"
    return text


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
