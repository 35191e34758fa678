"""Logging configured as vLLM configures it, and what vLLM's handler printed.

Usage, inside a test's body (not in a fixture: pytest gives the root logger its
capture handlers at the start of each phase, and a process of ``vllm serve`` has
none there)::

    from .vllm_log import vllm_logging

    def test_a_down_tier_is_one_warning(model):
        with vllm_logging() as log:
            engine = build_engine(model, ...)   # TieringSpec & co. built in here
            ...
        assert log.lines("WARNING", "cannot be reached") == [...]   # one line, or check len
        print(log.text)                                            # all vLLM printed

`vllm_logging` applies vLLM 0.33's own configuration with vLLM's own function
(`vllm.logger.configure_logging` with a `LoggingConfig`, what ``vllm serve``'s
engine core calls: ``DEFAULT_LOGGING_CONFIG`` through ``dictConfig``, the ``vllm``
logger with its handler and formatter, ``propagate`` off), with no handler on the
root logger, as in vLLM's server process, and points the stream of vLLM's handler
(``ext://sys.stdout`` by default) at a buffer. On leaving, the logging state it
changed (the ``vllm``, ``tiering`` and root loggers, the record factory) is put
back, so later tests see pytest's capture as before.

`VllmLog.records` parses each line of vLLM's text format,
``(EngineCore pid=12) WARNING 06-01 12:00:00 [spec.py:123] message``, into a
`VllmLine` (level, time, file, line number, message).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import vllm.logger
from vllm.config.logging import LoggingConfig

__all__ = ["VllmLine", "VllmLog", "vllm_logging"]

#: A line in vLLM's text format (``vllm.logger._FORMAT``, no prefix, no colour).
_LINE = re.compile(
    r"^\((?P<process>[^ ]+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) "
    r"(?P<time>\d\d-\d\d \d\d:\d\d:\d\d) \[(?P<file>[^\]:]+):(?P<lineno>\d+)\] (?P<message>.*)$"
)
_LOGGERS = ("vllm", "tiering", "")


@dataclass(frozen=True)
class VllmLine:
    """One record as vLLM's formatter printed it."""

    level: str
    time: str
    file: str
    lineno: int
    message: str
    text: str
    process: str = ""  # vLLM's name of the process that printed it (EngineCore, Worker_TP1)


class VllmLog:
    """What vLLM's handler printed while `vllm_logging` was active."""

    def __init__(self, stream: io.StringIO) -> None:
        self._stream = stream

    @property
    def text(self) -> str:
        return self._stream.getvalue()

    @property
    def records(self) -> list[VllmLine]:
        """Every record printed (a record over several lines is one, as vLLM prints it:
        its continuation lines start with the same prefix)."""
        found = []
        for text in self.text.splitlines():
            match = _LINE.match(text)
            if match is None:
                raise AssertionError(f"not in vLLM's log format: {text!r}\n{self.text}")
            found.append(
                VllmLine(
                    level=match["level"],
                    time=match["time"],
                    file=match["file"],
                    lineno=int(match["lineno"]),
                    message=match["message"],
                    text=text,
                    process=match["process"],
                )
            )
        return found

    def lines(self, level: str | None = None, containing: str = "") -> list[VllmLine]:
        """The records of ``level`` (any if None) whose message holds ``containing``."""
        return [
            line
            for line in self.records
            if (level is None or line.level == level) and containing in line.message
        ]


@contextlib.contextmanager
def vllm_logging(level: str = "INFO") -> Iterator[VllmLog]:
    """Logging as vLLM's server configures it, at ``level``; yields what it printed."""
    loggers = [logging.getLogger(name) if name else logging.getLogger() for name in _LOGGERS]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    factory = logging.getLogRecordFactory()
    last = vllm.logger._last_configured_logging_config
    color = {name: os.environ.get(name) for name in ("NO_COLOR", "VLLM_LOGGING_COLOR")}
    stream = io.StringIO()
    root = logging.getLogger()
    try:
        os.environ["NO_COLOR"] = "1"  # the plain format, whatever the terminal
        os.environ.pop("VLLM_LOGGING_COLOR", None)
        for handler in list(root.handlers):  # vllm serve's root logger has none
            root.removeHandler(handler)
        vllm.logger.configure_logging(
            LoggingConfig(
                log_level=level,  # type: ignore[arg-type]
                formatter="text",
                configure_logging=True,
                pylogging_config_file=None,
            )
        )
        handlers = logging.getLogger("vllm").handlers
        assert [h.name for h in handlers] == ["vllm"], handlers
        stream_handler = handlers[0]
        assert isinstance(stream_handler, logging.StreamHandler)
        stream_handler.setStream(stream)
        yield VllmLog(stream)
    finally:
        for lg, handlers, lg_level, propagate, disabled in saved:
            for handler in list(lg.handlers):
                lg.removeHandler(handler)
            for handler in handlers:
                lg.addHandler(handler)
            lg.setLevel(lg_level)
            lg.propagate, lg.disabled = propagate, disabled
        logging.setLogRecordFactory(factory)
        vllm.logger._last_configured_logging_config = last
        for name, value in color.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
