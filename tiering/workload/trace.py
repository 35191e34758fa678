"""Request traces in the Mooncake format: one JSON object a line.

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}

- ``timestamp``: arrival time in milliseconds from the start of the trace;
- ``input_length``, ``output_length``: prompt and answer lengths in tokens;
- ``hash_ids``: one id per `BLOCK_TOKENS`-token block of the prompt, as prefix
  hashes: two requests whose first k ids are equal share their first k blocks.

Lines are decoded straight into `Request` by one reused msgspec decoder (no
dict per line in between). Keys other than
these four are ignored (traces from other sources carry more); a missing key, a
wrong type, a negative number, a line that is not a JSON object or not UTF-8
raises `WorkloadError` naming the file and the 1-based line number. Blank lines
are skipped.

A request whose ``hash_ids`` disagree with its ``input_length`` (not
``ceil(input_length / BLOCK_TOKENS)`` of them) or name one block twice is read
as given: such a trace can still be replayed, so `check_trace` counts them and
leaves reporting them to the caller.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, BinaryIO

import msgspec

from tiering._checks import check_int
from tiering.errors import WorkloadError

__all__ = [
    "BLOCK_TOKENS",
    "Request",
    "TraceCheck",
    "check_trace",
    "iter_trace",
    "read_trace",
    "write_trace",
]

#: Tokens per hash block in the Mooncake format: ``hash_ids[i]`` names the prefix
#: up to token ``(i + 1) * BLOCK_TOKENS``.
BLOCK_TOKENS = 512

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_MAX_HASH_ID = 2**64 - 1  # hash ids are unsigned 64-bit prefix hashes

_BOM = b"\xef\xbb\xbf"


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a trace; the field names are the JSON keys of the format."""

    timestamp: _NonNegative
    """Arrival time in milliseconds from the start of the trace."""
    input_length: _NonNegative
    """Prompt length in tokens."""
    output_length: _NonNegative
    """Answer length in tokens."""
    hash_ids: tuple[_NonNegative, ...]
    """One prefix-hash id per `BLOCK_TOKENS`-token block of the prompt."""


class TraceCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What `check_trace` found; request numbers are 0-based indices, None when none."""

    requests: int
    length_mismatches: int
    """Requests whose ``input_length`` needs another number of hash ids."""
    repeated_ids: int
    """Requests that name one hash id more than once."""
    first_mismatch: int | None
    first_repeat: int | None

    @property
    def consistent(self) -> bool:
        """True when every request's hash ids agree with its length and are distinct."""
        return not (self.length_mismatches or self.repeated_ids)


def check_trace(requests: Sequence[Request], *, block_tokens: int = BLOCK_TOKENS) -> TraceCheck:
    """Count the requests whose hash ids are not ``ceil(input_length / block_tokens)``
    or repeat an id (a block cannot be its own prefix)."""
    if block_tokens < 1:
        raise WorkloadError(f"block tokens must be at least 1, got {block_tokens}")
    mismatches = [
        i
        for i, r in enumerate(requests)
        if len(r.hash_ids) != -(-r.input_length // block_tokens)  # ceil
    ]
    repeats = [i for i, r in enumerate(requests) if len(set(r.hash_ids)) != len(r.hash_ids)]
    return TraceCheck(
        requests=len(requests),
        length_mismatches=len(mismatches),
        repeated_ids=len(repeats),
        first_mismatch=mismatches[0] if mismatches else None,
        first_repeat=repeats[0] if repeats else None,
    )


_DECODER = msgspec.json.Decoder(Request)
_ENCODER = msgspec.json.Encoder()


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except IsADirectoryError:
        raise WorkloadError(f"cannot read trace {path}: it is a directory, not a file") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise WorkloadError(f"cannot read trace {path}: {reason}") from exc


def _decode_lines(stream: BinaryIO, path: Path) -> Iterator[Request]:
    """Decode ``stream`` line by line; does not close it."""
    lineno = 0
    try:
        for lineno, raw in enumerate(stream, start=1):
            line = raw[len(_BOM) :] if lineno == 1 and raw.startswith(_BOM) else raw
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise WorkloadError(
                    f"{path}, line {lineno}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
            try:
                request = _DECODER.decode(text)
            except msgspec.DecodeError as exc:
                raise WorkloadError(
                    f"{path}, line {lineno}: {exc}; expected a JSON object with integer "
                    "'timestamp', 'input_length', 'output_length' >= 0 and a list "
                    "'hash_ids' of integers >= 0"
                ) from None
            if request.hash_ids and max(request.hash_ids) > _MAX_HASH_ID:
                raise WorkloadError(
                    f"{path}, line {lineno}: hash id {max(request.hash_ids)} does not fit in "
                    f"64 bits; hash ids must be in [0, {_MAX_HASH_ID}]"
                )
            yield request
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise WorkloadError(f"cannot read trace {path} after line {lineno}: {reason}") from exc


def iter_trace(path: str | os.PathLike[str]) -> Generator[Request, None, None]:
    """Yield the requests of the trace at ``path`` one at a time, in file order.

    The file is opened at the first ``next()`` and closed when the iterator is
    exhausted or closed. Raises `WorkloadError` as `read_trace` does.
    """
    trace = Path(path)
    with _open(trace) as stream:
        yield from _decode_lines(stream, trace)


def _capped(limit: int | None) -> int | None:
    return None if limit is None else min(limit, sys.maxsize)


def read_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Request]:
    """Read the requests of the trace at ``path``, in file order.

    With ``limit``, read only the first ``limit`` requests: the rest of the file
    is not parsed or checked. Raises `WorkloadError` when the file is missing,
    is a directory, cannot be read, or a line is malformed (the message names the
    file and the 1-based line number), and when ``limit`` is negative.
    """
    if limit is not None:
        check_int("limit (None: no limit)", limit, minimum=0, error=WorkloadError)
    trace = Path(path)
    if not str(path):
        raise WorkloadError("the trace path is empty; give a file")
    with _open(trace) as stream:
        return list(itertools.islice(_decode_lines(stream, trace), _capped(limit)))


def write_trace(path: str | os.PathLike[str], requests: Iterable[Request]) -> None:
    """Write ``requests`` to ``path`` in the same format, one JSON object a line.

    Overwrites ``path``. Raises `WorkloadError` when the file cannot be written.
    """
    trace = Path(path)
    try:
        with trace.open("wb") as stream:
            for request in requests:
                stream.write(_ENCODER.encode(request))
                stream.write(b"\n")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise WorkloadError(f"cannot write trace {trace}: {reason}") from exc
