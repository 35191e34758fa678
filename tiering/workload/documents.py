"""A built-in synthetic workload: many short questions about long shared documents.

`documents_workload` returns requests in the trace form (`Request`), a shape
unlike a chat service's: a few long prefixes (documents) are each reused by many
requests, most of them a single question, while new documents keep arriving and
old ones fade. It is the second workload cache policies are measured on (the
first being `chat_workload`), so that a policy tuned to one shape of reuse is
caught out on the other.

Design note. Every prompt is::

    system prompt | document | question 1 | answer 1 | question 2 | ...

A session picks one document and asks ``mean_turns`` questions on average
(geometric); turn k's prompt is turn k-1's prompt, its answer and a new question.
Hash block i covers tokens ``[i * 512, (i + 1) * 512)``; a *full* block is named
by the system prompt when it lies wholly inside it (shared by every request), by
(document, i) when it lies wholly inside system prompt and document (shared by
every session on that document), and by (session, i) otherwise. A prompt's last,
partial block gets a fresh id, as in `chat_workload`.

Popularity drifts: ``initial_documents`` documents exist at the start and a new
one arrives every ``1 / document_rate`` seconds; a session picks the document of
recency rank r (0: the newest) with weight ``1 / (r + 1) ** popularity_skew``.
Each document's length is drawn from its own seeded stream, so a document has
the same length whichever request first uses it, and the first n requests of a
longer workload are the n requests of a shorter one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from tiering.errors import WorkloadError
from tiering.workload.sessions import Batch, Lengths, check_sessions, draw_batch, requests_of
from tiering.workload.synthetic import BATCH, check_int, check_real, log_normal_mu
from tiering.workload.trace import BLOCK_TOKENS, Request

__all__ = ["documents_workload"]

_DOCUMENT_SIGMA = 0.5
_QUESTION_SIGMA = 0.8
_ANSWER_SIGMA = 0.8
_MIN_DOCUMENT_TOKENS = 512
_MIN_QUESTION_TOKENS = 4
_MAX_ANSWER_TOKENS = 4096


def documents_workload(
    num_requests: int = 5000,
    *,
    seed: int = 0,
    initial_documents: int = 40,
    document_rate: float = 0.05,
    popularity_skew: float = 1.0,
    document_tokens: int = 12000,
    system_prompt_tokens: int = 1024,
    question_tokens: int = 60,
    answer_tokens: int = 250,
    mean_turns: float = 1.5,
    request_rate: float = 4.0,
    think_time_s: float = 20.0,
    max_input_tokens: int = 65536,
) -> list[Request]:
    """A deterministic document question-answering workload of ``num_requests`` requests.

    - one system prompt of ``system_prompt_tokens`` tokens heads every prompt;
    - documents of ``document_tokens`` tokens on average (log-normal, at least
      512, cut to leave room for a question): ``initial_documents`` at the start,
      then one more every ``1 / document_rate`` seconds, picked by recency with
      Zipf weights of exponent ``popularity_skew``;
    - sessions of ``mean_turns`` questions on average (geometric) of
      ``question_tokens`` tokens on average, answers of ``answer_tokens``; a turn
      that would pass ``max_input_tokens`` ends its session;
    - requests arrive at about ``request_rate`` per second, a turn
      ``think_time_s`` on average after the previous answer ends.

    Requests are sorted by ``timestamp`` (ms, from 0) and follow the same block
    conventions as `chat_workload`. The same arguments always give the same
    requests. Raises `WorkloadError` for a parameter out of range.
    """
    turns_mean, rate, think = check_sessions(
        num_requests, seed, mean_turns, request_rate, think_time_s, max_input_tokens
    )
    check_int("initial_documents", initial_documents, 1)
    doc_rate = check_real("document_rate", document_rate, 0.0, inclusive=True)
    skew = check_real("popularity_skew", popularity_skew, 0.0, inclusive=True)
    check_int("document_tokens", document_tokens, _MIN_DOCUMENT_TOKENS)
    check_int("system_prompt_tokens", system_prompt_tokens, 0)
    check_int("question_tokens", question_tokens, _MIN_QUESTION_TOKENS)
    check_int("answer_tokens", answer_tokens, 1)
    room = max_input_tokens - system_prompt_tokens - 2 * BLOCK_TOKENS
    if room < _MIN_DOCUMENT_TOKENS:
        raise WorkloadError(
            f"max_input_tokens must be at least system_prompt_tokens + "
            f"{_MIN_DOCUMENT_TOKENS + 2 * BLOCK_TOKENS} = "
            f"{system_prompt_tokens + _MIN_DOCUMENT_TOKENS + 2 * BLOCK_TOKENS} so that a "
            f"document and a question fit, got {max_input_tokens}"
        )
    if num_requests == 0:
        return []
    documents = _Documents(seed, document_tokens, room, skew)
    batches = _batches(
        np.random.default_rng(seed),
        question_tokens=question_tokens,
        answer_tokens=answer_tokens,
        mean_turns=turns_mean,
        session_rate=rate / turns_mean,
        think_time_s=think,
    )

    def start(batch: Batch, j: int, start_s: float) -> tuple[int, int]:
        document = documents.pick(batch.picks[j], initial_documents + int(start_s * doc_rate))
        return system_prompt_tokens + documents.length(document), document

    def prefix_tokens(document: int) -> int:
        return system_prompt_tokens + documents.length(document)

    return requests_of(
        num_requests, batches, start, max_input_tokens, prefix_tokens, system_prompt_tokens
    )


class _Documents:
    """Document lengths (each from its own seeded stream) and recency-Zipf picks."""

    def __init__(self, seed: int, mean_tokens: int, max_tokens: int, skew: float) -> None:
        self._seed = seed
        self._mu = log_normal_mu(mean_tokens, _DOCUMENT_SIGMA)
        self._max = max_tokens
        self._skew = skew
        self._lengths: dict[int, int] = {}
        self._cumulative: npt.NDArray[np.float64] = np.zeros(0)

    def length(self, document: int) -> int:
        tokens = self._lengths.get(document)
        if tokens is None:
            rng = np.random.default_rng([self._seed, document])
            drawn = round(float(rng.lognormal(self._mu, _DOCUMENT_SIGMA)))
            tokens = self._lengths[document] = min(max(drawn, _MIN_DOCUMENT_TOKENS), self._max)
        return tokens

    def pick(self, uniform: float, count: int) -> int:
        """The document a draw ``uniform`` in [0, 1) picks among ``count`` (0 the oldest)."""
        if self._cumulative.size < count:
            size = max(count, 2 * self._cumulative.size, 64)
            weights = np.arange(1, size + 1, dtype=np.float64) ** -self._skew
            self._cumulative = np.cumsum(weights)
        u = uniform * float(self._cumulative[count - 1])
        rank = min(int(np.searchsorted(self._cumulative[:count], u, side="right")), count - 1)
        return count - 1 - rank


def _batches(
    rng: np.random.Generator,
    *,
    question_tokens: int,
    answer_tokens: int,
    mean_turns: float,
    session_rate: float,
    think_time_s: float,
) -> Iterator[Batch]:
    """Sessions, `BATCH` at a time: each picks a document by a uniform draw (`_Documents`)."""
    question = Lengths(question_tokens, _QUESTION_SIGMA, _MIN_QUESTION_TOKENS)
    answer = Lengths(answer_tokens, _ANSWER_SIGMA, 1, _MAX_ANSWER_TOKENS)
    while True:
        counts = rng.geometric(1.0 / mean_turns, size=BATCH)
        start_gaps = rng.exponential(1.0 / session_rate, size=BATCH)
        picks = rng.random(size=BATCH).tolist()
        yield draw_batch(rng, counts, start_gaps, picks, question, answer, think_time_s)
