"""What the built-in synthetic workloads share: argument checks, log-normal
lengths, and the constants that fix how a workload is drawn."""

from __future__ import annotations

import math

from tiering.errors import WorkloadError

__all__ = [
    "BATCH",
    "DECODE_SECONDS_PER_TOKEN",
    "MAX_REQUESTS",
    "check_int",
    "check_real",
    "check_request_count",
    "log_normal_mu",
]

#: The largest generated workload (about 1.7 s and a few hundred MB per 100,000).
MAX_REQUESTS = 10_000_000

#: How fast an answer is decoded (it delays the user's next turn).
DECODE_SECONDS_PER_TOKEN = 0.02

#: Conversations (sessions) are drawn this many at a time; fixed, so that the
#: draws (and the workload) do not depend on how many requests are asked for.
BATCH = 64


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an integer ``>= minimum``, else a `WorkloadError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_real(name: str, value: object, minimum: float, *, inclusive: bool) -> float:
    """``value`` as a float if it is a finite number above (or at) ``minimum``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
        or (value == minimum and not inclusive)
    ):
        bound = ">=" if inclusive else ">"
        raise WorkloadError(f"{name} must be a finite number {bound} {minimum:g}, got {value!r}")
    return float(value)


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
