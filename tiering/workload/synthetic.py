"""What the built-in synthetic workloads share: argument checks, log-normal
lengths, the constants that fix how a workload is drawn, when to stop drawing,
and how a prompt's block ids become a request."""

from __future__ import annotations

import heapq
import math

from tiering import _checks as checks
from tiering.errors import WorkloadError
from tiering.workload.trace import BLOCK_TOKENS, Request

__all__ = [
    "BATCH",
    "DECODE_SECONDS_PER_TOKEN",
    "MAX_REQUESTS",
    "EarliestTurns",
    "check_int",
    "check_real",
    "check_request_count",
    "log_normal_mu",
    "prompt_request",
]

#: The largest generated workload: a bound on what a mistyped count can cost in memory and time.
MAX_REQUESTS = 10_000_000

#: How fast an answer is decoded (it delays the user's next turn).
DECODE_SECONDS_PER_TOKEN = 0.02

#: Conversations (sessions) are drawn this many at a time; fixed, so that the
#: draws (and the workload) do not depend on how many requests are asked for.
BATCH = 64


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer ``>= minimum``, else a `WorkloadError` naming it."""
    return checks.check_int(name, value, minimum=minimum, error=WorkloadError)


def check_real(name: str, value: object, minimum: float, *, inclusive: bool) -> float:
    """``value`` as a float if it is a finite number above (or at) ``minimum``."""
    return checks.check_real(name, value, minimum=minimum, inclusive=inclusive, error=WorkloadError)


def check_request_count(num_requests: object) -> int:
    """``num_requests`` if it is an integer in ``[0, MAX_REQUESTS]``."""
    count = check_int("num_requests", num_requests, 0)
    if count > MAX_REQUESTS:
        raise WorkloadError(
            f"num_requests must be at most {MAX_REQUESTS:,} for a generated workload, got {count:,}"
        )
    return count


def log_normal_mu(mean: float, sigma: float) -> float:
    """The ``mu`` of a log-normal with this ``mean`` and ``sigma``."""
    return math.log(mean) - sigma * sigma / 2.0


class EarliestTurns:
    """The arrival times of the ``count`` earliest turns drawn so far.

    Conversations are drawn in order of their start; a conversation's turns all
    come after its start. So once the next conversation starts after the latest
    of the ``count`` earliest turns, no later one can put a turn among them, and
    drawing can stop (`complete_before`).
    """

    __slots__ = ("_count", "_latest_first")

    def __init__(self, count: int) -> None:
        self._count = count
        self._latest_first: list[float] = []  # negated times: a max-heap

    def add(self, time_s: float) -> None:
        heap = self._latest_first
        if len(heap) < self._count:
            heapq.heappush(heap, -time_s)
        elif time_s < -heap[0]:
            heapq.heapreplace(heap, -time_s)

    def complete_before(self, start_s: float) -> bool:
        """Whether no turn at or after ``start_s`` can be among the earliest ``count``."""
        heap = self._latest_first
        return len(heap) == self._count and -heap[0] <= start_s


def prompt_request(
    time_s: float, input_length: int, output_length: int, full_ids: list[int], next_id: int
) -> tuple[Request, int]:
    """The request of a prompt whose full blocks are ``full_ids``, and the next free id.

    A partial last block gets id ``next_id``: content no other prompt has.
    """
    hash_ids = list(full_ids)
    if input_length % BLOCK_TOKENS:
        hash_ids.append(next_id)
        next_id += 1
    request = Request(
        timestamp=int(time_s * 1000.0),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
    )
    return request, next_id
