"""A run's progress on a terminal: `tiering simulate`'s and `tiering replay`'s bar."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """A one-line progress bar on a terminal, redrawn at most every 0.1 s: a `Progress`.

    ``label`` names the run under way (drawn at least once each, whatever the
    time); the line ends once ``done`` reaches ``total``.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.label = ""
        self._drawn_label: str | None = None
        self._drawn = 0  # the length of the line on screen
        self._last = 0.0
        self._start = time.perf_counter()

    def __call__(self, done: int, total: int, hits: int, blocks: int) -> None:
        now = time.perf_counter()
        if now - self._last < 0.1 and done < total and self.label == self._drawn_label:
            return
        self._last = now
        self._drawn_label = self.label
        filled = math.floor(self.width * done / total) if total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        rate = done / (now - self._start) if now > self._start else 0.0
        hit = hits / blocks if blocks else 0.0
        line = (
            f"{self.label}[{bar}] {done:,}/{total:,} requests  hit rate {hit:.1%}  "
            f"{rate:,.0f} req/s"
        )
        self.stream.write("\r" + line.ljust(self._drawn))
        self._drawn = len(line)
        if done >= total:
            self.stream.write("\n")
            self._drawn = 0
        self.stream.flush()
