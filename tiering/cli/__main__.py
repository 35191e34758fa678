"""``python -m tiering.cli``: the command line."""

from __future__ import annotations

from tiering.cli import main

raise SystemExit(main())
