"""Why a lower tier did not write (or load) a chunk, and what a store's error means.

Two things, each said once for every tier:

- `Unwritten`: the reason a chunk handed to `SecondaryTier.write` was not
  written, as counted in ``write_errors_by_reason`` (and shown by the CLI's
  summary, ``--json`` and the metrics: the strings are part of the output and
  never change). A chunk the store refused is counted under ``refused <CODE>``
  (`refused_reason`), its code being the store's own (``OOM``, ``ENOSPC``).
- `Fault`: what an error the store reported means for the tier, looked up in
  one table per kind of store, as httpcore's ``map_exceptions`` keeps one
  mapping: `ERRNO_FAULTS` (an ``OSError``'s ``errno``, the disk tier) and
  `SERVER_FAULTS` (a Redis error reply's code, the Redis tier). A code in
  neither table is `Fault.FAILED` (an errno) or `Fault.REFUSED` (an error reply:
  the server answered, it refused that one command).

What each fault does::

    fault        counted as                   writes back off   rest of the call
    REFUSED      refused <CODE>               yes               tried
    NO_SPACE     refused <CODE>               yes (1)           not tried (2)
    READ_ONLY    refused <CODE>               yes               not tried (2)
    MOVED        refused <CODE>               no (3)            tried
    UNAVAILABLE  the call failed: down        -                 not tried
    FAILED       the call (or value) failed   -                 tried
    NOT_REGULAR  not a regular file           -                 tried

(1) unless the tier made room by fitting its file system (the disk tier).
(2) on a disk: the other values would be refused alike; a Redis pipeline has
sent them already, and counts each reply.
(3) a Redis Cluster resharding: the slot map is stale, not the server full.
"""

from __future__ import annotations

import enum
import errno

__all__ = [
    "ERRNO_FAULTS",
    "SERVER_FAULTS",
    "Fault",
    "Unwritten",
    "errno_fault",
    "refused_reason",
    "server_fault",
]


class Unwritten(enum.StrEnum):
    """Why chunks handed to a tier's ``write`` were not written (``write_errors_by_reason``).

    A member is its string (``Unwritten.DOWN == "down"``); counts are keyed by
    the plain string (``.value``).
    """

    #: Answered without I/O: the tier was down and not due a retry.
    DOWN = "down"
    #: Answered without I/O: the store refused writes just before (the write gate).
    BACKING_OFF = "backing off"
    #: Every worker thread of the tier stayed busy until the call's deadline.
    BUSY = "busy"
    #: The call ran out of time.
    TIMEOUT = "timeout"
    #: The call failed: connection lost, protocol error, an I/O error.
    FAILED = "failed"
    #: The caller gave up (the call was cancelled).
    CANCELLED = "cancelled"
    #: A store of many nodes (a Redis Cluster): the node that holds the key is down.
    NODE_DOWN = "node down"
    #: The disk tier: every value it holds is being read or written, none can go.
    NO_ROOM = "no room"
    #: The disk tier was opened read-only.
    READ_ONLY = "read only"
    #: The disk tier: a link, FIFO or folder where the value or its shard belongs
    #: (also a reason values are rejected on reading: ``rejected_by_reason``).
    NOT_REGULAR = "not a regular file"
    #: The engine's write-through queue was full: the tier fell behind.
    BEHIND = "behind"
    #: vLLM's tier: its write queue was full at submit.
    QUEUE_FULL = "queue full"
    #: vLLM's tier: closed before the write was submitted.
    CLOSED = "closed"


def refused_reason(code: str) -> str:
    """The reason a chunk the store refused with ``code`` is counted under:
    ``refused OOM``, ``refused ENOSPC``."""
    return f"refused {code}"


class Fault(enum.Enum):
    """What an error the store reported means for the tier (see the module's table)."""

    REFUSED = "refused"
    NO_SPACE = "no space"
    READ_ONLY = "read only"
    MOVED = "moved"
    UNAVAILABLE = "unavailable"
    FAILED = "failed"
    NOT_REGULAR = "not regular"

    @property
    def refused(self) -> bool:
        """The store refused the command or value: counted by code, not as an error."""
        return self in _REFUSALS

    @property
    def backs_off(self) -> bool:
        """A refusal that takes the tier's writes down for a while (its write gate)."""
        return self in _REFUSALS and self is not Fault.MOVED

    @property
    def stops(self) -> bool:
        """The other values of the same call would be refused alike: not tried (a disk)."""
        return self is Fault.NO_SPACE or self is Fault.READ_ONLY


_REFUSALS = frozenset({Fault.REFUSED, Fault.NO_SPACE, Fault.READ_ONLY, Fault.MOVED})

#: An ``OSError``'s ``errno`` -> what it means; any other errno is `Fault.FAILED`.
ERRNO_FAULTS: dict[int, Fault] = {
    errno.ENOSPC: Fault.NO_SPACE,
    errno.EDQUOT: Fault.NO_SPACE,  # the user's quota: ``fstatvfs`` does not show it
    errno.EROFS: Fault.READ_ONLY,
    errno.EACCES: Fault.REFUSED,
    errno.EPERM: Fault.REFUSED,
    # What opening with ``O_NOFOLLOW | O_NONBLOCK`` answers for what is not a regular
    # file: a link (``ELOOP``; ``ENOTDIR`` with ``O_DIRECTORY``), a socket or a FIFO
    # opened to write (``ENXIO``), a folder opened to write (``EISDIR``).
    errno.ELOOP: Fault.NOT_REGULAR,
    errno.ENXIO: Fault.NOT_REGULAR,
    errno.EISDIR: Fault.NOT_REGULAR,
    errno.ENOTDIR: Fault.NOT_REGULAR,
}

#: A Redis error reply's code -> what it means; any other code is `Fault.REFUSED`.
#: (The exception class each code is reported in: `tiering.secondary.redis.failures`.)
SERVER_FAULTS: dict[str, Fault] = {
    "OOM": Fault.NO_SPACE,  # ``maxmemory`` reached under ``noeviction``
    "READONLY": Fault.READ_ONLY,  # a replica
    "MOVED": Fault.MOVED,
    "ASK": Fault.MOVED,
    "TRYAGAIN": Fault.MOVED,
    "LOADING": Fault.UNAVAILABLE,  # the server is loading its data set
    "CLUSTERDOWN": Fault.UNAVAILABLE,
    "MASTERDOWN": Fault.UNAVAILABLE,
    "WRONGPASS": Fault.UNAVAILABLE,  # the connection is not logged in
    "NOAUTH": Fault.UNAVAILABLE,
}
#: ``ERR`` replies that mean more than a refusal (by their whole message).
_SERVER_ERR_FAULTS: dict[str, Fault] = {
    "max number of clients reached": Fault.UNAVAILABLE,
    "invalid password": Fault.UNAVAILABLE,
}


def errno_fault(number: int | None) -> Fault:
    """What an ``OSError`` with ``errno`` ``number`` means (`ERRNO_FAULTS`; else FAILED)."""
    return ERRNO_FAULTS.get(number or 0, Fault.FAILED)


def server_fault(text: str) -> Fault:
    """What a Redis error reply (its whole text, ``OOM command not allowed ...``) means
    (`SERVER_FAULTS` by its code; an ``ERR`` reply by its message; else REFUSED)."""
    code, _, message = text.partition(" ")
    if code == "ERR":
        return _SERVER_ERR_FAULTS.get(message, Fault.REFUSED)
    return SERVER_FAULTS.get(code, Fault.REFUSED)
