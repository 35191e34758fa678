"""`tiering.secondary.refusals`: one name per reason, one table per kind of store."""

from __future__ import annotations

import errno

import pytest

from tiering.secondary import base
from tiering.secondary.refusals import (
    ERRNO_FAULTS,
    SERVER_FAULTS,
    Fault,
    Unwritten,
    errno_fault,
    refused_reason,
    server_fault,
)


def test_the_reasons_are_the_strings_the_output_shows() -> None:
    # These strings are keys of ``write_errors_by_reason``: the CLI, --json and the
    # metrics show them, so they never change.
    assert {m.name: m.value for m in Unwritten} == {
        "DOWN": "down",
        "BACKING_OFF": "backing off",
        "BUSY": "busy",
        "TIMEOUT": "timeout",
        "FAILED": "failed",
        "CANCELLED": "cancelled",
        "NODE_DOWN": "node down",
        "NO_ROOM": "no room",
        "READ_ONLY": "read only",
        "NOT_REGULAR": "not a regular file",
        "BEHIND": "behind",
        "QUEUE_FULL": "queue full",
        "CLOSED": "closed",
    }
    assert refused_reason("OOM") == "refused OOM"
    assert f"{Unwritten.NODE_DOWN}" == "node down"


def test_the_old_names_are_the_members() -> None:
    assert base.UNWRITTEN_DOWN is Unwritten.DOWN
    assert base.UNWRITTEN_BACKING_OFF is Unwritten.BACKING_OFF
    assert base.UNWRITTEN_BUSY is Unwritten.BUSY
    assert base.UNWRITTEN_TIMEOUT is Unwritten.TIMEOUT
    assert base.UNWRITTEN_FAILED is Unwritten.FAILED
    assert base.UNWRITTEN_CANCELLED is Unwritten.CANCELLED
    assert base.UNWRITTEN_NODE_DOWN is Unwritten.NODE_DOWN


def test_counts_are_keyed_by_plain_strings() -> None:
    counters = base.TierCounters()
    counters.written(1, 4, 8, cause=Unwritten.TIMEOUT, refused=[("OOM", "OOM: full")])
    s = counters.snapshot("t", "up")
    assert s.write_errors_by_reason == {"timeout": 2, "refused OOM": 1}
    assert all(type(key) is str for key in s.write_errors_by_reason)


def test_errno_table() -> None:
    assert [errno_fault(n) for n in (errno.ENOSPC, errno.EDQUOT)] == [Fault.NO_SPACE] * 2
    assert errno_fault(errno.EROFS) is Fault.READ_ONLY
    assert errno_fault(errno.EACCES) is errno_fault(errno.EPERM) is Fault.REFUSED
    assert errno_fault(errno.ELOOP) is Fault.NOT_REGULAR
    assert errno_fault(errno.EIO) is errno_fault(None) is Fault.FAILED
    refusals = {n for n, fault in ERRNO_FAULTS.items() if fault.refused}
    assert refusals == {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
    stops = {n for n, fault in ERRNO_FAULTS.items() if fault.stops}
    assert stops == {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def test_what_each_fault_does() -> None:
    assert [f for f in Fault if f.refused] == [
        Fault.REFUSED,
        Fault.NO_SPACE,
        Fault.READ_ONLY,
        Fault.MOVED,
    ]
    assert [f for f in Fault if f.backs_off] == [Fault.REFUSED, Fault.NO_SPACE, Fault.READ_ONLY]


REPLIES = [
    *(f"{code} some text" for code in SERVER_FAULTS if code not in ("MOVED", "ASK")),
    "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOSCRIPT No matching script",
    "NOPERM this user has no permissions",
    "ERR max number of clients reached",
    "ERR invalid password",
    "ERR unknown command",
    "Error lower-case code",
]


@pytest.mark.parametrize("text", REPLIES)
def test_server_table_sorts_as_redis_pys_classes_do(text: str) -> None:
    pytest.importorskip("redis")
    from tiering.secondary.redis.failures import error_from_reply, errors
    from tiering.secondary.redis.resp import ErrorReply

    e = errors()
    error = error_from_reply(ErrorReply(text))
    fault = server_fault(text)
    assert (fault is Fault.UNAVAILABLE) == isinstance(error, e.unavailable)
    assert (fault is Fault.MOVED) == isinstance(error, e.moved)
    assert fault.refused == (not isinstance(error, e.unavailable))
