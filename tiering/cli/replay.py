"""`tiering replay`: the engine over a workload, real bytes on an emulated KV cache
(`tiering.replay`, imported only when the subcommand runs: torch, anyio)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from tiering._extras import require
from tiering.cli.arguments import (
    UsageError,
    add_hint_args,
    add_workload_args,
    check_hint_args,
    load_requests,
    port,
    positive_int,
    seconds,
)
from tiering.cli.tables import replay_table
from tiering.config import DEFAULT_POLICY
from tiering.events.config import DEFAULT_ENDPOINT as _EVENTS_ENDPOINT  # msgspec only
from tiering.policies import POLICY_NAMES

if TYPE_CHECKING:
    from tiering.engine import TieringEngine
    from tiering.metrics import MetricsServer
    from tiering.secondary.auth import AuthKey

__all__ = ["add_parser"]

_METRICS_HOST = "127.0.0.1"
_REMOTE_URL_ENV = "TIERING_REMOTE_URL"  # --remote-url-env without a name
#: The flags `ReplayOptions` takes as they are, under the same names.
_AS_GIVEN = (
    "policy", "bytes_per_token", "block_tokens", "concurrency", "verify", "backend",
    "events_endpoint", "replay_endpoint", "disk", "disk_bytes", "remote", "remote_url_env",
    "remote_password_file",
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``replay`` subcommand: its flags, and what runs it."""
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
    add_workload_args(rep)
    size = rep.add_mutually_exclusive_group()
    size.add_argument(
        "--capacity-tokens",
        type=positive_int,
        metavar="N",
        help="CPU tier capacity in tokens (default 3000000)",
    )
    size.add_argument("--cpu-bytes", type=positive_int, metavar="B", help="CPU tier size in bytes")
    rep.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default=DEFAULT_POLICY,
        help=f"cache policy (default {DEFAULT_POLICY})",
    )
    rep.add_argument(
        "--bytes-per-token",
        type=positive_int,
        default=128,
        metavar="B",
        help="KV bytes per token of the emulated model (default 128)",
    )
    rep.add_argument(
        "--block-tokens", type=positive_int, default=512, metavar="N",
        help="tokens per hash id, block and chunk (default 512)",
    )  # fmt: skip
    rep.add_argument(
        "--concurrency", type=positive_int, default=4, metavar="C",
        help="requests in flight at once (default 4)",
    )  # fmt: skip
    rep.add_argument(
        "--backend", choices=("auto", "cpu", "cuda", "mock"), default="auto",
        help="transfer backend (default auto: cuda for CUDA tensors, else cpu)",
    )  # fmt: skip
    rep.add_argument("--verify", action="store_true", help="check every loaded chunk byte for byte")
    rep.add_argument(
        "--metrics-port", type=port, metavar="P",
        help="serve Prometheus metrics on port P while the replay runs (0: any free port)",
    )  # fmt: skip
    rep.add_argument(
        "--metrics-host", metavar="H",
        help=f"address the metrics server binds to (default {_METRICS_HOST}; "
        "needs --metrics-port)",
    )  # fmt: skip
    rep.add_argument(
        "--hold", type=seconds, metavar="S",
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
        "--disk-bytes", type=positive_int, metavar="N",
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
    add_hint_args(rep)
    rep.add_argument("--json", action="store_true", help="print one JSON object")
    rep.set_defaults(run=_run)


def _check_replay_flags(args: argparse.Namespace) -> None:
    """Refuse flags that mean nothing without another one."""
    if args.metrics_host is not None and args.metrics_port is None:
        raise UsageError(
            f"--metrics-host {args.metrics_host} is the metrics server's address, and no "
            "server was asked for: add --metrics-port P, or drop --metrics-host"
        )
    if args.hold is not None and args.metrics_port is None and args.events_endpoint is None:
        raise UsageError(
            f"--hold {args.hold:g} keeps metrics or events up after the replay, and neither "
            "is on: add --metrics-port P or --events-endpoint E, or drop --hold"
        )
    if args.disk is not None and args.disk_bytes is None:
        raise UsageError(
            f"--disk {args.disk} needs the tier's size: add --disk-bytes N (bytes of values "
            "it may hold, e.g. 100000000000 for 100 GB)"
        )
    for flag, value in (("--disk-bytes", args.disk_bytes), ("--disk-fsync", args.disk_fsync)):
        if value is not None and args.disk is None:
            raise UsageError(
                f"{flag} {value} sets the disk tier, and none was given: add --disk DIR, "
                f"or drop {flag}"
            )
    remote = args.remote is not None or args.remote_url_env is not None
    if args.remote is not None and args.remote_url_env is not None:
        raise UsageError(
            "--remote and --remote-url-env both give the remote tier's URL: give one of them"
        )
    for flag, value in (
        ("--remote-namespace", args.remote_namespace),
        ("--remote-password-file", args.remote_password_file),
    ):
        if value is not None and not remote:
            raise UsageError(
                f"{flag} {value!r} is for a remote tier, and none was given: add --remote URL "
                f"or --remote-url-env NAME, or drop {flag}"
            )
    if args.auth_key_file is not None and not remote and args.disk is None:
        raise UsageError(
            f"--auth-key-file {args.auth_key_file!r} authenticates the values of a disk or "
            "remote tier, and none was given: add --disk DIR or --remote URL, or drop it"
        )
    # The optional packages the flags need: one line now, not a traceback after a load.
    if remote:
        require("redis", "redis", "the remote tier (--remote, --remote-url-env)")
    if args.events_endpoint is not None:
        require("zmq", "events", "--events-endpoint")


def _run(args: argparse.Namespace) -> None:
    from tiering.replay import ReplayOptions, run_replay  # torch, anyio: if used

    _check_replay_flags(args)
    hints, hint_error, hint_seed = check_hint_args(args)
    requests = load_requests(args)
    size = {"cpu_bytes": args.cpu_bytes} if args.cpu_bytes else {}
    if args.capacity_tokens:  # else ReplayOptions' default capacity, unless bytes are given
        size["capacity_tokens"] = args.capacity_tokens
    options = ReplayOptions(
        **size,
        **{name: getattr(args, name) for name in _AS_GIVEN},
        hold=args.hold or 0.0,
        disk_fsync=args.disk_fsync or "none",
        remote_namespace=args.remote_namespace or "",
        auth_key=_auth_key(args),
        hints=hints,
        hint_error=hint_error,
        hint_seed=hint_seed,
    )
    url = options.remote_url()  # an unset variable or a bad password file: now, not after a load
    if args.remote is not None and url is not None:
        from tiering.secondary.redis.address import holds_password, parse_url

        parse_url(url, None)  # a URL that cannot work is its one line, without the warning
        if holds_password(args.remote):
            print(
                "tiering: warning: --remote's URL holds a password, which other users of "
                "this host can read (ps, /proc) and your shell keeps in its history: give "
                "the URL in a variable (--remote-url-env NAME) or the password in a file "
                "(--remote-password-file FILE) instead",
                file=sys.stderr,
                flush=True,
            )
    result = run_replay(
        requests,
        options,
        show_progress=not args.json and sys.stderr.isatty(),
        on_open=_services(args),
        on_hold=_holding(args),
    )
    if args.json:
        sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
        return
    print(replay_table(result, args, requests, options.auth_key))


def _holding(args: argparse.Namespace) -> Callable[[TieringEngine, float], None]:
    """What says, as the hold begins, that the requests are done and what stays up."""

    def holding(engine: TieringEngine, seconds: float) -> None:
        held = []
        if args.metrics_port is not None:
            held.append("the metrics endpoint")
        if engine.event_endpoints is not None:
            events = engine.statistics().events
            published = events.events_total if events is not None else 0
            ends = "endpoints" if engine.event_endpoints[1] is not None else "endpoint"
            held.append(f"the events {ends} ({published:,} KV cache events published)")
        print(
            f"tiering: replay done; holding {' and '.join(held)} for {seconds:g} s, the "
            "engine open (Ctrl-C ends the hold); the summary follows",
            file=sys.stderr,
            flush=True,
        )

    return holding


def _auth_key(args: argparse.Namespace) -> AuthKey | None:
    """The key of --auth-key-file, else of $TIERING_AUTH_KEY, for a disk or remote tier."""
    from tiering.secondary.auth import AuthKey as Key  # the secondary package: if used

    if args.disk is None and args.remote is None and args.remote_url_env is None:
        return None  # nothing to authenticate: an exported variable is not an error
    return Key.load(args.auth_key_file)


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
