"""What the synthetic workloads share: sessions of turns over a shared prefix, drawn and named.

Both `chat_workload` and `documents_workload` are sessions (a conversation, or
questions on one document) whose prompts grow turn by turn over a prefix
shared with other sessions (a system prompt, or a system prompt and a
document). Each workload draws its batches of sessions its own way, in its own
order from its seeded generator (`Batch`); `earliest_turns` lays the turns out
in time and keeps the earliest, and `turns_to_requests` names their blocks:
the shared prefix's full blocks by the prefix, the rest by the session, a
partial last block fresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from tiering.workload.synthetic import (
    BATCH,
    DECODE_SECONDS_PER_TOKEN,
    EarliestTurns,
    check_int,
    check_real,
    check_request_count,
    log_normal_mu,
    prompt_request,
)
from tiering.workload.trace import BLOCK_TOKENS, Request

__all__ = [
    "Batch",
    "Lengths",
    "Turn",
    "check_sessions",
    "draw_batch",
    "earliest_turns",
    "requests_of",
    "turns_to_requests",
]


class Turn(NamedTuple):
    """One request of a session (sorted by time, then session: a session's turns
    never share a time)."""

    time_s: float
    session: int
    prefix: int  # the shared prefix the session grows from: a system prompt, a document
    input_length: int
    output_length: int


class Batch(NamedTuple):
    """`BATCH` sessions' draws: per session its turn count, the gap to the next
    session's start and its pick of a prefix; per turn (the sessions' turns one
    after another) the new message's tokens, the answer's and the think time."""

    turns: list[int]
    gaps: list[float]
    picks: list[int] | list[float]
    messages: list[int]
    answers: list[int]
    thinks: list[float]


class Lengths(NamedTuple):
    """Log-normal token counts of ``mean`` and spread ``sigma``, rounded and clipped to
    ``[low, high]`` (``high`` None: no bound)."""

    mean: int
    sigma: float
    low: int
    high: int | None = None


def check_sessions(
    num_requests: object,
    seed: object,
    mean_turns: object,
    request_rate: object,
    think_time_s: object,
    max_input_tokens: object,
) -> tuple[float, float, float]:
    """Check what every synthetic workload's sessions take (`WorkloadError` naming the
    bad one); ``mean_turns``, ``request_rate`` and ``think_time_s`` as floats."""
    check_request_count(num_requests)
    check_int("seed", seed, 0)
    turns = check_real("mean_turns", mean_turns, 1.0, inclusive=True)
    rate = check_real("request_rate", request_rate, 0.0, inclusive=False)
    think = check_real("think_time_s", think_time_s, 0.0, inclusive=True)
    check_int("max_input_tokens", max_input_tokens, 1)
    return turns, rate, think


def draw_batch(
    rng: np.random.Generator,
    counts: npt.NDArray[np.int64],
    gaps: npt.NDArray[np.float64],
    picks: list[int] | list[float],
    message: Lengths,
    answer: Lengths,
    think_time_s: float,
) -> Batch:
    """A `Batch` of sessions whose turn ``counts``, start ``gaps`` and ``picks`` are
    drawn: its turns' messages, answers and think times, drawn from ``rng`` now, in
    that order."""
    total = int(counts.sum())
    messages = rng.lognormal(log_normal_mu(message.mean, message.sigma), message.sigma, total)
    answers = rng.lognormal(log_normal_mu(answer.mean, answer.sigma), answer.sigma, total)
    thinks = rng.exponential(think_time_s, size=total)
    return Batch(
        turns=counts.tolist(),
        gaps=gaps.tolist(),
        picks=picks,
        messages=np.clip(np.rint(messages), message.low, message.high).astype(np.int64).tolist(),
        answers=np.clip(np.rint(answers), answer.low, answer.high).astype(np.int64).tolist(),
        thinks=thinks.tolist(),
    )


def earliest_turns(
    num_requests: int,
    batches: Iterator[Batch],
    start_session: Callable[[Batch, int, float], tuple[int, int]],
    max_input_tokens: int,
) -> list[Turn]:
    """The ``num_requests`` earliest turns of the sessions of ``batches``, sorted by time.

    ``start_session(batch, j, start_s)`` gives session ``j`` of ``batch``, starting
    at ``start_s``, its prefix's length in tokens and the prefix. A turn's prompt is
    the previous turn's prompt and answer and a new message; a first prompt longer
    than ``max_input_tokens`` is cut to it, a later one ends its session. The next
    turn comes when the answer is decoded and the think time has passed.
    """
    turns: list[Turn] = []
    earliest = EarliestTurns(num_requests)
    start = 0.0
    session = 0
    for batch in batches:
        messages, answers, thinks = batch.messages, batch.answers, batch.thinks
        offset = 0
        for j in range(BATCH):
            if earliest.complete_before(start):
                turns.sort()
                return turns[:num_requests]
            length, prefix = start_session(batch, j, start)
            time_s = start
            count = batch.turns[j]
            for k in range(count):
                prompt = length + messages[offset + k]
                if prompt > max_input_tokens:
                    if k:
                        break
                    prompt = max_input_tokens
                output = answers[offset + k]
                turns.append(Turn(time_s, session, prefix, prompt, output))
                earliest.add(time_s)
                length = prompt + output
                time_s += output * DECODE_SECONDS_PER_TOKEN + thinks[offset + k]
            offset += count
            session += 1
            start += batch.gaps[j]
    raise AssertionError("the batches of a workload never end")  # pragma: no cover


def turns_to_requests(
    turns: list[Turn], prefix_tokens: Callable[[int], int], common_tokens: int = 0
) -> list[Request]:
    """Requests of sorted ``turns``, block ids numbered in order of first appearance.

    Every prompt starts with ``common_tokens`` shared by all (their full blocks
    named once, at the first prompt that needs a new block); prefix ``p`` ends at
    ``prefix_tokens(p)`` tokens (common ones included), and its full blocks are
    named by it. A session's prompts only grow, so its full blocks are one growing
    list (the stream) and each turn names only its new blocks.
    """
    next_id = 0
    common: list[int] = []
    common_blocks = common_tokens // BLOCK_TOKENS
    prefixes: dict[int, list[int]] = {}
    streams: dict[int, list[int]] = {}
    requests: list[Request] = []
    for turn in turns:
        full_blocks = turn.input_length // BLOCK_TOKENS
        stream = streams.setdefault(turn.session, [])
        if len(stream) < full_blocks:
            shared = min(prefix_tokens(turn.prefix) // BLOCK_TOKENS, full_blocks)
            while len(common) < common_blocks:
                common.append(next_id)
                next_id += 1
            own = prefixes.setdefault(turn.prefix, list(common))
            while len(own) < shared:
                own.append(next_id)
                next_id += 1
            if len(stream) < shared:
                stream.extend(own[len(stream) : shared])
            fresh = full_blocks - len(stream)
            stream.extend(range(next_id, next_id + fresh))
            next_id += fresh
        request, next_id = prompt_request(
            turn.time_s, turn.input_length, turn.output_length, stream[:full_blocks], next_id
        )
        requests.append(request)
    return requests


def requests_of(
    num_requests: int,
    batches: Iterator[Batch],
    start_session: Callable[[Batch, int, float], tuple[int, int]],
    max_input_tokens: int,
    prefix_tokens: Callable[[int], int],
    common_tokens: int = 0,
) -> list[Request]:
    """The requests of the ``num_requests`` earliest turns (`earliest_turns`), their
    blocks named (`turns_to_requests`)."""
    turns = earliest_turns(num_requests, batches, start_session, max_input_tokens)
    return turns_to_requests(turns, prefix_tokens, common_tokens)
