"""What the subcommands share: argument types, the workload flags, and one-line errors.

Bad input (a missing file, a malformed trace line, an impossible number, an
unknown name) prints one line on stderr and exits with code 2, without a
traceback: a subcommand raises `UsageError` (or a `TieringError`), and
`tiering.cli.parser.main` reports it through `fail`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tiering.workload import WORKLOADS, Request, check_trace, load_workload, read_trace
from tiering.workload.synthetic import MAX_REQUESTS

__all__ = [
    "EXIT_USAGE",
    "UsageError",
    "add_workload_args",
    "fail",
    "int_list",
    "load_requests",
    "name_list",
    "port",
    "positive_int",
    "scope_of",
    "seconds",
]

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port from 0 to 65535 (0 for any free port), got {text!r}"
        )
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers (``1000000,3000000``)."""
    return [positive_int(part.strip()) for part in text.split(",")]


def name_list(choices: Sequence[str]) -> argparse._ActionType:
    def parse(text: str) -> list[str]:
        names = [part.strip().lower() for part in text.split(",")]
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown name {name!r}; choose from {', '.join(choices)}"
                )
        return names

    return parse


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a Mooncake-format JSON-lines trace")
    source.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="a built-in synthetic workload"
    )
    parser.add_argument(
        "--requests", type=positive_int, metavar="N", help="use only the first N requests"
    )


def load_requests(args: argparse.Namespace) -> list[Request]:
    """The requests of ``--trace`` or ``--workload``; a trace whose hash ids disagree
    with its lengths gets one warning line, and is run as given."""
    if args.trace is None:
        if args.requests is not None and args.requests > MAX_REQUESTS:
            raise UsageError(
                f"--requests {args.requests:,} is more than a built-in workload makes; "
                f"give at most {MAX_REQUESTS:,}"
            )
        requests = load_workload(args.workload, args.requests)
    else:
        requests = read_trace(args.trace, limit=args.requests)
        _warn_inconsistent(args, requests)
    if not requests:
        raise UsageError("the workload has no requests")
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


def scope_of(args: argparse.Namespace, requests: Sequence[Request]) -> str:
    """Which requests ran: all of the trace, its first N, or a built-in workload's."""
    if args.trace is None:
        return f"{len(requests):,} requests of the {args.workload} workload"
    name = Path(args.trace).name
    if args.requests is not None and len(requests) == args.requests:
        return f"the first {len(requests):,} requests of {name}"
    return f"all {len(requests):,} requests of {name}"


def fail(message: str) -> NoReturn:
    print(f"tiering: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)
