"""What the subcommands share: argument types, the workload flags, and one-line errors.

Bad input (a missing file, a malformed trace line, an impossible number, an
unknown name) prints one line on stderr and exits with code 2, without a
traceback: a subcommand raises `UsageError` (or a `TieringError`), and
`tiering.cli.parser.main` reports it through `fail`.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from tiering.workload import WORKLOADS, Request, check_trace, load_workload, read_trace
from tiering.workload.hints import CONTINUATION_RETAIN_S, HintSource
from tiering.workload.synthetic import MAX_REQUESTS

__all__ = [
    "EXIT_USAGE",
    "UsageError",
    "add_hint_args",
    "add_workload_args",
    "check_hint_args",
    "default_requests",
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


#: A number written with commas between groups of three digits (``1,000,000``).
_GROUPED = re.compile(r"\d{1,3}(,\d{3})+")


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit code 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        hint = (
            f": write {text.replace(',', '')}, without commas" if _GROUPED.fullmatch(text) else ""
        )
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}{hint}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _integer(text: str, ok: Callable[[int], bool], expected: str) -> int:
    """``text`` as an integer that is ``ok``, else the flag's error: expected what."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _real(text: str, ok: Callable[[float], bool], expected: str) -> float:
    """``text`` as a number that is ``ok`` (never nan), else the flag's error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def port(text: str) -> int:
    return _integer(text, lambda v: 0 <= v <= 65535, "a port from 0 to 65535 (0 for any free port)")


def seconds(text: str) -> float:
    return _real(text, lambda v: math.isfinite(v) and v >= 0, "a number of seconds >= 0")


def fraction(text: str) -> float:
    return _real(
        text, lambda v: 0.0 <= v <= 1.0, "a fraction from 0 to 1 (0.2: one request in five)"
    )


def seed(text: str) -> int:
    return _integer(text, lambda v: v >= 0, "a seed, an integer >= 0")


def int_list(text: str) -> list[int]:
    """A comma-separated list of capacities, positive integers (``1000000,3000000``).

    Thousands separators (``1,000,000``: a part after the first of three digits
    starting with 0, which no one writes for a capacity) are refused as such, not
    read as the capacities 1, 0, 0.
    """
    parts = [part.strip() for part in text.split(",")]
    if any(len(p) == 3 and p.isdigit() and p.startswith("0") for p in parts[1:]):
        read = ", ".join(str(int(p)) if p.isdigit() else repr(p) for p in parts)
        fix = (
            f"write {''.join(parts)}"
            if _GROUPED.fullmatch(text.strip())
            else "write each without thousands separators (1000000, not 1,000,000)"
        )
        raise argparse.ArgumentTypeError(
            f"{text} reads as capacities {read}; commas separate capacities: {fix}"
        )
    return [positive_int(part) for part in parts]


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


def add_hint_args(parser: argparse.ArgumentParser) -> None:
    """``--hints``, ``--hint-error``, ``--hint-seed``: retention hints derived from the
    workload (`tiering.workload.hints`)."""
    parser.add_argument(
        "--hints",
        choices=[source.value for source in HintSource],
        default=HintSource.NONE.value,
        help="retention hints per request: none (the default), or continuation: retain "
        f"{CONTINUATION_RETAIN_S:g} s when a later request begins with the request's complete "
        "blocks, else release",
    )
    parser.add_argument(
        "--hint-error",
        type=fraction,
        metavar="P",
        help="give the wrong hint (retain for release and back) to a share P of the "
        "requests, drawn with --hint-seed (needs --hints continuation; default 0)",
    )
    parser.add_argument(
        "--hint-seed",
        type=seed,
        metavar="S",
        help="the seed of the requests --hint-error spoils (default 0; the requests "
        "spoiled at a rate are among those spoiled at any higher rate)",
    )


def check_hint_args(args: argparse.Namespace) -> tuple[str, float, int]:
    """The hints asked for: their source, error and seed; `UsageError` for an error or
    a seed without hints to spoil."""
    if args.hints == HintSource.NONE.value:
        for flag, value, does in (
            ("--hint-error", args.hint_error, "spoils retention hints"),
            ("--hint-seed", args.hint_seed, "picks the retention hints --hint-error spoils"),
        ):
            if value is not None:
                raise UsageError(
                    f"{flag} {value} {does}, and none were asked for: add "
                    f"--hints {HintSource.CONTINUATION.value}, or drop {flag}"
                )
    return args.hints, args.hint_error or 0.0, args.hint_seed or 0


def default_requests(workload: str) -> int:
    """How many requests the built-in ``workload`` makes when not told (its factory's
    default ``num_requests``)."""
    return int(inspect.signature(WORKLOADS[workload]).parameters["num_requests"].default)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    defaults = ", ".join(f"{name} {default_requests(name):,}" for name in sorted(WORKLOADS))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="a Mooncake-format JSON-lines trace")
    source.add_argument(
        "--workload", choices=sorted(WORKLOADS), help="a built-in synthetic workload"
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        metavar="N",
        help="the first N requests of a trace (default: all of them), or N made by a "
        f"built-in workload (default: {defaults}; at most {MAX_REQUESTS:,})",
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
