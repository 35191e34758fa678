"""A built-in synthetic workload: multi-turn chat over shared system prompts.

`chat_workload` returns requests in the trace form (`Request`), so a replay runs
with no trace file (`tiering.workload.registry` finds it by name).

Design note. Each conversation is one growing token stream::

    system prompt | user 1 | answer 1 | user 2 | answer 2 | ...

and turn k's prompt is the prefix of that stream up to the end of user message k.
Hash block i of a prompt covers its tokens ``[i * 512, (i + 1) * 512)``. A *full*
block's content is fixed by the stream alone, so it is named by where it lies:
by (system prompt, i) when it lies wholly inside the system prompt, shared by
every conversation that uses that prompt, and by (conversation, i) otherwise,
shared by every later turn of the conversation. A prompt's last, partial block
holds content that no other request has (later turns fill it further), so it gets
a fresh id. This is exactly the reuse a prefix cache sees in a chat service:
system-prompt blocks across conversations, the whole history within one. Ids are
numbered in order of first appearance, as in the Mooncake traces.

Timing: conversations start as a Poisson process; a conversation's next turn
arrives after the previous answer has been decoded plus an exponential think
time, so conversations interleave. Lengths are log-normal (heavy-tailed user
messages, a few hundred tokens of answer), and a conversation ends after a
geometric number of turns or when its next prompt would pass
``max_input_tokens``. Everything is drawn from one seeded `numpy.random.Generator`
in a fixed order, so a seed names one workload, and the first n requests of a
longer workload are the n requests of a shorter one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tiering.errors import WorkloadError
from tiering.workload.sessions import Batch, Lengths, check_sessions, draw_batch, requests_of
from tiering.workload.synthetic import BATCH, check_int, check_real
from tiering.workload.trace import Request

__all__ = ["chat_workload"]

# Shapes that are not parameters: log-normal spreads of message lengths and bounds.
_USER_SIGMA = 1.2
_OUTPUT_SIGMA = 0.8
_MIN_USER_TOKENS = 8
_MAX_OUTPUT_TOKENS = 4096


def chat_workload(
    num_requests: int = 5000,
    *,
    seed: int = 0,
    num_system_prompts: int = 8,
    system_prompt_tokens: int = 2048,
    popularity_skew: float = 1.0,
    mean_turns: float = 4.0,
    user_tokens: int = 600,
    output_tokens: int = 350,
    request_rate: float = 3.0,
    think_time_s: float = 30.0,
    max_input_tokens: int = 32768,
) -> list[Request]:
    """A deterministic multi-turn chat workload of ``num_requests`` requests.

    - ``num_system_prompts`` system prompts of ``system_prompt_tokens`` tokens on
      average (each drawn from half to one and a half times that), chosen by
      conversations with Zipf popularity: prompt r (from 0) has weight
      ``1 / (r + 1) ** popularity_skew``;
    - conversations of ``mean_turns`` turns on average (geometric); turn k's
      prompt is turn k-1's prompt, its answer and a new user message of
      ``user_tokens`` tokens on average; answers have ``output_tokens`` on
      average; no prompt is longer than ``max_input_tokens`` (the first turn's
      message is cut to fit, a later turn that would not fit ends the conversation);
    - requests arrive at about ``request_rate`` per second in the long run
      (conversations start at ``request_rate / mean_turns`` per second), a turn
      ``think_time_s`` on average after the previous answer ends.

    Requests are sorted by ``timestamp`` (ms, from 0). ``hash_ids`` has one id per
    `BLOCK_TOKENS`-token block, ``(len(hash_ids) - 1) * BLOCK_TOKENS < input_length
    <= len(hash_ids) * BLOCK_TOKENS``; equal leading ids are exactly shared
    prefixes. The same arguments always give the same requests. Raises
    `WorkloadError` for a parameter out of range.
    """
    turns_mean, rate, think = check_sessions(
        num_requests, seed, mean_turns, request_rate, think_time_s, max_input_tokens
    )
    check_int("num_system_prompts", num_system_prompts, 1)
    check_int("system_prompt_tokens", system_prompt_tokens, 1)
    skew = check_real("popularity_skew", popularity_skew, 0.0, inclusive=True)
    check_int("user_tokens", user_tokens, _MIN_USER_TOKENS)
    check_int("output_tokens", output_tokens, 1)
    if max_input_tokens < 2 * system_prompt_tokens:
        raise WorkloadError(
            f"max_input_tokens must be at least 2 * system_prompt_tokens = "
            f"{2 * system_prompt_tokens} so that every first turn fits, got {max_input_tokens}"
        )
    if num_requests == 0:
        return []

    rng = np.random.default_rng(seed)
    system_lengths = rng.integers(
        max(1, system_prompt_tokens // 2),
        system_prompt_tokens * 3 // 2 + 1,
        size=num_system_prompts,
    )
    batches = _batches(
        rng,
        system_lengths.size,
        skew=skew,
        mean_turns=turns_mean,
        user_tokens=user_tokens,
        output_tokens=output_tokens,
        conversation_rate=rate / turns_mean,
        think_time_s=think,
    )
    lengths = system_lengths.tolist()

    def start(batch: Batch, j: int, start_s: float) -> tuple[int, int]:
        system = int(batch.picks[j])
        return lengths[system], system

    return requests_of(num_requests, batches, start, max_input_tokens, lengths.__getitem__)


def _batches(
    rng: np.random.Generator,
    system_prompts: int,
    *,
    skew: float,
    mean_turns: float,
    user_tokens: int,
    output_tokens: int,
    conversation_rate: float,
    think_time_s: float,
) -> Iterator[Batch]:
    """Conversations, `BATCH` at a time: each picks a system prompt by popularity."""
    weights = np.arange(1, system_prompts + 1, dtype=np.float64) ** -skew
    weights /= weights.sum()
    user = Lengths(user_tokens, _USER_SIGMA, _MIN_USER_TOKENS)
    output = Lengths(output_tokens, _OUTPUT_SIGMA, 1, _MAX_OUTPUT_TOKENS)
    while True:
        systems = rng.choice(system_prompts, size=BATCH, p=weights)
        counts = rng.geometric(1.0 / mean_turns, size=BATCH)
        start_gaps = rng.exponential(1.0 / conversation_rate, size=BATCH)
        yield draw_batch(rng, counts, start_gaps, systems.tolist(), user, output, think_time_s)
