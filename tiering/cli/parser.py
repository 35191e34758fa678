"""The `tiering` command line: its parser, and `main`, which runs a subcommand.

Each subcommand adds its own flags (`tiering.cli.simulate`, `tiering.cli.replay`,
`tiering.cli.events`); bad input exits with code 2 and one line on stderr
(`tiering.cli.arguments`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Sequence
from typing import NoReturn

from tiering.cli import events, replay, simulate
from tiering.cli.arguments import EXIT_USAGE, UsageError, fail
from tiering.errors import TieringError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


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
    simulate.add_parser(sub)
    replay.add_parser(sub)
    events.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (bad input exits with 2)."""
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (TieringError, UsageError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return 0
