"""Retention hints derived from a workload itself: which requests have a next turn.

`tiering simulate --hints continuation` and `tiering replay --hints continuation`
measure what hints are worth by giving each request the hint an all-knowing
client would send, then spoiling a share of them (`continuation_hints`).

The rule. A request *continues* when a later request's prompt begins with all
of its complete blocks: its first ``input_length // block_tokens`` blocks (a
partial last block is not reused as such: the next turn fills it further, so
its content is new). Hash ids are prefix hashes (equal ids, equal prefixes), so
a later request holds that prefix exactly when it holds the id of the last
complete block; a request with no complete block never continues. The rule
says nothing of whose the blocks are: on the conversation trace every request
begins with block 0 (the system prompt), so the 1,354 requests whose only
complete block it is continue by it alone, whatever their conversation does
(1,354 of the 5,286 that continue; giving them a release instead measured
10.85 / 31.22 / 35.81 % at 1M / 3M / 10M tokens, against 13.64 / 31.25 /
35.78 % as the rule stands: dslru, exact hints). A request that continues
gets ``Hint(retain_s=CONTINUATION_RETAIN_S)``, the others
``Hint(release=True)``. The rule needs the whole workload ahead, as a client
that knows its session does: it is computed in one pass from the end, O(total
blocks).

The documents rule. A conversation (the trace, ``chat``) goes on when its
next turn comes: the rule above. A ``documents`` session's prompt is mostly its
document, which later sessions re-read while this one ends; a looser rule was
measured for it, a request continuing when a later request begins with at least
half of its complete blocks (``share`` 0.5: the first ``ceil(0.5 * complete)``):
with exact hints, dslru over 12,000 requests at 51,200 / 153,600 / 512,000 /
1,536,000 tokens gave 0.965 / 0.993 / 1.009 / 1.002 of its hit rate without hints
(a share of 0.25: the same), the conversation rule 0.999 / 1.000 / 1.000 / 1.000.
A release spares the head other requests share (`tiering.policies.hints`), so the
conversation rule never releases a document others re-read, and the looser
rule's retentions also protect an ending session's own blocks, never read again,
which is what they cost at the small capacities. So ``documents`` uses the
conversation rule like every workload, and ``continuation_hints(share=...)``
keeps the looser one for whoever wants to measure it.

The TTL. ``retain_s`` must cover the time from a request to the first later
request that continues it (`continuation_delays`). On the conversation trace
(5,286 of its 12,031 requests continue) those delays are, in seconds: median
78, p90 411, p95 555, p99 1,235; 600 s covers 96 % of them. The built-in
workloads' come sooner (12,000 requests each: ``chat`` p99 133 s,
``documents`` p99 353 s), so the same TTL covers them all. A longer TTL
protects each prefix longer for the few late turns; the hints' share of the
tier bounds what they can hold either way (`tiering.policies.hints`).

Errors. `flip_mask` draws ``rng.random(n) < error`` from
``numpy.random.default_rng(seed)``: one uniform number per request, whatever the
rate, so for one seed the requests flipped at a rate are among those flipped at
any higher rate. A flipped request gets the other hint (retain for release,
release for retain).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tiering import _checks as checks
from tiering.errors import WorkloadError
from tiering.hints import Hint
from tiering.workload.trace import BLOCK_TOKENS, Request

__all__ = [
    "CONTINUATION_RETAIN_S",
    "HintSource",
    "arrival_times_s",
    "continuation_delays",
    "continuation_hints",
    "continues",
    "flip_mask",
    "workload_hints",
]

#: The retention a continuing request asks for, in seconds: 96 % of the conversation
#: trace's next turns come within it (the module's docstring).
CONTINUATION_RETAIN_S = 600.0

_RETAIN = Hint(retain_s=CONTINUATION_RETAIN_S)
_RELEASE = Hint(release=True)


class HintSource(enum.Enum):
    """Where a run's hints come from."""

    NONE = "none"  # no hint at all: the run is exactly one without hints
    CONTINUATION = "continuation"  # the continuation rule (module docstring)


def arrival_times_s(requests: Sequence[Request]) -> list[float]:
    """The requests' arrival times in seconds (the workload's clock, which hints need)."""
    return [r.timestamp / 1000.0 for r in requests]


def _needed(request: Request, block_tokens: int, share: float) -> int | None:
    """The id of the last block a later request must begin with to continue the
    request (the first ``ceil(share * complete)`` blocks), or None without a
    complete block."""
    complete = min(request.input_length // block_tokens, len(request.hash_ids))
    need = min(complete, math.ceil(share * complete))
    return request.hash_ids[need - 1] if need else None


def _check_share(share: float) -> float:
    value = checks.check_real("continuation share", share, minimum=0.0, inclusive=False,
                              error=WorkloadError)  # fmt: skip
    if value > 1.0:
        raise WorkloadError(f"continuation share must be a fraction in (0, 1], got {share!r}")
    return value


def continuation_delays(
    requests: Sequence[Request], *, block_tokens: int = BLOCK_TOKENS, share: float = 1.0
) -> list[float | None]:
    """Per request, the seconds to the first later request that continues it (the
    module's rule, with ``share`` of its complete blocks; None where none does);
    one pass from the end."""
    checks.check_int("block_tokens", block_tokens, minimum=1, error=WorkloadError)
    share = _check_share(share)
    nearest: dict[int, int] = {}  # hash id -> timestamp (ms) of the next request holding it
    out: list[float | None] = [None] * len(requests)
    for index in range(len(requests) - 1, -1, -1):
        request = requests[index]
        last = _needed(request, block_tokens, share)
        if last is not None:
            later = nearest.get(last)
            if later is not None:
                out[index] = (later - request.timestamp) / 1000.0
        for hash_id in request.hash_ids:
            nearest[hash_id] = request.timestamp
    return out


def continues(
    requests: Sequence[Request], *, block_tokens: int = BLOCK_TOKENS, share: float = 1.0
) -> list[bool]:
    """Per request, whether a later request continues it (the module's rule)."""
    delays = continuation_delays(requests, block_tokens=block_tokens, share=share)
    return [delay is not None for delay in delays]


def flip_mask(count: int, error: float, seed: int) -> npt.NDArray[np.bool_]:
    """Which of ``count`` requests get the wrong hint at rate ``error`` (nested across
    rates for one ``seed``: the module's docstring)."""
    checks.check_int("hint seed", seed, minimum=0, error=WorkloadError)
    rate = checks.check_real("hint error", error, minimum=0.0, error=WorkloadError)
    if rate > 1.0:
        raise WorkloadError(f"hint error must be a fraction from 0 to 1, got {error!r}")
    mask: npt.NDArray[np.bool_] = np.random.default_rng(seed).random(count) < rate
    return mask


def continuation_hints(
    requests: Sequence[Request],
    *,
    error: float = 0.0,
    seed: int = 0,
    block_tokens: int = BLOCK_TOKENS,
    share: float = 1.0,
) -> list[Hint]:
    """Per request, its continuation hint (retain if it continues, else release), the
    other one for the share ``error`` of the requests `flip_mask` picks with ``seed``."""
    flipped = flip_mask(len(requests), error, seed).tolist()
    goes_on = continues(requests, block_tokens=block_tokens, share=share)
    return [_RETAIN if on != flip else _RELEASE for on, flip in zip(goes_on, flipped, strict=True)]


def workload_hints(
    requests: Sequence[Request],
    source: HintSource | str,
    *,
    error: float = 0.0,
    seed: int = 0,
    block_tokens: int = BLOCK_TOKENS,
) -> list[Hint] | None:
    """The hints of a run: None for `HintSource.NONE` (an ``error`` other than 0 is then
    refused: there is nothing to spoil), else `continuation_hints`."""
    try:
        kind = HintSource(source)
    except ValueError:
        known = ", ".join(s.value for s in HintSource)
        raise WorkloadError(f"unknown hint source {source!r}; choose one of {known}") from None
    if kind is HintSource.NONE:
        if error:
            raise WorkloadError(
                f"a hint error of {error!r} needs hints to spoil: ask for continuation hints"
            )
        return None
    return continuation_hints(requests, error=error, seed=seed, block_tokens=block_tokens)
