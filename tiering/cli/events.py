"""`tiering events`: print the KV cache events an engine publishes (pyzmq, anyio: only
when the subcommand runs)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tiering._extras import require
from tiering.cli.arguments import fail, positive_int, seconds
from tiering.events.config import DEFAULT_ENDPOINT as _EVENTS_ENDPOINT  # msgspec only

__all__ = ["add_parser"]

#: `tiering events`: seconds to wait for a first event by default, with a person watching
#: (stdout or stderr a terminal) and without (a script: time for a server to start, never
#: for ever; --timeout 0 listens for ever).
_EVENTS_WAIT_TTY = 5.0
_EVENTS_WAIT_PIPED = 60.0


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The ``events`` subcommand: its flags, and what runs it."""

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
    ev.add_argument("--limit", type=positive_int, metavar="N", help="stop after N events")
    ev.add_argument(
        "--timeout", type=seconds, metavar="S",
        help="give up (exit status 2) when no event came in the first S seconds; 0: wait for "
        f"ever (default {_EVENTS_WAIT_TTY:g} on a terminal, else {_EVENTS_WAIT_PIPED:g})",
    )  # fmt: skip
    ev.add_argument("--json", action="store_true", help="JSON lines (hashes as hex)")
    ev.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    import functools

    import anyio

    from tiering.events.config import check_endpoint, check_replay_endpoint

    require("zmq", "events", "tiering events")
    from tiering.events.tool import print_events  # pyzmq: only when used

    # As the replay's --events-endpoint: ZeroMQ would bind port 99999 as 34463,
    # and retry a connect to it (or to port 0) for ever.
    check_endpoint("endpoint", args.endpoint)
    if args.replay_endpoint is not None:
        check_replay_endpoint(
            "--replay-endpoint",
            args.replay_endpoint,
            args.endpoint,
            "the publisher's replay socket has an address of its own; give the port its "
            "--replay-endpoint binds (tiering replay prints it at start)",
        )
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
        fail(str(exc))
