"""The one exception tree of `tiering`.

Every error the library raises on purpose is a `TieringError`; a caller that
wants to catch "anything tiering refused" catches that one class::

    TieringError
    ├── ConfigError            a configuration value is missing, mistyped or impossible
    ├── SpecError              a load/store spec does not fit the layout or the pool
    │   └── InvalidKeyError    a key or block hash is not of a form keys are made of
    ├── ChunkStateError        a call does not fit a chunk's state (misuse of the manager)
    │   └── UnknownKeyError    the key is not in the tier at all
    ├── CapacityError          a tier or buffer cannot be sized as asked
    ├── TransferError          a copy failed inside a backend
    │   └── CopyFailedError    a job's copy raised: the torch or CUDA error is its ``cause``
    ├── ResourceClosedError    the object was closed and cannot be used any more
    ├── EventSchemaError       a KV event payload or block description does not fit the schema
    └── WorkloadError          a trace or workload description is malformed

Expected outcomes are not errors: a lookup miss, a full tier (``prepare_store``
returns ``None``) and a failed transfer (a failed result) are return values.
"""

from __future__ import annotations

import traceback

__all__ = [
    "CapacityError",
    "ChunkStateError",
    "ConfigError",
    "CopyFailedError",
    "EventSchemaError",
    "InvalidKeyError",
    "ResourceClosedError",
    "SpecError",
    "TieringError",
    "TransferError",
    "UnknownKeyError",
    "UnknownNameError",
    "WorkloadError",
    "failure_text",
    "transfer_error",
]


class TieringError(Exception):
    """Base class of every error that `tiering` raises on purpose."""


class ConfigError(TieringError, ValueError):
    """A configuration field is missing, has the wrong type or an impossible value."""


class UnknownNameError(ConfigError, AttributeError):
    """A configuration names a class that a module of tiering's does not have (vLLM's
    ``module_path`` and ``type``, say): a `ConfigError`, and the ``AttributeError``
    that ``getattr`` and ``hasattr`` expect."""


class SpecError(TieringError, ValueError):
    """A load/store spec does not fit the layout, the pool or itself."""


class InvalidKeyError(SpecError, TypeError):
    """A chunk key, or the block hash it is made from, has the wrong type or form.

    A `SpecError` (so a `ValueError`) and a `TypeError`: a str or a float given
    as a hash is caught by either.
    """


class ChunkStateError(TieringError):
    """A manager call does not fit the state of a chunk (e.g. loading a chunk being written)."""


class UnknownKeyError(ChunkStateError, KeyError):
    """The key names no chunk in the tier."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CapacityError(TieringError):
    """A tier, pool or buffer cannot be sized as asked (zero chunks, not enough memory)."""


class TransferError(TieringError):
    """A copy failed inside a transfer backend.

    Backends do not raise it: a failed copy is a failed `TransferResult` whose
    ``exception`` holds it (the mock backend's scripted failures are plain
    `TransferError`s; real failures are `CopyFailedError`s).
    """


class CopyFailedError(TransferError):
    """The copy of job ``job_id`` raised ``cause`` (a torch or CUDA error) inside a backend.

    ``cause`` is also ``__cause__``, as after ``raise ... from cause``; the
    message is the text failed results always carried, ``"RuntimeError: ..."``.
    The backend stays usable.
    """

    def __init__(self, message: str, cause: BaseException, job_id: int | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.job_id = job_id
        self.__cause__ = cause

    def __reduce__(self) -> tuple[type[CopyFailedError], tuple[str, BaseException, int | None]]:
        return type(self), (str(self), self.cause, self.job_id)


class ResourceClosedError(TieringError):
    """The object was closed; it cannot be used any more."""


class WorkloadError(TieringError, ValueError):
    """A request trace or workload description is malformed."""


class EventSchemaError(TieringError, ValueError):
    """A payload, event or block description does not fit the KV event schema."""


def failure_text(exc: BaseException) -> str:
    """The one line a failed result says of ``exc``: ``"RuntimeError: ..."``."""
    return f"{type(exc).__name__}: {exc}"


def transfer_error(exc: BaseException, job_id: int | None = None) -> TransferError:
    """``exc`` as the `TransferError` a failed result holds: itself if it is one, else
    a `CopyFailedError` from it.

    The frames of its traceback drop their local variables (the line numbers
    stay): a result may be kept long after, and must not keep a job's tensors,
    or the backend, alive.
    """
    traceback.clear_frames(exc.__traceback__)
    if isinstance(exc, TransferError):
        return exc
    return CopyFailedError(failure_text(exc), exc, job_id)
