"""The `tiering` command line (`tiering.cli.parser.main`), one module per subcommand."""

from __future__ import annotations

from tiering.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
