"""Request workloads for replays: Mooncake-format traces and built-in synthetic ones.

Both give a list of `Request` (arrival time in ms, prompt and answer lengths in
tokens, one prefix-hash id per 512-token block), the form `tiering replay` runs.
"""

from __future__ import annotations

from tiering.workload.chat import chat_workload
from tiering.workload.documents import documents_workload
from tiering.workload.registry import CAPACITY_TOKENS, WORKLOADS, WorkloadFactory, load_workload
from tiering.workload.trace import (
    BLOCK_TOKENS,
    Request,
    TraceCheck,
    check_trace,
    iter_trace,
    read_trace,
    write_trace,
)

__all__ = [
    "BLOCK_TOKENS",
    "CAPACITY_TOKENS",
    "WORKLOADS",
    "Request",
    "TraceCheck",
    "WorkloadFactory",
    "chat_workload",
    "check_trace",
    "documents_workload",
    "iter_trace",
    "load_workload",
    "read_trace",
    "write_trace",
]
